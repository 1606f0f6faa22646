//! OpenAI's Responses API, stateless: `POST /v1/responses`. A request (`input` as text
//! or items, `instructions`, tools, `text.format`, `reasoning`) is rewritten as the chat
//! completion it asks for; the answer comes back as output items (reasoning, message,
//! function calls) or as the API's typed event stream. No response is kept, so
//! `previous_response_id` is refused.

use super::*;

/// `POST /v1/responses`.
pub(super) async fn responses(State(state): State<Shared>, body: Body) -> Response {
    let mut tracker = Tracker::new(&state);
    let mut echo = Map::new();
    let parsed = parse_body(&state, body, |b, r| {
        echo = echoed(b);
        api::completion_request(&to_chat(b)?, true, r.n_vocab)
    })
    .await;
    match parsed.and_then(|req| accept(&state, req, true)) {
        Err(e) => tracker.fail(e).into_response(),
        Ok(q) => {
            let a = Accepted::new(&state, q, tracker, true, "resp_");
            if a.req.stream {
                stream_response(a, echo)
            } else {
                whole_response(a, echo).await
            }
        }
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// The request fields a response object repeats.
fn echoed(b: &Map<String, Value>) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("temperature", json!(1.0)),
        ("top_p", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("parallel_tool_calls", json!(true)),
        ("text", json!({"format": {"type": "text"}})),
        ("reasoning", json!({"effort": null, "summary": null})),
        ("metadata", json!({})),
    ] {
        out.insert(
            key.into(),
            b.get(key)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(default),
        );
    }
    out
}

/// Text of an input item's content: a string or a list of `input_text` /
/// `output_text` parts (images become `image_url` parts).
fn parts(content: &Value, at: &str) -> Result<Value, ApiError> {
    match content {
        Value::String(s) => Ok(json!(s)),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(j, p)| match p.get("type").and_then(Value::as_str) {
                Some("input_text" | "output_text" | "text") => Ok(json!({"type": "text", "text": p.get("text").and_then(Value::as_str).unwrap_or("")})),
                Some("input_image") => Ok(json!({"type": "image_url", "image_url": {"url": p.get("image_url").and_then(Value::as_str).unwrap_or("")}})),
                Some(other) => Err(invalid("input", format!("{at}.content[{j}]: parts of type '{other}' are not supported"))),
                None => Err(invalid("input", format!("{at}.content[{j}] must have a 'type'"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array),
        _ => Err(invalid("input", format!("{at}.content must be a string or a list of parts"))),
    }
}

/// The chat completion body a Responses request asks for.
fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    if get("previous_response_id").is_some() || get("conversation").is_some() {
        return Err(invalid(
            "previous_response_id",
            "'previous_response_id' is not supported: this server keeps no responses; send the whole conversation in 'input'",
        ));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = get("instructions") {
        let text = i
            .as_str()
            .ok_or_else(|| invalid("instructions", "'instructions' must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    match get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                match item.get("type").and_then(Value::as_str) {
                    None | Some("message") => {
                        let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                        if !matches!(role, "user" | "assistant" | "system" | "developer") {
                            return Err(invalid(
                                "input",
                                format!("{at}.role must be user, assistant, system or developer"),
                            ));
                        }
                        messages.push(json!({"role": role, "content": parts(item.get("content").unwrap_or(&Value::Null), &at)?}));
                    }
                    Some("function_call") => {
                        let (Some(id), Some(name)) = (
                            item.get("call_id").and_then(Value::as_str),
                            item.get("name").and_then(Value::as_str),
                        ) else {
                            return Err(invalid(
                                "input",
                                format!("{at}: a function_call needs 'call_id' and 'name'"),
                            ));
                        };
                        let args = item
                            .get("arguments")
                            .and_then(Value::as_str)
                            .unwrap_or("{}");
                        let call = json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}});
                        // Consecutive calls belong to one assistant turn.
                        match messages
                            .last_mut()
                            .filter(|m| m["role"] == "assistant" && m.get("tool_calls").is_some())
                        {
                            Some(m) => m["tool_calls"].as_array_mut().expect("an array").push(call),
                            None => messages.push(
                                json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                            ),
                        }
                    }
                    Some("function_call_output") => {
                        let id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                            invalid("input", format!("{at}.call_id must be a string"))
                        })?;
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        };
                        messages
                            .push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                    }
                    // Earlier reasoning is not fed back.
                    Some("reasoning") => {}
                    Some(other) => {
                        return Err(invalid(
                            "input",
                            format!("{at}: items of type '{other}' are not supported"),
                        ))
                    }
                }
            }
        }
        _ => {
            return Err(invalid(
                "input",
                "'input' must be a string or a list of items",
            ))
        }
    }
    let mut out = Map::new();
    out.insert("messages".into(), json!(messages));
    copy_fields(
        body,
        &mut out,
        &[
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("stream", "stream"),
            ("model", "model"),
            ("parallel_tool_calls", "parallel_tool_calls"),
        ],
    );
    if let Some(tools) = get("tools") {
        let list = tools
            .as_array()
            .ok_or_else(|| invalid("tools", "'tools' must be an array"))?;
        let openai: Vec<Value> = list
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(invalid(
                        "tools",
                        format!("tools[{i}]: only function tools are supported"),
                    ));
                }
                Ok(nested_tool(t, "parameters"))
            })
            .collect::<Result<_, _>>()?;
        out.insert("tools".into(), json!(openai));
    }
    if let Some(choice) = get("tool_choice") {
        let openai = match choice {
            Value::String(_) => choice.clone(),
            _ => match (choice.get("type").and_then(Value::as_str), choice.get("name").and_then(Value::as_str)) {
                (Some("function"), Some(n)) => json!({"type": "function", "function": {"name": n}}),
                _ => return Err(invalid("tool_choice", "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}")),
            },
        };
        out.insert("tool_choice".into(), openai);
    }
    if let Some(format) = get("text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
    {
        let rf = match format.get("type").and_then(Value::as_str) {
            Some("text") => json!({"type": "text"}),
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                "name": format.get("name"), "schema": format.get("schema"), "strict": format.get("strict")}}),
            _ => {
                return Err(invalid(
                    "text.format",
                    "'text.format.type' must be text, json_object or json_schema",
                ))
            }
        };
        out.insert("response_format".into(), rf);
    }
    if let Some(effort) = get("reasoning")
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        if effort != "none" {
            out.insert("think".into(), json!(true));
        }
    }
    Ok(out)
}

