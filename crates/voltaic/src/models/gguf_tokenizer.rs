//! The tokenizer and chat template a GGUF file carries: a byte-level BPE
//! vocabulary with its merges (`tokenizer.ggml.*`), built with the
//! `tokenizers` crate, and the Jinja chat template
//! (`tokenizer.chat_template`), rendered with `minijinja`.

use crate::error::{Error, Result};
use crate::io::gguf::{GgufFile, GgufValue};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// One message of a conversation, as chat templates expect it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// The tokenizer of a GGUF model; see the [module docs](self).
#[derive(Clone)]
pub struct GgufTokenizer {
    tokenizer: Tokenizer,
    /// Id of the beginning-of-sequence token.
    pub bos: Option<u32>,
    /// Id of the end-of-sequence token (generation stops there).
    pub eos: Option<u32>,
    /// Whether a prompt starts with the BOS token (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    template: Option<String>,
    bos_text: String,
    eos_text: String,
}

impl std::fmt::Debug for GgufTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GgufTokenizer {{ vocab: {}, bos: {:?}, eos: {:?} }}", self.tokenizer.get_vocab_size(true), self.bos, self.eos)
    }
}

/// llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` name (those
/// that are not plain GPT-2).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl GgufTokenizer {
    /// Build the tokenizer from `f`'s metadata. Only byte-level BPE
    /// (`tokenizer.ggml.model = gpt2`) is supported; another model or an
    /// unknown pre-tokenizer is an error naming it.
    pub fn from_gguf(f: &GgufFile) -> Result<GgufTokenizer> {
        let bad = |msg: String| Error::Format(format!("{}: {msg}", f.path().display()));
        let model = f.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(bad(format!("tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") tokenizers are supported")));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            let v = f.get(key)?;
            let arr = v.as_array().ok_or_else(|| bad(format!("{key} is not an array")))?;
            arr.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| bad(format!("{key} holds a non-string")))).collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| bad(format!("merge {m:?} is not two tokens"))))
            .collect::<Result<_>>()?;
        let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| bad(format!("BPE: {e}")))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let pre = f.metadata.get("tokenizer.ggml.pre").and_then(GgufValue::as_str).unwrap_or("default");
        let byte_level = |regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
        let pre_tok = match pre {
            "default" | "gpt2" | "gpt-2" => Sequence::new(vec![byte_level(true)]),
            // Digits one by one, then GPT-2's split (SmolLM, StarCoder).
            "smollm" | "starcoder" | "refact" => Sequence::new(vec![PreTokenizerWrapper::Digits(Digits::new(true)), byte_level(true)]),
            "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => {
                let split = Split::new(SplitPattern::Regex(LLAMA3_REGEX.into()), SplitDelimiterBehavior::Isolated, false).map_err(|e| bad(format!("pre-tokenizer regex: {e}")))?;
                Sequence::new(vec![PreTokenizerWrapper::Split(split), byte_level(false)])
            }
            other => return Err(bad(format!("tokenizer.ggml.pre {other:?} is not supported (default/gpt2, smollm/starcoder, llama3/llama-bpe are)"))),
        };
        tokenizer.with_pre_tokenizer(Some(pre_tok));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        // Control tokens (type 3) and user-defined ones (type 4) are matched whole.
        if let Some(types) = f.metadata.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            let special: Vec<AddedToken> =
                types.iter().zip(&tokens).filter(|(t, _)| matches!(t.as_u64(), Some(3) | Some(4))).map(|(t, s)| AddedToken::from(s.clone(), t.as_u64() == Some(3)).normalized(false)).collect();
            tokenizer.add_special_tokens(special).map_err(|e| bad(format!("special tokens: {e}")))?;
        }
        let id = |key: &str| f.metadata.get(key).and_then(GgufValue::as_u64).map(|v| v as u32).filter(|&v| (v as usize) < tokens.len());
        let (bos, eos) = (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"));
        let text = |i: Option<u32>| i.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        Ok(GgufTokenizer {
            tokenizer,
            bos,
            eos,
            add_bos: matches!(f.metadata.get("tokenizer.ggml.add_bos_token"), Some(GgufValue::Bool(true))),
            template: f.metadata.get("tokenizer.chat_template").and_then(GgufValue::as_str).map(str::to_string),
            bos_text: text(bos),
            eos_text: text(eos),
        })
    }

    /// Token ids of `text` (special tokens written in the text are matched
    /// whole), with the BOS token first when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, false).map_err(|e| Error::Value { op: "tokenize", msg: e.to_string() })?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids` (special tokens included, as they were written).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, false).map_err(|e| Error::Value { op: "detokenize", msg: e.to_string() })
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Whether the file has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// `messages` rendered with the model's chat template, ending with the
    /// assistant's turn opened when `add_generation_prompt` is set.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let Some(src) = &self.template else {
            return Err(Error::Value { op: "chat", msg: "the model has no chat template (tokenizer.chat_template)".into() });
        };
        let bad = |e: minijinja::Error| Error::Value { op: "chat", msg: format!("chat template: {e}") };
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> { Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg)) });
        env.add_template("chat", src).map_err(bad)?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_text.clone(),
            eos_token => self.eos_text.clone(),
        };
        env.get_template("chat").and_then(|t| t.render(ctx)).map_err(bad)
    }
}
