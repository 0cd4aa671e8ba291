//! Token counting: the model's HuggingFace tokenizer, or a documented byte estimate.

use tokenizers::parallelism::{MaybeParallelIterator, MaybeParallelRefIterator};
use tokenizers::{
    Model, OffsetReferential, OffsetType, PostProcessor, PreTokenizer, Result as TkResult,
    Tokenizer,
};

use super::error::AnalysisError;

/// How text is turned into a token count.
pub enum Counter {
    /// The model's own `tokenizer.json` (HuggingFace `tokenizers`): exact counts. Truncation and
    /// padding are switched off at load time, since either would falsify a count.
    Tokenizer(Box<Tokenizer>),
    /// No tokenizer configured: `ceil(utf8_bytes / 4)` per piece of text (OpenAI's rule of thumb
    /// of about four characters of English per token). Deterministic and cheap, never exact.
    Estimate,
}

impl Counter {
    /// Loads a tokenizer from `tokenizer.json` text and disables truncation and padding.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let mut tok: Tokenizer = json
            .parse()
            .map_err(|e| format!("invalid tokenizer.json: {e}"))?;
        tok.with_truncation(None)
            .map_err(|e| format!("tokenizer truncation: {e}"))?;
        tok.with_padding(None);
        Ok(Self::Tokenizer(Box::new(tok)))
    }

    /// Whether counts are exact (a tokenizer is loaded).
    pub fn is_exact(&self) -> bool {
        matches!(self, Self::Tokenizer(_))
    }

    /// Vocabulary size including added tokens, for validating token-id prompts (`None` for the
    /// estimate, which accepts any id).
    pub fn vocab_size(&self) -> Option<u64> {
        match self {
            Self::Tokenizer(t) => Some(t.get_vocab_size(true) as u64),
            Self::Estimate => None,
        }
    }

    /// Tokens in one text. `add_special_tokens` applies the tokenizer's post-processor (BOS/EOS)
    /// as engines do for raw prompts; chat templates already contain them, so pass `false` there.
    pub fn count(&self, text: &str, add_special_tokens: bool) -> Result<u64, AnalysisError> {
        match self {
            Self::Tokenizer(t) => count_tokens(t, text, add_special_tokens)
                .map_err(|e| AnalysisError::internal(format!("tokenizer failed: {e}"))),
            Self::Estimate => Ok(estimate(text)),
        }
    }

    /// Tokens in each text, encoded as one batch (the tokenizer parallelises across texts).
    pub fn count_many(
        &self,
        texts: &[&str],
        add_special_tokens: bool,
    ) -> Result<Vec<u64>, AnalysisError> {
        match self {
            Self::Tokenizer(t) if texts.len() > 1 => texts
                .maybe_par_iter()
                .map(|text| count_tokens(t, text, add_special_tokens))
                .collect::<TkResult<Vec<u64>>>()
                .map_err(|e| AnalysisError::internal(format!("tokenizer failed: {e}"))),
            _ => texts
                .iter()
                .map(|t| self.count(t, add_special_tokens))
                .collect(),
        }
    }
}

/// The byte estimate: `ceil(len / 4)` tokens for `len` UTF-8 bytes.
pub fn estimate(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// Texts longer than this (bytes) are counted in segments of at most this size (see
/// [`segments`]). The tokenizer's working memory grows by about 100 bytes per input byte (a
/// normalised copy with per-byte alignments, then the BPE symbols of each word), so a 3 MB
/// prompt counted whole took about 370 MB; in segments it takes a few MB per thread.
pub const SEGMENT_BYTES: usize = 16 * 1024;

/// Counts tokens the way `Tokenizer::encode_fast(text, add_special_tokens).len()` does, without
/// building an `Encoding` (no token strings, offsets or masks are kept): added-token extraction
/// and normalisation, pre-tokenisation, the model on each word, plus the post-processor's added
/// tokens (BOS/EOS) once when asked. Truncation and padding are off (see
/// [`Counter::from_json`]), so this equals the encoding's length; the unit and Python tests check
/// it against the `tokenizers` package.
///
/// A text over [`SEGMENT_BYTES`] is cut into [`segments`], counted in parallel and summed.
/// Cuts fall before a space between two letters or digits, where the usual pre-tokenizers
/// (GPT-2 / Llama 3 style byte-level regexes, whitespace and Metaspace splitting) split anyway,
/// so normal text keeps its exact count. Only a run of over [`SEGMENT_BYTES`] bytes with no
/// such space (one character repeated, a base64 blob, unspaced CJK) is cut inside a word; each
/// such cut may change the count by a few tokens, usually adding some, which is harmless for
/// admission. (Tokenizers whose normaliser prepends a marker to every input, as SentencePiece
/// conversions do, may count one more token per segment.)
fn count_tokens(t: &Tokenizer, text: &str, add_special_tokens: bool) -> TkResult<u64> {
    let words = if text.len() <= SEGMENT_BYTES {
        count_segment(t, text)?
    } else {
        segments(text, SEGMENT_BYTES)
            .into_maybe_par_iter()
            .map(|seg| count_segment(t, seg))
            .collect::<TkResult<Vec<usize>>>()?
            .iter()
            .sum()
    };
    let special = match (add_special_tokens, t.get_post_processor()) {
        (true, Some(p)) => p.added_tokens(false),
        _ => 0,
    };
    Ok((words + special) as u64)
}

/// Tokens of one piece of text without special tokens: added-token extraction, normalisation,
/// pre-tokenisation, then the model on each word.
fn count_segment(t: &Tokenizer, text: &str) -> TkResult<usize> {
    let mut pretok = t
        .get_added_vocabulary()
        .extract_and_normalize(t.get_normalizer(), text);
    if let Some(pre) = t.get_pre_tokenizer() {
        pre.pre_tokenize(&mut pretok)?;
    }
    let model = t.get_model();
    pretok
        .get_splits(OffsetReferential::Normalized, OffsetType::None)
        .into_iter()
        .map(|(word, _, tokens)| match tokens {
            Some(done) => Ok(done.len()),
            None => model.tokenize(word).map(|v| v.len()),
        })
        .sum()
}

/// Cuts `text` into consecutive pieces of at most `max` bytes (`max` ≥ 4). Each cut is the
/// last ASCII space within reach that has a letter or digit on both sides (the space starts
/// the next piece, as pre-tokenizers attach it to the following word); where there is none,
/// the cut is at the last character boundary within reach, inside a word.
pub fn segments(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::with_capacity(text.len() / max.max(1) + 1);
    let mut rest = text;
    while rest.len() > max {
        let (piece, tail) = rest.split_at(cut_point(rest, max));
        out.push(piece);
        rest = tail;
    }
    out.push(rest);
    out
}

/// Where [`segments`] cuts `text` (longer than `max`): a byte index in `1..=max`.
fn cut_point(text: &str, max: usize) -> usize {
    let bytes = text.as_bytes();
    let alnum_before = |p: usize| {
        text[..p]
            .chars()
            .next_back()
            .is_some_and(char::is_alphanumeric)
    };
    let alnum_after = |p: usize| {
        text[p + 1..]
            .chars()
            .next()
            .is_some_and(char::is_alphanumeric)
    };
    if let Some(p) = (1..=max)
        .rev()
        .find(|&p| bytes[p] == b' ' && alnum_before(p) && alnum_after(p))
    {
        return p;
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}
