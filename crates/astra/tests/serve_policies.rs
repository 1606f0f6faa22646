//! `astra serve` policies end to end on the real SmolLM2 model: thinking and answer
//! reservation, capabilities, images, the memory admission gate, keep-alive unloading,
//! the API key, keep-awake and telemetry gauges.

mod common;

use std::time::{Duration, Instant};

use common::{sse_events, user, Server};
use serde_json::{json, Value};

const WRAP_UP: &str = "I have thought about this long enough; time to give my answer.";

fn thinking_request(answer_room: usize) -> Value {
    json!({"messages": [{"role": "user", "content": "Explain in detail how bread rises, step by step."}],
           "max_tokens": 64, "temperature": 0, "think": true, "answer_room": answer_room})
}

/// (reasoning, content) of a streamed response.
fn streamed_parts(text: &str) -> (String, String, Value) {
    let (mut reasoning, mut content, mut usage) = (String::new(), String::new(), Value::Null);
    for e in sse_events(text) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        if let Some(d) = v["choices"].get(0).map(|c| &c["delta"]) {
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (reasoning, content, usage)
}

#[test]
fn thinking_budget_wraps_up_and_leaves_room_to_answer() {
    let Some(s) = Server::start(&[]) else { return };
    let r = s.chat(&thinking_request(16));
    let msg = &r["choices"][0]["message"];
    let reasoning = msg["reasoning_content"].as_str().unwrap();
    let content = msg["content"].as_str().unwrap();
    let thinking_tokens = r["usage"]["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        reasoning.trim_end().ends_with(WRAP_UP),
        "reasoning: {reasoning:?}"
    );
    assert_eq!(reasoning.matches(WRAP_UP).count(), 1);
    assert!(thinking_tokens <= 48, "{thinking_tokens} thinking tokens");
    assert!(!content.trim().is_empty(), "no answer after the wrap-up");
    assert!(
        !content.contains(WRAP_UP) && !content.contains("</think>"),
        "content: {content:?}"
    );
    let logged = s.wait_for_log("reasoning budget: cap=64 answer_room=16 thinking_budget=48");
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(logged[0].contains("injected=wrap_up"), "{}", logged[0]);
    // Streamed: the same reasoning and answer.
    let mut body = thinking_request(16);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = s.post_raw("/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200);
    let (sr, sc, usage) = streamed_parts(&text);
    assert_eq!((sr.as_str(), sc.as_str()), (reasoning, content));
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"].as_u64(),
        Some(thinking_tokens)
    );
}

/// A model that ends its turn inside the thinking, with answer room left, gets its
/// thinking closed and answers; with the reservation off, the turn ends there.
#[test]
fn an_end_of_turn_inside_the_thinking_still_gets_an_answer() {
    let Some(s) = Server::start(&[]) else { return };
    // Prompts on which SmolLM2 ends its turn inside the thinking after a few tokens.
    for (i, prompt) in ["What is the capital of France?", "Say hello."]
        .into_iter()
        .enumerate()
    {
        let mut body = thinking_request(16);
        body["messages"][0]["content"] = json!(prompt);
        let mut off_body = body.clone();
        off_body["answer_room"] = json!(0);
        let off = s.chat(&off_body);
        let off_msg = &off["choices"][0]["message"];
        assert_eq!(off_msg["content"], "", "{prompt}: {off}");
        assert!(off["usage"]["completion_tokens"].as_u64().unwrap() < 48);
        let r = s.chat(&body);
        let msg = &r["choices"][0]["message"];
        let (reasoning, content) = (
            msg["reasoning_content"].as_str().unwrap(),
            msg["content"].as_str().unwrap(),
        );
        assert!(!content.trim().is_empty(), "{prompt}: no answer: {r}");
        assert!(!content.contains("</think>") && !reasoning.contains("</think>"));
        assert!(!reasoning.contains(WRAP_UP), "{reasoning:?}");
        // The thinking is the one the turn ended in.
        assert_eq!(
            reasoning.trim_end(),
            off_msg["reasoning_content"].as_str().unwrap().trim_end()
        );
        let t0 = Instant::now();
        while s.log_lines("injected=end_marker").len() <= i && t0.elapsed().as_secs() < 10 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let logged = s.log_lines("injected=end_marker");
        assert_eq!(logged.len(), i + 1, "{logged:?}");
        assert!(logged[i].contains("answer_room=16"), "{}", logged[i]);
    }
}

#[test]
fn answer_room_zero_turns_the_reservation_off() {
    let Some(s) = Server::start(&[]) else { return };
    let r = s.chat(&thinking_request(0));
    let reasoning = r["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap_or("");
    assert!(!reasoning.contains(WRAP_UP));
    let logged = s.wait_for_log("reasoning budget: cap=64 answer_room=0 thinking_budget=unlimited");
    assert!(
        logged.len() == 1 && logged[0].contains("injected=none"),
        "{logged:?}"
    );
    // An explicit thinking_budget replaces the reservation.
    let mut body = thinking_request(16);
    body["thinking_budget"] = json!(20);
    let r = s.chat(&body);
    assert!(
        r["usage"]["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            <= 20
    );
    assert!(r["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap()
        .trim_end()
        .ends_with(WRAP_UP));
}

/// The output items of a streamed Responses answer (each `response.output_item.done`)
/// and the final response object.
fn streamed_items(text: &str) -> (Vec<Value>, Value) {
    let (mut items, mut last) = (Vec::new(), Value::Null);
    for event in text.split("\n\n") {
        let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        let v: Value = serde_json::from_str(data).unwrap();
        match v["type"].as_str() {
            Some("response.output_item.done") => items.push(v["item"].clone()),
            Some("response.completed" | "response.incomplete") => last = v["response"].clone(),
            _ => {}
        }
    }
    (items, last)
}

/// An item's type, status and text: what a whole and a streamed answer share (ids
/// differ from request to request).
fn item_shape(item: &Value) -> (Value, Value, Value) {
    (
        item["type"].clone(),
        item["status"].clone(),
        item["content"][0]["text"].clone(),
    )
}

/// A Responses answer that the token budget cuts while it still reasons is its
/// reasoning item alone, and one that ends its turn inside the reasoning ends in an
/// empty message; whole and streamed alike.
#[test]
fn a_response_cut_in_its_reasoning_is_the_reasoning_alone() {
    let Some(s) = Server::start(&["--answer-room", "0"]) else {
        return;
    };
    // 8 tokens cut the first prompt's reasoning; SmolLM2 ends its turn inside the
    // reasoning on the second (as an_end_of_turn_inside_the_thinking_still_gets_an_answer
    // shows).
    for (prompt, max, status, types) in [
        (
            "Explain in detail how bread rises, step by step.",
            8,
            "incomplete",
            vec!["reasoning"],
        ),
        ("Say hello.", 64, "completed", vec!["reasoning", "message"]),
    ] {
        let body = json!({"input": prompt, "max_output_tokens": max, "temperature": 0,
                          "reasoning": {"effort": "medium"}});
        let (code, whole) = s.post("/v1/responses", &body);
        assert_eq!(code, 200, "{whole}");
        let output = whole["output"].as_array().unwrap();
        let got: Vec<&str> = output.iter().map(|o| o["type"].as_str().unwrap()).collect();
        assert_eq!(
            (whole["status"].as_str(), got),
            (Some(status), types),
            "{whole}"
        );
        assert!(
            !output[0]["content"][0]["text"].as_str().unwrap().is_empty(),
            "{whole}"
        );
        if let Some(message) = output.get(1) {
            assert_eq!(message["content"][0]["text"], "", "{whole}");
        }
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (code, text) = s.post_raw("/v1/responses", &streamed.to_string());
        assert_eq!(code, 200, "{text}");
        let (items, last) = streamed_items(&text);
        let shapes = |items: &[Value]| items.iter().map(item_shape).collect::<Vec<_>>();
        assert_eq!(shapes(&items), shapes(output), "{prompt}: {text}");
        let last_output = last["output"].as_array();
        assert_eq!(
            shapes(last_output.unwrap_or_else(|| panic!("no final response: {text}"))),
            shapes(output)
        );
        assert_eq!(last["status"], whole["status"]);
    }
}

#[test]
fn capabilities_are_stated_and_enforced() {
    let Some(s) = Server::start(&[]) else { return };
    let line = s.wait_for_log("capabilities: ");
    assert_eq!(line.len(), 1);
    assert!(
        line[0]
            .contains("capabilities: logit_bias=1 images=0 thinking=1 tools=1 structured_output=1"),
        "{}",
        line[0]
    );
    assert!(line[0].contains("backend=cpu"), "{}", line[0]);
    let props: Value = serde_json::from_str(&s.get("/props").1).unwrap();
    assert_eq!(props["capabilities"]["logit_bias"], true);
    assert_eq!(props["capabilities"]["images"], false);
    assert_eq!(
        (
            &props["capabilities"]["tools"],
            &props["capabilities"]["structured_output"]
        ),
        (&json!(true), &json!(true))
    );
    let mut body = user("hi", 4);
    body["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let (status, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    // A schema that cannot be enforced is refused, naming the field.
    let mut body = user("hi", 4);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 1}}});
    let (status, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
    // An image on this text-only model, under the default policy (reject).
    let (status, v) = s.post("/v1/chat/completions", &with_image("AAAA"));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("images")),
        "{v}"
    );
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--images omit"));
}

