//! The tokenizer against llama.cpp on the real models: token ids, round trips, chat
//! templates, and the incremental encoder against full encodes.

use astra_gguf::GgufFile;
use astra_tokenizer::{ChatMessage, ChatTemplate, EncodeOptions, PromptEncoder, Tokenizer};
use serde_json::Value;

fn data(name: &str) -> Value {
    let path = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn load(model: &str) -> Option<(GgufFile, Tokenizer)> {
    let path = astra_models::model_for_test(model)?;
    let file = GgufFile::open(path).unwrap();
    let tok = Tokenizer::from_metadata(file.metadata()).unwrap();
    Some((file, tok))
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_llama_cpp_ids(model: &str) {
    let Some((_, tok)) = load(model) else { return };
    let cases = data(&format!("tokenize_{model}.json"));
    let mut failures = Vec::new();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let opts = EncodeOptions {
            add_special: case["add_bos"].as_bool().unwrap(),
            parse_special: case["parse_special"].as_bool().unwrap(),
        };
        let got = tok.encode(text, opts);
        let want = ids(&case["ids"]);
        if got != want {
            failures.push(format!(
                "{} {opts:?}\n  got  {got:?}\n  want {want:?}",
                case["name"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{model}: {} of {} cases differ:\n{}",
        failures.len(),
        cases.as_array().unwrap().len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_ids_equal_llama_cpp() {
    check_llama_cpp_ids("smollm2-135m");
}

#[test]
fn gemma3_ids_equal_llama_cpp() {
    check_llama_cpp_ids("gemma3-270m");
}

/// decode(encode(s)) == s with special tokens parsed and rendered. Neither model adds
/// a SentencePiece space prefix, so no leading space is removed (the rule, for models
/// that add one: the first token's leading space is dropped unless BOS precedes it).
#[test]
fn decoding_restores_the_text() {
    for model in ["smollm2-135m", "gemma3-270m"] {
        let Some((_, tok)) = load(model) else {
            continue;
        };
        for case in data(&format!("tokenize_{model}.json")).as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            for parse_special in [true, false] {
                let encoded = tok.encode(
                    text,
                    EncodeOptions {
                        add_special: false,
                        parse_special,
                    },
                );
                assert_eq!(tok.decode(&encoded, true), text, "{model} {}", case["name"]);
            }
        }
    }
}

#[test]
fn chat_prompts_equal_llama_server() {
    let all = data("chat_llama_server.json");
    for model in ["smollm2-135m", "gemma3-270m"] {
        let Some((file, tok)) = load(model) else {
            continue;
        };
        let template = ChatTemplate::for_model(file.metadata(), &tok).unwrap();
        for case in all[model].as_array().unwrap() {
            let messages = messages(&case["messages"]);
            let prompt = template.render(&messages, true).unwrap();
            assert_eq!(prompt, case["prompt"].as_str().unwrap(), "{model}");
            assert_eq!(
                tok.encode(&prompt, EncodeOptions::default()),
                ids(&case["ids"]),
                "{model}"
            );
        }
    }
}

#[test]
fn smollm2_template_equals_jinja2() {
    let Some((file, tok)) = load("smollm2-135m") else {
        return;
    };
    let template = ChatTemplate::for_model(file.metadata(), &tok).unwrap();
    for case in data("chat_jinja2.json").as_array().unwrap() {
        let messages = messages(&case["messages"]);
        let add = case["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            template.render(&messages, add).unwrap(),
            case["expected"].as_str().unwrap(),
            "{}",
            case["name"]
        );
    }
}

/// Appending a conversation message by message, and a text piece by piece at every
/// split of the oracle strings, gives the full encode each time.
#[test]
fn incremental_encoding_equals_full_encoding_on_the_oracle_strings() {
    for model in ["smollm2-135m", "gemma3-270m"] {
        let Some((_, tok)) = load(model) else {
            continue;
        };
        let cases = data(&format!("tokenize_{model}.json"));
        let texts: Vec<&str> = cases
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap())
            .collect();
        for parse_special in [true, false] {
            let opts = EncodeOptions {
                add_special: true,
                parse_special,
            };
            let mut whole = PromptEncoder::new(&tok, opts);
            for text in texts.iter().step_by(8) {
                whole.push_str(text);
                assert_eq!(
                    whole.ids(),
                    tok.encode(whole.text(), opts),
                    "{model} appending {text:?}"
                );
            }
            for text in &texts {
                let cuts: Vec<usize> = (0..=text.len())
                    .filter(|&i| text.is_char_boundary(i))
                    .step_by(3)
                    .collect();
                let mut enc = PromptEncoder::new(&tok, opts);
                let mut last = 0;
                for &c in cuts.iter().chain([&text.len()]) {
                    enc.push_str(&text[last..c]);
                    last = c;
                    assert_eq!(
                        enc.ids(),
                        tok.encode(enc.text(), opts),
                        "{model} {text:?} cut at {c}"
                    );
                }
            }
        }
    }
}

/// A 35 KB document (the text llama-perplexity scores) tokenizes to llama.cpp's ids.
#[test]
fn gpl3_document_ids_equal_llama_cpp() {
    let text = std::fs::read_to_string(format!("{}/tests/data/GPL-3", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let text = text.strip_suffix('\n').unwrap();
    let all = data("gpl3_tokens.json");
    for model in ["smollm2-135m", "gemma3-270m"] {
        let Some((_, tok)) = load(model) else {
            continue;
        };
        let want = ids(&all[model]["ids"]);
        let got = tok.encode(
            text,
            EncodeOptions {
                add_special: true,
                parse_special: false,
            },
        );
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(
            got.len(),
            want.len(),
            "{model}: first difference at {first_diff:?}"
        );
        assert_eq!(first_diff, None, "{model}");
    }
}

/// The end-of-generation sets llama.cpp derives (its vocabulary log).
#[test]
fn end_of_generation_tokens_match_llama_cpp() {
    for (model, want) in [
        ("smollm2-135m", vec![0, 2, 4]),
        ("gemma3-270m", vec![1, 106, 212]),
    ] {
        let Some((_, tok)) = load(model) else {
            continue;
        };
        assert_eq!(tok.vocab().eog, want, "{model}");
    }
}
