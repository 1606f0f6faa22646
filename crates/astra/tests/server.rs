//! `astra serve` end to end: the real binary on a loopback port with the real SmolLM2
//! model, driven over HTTP.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{content, post_to, sse_events, user, Server};
use serde_json::{json, Value};

#[test]
fn chat_whole_and_streamed_agree() {
    let Some(s) = Server::start(&[]) else { return };
    let prompt = "Write a long story about a dragon who learns to bake bread.";
    let whole = s.chat(&user(prompt, 24));
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    assert!(whole["timings"]["predicted_per_second"].as_f64().unwrap() > 0.0);
    let mut body = user(prompt, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = s.post_raw("/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content(&whole));
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(usage["prompt_tokens"], whole["usage"]["prompt_tokens"]);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
    // Plain completions, too.
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "The sky is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

/// `/v1/completions` with a list of prompts: `n` choices per prompt, numbered
/// prompt-major, each the text its prompt gives alone; usage counts every prompt once;
/// streamed, the chunks carry the same indices and texts.
#[test]
fn several_prompts_in_one_completion() {
    let Some(s) = Server::start(&[]) else { return };
    let prompts = ["The sky is", "Paris is the capital of", "1, 2, 3,"];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| {
            let (status, v) = s.post(
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": 6, "temperature": 0}),
            );
            assert_eq!(status, 200, "{v}");
            v
        })
        .collect();
    let prompt_tokens: u64 = alone
        .iter()
        .map(|a| a["usage"]["prompt_tokens"].as_u64().unwrap())
        .sum();
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2}),
    );
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], alone[i / 2]["choices"][0]["text"], "choice {i}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 36);
    let body = json!({"prompt": prompts, "max_tokens": 6, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = s.post_raw("/v1/completions", &body.to_string());
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for (i, a) in alone.iter().enumerate() {
        let streamed: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(
            streamed,
            a["choices"][0]["text"].as_str().unwrap(),
            "prompt {i}"
        );
    }
    assert_eq!(
        chunks.last().unwrap()["usage"]["prompt_tokens"],
        prompt_tokens
    );
}

fn long_prefix() -> String {
    let mut s = String::from("You are a meticulous assistant. Background notes follow.\n");
    for i in 0..40 {
        s.push_str(&format!("Note {i}: the river town of Vell{i} trades wool, salt and copper with its neighbours.\n"));
    }
    s
}

fn with_prefix(question: &str) -> Value {
    json!({"messages": [{"role": "system", "content": long_prefix()}, {"role": "user", "content": question}],
           "max_tokens": 16, "temperature": 0})
}

#[test]
fn shared_prefix_is_served_from_the_cache_with_the_same_output() {
    let Some(s) = Server::start(&[]) else { return };
    let first = s.chat(&with_prefix("Which town trades salt?"));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = s.chat(&with_prefix("Summarise note 3."));
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let prefix_tokens = {
        let (_, v) = s.post("/tokenize", &json!({"content": long_prefix()}));
        v["tokens"].as_array().unwrap().len() as u64
    };
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        prefix_tokens > 400 && cached * 10 >= prefix_tokens * 9,
        "cached {cached} of a {prefix_tokens}-token prefix"
    );
    assert!(cached < prompt_tokens);
    // The same request on a fresh server (nothing cached) gives the same text.
    drop(s);
    let fresh = Server::start(&[]).unwrap();
    let uncached = fresh.chat(&with_prefix("Summarise note 3."));
    assert_eq!(
        uncached["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(content(&uncached), content(&second));
}

fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Chats that share a system prompt, running together, hold its KV pages once: each is
/// served its prefix from the cache, the pages in memory are the prompt's once plus a
/// few of each chat's own, and the answers are those of a server that cached nothing.
#[test]
fn concurrent_chats_hold_one_system_prompt_once() {
    let Some(s) = Server::start(&["--parallel", "8"]) else {
        return;
    };
    let prefix_tokens = {
        let (_, v) = s.post("/tokenize", &json!({"content": long_prefix()}));
        v["tokens"].as_array().unwrap().len() as u64
    };
    let prefix_pages = prefix_tokens / 64;
    s.chat(&with_prefix("Which town trades salt?"));
    let questions: Vec<String> = (0..8).map(|i| format!("Summarise note {i}.")).collect();
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = questions
            .iter()
            .map(|q| {
                let body = with_prefix(q).to_string();
                let base = s.base.clone();
                scope.spawn(move || {
                    let (status, text) = common::post_to(&base, "/v1/chat/completions", &body);
                    assert_eq!(status, 200, "{text}");
                    serde_json::from_str::<Value>(&text).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for a in &answers {
        assert!(
            cached_tokens(a) >= prefix_tokens - 1,
            "cached {} of a {prefix_tokens}-token prefix",
            cached_tokens(a)
        );
    }
    // Nine chats: the prefix's pages once, and each chat's question and answer (at
    // most 64 + 16 positions past the prefix's last whole page: two pages of its own).
    let pages = s.metric("astra_kv_pages") as u64;
    assert!(
        pages <= prefix_pages + 1 + 9 * 2,
        "{pages} pages for nine chats over a {prefix_pages}-page prefix"
    );
    assert!(s.metric("astra_kv_pages_shared") as u64 >= prefix_pages);
    drop(s);
    let fresh = Server::start(&[]).unwrap();
    for (q, a) in questions.iter().zip(&answers).take(3) {
        let alone = fresh.chat(&with_prefix(q));
        assert_eq!(content(&alone), content(a), "{q}");
    }
}

/// Conversations that share only the chat template's first tokens each keep their own
/// cache: taking turns, every one finds its whole history cached.
#[test]
fn conversations_in_turn_each_stay_cached() {
    let Some(s) = Server::start(&[]) else { return };
    let history = |topic: usize, turns: usize| {
        let mut messages = vec![json!({"role": "system", "content": format!(
            "You are a guide to the town of Vell{topic}. {}", long_prefix())})];
        for t in 0..turns {
            messages.push(json!({"role": "user", "content": format!("Tell me fact {t}.")}));
            messages
                .push(json!({"role": "assistant", "content": format!("Fact {t} of Vell{topic}.")}));
        }
        messages.push(json!({"role": "user", "content": format!("Tell me fact {turns}.")}));
        json!({"messages": messages, "max_tokens": 4, "temperature": 0})
    };
    let first: Vec<Value> = (0..5).map(|c| s.chat(&history(c, 0))).collect();
    for (c, f) in first.iter().enumerate() {
        let again = s.chat(&history(c, 1));
        let before = f["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached_tokens(&again) >= before,
            "conversation {c}: {} of its {before} earlier tokens cached",
            cached_tokens(&again)
        );
    }
}

#[test]
fn json_key_order_and_whitespace_do_not_change_caching() {
    let Some(s) = Server::start(&[]) else { return };
    let a = r#"{"model":"m","temperature":0,"max_tokens":6,"messages":[{"role":"user","content":"Tell me about otters."}]}"#;
    let b = r#"{ "messages" : [ { "content" : "Tell me about otters.", "role" : "user" } ],
                 "max_tokens" : 6 ,"temperature":0.0, "model": "m" }"#;
    let (sa, va) = s.post_raw("/v1/chat/completions", a);
    let (sb, vb) = s.post_raw("/v1/chat/completions", b);
    assert_eq!((sa, sb), (200, 200));
    let (va, vb): (Value, Value) = (
        serde_json::from_str(&va).unwrap(),
        serde_json::from_str(&vb).unwrap(),
    );
    let prompt = vb["usage"]["prompt_tokens"].as_u64().unwrap();
    // Everything but the last prompt token (whose logits start the generation).
    assert_eq!(
        vb["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt - 1
    );
    assert_eq!(content(&va), content(&vb));
}

#[test]
fn logit_bias_bans_the_greedy_token() {
    let Some(s) = Server::start(&[]) else { return };
    let mut body = user("Write one word: the color of grass.", 12);
    body["logprobs"] = json!(true);
    let plain = s.chat(&body);
    let ids = |v: &Value| -> Vec<u64> {
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_u64().unwrap())
            .collect()
    };
    let first = ids(&plain)[0];
    body["logit_bias"] = json!({ first.to_string(): -100 });
    let biased = s.chat(&body);
    assert_ne!(content(&biased), content(&plain));
    assert!(
        !ids(&biased).contains(&first),
        "token {first} was emitted despite a -100 bias"
    );
}

#[test]
fn concurrent_requests_match_their_single_outputs() {
    let Some(s) = Server::start(&["--parallel", "4", "--queue", "32"]) else {
        return;
    };
    // Every third request is constrained by a JSON schema (sampled, with a logit bias),
    // so that constrained and free sequences share the batched steps.
    let schema = json!({"type": "object", "properties": {"fact": {"type": "string", "maxLength": 20}},
                        "required": ["fact"], "additionalProperties": false});
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            let mut body = user(
                &format!("Give me fact number {i} about the number {}.", i * 7 + 3),
                12,
            );
            if i % 3 == 1 {
                body["max_tokens"] = json!(48);
                body["temperature"] = json!(0.8);
                body["seed"] = json!(i);
                body["logit_bias"] = json!({"28": -2});
                body["response_format"] =
                    json!({"type": "json_schema", "json_schema": {"name": "f", "schema": schema}});
            }
            body
        })
        .collect();
    let single: Vec<String> = bodies
        .iter()
        .map(|b| content(&s.chat(b)).to_owned())
        .collect();
    for (i, text) in single.iter().enumerate().filter(|(i, _)| i % 3 == 1) {
        let v: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("request {i}: {e}: {text}"));
        assert!(v["fact"].is_string(), "request {i}: {text}");
    }
    for (i, (got, want)) in all_at_once(&s, &bodies).iter().zip(&single).enumerate() {
        assert_eq!(content(got), want, "request {i} under load");
    }
}

/// The chat completions of `bodies`, all sent at once.
fn all_at_once(s: &Server, bodies: &[Value]) -> Vec<Value> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let (base, body) = (s.base.clone(), b.to_string());
                scope.spawn(move || {
                    let (status, text) = post_to(&base, "/v1/chat/completions", &body);
                    assert_eq!(status, 200, "{text}");
                    serde_json::from_str::<Value>(&text).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// More running requests than the KV arena holds: the newest pause when the pages run
/// out, and go on from their tokens once others finish. Every answer, greedy or
/// sampled, is the one the request gets alone.
#[test]
fn requests_paused_for_kv_pages_answer_as_alone() {
    // 48 MiB hold about 34 pages of 64 positions; ten requests of about 300 positions
    // each want about 50.
    let Some(s) = Server::start(&["--parallel", "10", "--arena-mib", "48"]) else {
        return;
    };
    let bodies: Vec<Value> = (0..10)
        .map(|i| {
            let mut body = user(
                &format!("Tell a long story about a lighthouse keeper named {i}."),
                256,
            );
            // Both end tokens banned: every answer runs its whole length.
            body["logit_bias"] = json!({"0": -100, "2": -100});
            if i % 2 == 1 {
                body["temperature"] = json!(0.9);
                body["seed"] = json!(i);
            }
            body
        })
        .collect();
    let single: Vec<Value> = bodies.iter().map(|b| s.chat(b)).collect();
    assert_eq!(s.metric("astra_preemptions_total"), 0.0);
    let answers = all_at_once(&s, &bodies);
    assert!(
        s.metric("astra_preemptions_total") > 0.0,
        "nothing paused: the test no longer overfills the arena"
    );
    assert!(s.metric("astra_kv_bytes") <= 48.0 * (1 << 20) as f64);
    for (i, (got, want)) in answers.iter().zip(&single).enumerate() {
        assert_eq!(got["usage"]["completion_tokens"], 256, "{got}");
        assert_eq!(content(got), content(want), "request {i}");
    }
}

#[test]
fn a_disconnecting_client_frees_its_slot() {
    let Some(s) = Server::start(&["--parallel", "1"]) else {
        return;
    };
    let addr = s.base.strip_prefix("http://").unwrap().to_owned();
    let body = json!({"messages": [{"role": "user", "content": "Count slowly to a thousand."}], "max_tokens": 1500,
                      "temperature": 0, "stream": true})
    .to_string();
    let mut conn = TcpStream::connect(&addr).unwrap();
    write!(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 2048];
    let n = conn.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let busy = |want: u64| {
        let t0 = Instant::now();
        loop {
            let h: Value = serde_json::from_str(&s.get("/health").1).unwrap();
            if h["slots_processing"] == want {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "slots_processing is not {want} after 5 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    busy(1);
    drop(conn);
    // The slot frees within a few steps, long before 1500 tokens could be generated.
    busy(0);
    assert_eq!(s.metric("astra_requests_total{outcome=\"cancelled\"}"), 1.0);
    // And the next request is served.
    assert_eq!(s.chat(&user("Hi", 3))["usage"]["completion_tokens"], 3);
}

#[test]
fn over_the_queue_is_429() {
    let Some(s) = Server::start(&["--parallel", "1", "--queue", "1"]) else {
        return;
    };
    let base = s.base.clone();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let base = base.clone();
            std::thread::spawn(move || {
                post_to(
                    &base,
                    "/v1/chat/completions",
                    &user(&format!("Story {i}"), 40).to_string(),
                )
            })
        })
        .collect();
    let results: Vec<(u16, String)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let rejected: Vec<&(u16, String)> = results.iter().filter(|(st, _)| *st == 429).collect();
    assert!(
        results.iter().all(|(st, _)| *st == 200 || *st == 429),
        "{results:?}"
    );
    assert!(
        !rejected.is_empty() && results.iter().any(|(st, _)| *st == 200),
        "{results:?}"
    );
    let err: Value = serde_json::from_str(&rejected[0].1).unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error");
    assert!(err["error"]["message"].as_str().unwrap().contains("busy"));
}

#[test]
fn malformed_requests_get_4xx() {
    let Some(s) = Server::start(&[]) else { return };
    let chat = "/v1/chat/completions";
    let ok_msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    let cases: Vec<(&str, String, u16)> = vec![
        (chat, "not json".into(), 400),
        (chat, "[1,2]".into(), 400),
        (chat, "{}".into(), 400),
        (chat, r#"{"messages":"hi"}"#.into(), 400),
        (chat, r#"{"messages":[]}"#.into(), 400),
        (chat, r#"{"messages":[3]}"#.into(), 400),
        (
            chat,
            r#"{"messages":[{"role":"wizard","content":"x"}]}"#.into(),
            400,
        ),
        (chat, r#"{"messages":[{"content":"x"}]}"#.into(), 400),
        (
            chat,
            r#"{"messages":[{"role":"user","content":7}]}"#.into(),
            400,
        ),
        (
            chat,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#.into(),
            400,
        ),
        (chat, format!(r#"{{{ok_msgs},"max_tokens":-1}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"max_tokens":"ten"}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"max_tokens":1000000}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"temperature":-1}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"temperature":1e30}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"top_p":1.5}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"n":0}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"n":1000}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"stop":5}}"#), 400),
        (
            chat,
            format!(r#"{{{ok_msgs},"logit_bias":{{"abc":1}}}}"#),
            400,
        ),
        (
            chat,
            format!(r#"{{{ok_msgs},"logit_bias":{{"99999999":1}}}}"#),
            400,
        ),
        (
            chat,
            format!(r#"{{{ok_msgs},"logit_bias":{{"5":-1000}}}}"#),
            400,
        ),
        (chat, format!(r#"{{{ok_msgs},"seed":"x"}}"#), 400),
        (chat, format!(r#"{{{ok_msgs},"stream":"yes"}}"#), 400),
        (
            chat,
            format!(r#"{{{ok_msgs},"logprobs":true,"top_logprobs":100}}"#),
            400,
        ),
        (chat, format!(r#"{{{ok_msgs},"presence_penalty":9}}"#), 400),
        (
            chat,
            format!(
                r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
                "word ".repeat(3000)
            ),
            400,
        ),
        ("/v1/completions", "{}".into(), 400),
        ("/v1/completions", r#"{"prompt":{"a":1}}"#.into(), 400),
        ("/v1/completions", r#"{"prompt":[1, 99999999]}"#.into(), 400),
        ("/tokenize", r#"{"content":5}"#.into(), 400),
        ("/detokenize", r#"{"tokens":[-1]}"#.into(), 400),
        ("/v1/nowhere", "{}".into(), 404),
    ];
    assert!(cases.len() >= 20);
    for (path, body, want) in &cases {
        let (status, text) = s.post_raw(path, body);
        assert_eq!(
            status,
            *want,
            "{path} {}: {text}",
            &body[..body.len().min(80)]
        );
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{path}: error body is not JSON: {text}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{text}"
        );
    }
    // A body over the limit is refused from its declared length, before it is read. An
    // HTTP client still sending it may see the connection close under it (the server
    // does not read 9 MiB only to discard them), so this one is sent by hand: the
    // headers and a first piece, then the answer is read.
    let (status, text) = post_declared(s.base.strip_prefix("http://").unwrap(), chat, 9 << 20);
    assert_eq!(status, 413, "{text}");
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("error body is not JSON: {text}"));
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{text}"
    );
    let (status, _) = s.get("/v1/chat/completions");
    assert_eq!(status, 405);
    assert_eq!(s.get("/health").0, 200, "the server survives");
    let counted = cases
        .iter()
        .filter(|c| c.0 != "/tokenize" && c.0 != "/detokenize" && c.0 != "/v1/nowhere")
        .count()
        + 1;
    assert_eq!(
        s.metric("astra_requests_total{outcome=\"invalid\"}") as usize,
        counted
    );
}

/// POSTs headers declaring a JSON body of `len` bytes and sends only its first 64 KiB;
/// returns the status and body of the answer.
fn post_declared(addr: &str, path: &str, len: usize) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(conn, "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n").unwrap();
    let _ = conn.write_all(&vec![b' '; (64 << 10).min(len)]);
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

#[test]
fn tokenize_detokenize_models_props_metrics() {
    let Some(s) = Server::start(&[]) else { return };
    let (status, v) = s.post(
        "/tokenize",
        &json!({"content": "Hello world", "with_pieces": true}),
    );
    assert_eq!(status, 200);
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let pieces: String = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["piece"].as_str().unwrap())
        .collect();
    assert_eq!(pieces, "Hello world");
    let (_, d) = s.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(d["content"], "Hello world");
    let models: Value = serde_json::from_str(&s.get("/v1/models").1).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["meta"]["n_vocab"], 49152);
    let props: Value = serde_json::from_str(&s.get("/props").1).unwrap();
    assert_eq!(props["default_generation_settings"]["n_ctx"], 2048);
    assert_eq!(props["eos_token"], "<|im_end|>");
    s.chat(&user("Hi", 4));
    for name in [
        "astra_time_to_first_token_seconds_count",
        "astra_inter_token_latency_seconds_count",
        "astra_request_duration_seconds_count",
    ] {
        assert!(s.metric(name) >= 1.0, "{name}");
    }
    assert_eq!(s.metric("astra_generated_tokens_total"), 4.0);
    assert_eq!(s.metric("astra_requests_total{outcome=\"ok\"}"), 1.0);
}

#[test]
fn sigterm_finishes_in_flight_requests_then_exits_zero() {
    let Some(mut s) = Server::start(&[]) else {
        return;
    };
    let base = s.base.clone();
    let inflight = std::thread::spawn(move || {
        post_to(
            &base,
            "/v1/chat/completions",
            &user("Describe the sea.", 48).to_string(),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let (status, body) = inflight.join().unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 48);
    let t0 = Instant::now();
    loop {
        if let Some(code) = s.child.try_wait().unwrap() {
            assert!(code.success(), "exit status {code}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the server did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The official `openai` Python package as the client (tests/openai_client.py). Needs
/// python3 with `openai` importable; scripts/test installs it and requires this test.
#[test]
fn official_openai_python_client() {
    let script = format!("{}/tests/openai_client.py", env!("CARGO_MANIFEST_DIR"));
    if !python_has("openai") {
        return;
    }
    let Some(s) = Server::start(&[]) else { return };
    run_client(&script, &s.base, "");
}

/// Runs a Python client script against `base`; it must pass all its checks.
fn run_client(script: &str, base: &str, label: &str) {
    let out = Command::new("python3")
        .arg(script)
        .arg(base)
        .output()
        .expect("run python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{label}: {text}");
    assert!(text.contains("all checks passed"), "{label}: {text}");
}

/// Structured output and tool calls through the official clients
/// (tests/tools_client.py, answers validated with `jsonschema`): on SmolLM2 and Gemma 3,
/// whose templates have no tool format (the generic JSON format), and on SmolLM2 with a
/// template in the Hermes format (tests/data/hermes-tools.jinja).
#[test]
fn official_clients_structured_output_and_tools() {
    let script = format!("{}/tests/tools_client.py", env!("CARGO_MANIFEST_DIR"));
    let template = format!(
        "{}/tests/data/hermes-tools.jinja",
        env!("CARGO_MANIFEST_DIR")
    );
    if !python_has("openai, anthropic, jsonschema") {
        return;
    }
    for (model, extra) in [
        ("smollm2-135m", vec![]),
        (
            "smollm2-135m",
            vec!["--chat-template-file", template.as_str()],
        ),
        ("gemma3-270m", vec![]),
    ] {
        let Some(s) = Server::start_model(model, &extra, &[]) else {
            return;
        };
        run_client(&script, &s.base, &format!("{model} {extra:?}"));
    }
}

/// Whether python3 imports `modules`; when not, the test is skipped with the reason,
/// or fails under `ASTRA_REQUIRE_OPENAI=1` (scripts/test installs them).
fn python_has(modules: &str) -> bool {
    let has = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        let why = format!(
            "the Python packages {modules} are not importable (scripts/test installs them)"
        );
        assert!(
            std::env::var("ASTRA_REQUIRE_OPENAI").map_or(true, |v| v != "1"),
            "{why}"
        );
        eprintln!("SKIPPED: {why}");
    }
    has
}

/// One request written as given over a fresh connection: status, head and body.
fn raw_request(
    base: &str,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String, String) {
    let addr = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// The host check (DNS rebinding) and CORS: unknown hosts and origins get an
/// OpenAI-shaped 403 before any work; listed origins get their preflight and a marked
/// response.
#[test]
fn hosts_and_origins_are_checked() {
    let Some(s) = Server::start(&[
        "--cors-origins",
        "http://app.example",
        "--allowed-hosts",
        "astra.lan",
    ]) else {
        return;
    };
    let chat =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).to_string();
    let ct = "Content-Type: application/json";
    let port = s.base.rsplit(':').next().unwrap().to_owned();
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "astra.lan".into(),
    ] {
        let (status, _, body) = raw_request(
            &s.base,
            "GET",
            "/v1/models",
            &[&format!("Host: {host}")],
            "",
        );
        assert_eq!(status, 200, "{host}: {body}");
    }
    let before = s.metric("astra_prompt_tokens_total");
    let (status, _, body) = raw_request(
        &s.base,
        "POST",
        "/v1/chat/completions",
        &["Host: rebind.attacker.example", ct],
        &chat,
    );
    assert_eq!(status, 403, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    let local = format!("Host: 127.0.0.1:{port}");
    let (status, _, body) = raw_request(
        &s.base,
        "POST",
        "/v1/chat/completions",
        &[&local, ct, "Origin: http://evil.example"],
        &chat,
    );
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        s.metric("astra_prompt_tokens_total"),
        before,
        "refused before any work"
    );
    let (status, head, _) = raw_request(
        &s.base,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            &local,
            "Origin: http://app.example",
            "Access-Control-Request-Method: POST",
        ],
        "",
    );
    assert_eq!(status, 204);
    assert!(
        head.contains("access-control-allow-origin: http://app.example"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-headers: authorization, content-type"),
        "{head}"
    );
    let (status, head, _) = raw_request(
        &s.base,
        "POST",
        "/v1/chat/completions",
        &[&local, ct, "Origin: http://app.example"],
        &chat,
    );
    assert_eq!(status, 200);
    assert!(
        head.contains("access-control-allow-origin: http://app.example"),
        "{head}"
    );
}

/// The smaller edges of the OpenAI surface: a flat id list of any length is one prompt,
/// `GET /v1/models/{id}`, `model` must be a string, fields astra does not implement are
/// refused by name, `/props` shows a file name only, and the busy-slot gauge drops as
/// soon as a request ends.
#[test]
fn openai_edges_and_honest_slot_counts() {
    let Some(s) = Server::start(&["--api-key", "sekret"]) else {
        return;
    };
    let port = s.base.rsplit(':').next().unwrap().to_owned();
    let local = format!("Host: 127.0.0.1:{port}");
    let ct = "Content-Type: application/json";
    let post = |auth: &str, body: Value| {
        let (status, _, text) = raw_request(
            &s.base,
            "POST",
            "/v1/completions",
            &[&local, ct, auth],
            &body.to_string(),
        );
        (
            status,
            serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
        )
    };
    let ids: Vec<u32> = (100..118).collect();
    let (status, v) = post(
        "authorization: bearer sekret",
        json!({"prompt": ids, "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(status, 200, "18 ids, a lower-case scheme: {v}");
    assert_eq!(v["usage"]["prompt_tokens"], 18);
    let auth = "Authorization: Bearer sekret";
    for (body, param) in [
        (json!({"prompt": "x", "model": 5}), "model"),
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "suffix": "end"}), "suffix"),
        (json!({"prompt": "x", "best_of": 3}), "best_of"),
    ] {
        let (status, v) = post(auth, body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    let (status, v) = post(
        auth,
        json!({"prompt": "x", "echo": false, "best_of": 1, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "harmless values pass: {v}");
    let get = |path: &str| {
        let (status, _, text) = raw_request(&s.base, "GET", path, &[&local, auth], "");
        (
            status,
            serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
        )
    };
    let (_, list) = get("/v1/models");
    let id = list["data"][0]["id"].as_str().unwrap().to_owned();
    let (status, one) = get(&format!("/v1/models/{id}"));
    assert_eq!((status, &one), (200, &list["data"][0]));
    let (status, v) = get("/v1/models/gpt-none");
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    let (_, props) = get("/props");
    let file = props["model_path"].as_str().unwrap();
    assert!(file.ends_with(".gguf") && !file.contains('/'), "{props}");
    // The gauge drops with the response, not at the next request.
    let (status, _) = post(
        auth,
        json!({"prompt": "Once upon a time", "max_tokens": 16}),
    );
    assert_eq!(status, 200);
    std::thread::sleep(Duration::from_millis(100));
    let (_, health) = get("/health");
    assert_eq!(health["slots_processing"], 0, "{health}");
}

/// A configuration that cannot work fails before the port opens, saying what fits:
/// here one sequence of the context (8,192 positions, about 180 MiB) would not fit.
/// (Several sequences need not fit at once: they hold pages as they go, and pause.)
#[test]
fn an_arena_too_small_fails_before_listening() {
    let Some(model) = astra_models::model_for_test("smollm2-135m") else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_astra"))
        .args([
            "serve",
            "--port",
            "0",
            "--ctx",
            "8192",
            "--parallel",
            "4",
            "--arena-mib",
            "100",
        ])
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success());
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(
        stderr.contains("--arena-mib 100 holds 0 (lower --ctx"),
        "{stderr}"
    );
}

/// Writes `bytes` on a fresh connection and reads until the server closes it.
fn write_and_read(addr: &str, bytes: &[u8]) -> (Duration, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let started = Instant::now();
    // The server may answer and stop reading before all of an oversized head is sent.
    let _ = s.write_all(bytes);
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    (
        started.elapsed(),
        String::from_utf8_lossy(&answer).into_owned(),
    )
}

/// `answer` is a whole response with `status`, an OpenAI-shaped error body and its
/// length.
fn assert_json_error(answer: &str, status: u16) {
    let (head, body) = answer.split_once("\r\n\r\n").expect(answer);
    assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{answer}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-length: {}", body.len())),
        "{answer}"
    );
    let v: Value = serde_json::from_str(body).expect(answer);
    assert!(v["error"]["message"].is_string(), "{answer}");
}

/// Slow and idle clients: a request head dribbled past `--header-timeout` gets a 408
/// and an idle connection is closed; heads hyper cannot parse get JSON bodies;
/// connections past `--max-connections` get a 503 with Retry-After and a JSON body; once
/// idle ones time out, requests are served again.
#[test]
fn slow_and_idle_connections_are_bounded() {
    let Some(s) = Server::start(&[
        "--max-connections",
        "6",
        "--header-timeout",
        "2",
        "--body-timeout",
        "2",
    ]) else {
        return;
    };
    let addr = s.base.trim_start_matches("http://").to_owned();
    // A body that never ends: 408 once its time is up.
    let mut dribble = TcpStream::connect(&addr).unwrap();
    dribble
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let started = Instant::now();
    dribble
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
              Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
        )
        .unwrap();
    let mut answer = String::new();
    let _ = dribble.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    drop(dribble);
    // A head that never ends: 408 with a JSON body at the header timeout.
    let (waited, answer) = write_and_read(&addr, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    assert_json_error(&answer, 408);
    // An idle connection is closed at the header timeout without a word.
    let (waited, answer) = write_and_read(&addr, b"");
    assert!(waited < Duration::from_secs(6), "{waited:?}");
    assert_eq!(answer, "");
    // Heads hyper cannot parse get its status with a JSON body.
    for (head, status) in [
        (b"NOT HTTP AT ALL\r\n\r\n".to_vec(), 400),
        (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n".to_vec(),
            400,
        ),
        (
            [
                &b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "[..],
                &vec![b'a'; 1 << 19],
                b"\r\n\r\n",
            ]
            .concat(),
            431,
        ),
    ] {
        let (_, answer) = write_and_read(&addr, &head);
        assert_json_error(&answer, status);
    }
    // The server holds each of those connections until it has read the client's close.
    std::thread::sleep(Duration::from_millis(500));
    // Six idle connections fill the server; the seventh is refused at once.
    let idle: Vec<TcpStream> = (0..6).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, head, body) = raw_request(&s.base, "GET", "/health", &["Host: 127.0.0.1"], "");
    assert_eq!(status, 503, "{head}{body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "unavailable_error");
    // The idle ones are closed by the header timeout; then requests are served.
    std::thread::sleep(Duration::from_secs(3));
    let (status, _, body) = raw_request(&s.base, "GET", "/health", &["Host: 127.0.0.1"], "");
    assert_eq!(status, 200, "{body}");
    drop(idle);
}

/// The drain: after SIGTERM a new request gets 503 while the listener is still open; a
/// stream still running when the grace ends is cut with an error event and `[DONE]`,
/// its body terminated; then the server exits.
#[test]
fn a_drain_refuses_new_requests_and_cuts_streams_cleanly() {
    let Some(mut s) = Server::start(&["--shutdown-grace", "2"]) else {
        return;
    };
    let base = s.base.clone();
    let mut body = user("Write a very long story about the sea.", 1500);
    body["stream"] = json!(true);
    body["temperature"] = json!(1.0);
    let long =
        std::thread::spawn(move || post_to(&base, "/v1/chat/completions", &body.to_string()));
    std::thread::sleep(Duration::from_millis(500));
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(Duration::from_millis(300));
    let (status, head, body) = raw_request(&s.base, "GET", "/v1/models", &["Host: 127.0.0.1"], "");
    assert_eq!(status, 503, "{head}{body}");
    assert!(head.contains("retry-after"), "{head}");
    let (status, text) = long.join().unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shut down"),
        "{error}"
    );
    let t0 = Instant::now();
    while s.child.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the server did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
