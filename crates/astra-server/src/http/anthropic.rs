//! Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`. A
//! request is rewritten as the chat completion it asks for (system, content blocks,
//! tools, `tool_choice`, stop sequences, thinking budget), so that it is validated and
//! run as one; the answer comes back as content blocks or Anthropic's event stream, and
//! errors in Anthropic's shape.

use super::*;

/// `POST /v1/messages`.
pub(super) async fn messages(State(state): State<Shared>, body: Body) -> Response {
    let mut tracker = Tracker::new(&state);
    let parsed = parse_body(&state, body, |b, r| {
        api::completion_request(&to_chat(b, true)?, true, r.n_vocab)
    })
    .await;
    match parsed.and_then(|req| accept(&state, req, true)) {
        Err(e) => error_response(tracker.fail(e)),
        Ok(q) => {
            let a = Accepted::new(&state, q, tracker, true, "msg_");
            if a.req.stream {
                stream_response(a)
            } else {
                whole_response(a).await
            }
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would feed
/// them.
pub(super) async fn count_tokens(State(state): State<Shared>, body: Body) -> Response {
    let counted = parse_body(&state, body, |b, r| {
        let req = api::completion_request(&to_chat(b, false)?, true, r.n_vocab)?;
        let (tokens, _) = encode_prompt(r, &req, &req.prompt)?;
        Ok(tokens.len())
    })
    .await;
    match counted {
        Ok(n) => axum::Json(json!({"input_tokens": n})).into_response(),
        Err(e) => error_response(e),
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

fn error_response(e: ApiError) -> Response {
    let mut r = (
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(error_body(&e)),
    )
        .into_response();
    if e.retry_shortly() {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    r
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// The text of a `system` field or of a `tool_result`'s content: a string or a list of
/// text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t),
                    _ => Err(invalid(format!(
                        "{what} must be a string or a list of text blocks"
                    ))),
                }
            })
            .collect(),
        Value::Null => Ok(String::new()),
        _ => Err(invalid(format!(
            "{what} must be a string or a list of text blocks"
        ))),
    }
}

/// The chat completion body a Messages request asks for; `generating`: `max_tokens` is
/// required (not for counting).
fn to_chat(body: &Map<String, Value>, generating: bool) -> Result<Map<String, Value>, ApiError> {
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    let mut out = Map::new();
    let mut messages: Vec<Value> = Vec::new();
    if let Some(system) = get("system") {
        messages.push(json!({"role": "system", "content": text_of(system, "'system'")?}));
    }
    let list = get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("'messages' must be an array"))?;
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(role, Some("user" | "assistant")) {
            return Err(invalid(format!(
                "messages.{i}.role must be \"user\" or \"assistant\""
            )));
        }
        let role = role.unwrap_or_default();
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(invalid(format!(
                    "messages.{i}.content must be a string or a list of blocks"
                )))
            }
        };
        let (mut parts, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages.{i}.content.{j}");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    let t = b
                        .get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid(format!("{at}.text must be a string")))?;
                    parts.push(json!({"type": "text", "text": t}));
                }
                Some("image") => {
                    let src = b
                        .get("source")
                        .ok_or_else(|| invalid(format!("{at}.source is required")))?;
                    let url = match src.get("type").and_then(Value::as_str) {
                        Some("base64") => format!(
                            "data:{};base64,{}",
                            src.get("media_type").and_then(Value::as_str).unwrap_or(""),
                            src.get("data").and_then(Value::as_str).unwrap_or("")
                        ),
                        Some("url") => src
                            .get("url")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                        _ => {
                            return Err(invalid(format!(
                                "{at}.source must be of type base64 or url"
                            )))
                        }
                    };
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
                Some("tool_use") if role == "assistant" => {
                    let (id, name) = (
                        b.get("id").and_then(Value::as_str),
                        b.get("name").and_then(Value::as_str),
                    );
                    let (Some(id), Some(name)) = (id, name) else {
                        return Err(invalid(format!(
                            "{at}: a tool_use block needs 'id' and 'name'"
                        )));
                    };
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
                Some("tool_result") if role == "user" => {
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid(format!("{at}.tool_use_id must be a string")))?;
                    let mut text = text_of(
                        b.get("content").unwrap_or(&Value::Null),
                        &format!("{at}.content"),
                    )?;
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        text = format!("Error: {text}");
                    }
                    results.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
                }
                // Earlier thinking is not fed back, as Anthropic's own models drop it.
                Some("thinking" | "redacted_thinking") if role == "assistant" => {}
                Some(other) => {
                    return Err(invalid(format!(
                        "{at}: a block of type '{other}' is not supported in a {role} message"
                    )))
                }
                None => return Err(invalid(format!("{at} must be an object with a 'type'"))),
            }
        }
        // Tool results answer the calls before them; any text of the turn follows.
        messages.extend(results);
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": parts});
            if !calls.is_empty() {
                msg["tool_calls"] = json!(calls);
            }
            messages.push(msg);
        } else if !parts.is_empty() {
            messages.push(json!({"role": "user", "content": parts}));
        }
    }
    out.insert("messages".into(), json!(messages));
    match get("max_tokens") {
        Some(v) => {
            out.insert("max_tokens".into(), v.clone());
        }
        None if generating => return Err(invalid("'max_tokens' is required")),
        None => {}
    }
    copy_fields(
        body,
        &mut out,
        &[
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("stop_sequences", "stop"),
            ("stream", "stream"),
            ("model", "model"),
        ],
    );
    if let Some(tools) = get("tools") {
        let list = tools
            .as_array()
            .ok_or_else(|| invalid("'tools' must be an array"))?;
        let openai: Vec<Value> = list
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
                    return Err(invalid(format!("tools.{i}: server tools are not supported; give name, description and input_schema")));
                }
                Ok(nested_tool(t, "input_schema"))
            })
            .collect::<Result<_, _>>()?;
        out.insert("tools".into(), json!(openai));
    }
    if let Some(choice) = get("tool_choice") {
        let name = choice.get("name").and_then(Value::as_str);
        let openai = match (choice.get("type").and_then(Value::as_str), name) {
            (Some("auto"), _) => json!("auto"),
            (Some("any"), _) => json!("required"),
            (Some("none"), _) => json!("none"),
            (Some("tool"), Some(n)) => json!({"type": "function", "function": {"name": n}}),
            _ => return Err(invalid("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}")),
        };
        out.insert("tool_choice".into(), openai);
        if choice
            .get("disable_parallel_tool_use")
            .and_then(Value::as_bool)
            == Some(true)
        {
            out.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    if let Some(thinking) = get("thinking") {
        match thinking.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                let budget = thinking
                    .get("budget_tokens")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| invalid("thinking.budget_tokens must be a positive integer"))?;
                out.insert("think".into(), json!(true));
                out.insert("thinking_budget".into(), json!(budget));
            }
            // The model decides how long to think, within max_tokens and the answer room.
            Some("adaptive") => {
                out.insert("think".into(), json!(true));
            }
            Some("disabled") => {}
            _ => {
                return Err(invalid(
                    "thinking.type must be \"enabled\", \"adaptive\" or \"disabled\"",
                ))
            }
        }
    }
    // Structured output: `output_config.format` is a JSON schema.
    if let Some(format) = get("output_config")
        .and_then(|o| o.get("format"))
        .filter(|f| !f.is_null())
    {
        if format.get("type").and_then(Value::as_str) != Some("json_schema") {
            return Err(invalid("output_config.format.type must be \"json_schema\""));
        }
        let schema = format
            .get("schema")
            .ok_or_else(|| invalid("output_config.format.schema is required"))?;
        out.insert(
            "response_format".into(),
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
        );
    }
    Ok(out)
}

