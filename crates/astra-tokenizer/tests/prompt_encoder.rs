//! The incremental PromptEncoder against a full encode of the same text, on both real
//! tokenizers: random text (unicode from many scripts, whitespace runs, digits, special
//! token texts and their fragments) appended in random pieces, and random edits of an
//! earlier prompt, in both special-parsing modes.
//!
//! The suite runs 2000 cases; for the million-case run:
//!     PROPTEST_CASES=1000000 cargo test --release -p astra-tokenizer --test prompt_encoder

use std::sync::OnceLock;

use astra_gguf::GgufFile;
use astra_tokenizer::{EncodeOptions, PromptEncoder, Tokenizer};
use proptest::prelude::*;

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

/// Pieces that stress the boundaries: specials whole and cut, whitespace runs,
/// contractions, digits, multi-byte characters, byte-fallback characters.
const ATOMS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "end|>",
    "<",
    "|",
    ">",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of",
    "_turn>",
    "<bos>",
    "<eos>",
    "</s>",
    "<s>",
    "<b>",
    "</b>",
    "<div>",
    "\n",
    "\n\n",
    "\n\n\n",
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\r\n",
    "'s",
    "'ll",
    "'",
    "s",
    "ll",
    "don",
    "'t",
    "Hello",
    " world",
    "user",
    "assistant",
    "model",
    "0",
    "1",
    "12",
    "123",
    "4567",
    "3.14",
    "é",
    "e\u{301}",
    "ñ",
    "中文",
    "日本",
    "한국어",
    "🦀",
    "👍🏽",
    "\u{200d}",
    "\u{a0}",
    "\u{2581}",
    "—",
    "…",
    "«",
    "»",
    "!!",
    "?",
    ".",
    ",",
    "\u{7}",
    "\u{0}",
    "ß",
    "Ἀ",
    "Ж",
    "ا",
    "ह",
    "ก",
    "x",
    "y",
    "z",
    "aaaa",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let atom = prop_oneof![
        4 => prop::sample::select(ATOMS).prop_map(str::to_owned),
        1 => "\\PC{1,6}",
        1 => "[ \t\n]{1,5}",
    ];
    prop::collection::vec(atom, 0..24).prop_map(|v| v.concat())
}

/// Cut points (as fractions) of a text into appended pieces.
fn cuts_strategy() -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(0.0f64..1.0, 0..6)
}

fn pieces(text: &str, cuts: &[f64]) -> Vec<usize> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|f| {
            let mut i = (f * text.len() as f64) as usize;
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            i
        })
        .collect();
    points.push(text.len());
    points.sort();
    points
}

fn check(
    model: &str,
    text: &str,
    cuts: &[f64],
    edit: &str,
    parse_special: bool,
    add_special: bool,
) -> Result<(), TestCaseError> {
    let Some(tok) = tokenizer(model) else {
        return Ok(());
    };
    let opts = EncodeOptions {
        add_special,
        parse_special,
    };
    let mut enc = PromptEncoder::new(tok, opts);
    let mut last = 0;
    for p in pieces(text, cuts) {
        enc.push_str(&text[last..p]);
        last = p;
        prop_assert_eq!(
            enc.ids(),
            &tok.encode(enc.text(), opts)[..],
            "{} appending up to {} of {:?}",
            model,
            p,
            text
        );
    }
    // An edit: keep a prefix, then continue differently (as a regenerated chat turn).
    let keep = pieces(text, &cuts[..cuts.len().min(1)])[0];
    let edited = format!("{}{}", &text[..keep], edit);
    enc.set_text(&edited);
    prop_assert_eq!(
        enc.ids(),
        &tok.encode(&edited, opts)[..],
        "{} edit of {:?} to {:?}",
        model,
        text,
        edited
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn incremental_equals_full_encode(
        text in text_strategy(),
        cuts in cuts_strategy(),
        edit in text_strategy(),
        parse_special in any::<bool>(),
        add_special in any::<bool>(),
        gemma in any::<bool>(),
    ) {
        let model = if gemma { "gemma3-270m" } else { "smollm2-135m" };
        check(model, &text, &cuts, &edit, parse_special, add_special)?;
    }
}
