"""A random-weight Llama model for llama.cpp's ``llama-server``, written without a model hub.

What: :func:`write_gguf` writes a Llama-architecture GGUF file with random weights (``gguf`` +
``numpy``, deterministic under ``seed``) and a small SentencePiece ("llama") vocabulary:
``<unk> <s> </s> <|im_start|> <|im_end|>``, the 256 byte-fallback tokens ``<0x00>``..``<0xFF>``
(so any UTF-8 text tokenizes), ``▁`` and single characters, and a few hundred English words with
the ``▁`` word marker, built up one character at a time (``▁h``, ``▁he``, ... ``▁hello``) so that
every word piece is reached by merges of pieces that are themselves in the vocabulary. The file
carries a ChatML Jinja template in ``tokenizer.chat_template`` so ``/v1/chat/completions``
works. :func:`write_tokenizer_json` exports the same vocabulary as a HuggingFace
``tokenizer.json`` (BPE with byte fallback, merges ranked by the SentencePiece scores, a ``▁``
prepend / replace normalizer, a post-processor that adds BOS) so that kvgate counts a prompt the
way the engine does: llama.cpp's SentencePiece tokenizer merges the adjacent pair whose merged
piece has the highest score, which these merges reproduce; it adds a ``▁`` in front of the text
and after every special token (the normalizer runs on each piece between special tokens), and
BOS in front of the prompt (``tokenizer.ggml.add_bos_token``).

The output is garbage text but valid; with ``temperature: 0`` it is deterministic, and llama.cpp's
``"ignore_eos": true`` gives exact lengths.

Sizes: :data:`TINY` (4 layers, hidden 256, ff 768, 4 heads, f32: about 1.5 M parameters plus
the embeddings, a few MB, answers in milliseconds) and :data:`SLOW` (8 layers, hidden 1024, ff
3072, 16 heads, f16: about 100 M parameters, tens of tokens per second per stream on two CPU
cores, so a request keeps a slot busy for seconds).

Run as a script: ``python tests/realengine/make_model.py OUT_DIR [--slow]`` writes
``OUT_DIR/model.gguf`` and ``OUT_DIR/tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CHAT_TEMPLATE",
    "SLOW",
    "SPECIAL",
    "TINY",
    "ModelShape",
    "vocabulary",
    "write_gguf",
    "write_model",
    "write_tokenizer_json",
]

#: Special tokens, in id order (0..4): unknown, BOS, EOS and the two ChatML markers.
SPECIAL: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0

#: ChatML, as Qwen and others write it (no BOS: llama.cpp adds it in front of the prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = """
the of and to in is was that for it with as his on be at by had are but from or have an they
which one you were all her she there would their we him been has when who will no more if out
so up said what its about than into them can only other time new some could these two may first
then do any like my now over such our man me even most made after also did many off before must
well back through years much where your way down should because long each just those people how
too little state good very make world still see own men work last never us old between both
life being under same another know while year might great system day again three hand part
small general upon high once public end program every thought use set without however house
left point against several around few fact here number course since group water mean hello word
token model engine server request answer prompt stream cache memory slot queue gateway limit
count test quick brown fox jumps lazy dog cat red blue green light dark open close start stop
run walk talk read write line page book name place city country river sea sky sun moon star
tree stone fire wind rain snow cold warm hot summer winter spring autumn morning evening night
today tomorrow yesterday question reason story history science music picture table chair door
window road car train ship plane bird fish horse cow sheep friend family mother father child
girl boy woman king queen
""".split()  # noqa: SIM905 (a word list reads better as text)

_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"()-_/[]{}<>=+*&%$#@"
)


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """The vocabulary: pieces, SentencePiece scores (higher = merged first) and GGUF token types
    (``gguf.TokenType``: 2 unknown, 3 control, 6 byte, 1 normal), in id order."""
    import gguf

    pieces: list[str] = list(SPECIAL)
    types = [int(gguf.TokenType.UNKNOWN)] + [int(gguf.TokenType.CONTROL)] * (len(SPECIAL) - 1)
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(gguf.TokenType.BYTE)] * 256
    normal: list[str] = ["▁", *_CHARS]
    seen = set(normal)
    for word in _WORDS:
        for k in range(1, len(word) + 1):
            piece = "▁" + word[:k]
            if piece not in seen:
                seen.add(piece)
                normal.append(piece)
    pieces += normal
    types += [int(gguf.TokenType.NORMAL)] * len(normal)
    # specials and bytes score 0; normal pieces get distinct, decreasing scores
    scores = [0.0] * (len(SPECIAL) + 256) + [-float(i) for i in range(len(normal))]
    return pieces, scores, types


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama model's sizes. ``dtype`` is ``"f32"`` or ``"f16"``; ``context`` in tokens is
    ``llama.context_length`` (the training context, the most a slot can get)."""

    layers: int
    hidden: int
    ff: int
    heads: int
    context: int = 8192
    dtype: str = "f32"