/// The output items of an answer (its reasoning, its text, its calls) and the
/// response's status, which its message item shares.
fn output_items(a: &Accepted, c: &Choice) -> (Vec<Value>, &'static str) {
    let mut items = Vec::new();
    if !c.reasoning.is_empty() {
        items.push(reasoning_item(a, &c.reasoning));
    }
    let calls = a.calls(&c.text);
    let text = calls
        .as_ref()
        .map_or(c.text.as_str(), |(rest, _)| rest.as_str());
    let status = final_status(c.finish, calls.is_some());
    if !text.is_empty() || (calls.is_none() && !cut_in_reasoning(status, &c.reasoning, text)) {
        items.push(message_item(a, text, status));
    }
    for (k, call) in calls.iter().flat_map(|(_, calls)| calls.iter()).enumerate() {
        items.push(call_item(a, k, call, "completed"));
    }
    (items, status)
}

/// Whether an answer with no calls is its reasoning item alone: one that reasoned and
/// that the token budget cut before any text, as OpenAI's reasoning models answer.
/// Every other answer ends in a message item, empty where the model said nothing.
fn cut_in_reasoning(status: &str, reasoning: &str, text: &str) -> bool {
    status == "incomplete" && !reasoning.is_empty() && text.is_empty()
}

fn reasoning_item(a: &Accepted, text: &str) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{}", a.id), "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

/// A message item: `in_progress` (as a stream opens it) with no content yet, else
/// `completed` or `incomplete` (cut by the token budget) with its text.
fn message_item(a: &Accepted, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    };
    json!({"type": "message", "id": format!("msg_{}", a.id), "status": status, "role": "assistant", "content": content})
}

fn call_item(a: &Accepted, k: usize, call: &Call, status: &str) -> Value {
    let args = if status == "in_progress" {
        ""
    } else {
        call.arguments.as_str()
    };
    json!({"type": "function_call", "id": format!("fc_{}_{k}", a.id), "call_id": a.call_id(0, k),
           "name": call.name, "arguments": args, "status": status})
}

