//! OpenAI request bodies: parsing and validation into what the scheduler runs, with a
//! message that names the offending field for every rejection.

use astra_engine::sampler::SamplerConfig;
use astra_grammar::Spec;
use astra_tokenizer::ChatMessage;
use serde_json::{Map, Value};
use sha2::Digest;

use crate::tools::{Tool, ToolChoice, Tools};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// Busy or not ready: a client may try again shortly (`Retry-After: 1`).
    pub fn retry_shortly(&self) -> bool {
        matches!(self.status, 429 | 503)
    }

    pub fn body(&self) -> Value {
        let code = match self.status {
            404 => "not_found",
            405 => "method_not_allowed",
            413 => "request_too_large",
            429 => "rate_limit_exceeded",
            503 => "unavailable",
            s if s >= 500 => "server_error",
            _ => "invalid_request",
        };
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}})
    }
}

/// The prompt of a request, before tokenization.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
    /// Several prompts (a `/v1/completions` list of strings or of token-id lists), each
    /// given `n` choices: choice `i·n + j` is prompt i's choice j, as OpenAI numbers them.
    Many(Vec<Prompt>),
}

impl Prompt {
    /// The prompts a request's choices are made from, in order.
    pub fn each(&self) -> Vec<&Prompt> {
        match self {
            Prompt::Many(all) => all.iter().collect(),
            one => vec![one],
        }
    }
}

/// An image content part: where it sits and a digest of its URL (for a `data:` URL,
/// of the image bytes themselves).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePart {
    pub message: usize,
    pub digest: [u8; 32],
}

/// Thinking controls of a request (astra's extension fields).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThinkingRequest {
    /// Open the thinking after the generation prompt.
    pub think: bool,
    /// Thinking tokens allowed, replacing the answer reservation.
    pub thinking_budget: Option<usize>,
    /// Tokens of the cap reserved for the answer (0 turns the reservation off).
    pub answer_room: Option<usize>,
}

/// A validated completion request (chat or plain).
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Image parts of the messages (not part of `prompt`'s text).
    pub images: Vec<ImagePart>,
    pub thinking: ThinkingRequest,
    /// Capabilities the request needs beyond text (`tools`, `response_format`).
    pub needs: Vec<&'static str>,
    /// What the answer is constrained to, and the field that asked for it
    /// (`response_format`, `json_schema`, `grammar`, `regex`).
    pub output: Option<(&'static str, Spec)>,
    /// The tools offered, when any are.
    pub tools: Option<Tools>,
    /// ollama's `keep_alive`: `Some(None)` keeps the model loaded for good.
    pub keep_alive: Option<Option<std::time::Duration>>,
    pub sampler: SamplerConfig,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// Alternatives per token when log probabilities were asked for.
    pub logprobs: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
}

impl CompletionRequest {
    /// Choices in the response: `n` for each prompt.
    pub fn choices(&self) -> usize {
        self.prompt.each().len() * self.n
    }
}

/// Choices one request may ask for.
pub const MAX_CHOICES: usize = 16;
/// Alternatives per token in `top_logprobs`.
pub const MAX_TOP_LOGPROBS: usize = 20;
const MAX_STOPS: usize = 16;

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Reads typed, range-checked optional fields of a JSON object.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn number(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a number")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                key,
                format!("'{key}' must be between {lo} and {hi}, got {x}"),
            ));
        }
        Ok(Some(x as f32))
    }

    fn integer(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = v
            .as_i64()
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be an integer")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                key,
                format!("'{key}' must be between {lo} and {hi}, got {x}"),
            ));
        }
        Ok(Some(x))
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be true or false")))
    }
}

/// The body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request("the body must be a JSON object")),
    }
}

fn stop_strings(f: &Fields) -> Result<Vec<String>, ApiError> {
    let stops = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid("stop", "'stop' must be a string or a list of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or a list of strings",
            ))
        }
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOPS} stop strings, got {}", stops.len()),
        ));
    }
    Ok(stops)
}

