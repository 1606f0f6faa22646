//! Constraints over the two real vocabularies (byte-level BPE and SentencePiece),
//! driven by random logits: whatever the "model" prefers, the text that comes out
//! parses and validates, and only end-of-generation tokens follow a complete grammar.

use std::sync::OnceLock;

use astra_gguf::GgufFile;
use astra_tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::*;

fn tokenizer(model: &str) -> Option<&'static Tokenizer> {
    static SMOLLM: OnceLock<Option<Tokenizer>> = OnceLock::new();
    static GEMMA: OnceLock<Option<Tokenizer>> = OnceLock::new();
    let cell = if model == "smollm2-135m" {
        &SMOLLM
    } else {
        &GEMMA
    };
    cell.get_or_init(|| {
        let path = astra_models::model_for_test(model)?;
        Some(Tokenizer::from_metadata(GgufFile::open(path).unwrap().metadata()).unwrap())
    })
    .as_ref()
}

const MODELS: [&str; 2] = ["smollm2-135m", "gemma3-270m"];

/// xorshift64*: random logits, reproducible per seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Greedy decoding of random logits under the constraint, until an end of generation
/// (`Some(text)`) or `limit` tokens (`None`).
fn walk(tok: &Tokenizer, c: &mut Constraint, seed: u64, limit: usize) -> Option<String> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut ids = Vec::new();
    // Padding rows past the vocabulary, as some output matrices have.
    let mut logits = vec![0f32; tok.vocab().len() + 3];
    for _ in 0..limit {
        for l in logits.iter_mut() {
            *l = rng.next() * 8.0;
        }
        c.mask(&mut logits).unwrap();
        assert!(logits[tok.vocab().len()..]
            .iter()
            .all(|l| *l == f32::NEG_INFINITY));
        let id = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        assert!(logits[id as usize].is_finite(), "a masked token was picked");
        if tok.vocab().eog.contains(&id) || tok.eos() == Some(id) {
            return Some(tok.decode(&ids, false));
        }
        c.accept(id).unwrap();
        ids.push(id);
        if c.is_complete() {
            // Nothing but an end of generation may follow.
            let mut after = vec![0f32; tok.vocab().len()];
            c.mask(&mut after).unwrap();
            let allowed: Vec<usize> = (0..after.len()).filter(|&i| after[i].is_finite()).collect();
            assert!(!allowed.is_empty());
            assert!(allowed
                .iter()
                .all(|&i| tok.vocab().eog.contains(&(i as u32))));
        }
    }
    None
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    })
}

/// The schema's constraints, checked on a parsed value independently of llguidance.
fn valid_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let keys_ok = o.len() == 4;
    let name_ok = o["name"].as_str().is_some_and(|s| s.chars().count() <= 12);
    let age_ok = o["age"].as_i64().is_some_and(|a| (0..=150).contains(&a));
    let tags_ok = o["tags"].as_array().is_some_and(|t| {
        t.len() <= 3
            && t.iter()
                .all(|x| matches!(x.as_str(), Some("red" | "green" | "blue")))
    });
    keys_ok && name_ok && age_ok && tags_ok && o["ok"].is_boolean()
}

#[test]
fn json_schema_output_parses_and_validates_whatever_the_logits() {
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        let grammars = Grammars::new(tok).unwrap();
        for seed in 0..12 {
            let mut c = grammars
                .compile(&Spec::JsonSchema(person_schema()))
                .unwrap();
            let text = walk(tok, &mut c, seed, 600)
                .unwrap_or_else(|| panic!("{model} seed {seed}: no end within 600 tokens"));
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{model} seed {seed}: {e}: {text:?}"));
            assert!(valid_person(&v), "{model} seed {seed}: {text}");
        }
    }
}

#[test]
fn json_object_and_regex_and_lark_and_gbnf() {
    for model in MODELS {
        let Some(tok) = tokenizer(model) else {
            continue;
        };
        let grammars = Grammars::new(tok).unwrap();
        // Random logits rarely close an open object: a bounded walk checks the prefix
        // is well formed, a finished one parses.
        for seed in 0..4 {
            let mut c = grammars.compile(&Spec::JsonObject).unwrap();
            if let Some(text) = walk(tok, &mut c, seed, 300) {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert!(v.is_object(), "{text}");
            }
        }
        let rx = regex_lite(r"^[0-9]{3}-[a-z]{2}(!|\?)$");
        for seed in 0..6 {
            let mut c = grammars
                .compile(&Spec::Regex(r"[0-9]{3}-[a-z]{2}(!|\?)".into()))
                .unwrap();
            let text = walk(tok, &mut c, seed, 40).unwrap();
            assert!(rx(&text), "{model}: {text:?}");
        }
        let lark = "start: \"yes\" | \"no\" | \"maybe \" NUM\nNUM: /[1-9][0-9]?/";
        for seed in 0..6 {
            let mut c = grammars.compile(&Spec::Lark(lark.into())).unwrap();
            let text = walk(tok, &mut c, seed, 20).unwrap();
            let ok = text == "yes"
                || text == "no"
                || text.strip_prefix("maybe ").is_some_and(|n| {
                    n.parse::<u32>().is_ok_and(|n| (1..100).contains(&n)) && !n.starts_with('0')
                });
            assert!(ok, "{model}: {text:?}");
        }
        let gbnf = gbnf_to_lark("root ::= \"(\" [a-c]{2} (\",\" [a-c]{2})? \")\"").unwrap();
        for seed in 0..6 {
            let mut c = grammars.compile(&Spec::Lark(gbnf.clone())).unwrap();
            let text = walk(tok, &mut c, seed, 20).unwrap();
            let inner = text.strip_prefix('(').and_then(|t| t.strip_suffix(')'));
            let ok = inner.is_some_and(|i| {
                i.split(',').count() <= 2
                    && i.split(',')
                        .all(|p| p.len() == 2 && p.chars().all(|c| ('a'..='c').contains(&c)))
            });
            assert!(ok, "{model}: {text:?}");
        }
    }
}

/// The shape `^[0-9]{3}-[a-z]{2}(!|\?)$`, checked by hand.
fn regex_lite(_: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        let b = s.as_bytes();
        b.len() == 7
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..6].iter().all(u8::is_ascii_lowercase)
            && (b[6] == b'!' || b[6] == b'?')
    }
}

#[test]
fn bad_grammars_are_errors_that_say_why() {
    let Some(tok) = tokenizer("smollm2-135m") else {
        return;
    };
    let grammars = Grammars::new(tok).unwrap();
    for (spec, expect) in [
        (Spec::JsonSchema(json!({"type": "nonsense"})), "nonsense"),
        (Spec::JsonSchema(json!([1, 2])), "must be an object"),
        (
            Spec::JsonSchema(json!({"type": "string", "minLength": 5, "maxLength": 2})),
            "",
        ),
        (Spec::Lark("start: undefined_rule".into()), "undefined_rule"),
        (Spec::Lark("start: (".into()), ""),
        (Spec::Regex("(".into()), ""),
        (Spec::Regex(String::new()), "empty"),
    ] {
        let e = grammars
            .compile(&spec)
            .err()
            .unwrap_or_else(|| panic!("{spec:?} compiled"));
        let GrammarError::Compile(msg) = &e else {
            panic!("{e:?}")
        };
        assert!(!msg.is_empty() && msg.contains(expect), "{spec:?}: {msg}");
    }
}
