//! Constrained decoding: a request's JSON schema, Lark grammar or regular expression
//! compiled over the model's vocabulary (llguidance over a token trie built from the
//! GGUF vocabulary), and the mask of the tokens it allows at each step.
//!
//! A [`Grammars`] is built once per loaded model; each constrained sequence gets its own
//! [`Constraint`], which masks the logits before sampling and is told every token taken.
//! A grammar that does not compile is an error at request time, never unconstrained
//! output.

mod gbnf;

use std::sync::Arc;

use astra_tokenizer::TokenType;
use astra_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

pub use gbnf::gbnf_to_lark;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value valid under this JSON schema.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect (JSON schemas may be embedded with
    /// `%json { ... }`).
    Lark(String),
    /// A string matching this regular expression in full.
    Regex(String),
}

/// Why a grammar could not be built or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    #[error("{0}")]
    Compile(String),
    #[error("the grammar failed while decoding: {0}")]
    Decode(String),
}

/// Whitespace the JSON grammars allow between tokens: bounded, so that a model cannot
/// loop on blank space until its token budget runs out.
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,64}";

/// The grammar compiler for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl Grammars {
    /// Builds the token trie of `tok`'s vocabulary: control, unknown and unused tokens
    /// are special (a grammar never produces them unless it names them), and every
    /// end-of-generation token ends a grammar that is complete.
    pub fn new(tok: &Tokenizer) -> Result<Grammars, GrammarError> {
        let vocab = tok.vocab();
        let words: Vec<Vec<u8>> = (0..vocab.len() as u32)
            .map(|id| {
                let mut bytes = Vec::new();
                match vocab.types[id as usize] {
                    t if t.is_special() || t == TokenType::Unused => {
                        bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                        bytes.extend_from_slice(vocab.texts[id as usize].as_bytes());
                    }
                    _ => tok.token_bytes(id, false, &mut bytes),
                }
                bytes
            })
            .collect();
        let mut eog: Vec<u32> = vocab.eog.clone();
        if eog.is_empty() {
            eog.extend(tok.eos());
        }
        let Some(&first) = eog.first() else {
            return Err(GrammarError::Compile(
                "the vocabulary has no end-of-generation token".into(),
            ));
        };
        let info = TokRxInfo {
            tok_bos: tok.bos(),
            ..TokRxInfo::new(words.len() as u32, first)
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(compile_error)?;
        factory.quiet();
        Ok(Grammars {
            factory,
            vocab: words.len(),
        })
    }

    /// Compiles `spec`; an error names what is wrong with it.
    pub fn compile(&self, spec: &Spec) -> Result<Constraint, GrammarError> {
        let grammar = match spec {
            Spec::JsonObject => {
                TopLevelGrammar::from_json_schema(json_options(json!({"type": "object"}))?)
            }
            Spec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_options(schema.clone())?)
            }
            Spec::Lark(source) => TopLevelGrammar::from_lark(source.clone()),
            Spec::Regex(rx) => {
                // Rejected here rather than as a grammar that can never end.
                check_regex(rx)?;
                TopLevelGrammar::from_regex(rx)
            }
        };
        let parser = self.factory.create_parser(grammar).map_err(compile_error)?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        // A grammar that allows nothing at all would stall its request.
        let first = matcher
            .compute_mask()
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        if first.is_zero() {
            return Err(GrammarError::Compile(
                "the grammar matches no text this model can produce".into(),
            ));
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

fn compile_error(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Compile(e.to_string())
}

fn check_regex(rx: &str) -> Result<(), GrammarError> {
    if rx.is_empty() {
        return Err(GrammarError::Compile("the regex is empty".into()));
    }
    Ok(())
}

/// The schema with astra's JSON layout options (bounded whitespace), unless it sets its
/// own under llguidance's `x-guidance` key.
fn json_options(mut schema: Value) -> Result<Value, GrammarError> {
    match &mut schema {
        Value::Object(o) => {
            o.entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
            Ok(schema)
        }
        Value::Bool(true) => Ok(json!({"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})),
        _ => Err(GrammarError::Compile(
            "a JSON schema must be an object (or true)".into(),
        )),
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

/// A copy that goes on independently (each choice of a request gets one).
impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("complete", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Sets to −∞ the logit of every token the grammar does not allow next (once the
    /// grammar is complete, only end-of-generation tokens remain). Logits past the
    /// vocabulary (padding rows of the output matrix) are masked too.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Decode(e.to_string()))?;
        if allowed.is_zero() {
            return Err(GrammarError::Decode(
                "the grammar allows no next token".into(),
            ));
        }
        for (id, l) in logits.iter_mut().enumerate() {
            if id >= self.vocab || !allowed.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `id` (a token the mask allowed).
    pub fn accept(&mut self, id: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(id)
            .map_err(|e| GrammarError::Decode(e.to_string()))
    }

    /// The grammar is complete and allows nothing more than an end of generation.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