fn with_image(b64: &str) -> Value {
    json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe this picture in one sentence."},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}]}],
        "max_tokens": 6, "temperature": 0})
}

#[test]
fn omitted_images_warn_and_key_the_cache_by_their_bytes() {
    let Some(s) = Server::start(&["--images", "omit"]) else {
        return;
    };
    let first = s.chat(&with_image("iVBORw0KGgoAAAA"));
    assert!(
        first["warnings"][0]
            .as_str()
            .unwrap()
            .contains("1 image part(s) omitted"),
        "{first}"
    );
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let same = s.chat(&with_image("iVBORw0KGgoAAAA"));
    assert_eq!(
        same["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(prompt - 1)
    );
    // The same length of image data, other bytes: the cached prefix is not reused.
    let changed = s.chat(&with_image("iVBORw0KGgoAAAB"));
    assert_eq!(changed["usage"]["prompt_tokens"].as_u64(), Some(prompt));
    assert_eq!(
        changed["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0)
    );
}

#[test]
fn memory_gate_refuses_new_requests_below_the_threshold() {
    // Far above any machine's available memory.
    let Some(s) = Server::start(&["--min-free-mem-mib", "100000000"]) else {
        return;
    };
    let (status, v) = s.post("/v1/chat/completions", &user("hi", 4));
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--min-free-mem-mib"),
        "{v}"
    );
    assert_eq!(s.get("/health").0, 200);
    assert!(s.metric("astra_system_available_memory_bytes") > 0.0);
    assert!(s.metric("astra_process_resident_memory_bytes") > 0.0);
}

fn health(s: &Server) -> Value {
    serde_json::from_str(&s.get("/health").1).unwrap()
}

fn wait_for_health(s: &Server, status: &str) {
    let t0 = Instant::now();
    while health(s)["status"] != status {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "/health never said {status}: {}",
            health(s)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn keep_alive_unloads_when_idle_and_the_next_request_reloads() {
    let Some(s) = Server::start(&["--keep-alive", "1s"]) else {
        return;
    };
    let before = s.chat(&user("Say hello.", 6));
    wait_for_health(&s, "idle");
    let (status, body) = s.get("/health");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["loaded"],
        false
    );
    let after = s.chat(&user("Say hello.", 6));
    assert_eq!(common::content(&after), common::content(&before));
    assert_eq!(health(&s)["status"], "ready");
    assert_eq!(s.wait_for_log("model unloaded").len(), 1);
    // Per request (ollama's keep_alive): 0 unloads right after it, "-1" keeps it.
    let mut body = user("Say hello.", 2);
    body["keep_alive"] = json!("-1");
    s.chat(&body);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        health(&s)["status"],
        "ready",
        "keep_alive -1 keeps the model loaded"
    );
    body["keep_alive"] = json!(0);
    s.chat(&body);
    wait_for_health(&s, "idle");
}

#[test]
fn api_key_is_required_except_for_health() {
    let Some(s) = Server::start_with_env(&[], &[("ASTRA_API_KEY", "s3cret")]) else {
        return;
    };
    let call = |key: Option<&str>| {
        let mut req = Server::agent().get(&format!("{}/v1/models", s.base));
        if let Some(k) = key {
            req = req.header("authorization", &format!("Bearer {k}"));
        }
        let mut r = req.call().unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    };
    for key in [None, Some("wrong"), Some("s3cre"), Some("s3cret!")] {
        let (status, body) = call(key);
        assert_eq!(status, 401, "{key:?}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    assert_eq!(call(Some("s3cret")).0, 200);
    assert_eq!(s.get("/health").0, 200, "/health stays public");
}

#[test]
fn keep_awake_is_held_while_requests_run() {
    let Some(s) = Server::start(&["--parallel", "2"]) else {
        return;
    };
    assert_eq!(s.metric("astra_keep_awake_requests"), 0.0);
    let base = s.base.clone();
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let base = base.clone();
            std::thread::spawn(move || {
                common::post_to(
                    &base,
                    "/v1/chat/completions",
                    &user(&format!("Story {i}"), 40).to_string(),
                )
                .0
            })
        })
        .collect();
    let t0 = Instant::now();
    let mut seen = 0.0f64;
    while seen == 0.0 && t0.elapsed() < Duration::from_secs(10) {
        seen = s.metric("astra_keep_awake_requests");
    }
    assert!(seen >= 1.0, "never held during the requests");
    for w in workers {
        assert_eq!(w.join().unwrap(), 200);
    }
    assert_eq!(
        s.metric("astra_keep_awake_requests"),
        0.0,
        "still held after the last request"
    );
}
