//! The vocabulary as a GGUF file gives it: token texts, types, scores, and the special
//! settings (BOS, EOS, whether to add them, the space prefix).

use std::collections::HashMap;

use astra_gguf::{Array, Metadata};

use crate::TokenizerError;

/// A token's type (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_id(id: i64) -> TokenType {
        match id {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }

    /// Control and unknown tokens: matched in text only when special parsing is on,
    /// rendered only when asked for.
    pub fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown)
    }
}

/// Token texts that llama.cpp recognises as end-of-turn, fill-in-the-middle and
/// end-of-generation markers whatever the file says (its "auto-detect special tokens by
/// text" step in `llama_vocab::impl::load`). Each found token becomes a control token,
/// which changes tokenization (it is then matched only with special parsing on), so the
/// same must happen here for the ids to agree.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Tokens llama.cpp makes user-defined (harmony format markers).
const USER_DEFINED_TEXTS: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

pub struct Vocab {
    pub texts: Vec<String>,
    pub types: Vec<TokenType>,
    /// SentencePiece merge scores (empty for BPE files without them).
    pub scores: Vec<f32>,
    pub by_text: HashMap<String, u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// Tokens that end generation (EOS, end-of-turn and the markers above), sorted.
    pub eog: Vec<u32>,
}

/// Applies llama.cpp's text-based special-token detection to `types`; returns the
/// end-of-generation set.
fn detect_special_tokens(
    texts: &[String],
    types: &mut [TokenType],
    by_text: &HashMap<String, u32>,
    eos: Option<u32>,
) -> Vec<u32> {
    let mut eog = std::collections::BTreeSet::new();
    let find = |list: &[&str]| list.iter().filter_map(|t| by_text.get(*t).copied()).min();
    for (list, ends_generation) in [
        (EOT_TEXTS, true),
        (EOM_TEXTS, true),
        (FIM_PRE_TEXTS, false),
        (FIM_SUF_TEXTS, false),
        (FIM_MID_TEXTS, false),
        (FIM_PAD_TEXTS, true),
        (FIM_REP_TEXTS, true),
        (FIM_SEP_TEXTS, true),
    ] {
        if let Some(id) = find(list) {
            types[id as usize] = TokenType::Control;
            if ends_generation {
                eog.insert(id);
            }
        }
    }
    for text in EOG_TEXTS {
        if let Some(&id) = by_text.get(*text) {
            types[id as usize] = TokenType::Control;
            eog.insert(id);
        }
    }
    for text in USER_DEFINED_TEXTS {
        if let Some(&id) = by_text.get(*text) {
            types[id as usize] = TokenType::UserDefined;
        }
    }
    eog.extend(eos);
    let has = |eog: &std::collections::BTreeSet<u32>, text: &str| {
        eog.iter().any(|&id| texts[id as usize] == text)
    };
    // Harmony: with <|return|> and <|call|> (or <|calls|> and <|flush|>), <|end|>
    // separates messages rather than ending generation.
    let harmony = (has(&eog, "<|return|>") && has(&eog, "<|call|>"))
        || (has(&eog, "<|calls|>") && has(&eog, "<|flush|>"));
    if harmony && has(&eog, "<|end|>") {
        if let Some(&id) = by_text.get("<|end|>") {
            eog.remove(&id);
            types[id as usize] = TokenType::UserDefined;
        }
    }
    if has(&eog, "<|tool_response>") && has(&eog, "</s>") {
        if let Some(&id) = by_text.get("</s>") {
            eog.remove(&id);
            types[id as usize] = TokenType::Normal;
        }
    }
    eog.into_iter().collect()
}

fn ints(a: &Array) -> Option<Vec<i64>> {
    Some(match a {
        Array::I32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::I8(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U8(v) => v.iter().map(|&x| x as i64).collect(),
        Array::I64(v) => v.clone(),
        _ => return None,
    })
}

impl Vocab {
    pub fn from_metadata(md: &Metadata, spm: bool) -> Result<Vocab, TokenizerError> {
        // Empty texts are renamed as llama.cpp renames them.
        let texts: Vec<String> = md
            .strings("tokenizer.ggml.tokens")?
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.clone()
                }
            })
            .collect();
        let n = texts.len();
        let mut types: Vec<TokenType> =
            match md.optional("tokenizer.ggml.token_type", Metadata::array)? {
                Some(a) => {
                    let v = ints(a).ok_or_else(|| {
                        TokenizerError::Invalid(
                            "tokenizer.ggml.token_type is not an integer array".into(),
                        )
                    })?;
                    if v.len() != n {
                        return Err(TokenizerError::Invalid(format!(
                            "{} token types for {n} tokens",
                            v.len()
                        )));
                    }
                    v.into_iter().map(TokenType::from_id).collect()
                }
                None => vec![TokenType::Normal; n],
            };
        let scores = match md.optional("tokenizer.ggml.scores", Metadata::array)? {
            Some(Array::F32(v)) if v.len() == n => v.clone(),
            Some(_) => {
                return Err(TokenizerError::Invalid(
                    "tokenizer.ggml.scores is not one f32 per token".into(),
                ))
            }
            None => Vec::new(),
        };
        let mut by_text = HashMap::with_capacity(n);
        for (id, t) in texts.iter().enumerate() {
            // The last of duplicate texts wins, as in llama.cpp's token_to_id.
            by_text.insert(t.clone(), id as u32);
        }
        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match md.optional(key, Metadata::u32)? {
                Some(id) if (id as usize) < n => Ok(Some(id)),
                Some(id) => Err(TokenizerError::Invalid(format!(
                    "{key} = {id} is not a token id (vocabulary of {n})"
                ))),
                None => Ok(None),
            }
        };
        let bos = token_id("tokenizer.ggml.bos_token_id")?;
        let eos = token_id("tokenizer.ggml.eos_token_id")?;
        // Defaults when the file is silent: SentencePiece models add BOS, BPE ones do not.
        let add_bos = md
            .optional("tokenizer.ggml.add_bos_token", Metadata::bool)?
            .unwrap_or(spm)
            && bos.is_some();
        let add_eos = md
            .optional("tokenizer.ggml.add_eos_token", Metadata::bool)?
            .unwrap_or(false)
            && eos.is_some();
        let add_space_prefix = spm
            && md
                .optional("tokenizer.ggml.add_space_prefix", Metadata::bool)?
                .unwrap_or(true);
        let eog = detect_special_tokens(&texts, &mut types, &by_text, eos);
        Ok(Vocab {
            texts,
            types,
            scores,
            by_text,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix,
            eog,
        })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }
}