/// `stop_reason`: a call, the budget, a stop sequence or the end of the turn.
fn stop_reason(
    called: bool,
    finish: Option<FinishReason>,
    stop_string: Option<&str>,
) -> &'static str {
    match (called, finish, stop_string) {
        (true, _, _) => "tool_use",
        (_, Some(FinishReason::Length), _) => "max_tokens",
        (_, _, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic's usage: input tokens read from the prompt cache apart from the rest.
fn usage_of(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

fn tool_use(id: String, call: &Call) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
}

fn tool_use_id(a: &Accepted, k: usize) -> String {
    format!("toolu_{}_{k}", a.id.trim_start_matches("msg_"))
}

async fn whole_response(mut a: Accepted) -> Response {
    let choices = match a.collect().await {
        Ok(c) => c,
        Err(e) => return error_response(e),
    };
    let c = &choices[0];
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
    }
    let calls = a.calls(&c.text);
    let text = calls
        .as_ref()
        .map_or(c.text.as_str(), |(rest, _)| rest.as_str());
    if !text.is_empty() || (calls.is_none() && content.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for (k, call) in calls.iter().flat_map(|(_, calls)| calls.iter()).enumerate() {
        content.push(tool_use(tool_use_id(&a, k), call));
    }
    let usage = c.usage.clone().unwrap_or_default();
    let mut body = json!({
        "id": a.id, "type": "message", "role": "assistant", "model": a.model, "content": content,
        "stop_reason": stop_reason(calls.is_some(), c.finish, c.stop_string.as_deref()),
        "stop_sequence": c.stop_string, "usage": usage_of(&usage),
    });
    if !a.warnings.is_empty() {
        body["warnings"] = json!(a.warnings);
    }
    axum::Json(body).into_response()
}

fn event(kind: &str, data: &Value) -> Vec<u8> {
    format!("event: {kind}\ndata: {data}\n\n").into_bytes()
}

/// The block a stream has open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
}

/// A streamed message's blocks between events.
struct Blocks {
    open: Open,
    /// Index of the next block.
    index: usize,
}

impl Blocks {
    /// Moves to a block of `kind`, closing the open one.
    fn enter(&mut self, kind: Open, out: &mut Vec<u8>) {
        if self.open == kind {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Open::Text => json!({"type": "text", "text": ""}),
            Open::None => return,
        };
        out.extend(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = kind;
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if self.open != Open::None {
            if self.open == Open::Thinking {
                // Anthropic's clients expect a signature before a thinking block ends.
                out.extend(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""}}),
                ));
            }
            out.extend(event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
            self.open = Open::None;
        }
    }

    fn delta(&mut self, kind: Open, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        self.enter(kind, out);
        let delta = match kind {
            Open::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            _ => json!({"type": "text_delta", "text": text}),
        };
        out.extend(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        ));
    }
}