/// `logit_bias`: token id (as a string key) → bias in [-100, 100]; -100 bans the token.
fn logit_bias(f: &Fields, n_vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = f.get("logit_bias") else {
        return Ok(Vec::new());
    };
    let map = v.as_object().ok_or_else(|| {
        ApiError::invalid(
            "logit_bias",
            "'logit_bias' must be an object of token id to bias",
        )
    })?;
    let mut out = Vec::with_capacity(map.len().min(n_vocab));
    for (k, b) in map {
        let id: u32 = k
            .parse()
            .ok()
            .filter(|&id: &u32| (id as usize) < n_vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' key {k:?} is not a token id below {n_vocab}"),
                )
            })?;
        let bias = b
            .as_f64()
            .filter(|x| (-100.0..=100.0).contains(x))
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' for token {id} must be a number in [-100, 100]"),
                )
            })?;
        out.push((
            id,
            if bias <= -100.0 {
                f32::NEG_INFINITY
            } else {
                bias as f32
            },
        ));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

fn message_content(
    v: Option<&Value>,
    i: usize,
    role: &str,
    images: &mut Vec<ImagePart>,
) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("image_url"), _) => {
                        let url = p
                            .get("image_url")
                            .and_then(|u| u.get("url").or(Some(u)))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                ApiError::invalid(
                                    &param,
                                    format!("{param}[{j}].image_url.url must be a string"),
                                )
                            })?;
                        images.push(ImagePart {
                            message: i,
                            digest: sha2::Sha256::digest(url.as_bytes()).into(),
                        });
                    }
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!("{param}[{j}] has no 'text' string"),
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!(
                            "{param}[{j}]: content of type '{other}' is not supported (text only)"
                        ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!("{param}[{j}] must be an object with a 'type'"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        None | Some(Value::Null) => Err(ApiError::invalid(&param, format!("{param} is required"))),
        Some(_) => Err(ApiError::invalid(
            &param,
            format!("{param} must be a string or an array of content parts"),
        )),
    }
}

fn messages(f: &Fields, images: &mut Vec<ImagePart>) -> Result<Vec<ChatMessage>, ApiError> {
    let v = f
        .get("messages")
        .ok_or_else(|| ApiError::invalid("messages", "'messages' is required"))?;
    let list = v
        .as_array()
        .ok_or_else(|| ApiError::invalid("messages", "'messages' must be an array"))?;
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let m = m.as_object().ok_or_else(|| {
                ApiError::invalid("messages", format!("messages[{i}] must be an object"))
            })?;
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid("messages", format!("messages[{i}].role must be a string"))
            })?;
            if !ROLES.contains(&role) {
                return Err(ApiError::invalid(
                    "messages",
                    format!(
                        "messages[{i}].role '{role}' is not one of {}",
                        ROLES.join(", ")
                    ),
                ));
            }
            let content = match m.get("content") {
                None | Some(Value::Null) if m.get("tool_calls").is_some() => String::new(),
                c => message_content(c, i, role, images)?,
            };
            let mut message = ChatMessage::new(role, content);
            let param = format!("messages[{i}]");
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                message.tool_calls = Some(tool_calls(calls, &param)?);
            }
            let text = |key: &str| -> Result<Option<String>, ApiError> {
                match m.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(ApiError::invalid(
                        &param,
                        format!("{param}.{key} must be a string"),
                    )),
                }
            };
            message.tool_call_id = text("tool_call_id")?;
            message.name = text("name")?.filter(|_| role == "tool");
            if role == "tool" && message.tool_call_id.is_none() {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param}: a 'tool' message needs 'tool_call_id'"),
                ));
            }
            Ok(message)
        })
        .collect()
}

