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

/// Texts longer than this (bytes) have their pre-tokenized words encoded in parallel.
const PARALLEL_WORDS_MIN_BYTES: usize = 16 * 1024;

/// Counts tokens the way `Tokenizer::encode_fast(text, add_special_tokens).len()` does, without
/// building an `Encoding` (no token strings, offsets or masks are kept): added-token extraction
/// and normalisation, pre-tokenisation, the model on each word, plus the post-processor's added
/// tokens (BOS/EOS) when asked. Truncation and padding are off (see [`Counter::from_json`]), so
/// this equals the encoding's length; the unit and Python tests check it against the
/// `tokenizers` package. Long texts (rendered chat templates) are encoded word-parallel.
fn count_tokens(t: &Tokenizer, text: &str, add_special_tokens: bool) -> TkResult<u64> {
    let mut pretok = t
        .get_added_vocabulary()
        .extract_and_normalize(t.get_normalizer(), text);
    if let Some(pre) = t.get_pre_tokenizer() {
        pre.pre_tokenize(&mut pretok)?;
    }
    let model = t.get_model();
    let splits = pretok.get_splits(OffsetReferential::Normalized, OffsetType::None);
    let per_word = |(word, _, tokens): (&str, _, &Option<Vec<tokenizers::Token>>)| match tokens {
        Some(done) => Ok(done.len()),
        None => model.tokenize(word).map(|v| v.len()),
    };
    let words: usize = if text.len() >= PARALLEL_WORDS_MIN_BYTES {
        splits
            .into_maybe_par_iter()
            .map(per_word)
            .collect::<TkResult<Vec<usize>>>()?
            .iter()
            .sum()
    } else {
        splits.into_iter().map(per_word).sum::<TkResult<usize>>()?
    };
    let special = match (add_special_tokens, t.get_post_processor()) {
        (true, Some(p)) => p.added_tokens(false),
        _ => 0,
    };
    Ok((words + special) as u64)
}