/// The response object, `status` `in_progress` while streaming.
fn response_object(
    a: &Accepted,
    echo: &Map<String, Value>,
    status: &str,
    output: Vec<Value>,
    usage: Option<&Usage>,
) -> Value {
    let mut r = json!({
        "id": a.id, "object": "response", "created_at": a.created, "status": status, "model": a.model,
        "output": output, "error": null, "incomplete_details": null, "store": false,
        "usage": usage.map(|u| json!({
            "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })),
    });
    if status == "incomplete" {
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    for (k, v) in echo {
        r[k] = v.clone();
    }
    r
}

/// `completed`, or `incomplete` when the budget ran out before the answer ended.
fn final_status(finish: Option<FinishReason>, called: bool) -> &'static str {
    if finish == Some(FinishReason::Length) && !called {
        "incomplete"
    } else {
        "completed"
    }
}

async fn whole_response(mut a: Accepted, echo: Map<String, Value>) -> Response {
    let choices = match a.collect().await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let c = &choices[0];
    let (items, status) = output_items(&a, c);
    axum::Json(response_object(&a, &echo, status, items, c.usage.as_ref())).into_response()
}

/// Which output item a stream has open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Reasoning,
    Message,
}

/// A streamed response's items between events.
struct Items {
    echo: Map<String, Value>,
    open: Open,
    /// Text of the open item so far.
    text: String,
    /// Items finished, in order.
    done: Vec<Value>,
    sequence: u64,
}

impl Items {
    fn event(&mut self, kind: &str, mut data: Value, out: &mut Vec<u8>) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.extend(format!("event: {kind}\ndata: {data}\n\n").into_bytes());
    }

    fn enter(&mut self, a: &Accepted, kind: Open, out: &mut Vec<u8>) {
        if self.open == kind {
            return;
        }
        self.close(a, "completed", out);
        let index = self.done.len();
        match kind {
            Open::Reasoning => {
                let mut item = reasoning_item(a, "");
                item["content"] = json!([]);
                self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                    out,
                );
            }
            Open::Message => {
                let item = message_item(a, "", "in_progress");
                let id = item["id"].clone();
                self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                    out,
                );
                self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}),
                    out,
                );
            }
            Open::None => return,
        }
        self.open = kind;
    }

    /// Closes the open item; a message item ends with `status`.
    fn close(&mut self, a: &Accepted, status: &str, out: &mut Vec<u8>) {
        let index = self.done.len();
        let text = std::mem::take(&mut self.text);
        let item = match self.open {
            Open::None => return,
            Open::Reasoning => {
                let item = reasoning_item(a, &text);
                self.event("response.reasoning_text.done", json!({"item_id": item["id"], "output_index": index, "content_index": 0, "text": text}), out);
                item
            }
            Open::Message => {
                let item = message_item(a, &text, status);
                self.event("response.output_text.done", json!({"item_id": item["id"], "output_index": index, "content_index": 0, "text": text, "logprobs": []}), out);
                self.event("response.content_part.done", json!({"item_id": item["id"], "output_index": index, "content_index": 0, "part": item["content"][0]}), out);
                item
            }
        };
        self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
            out,
        );
        self.done.push(item);
        self.open = Open::None;
    }

    fn delta(&mut self, a: &Accepted, kind: Open, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        self.enter(a, kind, out);
        self.text.push_str(text);
        let index = self.done.len();
        let (event, id) = match kind {
            Open::Reasoning => ("response.reasoning_text.delta", format!("rs_{}", a.id)),
            _ => ("response.output_text.delta", format!("msg_{}", a.id)),
        };
        let mut data =
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text});
        if kind == Open::Message {
            data["logprobs"] = json!([]);
        }
        self.event(event, data, out);
    }
}

impl AnswerShape for Items {
    fn start(&mut self, a: &Accepted, out: &mut Vec<u8>) {
        let r = response_object(a, &self.echo, "in_progress", Vec::new(), None);
        self.event("response.created", json!({"response": r}), out);
        self.event("response.in_progress", json!({"response": r}), out);
    }

    fn reasoning(&mut self, a: &Accepted, text: &str, out: &mut Vec<u8>) {
        self.delta(a, Open::Reasoning, text, out);
    }

    fn text(&mut self, a: &Accepted, text: &str, out: &mut Vec<u8>) {
        self.delta(a, Open::Message, text, out);
    }

    fn done(&mut self, a: &Accepted, end: AnswerEnd, out: &mut Vec<u8>) {
        let status = final_status(Some(end.finish), end.calls.is_some());
        match &end.calls {
            Some((rest, calls)) => {
                self.delta(a, Open::Message, rest, out);
                self.close(a, "completed", out);
                for (k, call) in calls.iter().enumerate() {
                    let index = self.done.len();
                    let item = call_item(a, k, call, "in_progress");
                    let id = item["id"].clone();
                    self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                        out,
                    );
                    self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": call.arguments}),
                        out,
                    );
                    self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "arguments": call.arguments}),
                        out,
                    );
                    let item = call_item(a, k, call, "completed");
                    self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                        out,
                    );
                    self.done.push(item);
                }
            }
            None => {
                self.delta(a, Open::Message, &end.held, out);
                // No message yet: the answer said nothing after its reasoning, or nothing
                // at all. It gets its (empty) message as the whole answer does, unless
                // the budget cut it in its reasoning ([`cut_in_reasoning`]).
                let reasoning = match self.open {
                    Open::Reasoning => self.text.as_str(),
                    _ => "",
                };
                if self.open != Open::Message && !cut_in_reasoning(status, reasoning, "") {
                    self.enter(a, Open::Message, out);
                }
                self.close(a, status, out);
            }
        }
        let r = response_object(a, &self.echo, status, self.done.clone(), Some(&end.usage));
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.event(kind, json!({"response": r}), out);
    }

    fn fail(&mut self, a: &Accepted, message: String, out: &mut Vec<u8>) {
        let mut r = response_object(a, &self.echo, "failed", self.done.clone(), None);
        r["error"] = json!({"code": "server_error", "message": message});
        self.event("response.failed", json!({"response": r}), out);
    }
}

fn stream_response(a: Accepted, echo: Map<String, Value>) -> Response {
    answer_stream(
        a,
        Items {
            echo,
            open: Open::None,
            text: String::new(),
            done: Vec::new(),
            sequence: 0,
        },
    )
}