/// An assistant message's `tool_calls`: `[{"id", "type": "function", "function":
/// {"name", "arguments": string}}]`.
fn tool_calls(v: &Value, param: &str) -> Result<Value, ApiError> {
    let bad = |what: &str| ApiError::invalid(param, format!("{param}.tool_calls{what}"));
    let list = v.as_array().ok_or_else(|| bad(" must be an array"))?;
    for (j, c) in list.iter().enumerate() {
        let name = c.pointer("/function/name").and_then(Value::as_str);
        let args = c.pointer("/function/arguments");
        if name.is_none() || !args.is_some_and(|a| a.is_string() || a.is_object()) {
            return Err(bad(&format!(
                "[{j}] must have function.name and function.arguments (a JSON string)"
            )));
        }
    }
    Ok(v.clone())
}

/// Tools a request may offer.
pub const MAX_TOOLS: usize = 128;

/// `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools are offered.
fn tools(f: &Fields) -> Result<Option<Tools>, ApiError> {
    let list = match f.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!("at most {MAX_TOOLS} tools, got {}", list.len()),
        ));
    }
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid("tools", format!("tools[{i}]{what}"));
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(": only tools of type 'function' are supported"));
        }
        let func = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(".function must be an object"))?;
        let name = func
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(".function.name must be a string"))?;
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(bad(
                ".function.name must be 1 to 64 letters, digits, '_' or '-'",
            ));
        }
        if out.iter().any(|o| o.name == name) {
            return Err(bad(&format!(": the name '{name}' is used twice")));
        }
        let parameters = match func.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(bad(".function.parameters must be a JSON schema object")),
        };
        out.push(Tool {
            name: name.to_owned(),
            description: func
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_owned),
            parameters,
        });
    }
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("'tool_choice' must be \"auto\", \"none\", \"required\" or a function, got {other:?}"),
                ))
            }
        },
        Some(v) => {
            let name = v
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| ApiError::invalid("tool_choice", "a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}"))?;
            if !out.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid("tool_choice", format!("'tool_choice' names '{name}', which is not among the tools")));
            }
            ToolChoice::Named(name.to_owned())
        }
    };
    if out.is_empty() {
        if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' requires 'tools'",
            ));
        }
        return Ok(None);
    }
    Ok(Some(Tools {
        list: out,
        choice,
        parallel: f.boolean("parallel_tool_calls")?.unwrap_or(true),
    }))
}

/// `response_format`, or astra's `grammar` (Lark, or GBNF when it has `::=`) and
/// `regex` extensions (llama-server's `json_schema` field too); at most one of them.
fn output_format(f: &Fields) -> Result<Option<(&'static str, Spec)>, ApiError> {
    let mut found: Vec<(&'static str, Spec)> = Vec::new();
    if let Some(rf) = f.get("response_format") {
        let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                "response_format",
                "'response_format' must be an object with a 'type'",
            )
        })?;
        match kind {
            "text" => {}
            "json_object" => found.push((
                "response_format",
                match rf.get("schema") {
                    Some(schema) if !schema.is_null() => Spec::JsonSchema(schema.clone()),
                    _ => Spec::JsonObject,
                },
            )),
            "json_schema" => {
                let schema = rf
                    .pointer("/json_schema/schema")
                    .or_else(|| rf.get("schema"))
                    .filter(|s| !s.is_null())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "response_format",
                            "'response_format' of type json_schema needs json_schema.schema",
                        )
                    })?;
                found.push(("response_format", Spec::JsonSchema(schema.clone())));
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                    "'response_format' type {other:?} is not one of text, json_object, json_schema"
                ),
                ))
            }
        }
    }
    if let Some(schema) = f.get("json_schema") {
        found.push(("json_schema", Spec::JsonSchema(schema.clone())));
    }
    for key in ["grammar", "regex"] {
        match f.get(key) {
            None => {}
            Some(Value::String(s)) if key == "regex" => found.push((key, Spec::Regex(s.clone()))),
            Some(Value::String(s)) if s.contains("::=") => found.push((
                key,
                Spec::Lark(
                    astra_grammar::gbnf_to_lark(s)
                        .map_err(|e| ApiError::invalid(key, e.to_string()))?,
                ),
            )),
            Some(Value::String(s)) => found.push((key, Spec::Lark(s.clone()))),
            Some(_) => return Err(ApiError::invalid(key, format!("'{key}' must be a string"))),
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            found[1].0,
            format!(
                "'{}' and '{}' both constrain the output; give one",
                found[0].0, found[1].0
            ),
        )),
    }
}

