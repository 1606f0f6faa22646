//! Tokenizers built from GGUF metadata alone, giving llama.cpp's token ids for the same
//! file: byte-level BPE (`gpt2`) with the pre-tokenizer `tokenizer.ggml.pre` names, and
//! SentencePiece-style (`llama`) with score-driven merges and byte fallback.
//!
//! Encoding is two stages, as in llama.cpp: special tokens are cut out of the text
//! first (`partition`: control tokens when special parsing is on, user-defined tokens
//! always, longest first), then each remaining text fragment is tokenized on its own.
//! That fragment independence is what [`PromptEncoder`] relies on to reuse work.

mod bpe;
pub mod chat;
mod partition;
mod pretokenize;
mod prompt;
mod spm;
mod stream;
mod unicode;
mod unicode_data;
mod vocab;

use astra_gguf::{Metadata, MetadataError};

pub use chat::{ChatMessage, ChatTemplate, TemplateError};
pub use partition::Fragment;
pub use pretokenize::PreTokenizer;
pub use prompt::PromptEncoder;
pub use stream::StreamDecoder;
pub use vocab::{TokenType, Vocab};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error("unsupported tokenizer model {0:?} (supported: gpt2, llama)")]
    UnsupportedModel(String),
    #[error("unknown pre-tokenizer {0:?} (supported: gpt-2, smollm, llama-bpe, qwen2 and their aliases)")]
    UnknownPreTokenizer(String),
    #[error("invalid tokenizer metadata: {0}")]
    Invalid(String),
}

/// How to encode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS/EOS as the model says (`tokenizer.ggml.add_bos_token`, ...).
    pub add_special: bool,
    /// Recognise control tokens written in the text (`<|im_start|>`); user-defined
    /// tokens are recognised either way.
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            add_special: true,
            parse_special: true,
        }
    }
}

enum Model {
    /// Boxed: the BPE model's tables are large, the SentencePiece model carries none.
    Bpe(Box<bpe::Bpe>),
    Spm,
}

pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    specials: partition::Specials,
}

impl Tokenizer {
    pub fn from_metadata(md: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let model_name = md.str("tokenizer.ggml.model")?;
        let spm = match model_name {
            "llama" => true,
            "gpt2" => false,
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        let vocab = Vocab::from_metadata(md, spm)?;
        let model = if spm {
            if vocab.scores.is_empty() {
                return Err(TokenizerError::Invalid(
                    "a SentencePiece vocabulary needs tokenizer.ggml.scores".into(),
                ));
            }
            Model::Spm
        } else {
            let pre_name = md
                .optional("tokenizer.ggml.pre", Metadata::str)?
                .unwrap_or("gpt-2");
            let pre = PreTokenizer::from_name(pre_name)
                .ok_or_else(|| TokenizerError::UnknownPreTokenizer(pre_name.to_owned()))?;
            Model::Bpe(Box::new(bpe::Bpe::new(
                &vocab,
                pre,
                md.strings("tokenizer.ggml.merges")?,
            )?))
        };
        let specials = partition::Specials::new(&vocab);
        Ok(Tokenizer {
            vocab,
            model,
            specials,
        })
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Encodes `text` into token ids.
    pub fn encode(&self, text: &str, opts: EncodeOptions) -> Vec<u32> {
        self.encode_fragments(text, opts).0
    }

    /// Encodes and also returns the fragments and, for each, the index of its first id.
    pub(crate) fn encode_fragments(
        &self,
        text: &str,
        opts: EncodeOptions,
    ) -> (Vec<u32>, Vec<(Fragment, usize)>) {
        self.encode_parts(text, opts.parse_special, opts.add_special, opts.add_special)
    }

    /// The encoding of `text`, with BOS and EOS each added when asked and the model
    /// adds it; also the fragments and, for each, the index of its first id.
    pub(crate) fn encode_parts(
        &self,
        text: &str,
        parse_special: bool,
        bos: bool,
        eos: bool,
    ) -> (Vec<u32>, Vec<(Fragment, usize)>) {
        let fragments = self.specials.partition(text, parse_special);
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if bos && self.vocab.add_bos {
            ids.extend(self.vocab.bos);
        }
        let mut starts = Vec::with_capacity(fragments.len());
        let mut prev_special = true;
        for f in fragments {
            starts.push((f.clone(), ids.len()));
            match f {
                Fragment::Token { id, .. } => {
                    ids.push(id);
                    prev_special = true;
                }
                Fragment::Text(range) => {
                    self.encode_text(&text[range], prev_special, &mut ids);
                    prev_special = false;
                }
            }
        }
        if eos && self.vocab.add_eos {
            ids.extend(self.vocab.eos);
        }
        (ids, starts)
    }

    /// Tokenizes one fragment of plain text; `after_special` says whether it starts the
    /// text or follows a special token (where SentencePiece adds its space prefix).
    fn encode_text(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        match &self.model {
            Model::Bpe(bpe) => bpe.encode(&self.vocab, text, out),
            Model::Spm => {
                let mut escaped = String::with_capacity(text.len() + 3);
                if self.vocab.add_space_prefix && after_special {
                    escaped.push(spm::SPACE);
                }
                escaped.extend(text.chars().map(|c| if c == ' ' { spm::SPACE } else { c }));
                spm::encode(&self.vocab, &escaped, out);
            }
        }
    }

    /// The bytes of one token. Control and unknown tokens are rendered only when
    /// `special` is set (their text), as llama.cpp's `token_to_piece`.
    pub fn token_bytes(&self, id: u32, special: bool, out: &mut Vec<u8>) {
        let Some(text) = self.vocab.texts.get(id as usize) else {
            return;
        };
        let ty = self.vocab.types[id as usize];
        match ty {
            t if t.is_special() => {
                if special {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            TokenType::UserDefined => out.extend_from_slice(text.as_bytes()),
            TokenType::Byte => match spm::token_byte(text) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(text.as_bytes()),
            },
            _ => match &self.model {
                Model::Bpe(bpe) => bpe.token_bytes(text, out),
                Model::Spm => {
                    for c in text.chars() {
                        let c = if c == spm::SPACE { ' ' } else { c };
                        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
            },
        }
    }

    /// The bytes of a token sequence. With a SentencePiece space prefix, the space the
    /// encoder added before the first word is removed again, unless the sequence starts
    /// with BOS (llama.cpp's `detokenize` rule).
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let start = out.len();
            self.token_bytes(id, special, &mut out);
            if i == 0 && self.vocab.add_space_prefix && out.get(start) == Some(&b' ') {
                out.remove(start);
            }
        }
        out
    }

    /// The text of a token sequence; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, special)).into_owned()
    }

    /// A token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }
}