impl AnswerShape for Blocks {
    fn start(&mut self, a: &Accepted, out: &mut Vec<u8>) {
        let message = json!({"id": a.id, "type": "message", "role": "assistant", "model": a.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}});
        out.extend(event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
        ));
    }

    fn reasoning(&mut self, _: &Accepted, text: &str, out: &mut Vec<u8>) {
        self.delta(Open::Thinking, text, out);
    }

    fn text(&mut self, _: &Accepted, text: &str, out: &mut Vec<u8>) {
        self.delta(Open::Text, text, out);
    }

    fn done(&mut self, a: &Accepted, end: AnswerEnd, out: &mut Vec<u8>) {
        match &end.calls {
            Some((rest, calls)) => {
                self.delta(Open::Text, rest, out);
                self.close(out);
                for (k, call) in calls.iter().enumerate() {
                    let mut start = tool_use(tool_use_id(a, k), call);
                    start["input"] = json!({});
                    out.extend(event("content_block_start", &json!({"type": "content_block_start", "index": self.index, "content_block": start})));
                    out.extend(event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                    ));
                    out.extend(event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": self.index}),
                    ));
                    self.index += 1;
                }
            }
            None => {
                self.delta(Open::Text, &end.held, out);
                if self.index == 0 {
                    // A message has at least one block.
                    self.enter(Open::Text, out);
                }
                self.close(out);
            }
        }
        let reason = stop_reason(
            end.calls.is_some(),
            Some(end.finish),
            end.stop_string.as_deref(),
        );
        out.extend(event("message_delta", &json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": end.stop_string}, "usage": usage_of(&end.usage)})));
        out.extend(event("message_stop", &json!({"type": "message_stop"})));
    }

    fn fail(&mut self, _: &Accepted, message: String, out: &mut Vec<u8>) {
        out.extend(event("error", &error_body(&server_error(message))));
    }
}

fn stream_response(a: Accepted) -> Response {
    answer_stream(
        a,
        Blocks {
            open: Open::None,
            index: 0,
        },
    )
}