/// A list of token ids (field `param`), each below `n_vocab`.
fn token_ids(a: &[Value], n_vocab: usize, param: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .map(|t| {
            t.as_u64()
                .filter(|&id| (id as usize) < n_vocab)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        format!("'{param}': {t} is not a token id below {n_vocab}"),
                    )
                })
        })
        .collect()
}

fn prompt(f: &Fields, n_vocab: usize) -> Result<Prompt, ApiError> {
    let one_or_many = |mut all: Vec<Prompt>| {
        if all.len() == 1 {
            all.remove(0)
        } else {
            Prompt::Many(all)
        }
    };
    match f.get("prompt") {
        None => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        // A flat list of ids is one prompt, whatever its length.
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => token_ids(a, n_vocab, "prompt").map(Prompt::Tokens),
        Some(Value::Array(a)) if a.len() > MAX_CHOICES => {
            Err(ApiError::invalid("prompt", format!("'prompt' lists {} prompts; at most {MAX_CHOICES} are taken", a.len())))
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            Ok(one_or_many(a.iter().map(|s| Prompt::Text(s.as_str().unwrap_or_default().to_owned())).collect()))
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|p| p.as_array().is_some_and(|ids| !ids.is_empty() && ids.iter().all(Value::is_number))) => {
            let all = a.iter().map(|p| token_ids(p.as_array().map_or(&[][..], Vec::as_slice), n_vocab, "prompt").map(Prompt::Tokens));
            Ok(one_or_many(all.collect::<Result<_, _>>()?))
        }
        Some(_) => Err(ApiError::invalid(
            "prompt",
            "'prompt' must be a string, a non-empty list of strings, a non-empty list of token ids or a list of non-empty token-id lists",
        )),
    }
}

/// Refuses the OpenAI fields astra does not implement, unless they ask for what it does
/// anyway (`echo: false`, an empty `suffix`, `best_of` equal to `n`).
fn unsupported(f: &Fields) -> Result<(), ApiError> {
    let n = f.get("n").and_then(Value::as_u64).unwrap_or(1);
    let harmless = |name: &str, v: &Value| match name {
        "echo" => v == &Value::Bool(false),
        "suffix" => v.is_null() || v.as_str() == Some(""),
        _ => v.is_null() || v.as_u64() == Some(n),
    };
    for name in ["echo", "suffix", "best_of"] {
        if let Some(v) = f.get(name) {
            if !harmless(name, v) {
                return Err(ApiError::invalid(
                    name,
                    format!("'{name}' is not supported by this server"),
                ));
            }
        }
    }
    Ok(())
}

