"""A model's ``chat_template`` given as a file path is the file's text: prompts are counted
through it (so the context check fires), and a template that cannot render is refused by
``kvgate check-config`` and at start-up with the file's name and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvgate import AnalysisError
from kvgate.__main__ import main
from kvgate.config import load_config
from kvgate.gateway_build import build_gateway

CHAT = "/v1/chat/completions"
# Each message costs 40 bytes of markup plus its content; no tokenizer, so counts are
# ceil(utf8_bytes / 4) of the rendered text.
TEMPLATE = (
    "{% for m in messages %}<|start_of_a_message|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|end_of_message|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_config(tmp_path: Path, chat_template: str, context_window: int = 64) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "backends:\n- name: b\n  url: http://127.0.0.1:9\n  max_concurrency: 2\n"
        f"  models: [{{name: m, context_window: {context_window}, "
        f"chat_template: {orjson.dumps(chat_template).decode()}}}]\n"
    )
    return path


def rendered(messages: list[dict[str, str]]) -> str:
    out = "".join(
        f"<|start_of_a_message|>{m['role']}\n{m['content']}<|end_of_message|>\n" for m in messages
    )
    return out + "<|assistant|>\n"


def test_template_file_is_read_relative_to_the_config_and_counted(tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text(TEMPLATE)
    gw = build_gateway(load_config(write_config(tmp_path, "templates/chat.jinja")), poll=False)
    messages = [{"role": "user", "content": "hello"}]
    analysis = gw.registry.analyze(CHAT, orjson.dumps({"model": "m", "messages": messages}))
    assert analysis.counting == "estimate"
    assert analysis.prompt_tokens == -(-len(rendered(messages).encode()) // 4)
    # the context check fires on what the template renders: 5 messages of ~50 bytes > 64 tokens
    five = messages * 5
    with pytest.raises(AnalysisError) as info:
        gw.registry.analyze(CHAT, orjson.dumps({"model": "m", "messages": five}))
    assert info.value.code == "context_length_exceeded"
    assert gw.controller.backend_state(0)["in_use"] == 0


@pytest.mark.parametrize(
    ("template", "line", "words"),
    [
        # a syntax error on line 2
        ("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", 2, "syntax error"),
        # renders one user message, but the tool-call branch (line 3) calls an unknown method
        (
            "{% for m in messages %}{{ m['content'] }}\n{% if m.tool_calls %}\n"
            "{{ m.tool_calls[0].function.name.casefold() }}\n{% endif %}{% endfor %}",
            3,
            "casefold",
        ),
    ],
    ids=["syntax", "tool-call-branch"],
)
def test_check_config_names_the_template_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], template: str, line: int, words: str
) -> None:
    (tmp_path / "bad.jinja").write_text(template)
    path = write_config(tmp_path, "bad.jinja")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "kvgate serve would refuse it: model m:" in err, err
    assert f"{tmp_path / 'bad.jinja'}:{line}" in err, err
    assert words in err, err
    assert "Traceback" not in err


def test_check_config_accepts_a_template_that_refuses_system_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Templates may refuse a conversation on purpose (Gemma's refuses a system role); the
    sample is retried without it, and a template that renders one user message passes."""
    (tmp_path / "picky.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    assert main(["check-config", str(write_config(tmp_path, "picky.jinja"))]) == 0
    (tmp_path / "never.jinja").write_text("{{ raise_exception('this template refuses all') }}")
    assert main(["check-config", str(write_config(tmp_path, "never.jinja"))]) == 2
    err = capsys.readouterr().err
    assert "this template refuses all" in err
    assert str(tmp_path / "never.jinja") in err


def test_serve_refuses_to_start_with_a_broken_template_file(tmp_path: Path) -> None:
    (tmp_path / "bad.jinja").write_text("line one\n{% if %}\n")
    path = write_config(tmp_path, "bad.jinja")
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "kvgate serve: cannot start: model m:" in done.stderr
    assert f"{tmp_path / 'bad.jinja'}:2" in done.stderr
    assert "Traceback" not in done.stderr


def test_tokenizer_config_beside_the_tokenizer_gives_template_and_bos(tmp_path: Path) -> None:
    """Without ``chat_template`` the template of the ``tokenizer_config.json`` next to
    ``tokenizer.json`` counts the prompt (as vLLM loads it with the tokenizer); its
    ``bos_token`` also reaches a configured template file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # one token per word
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        orjson.dumps(
            {
                "bos_token": "BOS",
                "chat_template": "{% for m in messages %}turn {{ m['content'] }} {% endfor %}",
            }
        ).decode()
    )
    (tmp_path / "own.jinja").write_text("{{ bos_token }} own {{ messages[0]['content'] }}")
    path = tmp_path / "kvgate.yaml"
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a b c"}]})
    # "turn a b c" (the tokenizer's template), "BOS own a b c" (the file, with the tokenizer's
    # bos_token); without the tokenizer_config.json: 3 words + 4 overhead, and "own a b c"
    for template, tokens in [("", 4), ("own.jinja", 5)]:
        extra = f", chat_template: {template}" if template else ""
        path.write_text(
            "backends:\n- name: b\n  url: http://127.0.0.1:9\n  max_concurrency: 2\n"
            f"  models: [{{name: m, context_window: 64, tokenizer: model/tokenizer.json{extra}}}]\n"
        )
        analysis = build_gateway(load_config(path), poll=False).registry.analyze(CHAT, body)
        assert (analysis.counting, analysis.prompt_tokens) == ("chat_template", tokens), template