#: A few MB, a reply in milliseconds.
TINY = ModelShape(layers=4, hidden=256, ff=768, heads=4)
#: About 100 M parameters in f16: tens of tokens per second per stream on two CPU cores.
SLOW = ModelShape(layers=8, hidden=1024, ff=3072, heads=16, dtype="f16")


def write_gguf(path: Path, shape: ModelShape = TINY, *, seed: int = 0, name: str = "tiny") -> Path:
    """Write a random-weight Llama GGUF to ``path`` (overwritten) and return ``path``.

    Raises:
        ValueError: ``hidden`` is not a multiple of ``heads``, or an unknown ``dtype``.
    """
    import gguf

    if shape.hidden % shape.heads:
        raise ValueError(f"hidden {shape.hidden} is not a multiple of heads {shape.heads}")
    if shape.dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be f32 or f16, got {shape.dtype!r}")
    np_dtype = np.float32 if shape.dtype == "f32" else np.float16
    pieces, scores, types = vocabulary()
    head_dim = shape.hidden // shape.heads
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(
        int(gguf.LlamaFileType.ALL_F32 if shape.dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    )
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def weight(*dims: int) -> np.ndarray:
        # numpy shape (rows, cols) = ggml (cols, rows); 1-D norms are ones (f32, as ggml wants)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np_dtype)

    n_vocab = len(pieces)
    ones = np.ones(shape.hidden, dtype=np.float32)
    w.add_tensor("token_embd.weight", weight(n_vocab, shape.hidden))
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", weight(shape.hidden, shape.hidden))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", weight(shape.ff, shape.hidden))
        w.add_tensor(p + "ffn_up.weight", weight(shape.ff, shape.hidden))
        w.add_tensor(p + "ffn_down.weight", weight(shape.hidden, shape.ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weight(n_vocab, shape.hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer_json(path: Path) -> Path:
    """Write the vocabulary of :func:`vocabulary` as a HuggingFace ``tokenizer.json`` (loadable
    by the ``tokenizers`` package) and return ``path``."""
    pieces, scores, _ = vocabulary()
    n_special = len(SPECIAL)
    vocab = {p: i for i, p in enumerate(pieces)}
    # every normal piece of two or more characters is its prefix + its last character (both in
    # the vocabulary by construction); rank = the merged piece's score, highest first
    merges = [
        (scores[i], piece[:-1], piece[-1])
        for i, piece in enumerate(pieces)
        if i >= n_special + 256 and len(piece) >= 2
    ]
    merges.sort(key=lambda m: -m[0])
    missing = [
        (left, right) for _, left, right in merges if left not in vocab or right not in vocab
    ]
    if missing:
        raise ValueError(f"merges of pieces outside the vocabulary: {missing[:5]}")
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL)
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<s>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for _, left, right in merges],
        },
    }
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return path


def write_model(
    out_dir: Path, shape: ModelShape = TINY, *, seed: int = 0, name: str = "tiny"
) -> tuple[Path, Path]:
    """``out_dir/model.gguf`` and ``out_dir/tokenizer.json`` (the directory is created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return (
        write_gguf(out_dir / "model.gguf", shape, seed=seed, name=name),
        write_tokenizer_json(out_dir / "tokenizer.json"),
    )


def main() -> None:
    """``make_model.py OUT_DIR [--slow] [--seed N]``: write the model and its tokenizer.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--slow", action="store_true", help="the larger f16 variant")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gguf_path, tok_path = write_model(
        args.out_dir,
        SLOW if args.slow else TINY,
        seed=args.seed,
        name="slow" if args.slow else "tiny",
    )
    print(gguf_path, tok_path)


if __name__ == "__main__":
    main()