/// Parses a `/v1/chat/completions` (`chat`) or `/v1/completions` body.
pub fn completion_request(
    body: &Map<String, Value>,
    chat: bool,
    n_vocab: usize,
) -> Result<CompletionRequest, ApiError> {
    let f = Fields(body);
    if f.get("model").is_some_and(|m| !m.is_string()) {
        return Err(ApiError::invalid("model", "'model' must be a string"));
    }
    unsupported(&f)?;
    let mut images = Vec::new();
    let prompt = if chat {
        Prompt::Chat(messages(&f, &mut images)?)
    } else {
        prompt(&f, n_vocab)?
    };
    let mut needs = Vec::new();
    let tools = if chat { tools(&f)? } else { None };
    if tools.is_some() {
        needs.push("tools");
    }
    let output = output_format(&f)?;
    if output.is_some() {
        needs.push("structured_output");
    }
    if output.is_some() && tools.as_ref().is_some_and(Tools::forced) {
        return Err(ApiError::invalid(
            "tool_choice",
            "a required tool call and a constrained 'response_format' cannot be combined",
        ));
    }
    let thinking = ThinkingRequest {
        think: f.boolean("think")?.unwrap_or(false),
        thinking_budget: f
            .integer("thinking_budget", 0, i64::MAX)?
            .map(|n| n as usize),
        answer_room: f.integer("answer_room", 0, i64::MAX)?.map(|n| n as usize),
    };
    let max_tokens = match f.integer("max_completion_tokens", 1, i64::MAX)? {
        Some(n) => Some(n),
        None => f.integer("max_tokens", 1, i64::MAX)?,
    };
    let logprobs = if chat {
        let want = f.boolean("logprobs")?.unwrap_or(false);
        let top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
        if top.is_some() && !want {
            return Err(ApiError::invalid(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs': true",
            ));
        }
        want.then_some(top.unwrap_or(0) as usize)
    } else {
        f.integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
            .map(|n| n as usize)
    };
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).boolean("include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' must be an object",
            ))
        }
    };
    let defaults = SamplerConfig::default();
    let sampler = SamplerConfig {
        // OpenAI's default temperature is 1.
        temperature: f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_k: f
            .integer("top_k", 0, i64::from(u32::MAX))?
            .map_or(defaults.top_k, |k| k as usize),
        top_p: f.number("top_p", 0.0, 1.0)?.unwrap_or(defaults.top_p),
        min_p: f.number("min_p", 0.0, 1.0)?.unwrap_or(defaults.min_p),
        repeat_penalty: f
            .number("repeat_penalty", 0.0, 10.0)?
            .unwrap_or(defaults.repeat_penalty),
        frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        presence_penalty: f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        logit_bias: logit_bias(&f, n_vocab)?,
        seed: match f.get("seed") {
            None => defaults.seed,
            Some(v) => v
                .as_i64()
                .map(|s| s as u64)
                .or_else(|| v.as_u64())
                .ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?,
        },
        ..defaults
    };
    let n = f.integer("n", 1, MAX_CHOICES as i64)?.unwrap_or(1) as usize;
    let prompts = prompt.each().len();
    if prompts * n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!("{prompts} prompts × n {n} is more than {MAX_CHOICES} choices"),
        ));
    }
    Ok(CompletionRequest {
        prompt,
        images,
        thinking,
        needs,
        output,
        tools,
        keep_alive: keep_alive(&f)?,
        sampler,
        max_tokens: max_tokens.map(|n| n as usize),
        stop: stop_strings(&f)?,
        logprobs,
        n,
        stream,
        include_usage,
    })
}

/// ollama's `keep_alive`: a duration string ("30s", "5m", "1h", "250ms"), a number of
/// seconds, 0 to unload right after the request, a negative value to stay loaded.
fn keep_alive(f: &Fields) -> Result<Option<Option<std::time::Duration>>, ApiError> {
    use std::time::Duration;
    let bad = || {
        ApiError::invalid(
            "keep_alive",
            "'keep_alive' must be seconds or a duration such as \"30s\", \"5m\", \"1h\"",
        )
    };
    let secs = match f.get("keep_alive") {
        None => return Ok(None),
        Some(Value::Number(n)) => n.as_f64().ok_or_else(bad)?,
        Some(Value::String(s)) => parse_duration_secs(s).ok_or_else(bad)?,
        Some(_) => return Err(bad()),
    };
    if secs < 0.0 {
        return Ok(Some(None));
    }
    Duration::try_from_secs_f64(secs)
        .map(|d| Some(Some(d)))
        .map_err(|_| bad())
}

/// Seconds in "250ms", "30s", "5m", "1h", "-1" or a bare number.
pub fn parse_duration_secs(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(at) => s.split_at(at),
        None => (s, "s"),
    };
    let n: f64 = num.trim().parse().ok()?;
    let scale = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return None,
    };
    Some(n * scale).filter(|x| x.is_finite())
}

/// `/tokenize`: `{"content": string, "add_special"?: bool, "parse_special"?: bool, "with_pieces"?: bool}`.
pub struct TokenizeRequest {
    pub content: String,
    pub add_special: bool,
    pub parse_special: bool,
    pub with_pieces: bool,
}

pub fn tokenize_request(body: &Map<String, Value>) -> Result<TokenizeRequest, ApiError> {
    let f = Fields(body);
    let content = match f.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::invalid("content", "'content' must be a string")),
        None => return Err(ApiError::invalid("content", "'content' is required")),
    };
    Ok(TokenizeRequest {
        content,
        add_special: f.boolean("add_special")?.unwrap_or(false),
        parse_special: f.boolean("parse_special")?.unwrap_or(true),
        with_pieces: f.boolean("with_pieces")?.unwrap_or(false),
    })
}

/// `/detokenize`: `{"tokens": [id, ...]}`.
pub fn detokenize_request(body: &Map<String, Value>, n_vocab: usize) -> Result<Vec<u32>, ApiError> {
    let f = Fields(body);
    let list = match f.get("tokens") {
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                "tokens",
                "'tokens' must be an array of token ids",
            ))
        }
        None => return Err(ApiError::invalid("tokens", "'tokens' is required")),
    };
    token_ids(list, n_vocab, "tokens")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<CompletionRequest, ApiError> {
        completion_request(v.as_object().unwrap(), true, 1000)
    }

    fn plain(v: Value) -> Result<CompletionRequest, ApiError> {
        completion_request(v.as_object().unwrap(), false, 1000)
    }

    /// `/v1/completions` prompts: a string, a list of strings, token ids, lists of token
    /// ids; several prompts give `n` choices each, within MAX_CHOICES.
    #[test]
    fn completion_prompts_one_or_many() {
        let texts = |r: &CompletionRequest| -> Vec<String> {
            r.prompt
                .each()
                .iter()
                .map(|p| match p {
                    Prompt::Text(t) => t.clone(),
                    other => format!("{other:?}"),
                })
                .collect()
        };
        assert_eq!(texts(&plain(json!({"prompt": "a"})).unwrap()), ["a"]);
        assert_eq!(texts(&plain(json!({"prompt": ["a"]})).unwrap()), ["a"]);
        let two = plain(json!({"prompt": ["a", "b c"], "n": 3})).unwrap();
        assert!(matches!(two.prompt, Prompt::Many(_)));
        assert_eq!(
            (texts(&two), two.choices()),
            (vec!["a".to_owned(), "b c".to_owned()], 6)
        );
        let ids = plain(json!({"prompt": [[1, 2], [3]]})).unwrap();
        let ids: Vec<Vec<u32>> = ids
            .prompt
            .each()
            .iter()
            .map(|p| match p {
                Prompt::Tokens(t) => t.clone(),
                _ => panic!("{p:?}"),
            })
            .collect();
        assert_eq!(ids, vec![vec![1, 2], vec![3]]);
        assert!(
            matches!(plain(json!({"prompt": [[5, 6]]})).unwrap().prompt, Prompt::Tokens(ref t) if t == &[5, 6])
        );
        assert!(
            matches!(plain(json!({"prompt": [7, 8]})).unwrap().prompt, Prompt::Tokens(ref t) if t == &[7, 8])
        );
        for (bad, param) in [
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": [[]]}), "prompt"),
            (json!({"prompt": [[1], "a"]}), "prompt"),
            (json!({"prompt": [["a"]]}), "prompt"),
            (json!({"prompt": [[1, 5000]]}), "prompt"),
            (json!({"prompt": vec!["a"; MAX_CHOICES + 1]}), "prompt"),
            (json!({"prompt": ["a", "b"], "n": MAX_CHOICES / 2 + 1}), "n"),
        ] {
            let e = plain(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{bad}: {}",
                e.message
            );
        }
    }

    #[test]
    fn accepts_openai_shapes() {
        let r = chat(json!({
            "model": "x", "messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
            "max_tokens": 5, "temperature": 0, "stop": "\n", "logit_bias": {"7": -100, "9": 2.5},
            "logprobs": true, "top_logprobs": 3, "n": 2, "stream": true, "stream_options": {"include_usage": true},
            "seed": -1, "user": "ignored"
        }))
        .unwrap();
        let Prompt::Chat(m) = &r.prompt else {
            panic!("chat prompt")
        };
        assert_eq!(m[1].content, "hi there");
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampler.temperature, 0.0);
        assert_eq!(r.sampler.logit_bias, vec![(7, f32::NEG_INFINITY), (9, 2.5)]);
        assert_eq!(
            (r.logprobs, r.n, r.stream, r.include_usage),
            (Some(3), 2, true, true)
        );
        assert_eq!(r.stop, vec!["\n".to_owned()]);
    }

    #[test]
    fn rejects_with_the_field_named() {
        for (body, param) in [
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages",
            ),
            (
                json!({"messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5000": 1}}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 17}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "keep_alive": "soon"}),
                "keep_alive",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "answer_room": -1}),
                "answer_room",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}),
                "tools",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                       "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "regex": "a+"}),
                "regex",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= \"a"}),
                "grammar",
            ),
            (
                json!({"messages": [{"role": "tool", "content": "42"}]}),
                "messages[0]",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {}",
                e.message
            );
        }
    }

    #[test]
    fn tools_and_output_formats_are_read() {
        let r = chat(json!({
            "messages": [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": false,
        }))
        .unwrap();
        let tools = r.tools.unwrap();
        assert_eq!(
            (tools.list[0].name.as_str(), &tools.choice, tools.parallel),
            (
                "get_weather",
                &ToolChoice::Named("get_weather".into()),
                false
            )
        );
        let Prompt::Chat(m) = &r.prompt else {
            panic!("chat")
        };
        assert_eq!(
            (m[1].content.as_str(), m[1].tool_calls.is_some()),
            ("", true)
        );
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        let r = chat(json!({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= \"yes\" | \"no\""}))
            .unwrap();
        assert_eq!(
            r.output,
            Some((
                "grammar",
                Spec::Lark("start: g_root\ng_root: \"yes\" | \"no\"\n".into())
            ))
        );
        let schema = json!({"type": "object"});
        let r = chat(json!({"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": true}}}))
        .unwrap();
        assert_eq!(
            r.output,
            Some(("response_format", Spec::JsonSchema(schema)))
        );
        assert!(chat(json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}}))
            .unwrap()
            .output
            .is_none());
    }

    #[test]
    fn images_are_digested_by_their_bytes() {
        let with = |url: &str| {
            chat(json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}))
            .unwrap()
        };
        let (a, b, c) = (
            with("data:image/png;base64,AAAA"),
            with("data:image/png;base64,AAAB"),
            with("data:image/png;base64,AAAA"),
        );
        assert_eq!(a.images.len(), 1);
        assert_ne!(
            a.images[0].digest, b.images[0].digest,
            "same length, different bytes"
        );
        assert_eq!(a.images, c.images);
        let Prompt::Chat(m) = &a.prompt else {
            panic!("chat")
        };
        assert_eq!(m[0].content, "what is this?");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_secs("5m"), Some(300.0));
        assert_eq!(parse_duration_secs("250ms"), Some(0.25));
        assert_eq!(parse_duration_secs("-1"), Some(-1.0));
        assert_eq!(parse_duration_secs("3 days"), None);
    }
}
