//! Tool calls: the tools a request offers and how it lets the model use them, the
//! model's call format (its template's own, or a generic JSON format described in the
//! system message), the grammar that makes a required or named call always parse and
//! validate, and the calls parsed back out of an answer.

use astra_grammar::Spec;
use astra_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::{json, Map, Value};

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object.
    pub parameters: Value,
}

/// OpenAI's `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers in text or calls tools, as it chooses.
    Auto,
    /// No calls: the tools are not shown and nothing is parsed.
    None,
    /// At least one call, enforced by the grammar.
    Required,
    /// A call of this function, enforced by the grammar.
    Named(String),
}

/// The tools of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    pub list: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call may be made in one answer.
    pub parallel: bool,
}

impl Tools {
    /// Whether the answer may hold calls.
    pub fn active(&self) -> bool {
        !self.list.is_empty() && self.choice != ToolChoice::None
    }

    /// Whether the answer must be a call.
    pub fn forced(&self) -> bool {
        self.active() && matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// OpenAI's list shape, as chat templates receive it.
    pub fn openai_list(&self) -> Value {
        self.list
            .iter()
            .map(|t| {
                let mut f = json!({"name": t.name, "parameters": t.parameters});
                if let Some(d) = &t.description {
                    f["description"] = json!(d);
                }
                json!({"type": "function", "function": f})
            })
            .collect()
    }

    fn callable(&self) -> Vec<&Tool> {
        self.list
            .iter()
            .filter(|t| match &self.choice {
                ToolChoice::Named(n) => &t.name == n,
                _ => true,
            })
            .collect()
    }
}

/// How a model writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallFormat {
    /// `{"tool_calls": [{"name", "arguments"}]}`, described in the system message (for
    /// templates with no tool format of their own).
    Generic,
    /// Hermes / Qwen: `<tool_call>\n{"name", "arguments"}\n</tool_call>`.
    Hermes,
    /// Llama 3.x: `{"name", "parameters"}`, optionally after `<|python_tag|>`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name", "arguments"}]`.
    Mistral,
}

impl CallFormat {
    /// The format of a chat template: its own where it renders tools in a known
    /// format, else the generic one.
    pub fn of(template: &ChatTemplate) -> CallFormat {
        let src = template.source();
        if !template.knows_tools() {
            CallFormat::Generic
        } else if src.contains("<tool_call>") {
            CallFormat::Hermes
        } else if src.contains("[TOOL_CALLS]") {
            CallFormat::Mistral
        } else if src.contains("<|start_header_id|>") && src.contains("parameters") {
            CallFormat::Llama3
        } else {
            CallFormat::Generic
        }
    }

    /// Texts that open a call: a streamed answer starting with one (or with a prefix
    /// of one) is held until it is known to be a call or text.
    pub fn openings(self) -> &'static [&'static str] {
        match self {
            CallFormat::Generic => &["{"],
            CallFormat::Hermes => &["<tool_call>"],
            CallFormat::Llama3 => &["{", "<|python_tag|>"],
            CallFormat::Mistral => &["[TOOL_CALLS]"],
        }
    }

    /// Whether the chat template is given the tools itself.
    pub fn in_template(self) -> bool {
        self != CallFormat::Generic
    }
}

/// The generic format's instructions, appended to the system message.
pub fn generic_instructions(tools: &Tools) -> String {
    let list: Vec<Value> = tools
        .callable()
        .iter()
        .map(|t| json!({"name": t.name, "description": t.description, "parameters": t.parameters}))
        .collect();
    let list = serde_json::to_string_pretty(&list).unwrap_or_default();
    let must = if tools.forced() {
        "You must call a tool now."
    } else {
        "Call a tool when it helps; otherwise answer in plain text. Once a tool's result \
         is given, use it to answer the user in plain text."
    };
    format!(
        "You can call these tools:\n{list}\n\n{must} To call tools, reply with only a JSON object \
         of this form and nothing else:\n{{\"tool_calls\": [{{\"name\": \"<tool name>\", \
         \"arguments\": {{<arguments>}}}}]}}"
    )
}

/// The conversation as the template gets it: assistant calls with their arguments as
/// objects, and, in the generic format, the instructions in the system message, calls
/// written as the JSON the model produces, and tool results as user turns.
pub fn prepare_messages(
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    format: CallFormat,
) -> Vec<ChatMessage> {
    let active = tools.filter(|t| t.active());
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let mut m = m.clone();
        if let Some(calls) = m.tool_calls.as_mut() {
            for c in calls.as_array_mut().into_iter().flatten() {
                if let Some(args) = c.pointer_mut("/function/arguments") {
                    if let Some(text) = args.as_str() {
                        *args = serde_json::from_str(text).unwrap_or_else(|_| json!(text));
                    }
                }
            }
        }
        if format == CallFormat::Generic {
            if let Some(calls) = m.tool_calls.take() {
                // Told as what was done rather than in the call format: a small model
                // that sees the JSON right before a result tends to repeat it instead
                // of answering.
                let text: Vec<String> = calls
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        let name = c
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        let args = c
                            .pointer("/function/arguments")
                            .map(Value::to_string)
                            .unwrap_or_default();
                        format!("I called the tool {name} with {args}.")
                    })
                    .collect();
                let text = text.join("\n");
                m.content = if m.content.is_empty() {
                    text
                } else {
                    format!("{}\n{text}", m.content)
                };
            }
            if m.role == "tool" {
                // The function's name, from the call the result answers.
                if m.name.is_none() {
                    m.name = m
                        .tool_call_id
                        .as_ref()
                        .and_then(|id| called_name(messages, id));
                }
                let label = match (&m.name, &m.tool_call_id) {
                    (Some(n), _) => format!("Result of tool {n}"),
                    (None, Some(id)) => format!("Result of tool call {id}"),
                    (None, None) => "Tool result".to_owned(),
                };
                let text = format!("{label}:\n{}", m.content);
                // Consecutive results go into one user turn (templates that insist on
                // alternating roles accept that).
                if let Some(prev) = out
                    .last_mut()
                    .filter(|p| p.role == "user" && p.tool_call_id.is_some())
                {
                    prev.content.push_str("\n\n");
                    prev.content.push_str(&text);
                    continue;
                }
                let mut user = ChatMessage::new("user", text);
                // Marks the turn as made of results, so that the next result joins it.
                user.tool_call_id = m.tool_call_id.clone().or(Some(String::new()));
                out.push(user);
                continue;
            }
        }
        out.push(m);
    }
    if format == CallFormat::Generic {
        for m in &mut out {
            m.tool_call_id = None;
        }
        if let Some(tools) = active {
            let text = generic_instructions(tools);
            match out
                .first_mut()
                .filter(|m| m.role == "system" || m.role == "developer")
            {
                Some(system) => {
                    system.content.push_str("\n\n");
                    system.content.push_str(&text);
                }
                None => out.insert(0, ChatMessage::new("system", text)),
            }
        }
    }
    out
}

/// The function name of the call with this id among the messages' calls.
fn called_name(messages: &[ChatMessage], id: &str) -> Option<String> {
    messages
        .iter()
        .filter_map(|m| m.tool_calls.as_ref()?.as_array())
        .flatten()
        .find(|c| c.get("id").and_then(Value::as_str) == Some(id))
        .and_then(|c| c.pointer("/function/name")?.as_str().map(str::to_owned))
}

/// A call object's schema: one of the callable tools by name, with its arguments (no
/// arguments beyond those the tool names, unless its schema allows them itself).
fn call_schema(tools: &Tools, arguments_key: &str) -> Value {
    let each: Vec<Value> = tools
        .callable()
        .iter()
        .map(|t| {
            let mut parameters = t.parameters.clone();
            if let Some(o) = parameters.as_object_mut() {
                if o.contains_key("properties") {
                    o.entry("additionalProperties").or_insert(json!(false));
                }
            }
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": false,
            })
        })
        .collect();
    if each.len() == 1 {
        each.into_iter().next().expect("one")
    } else {
        json!({"anyOf": each})
    }
}

/// Calls one forced answer may make: a small model may repeat a call until its budget
/// runs out, and the grammar ends it here.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// The grammar of a forced answer: one call (or several, when `required` allows
/// parallel calls; a named choice is one call of that function) in the model's format,
/// arguments valid under the tool's schema.
pub fn forced_grammar(tools: &Tools, format: CallFormat, tok: &Tokenizer) -> Spec {
    let single = !tools.parallel || matches!(tools.choice, ToolChoice::Named(_));
    let max = if single { 1 } else { MAX_PARALLEL_CALLS };
    match format {
        CallFormat::Generic => {
            let mut calls =
                json!({"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1});
            calls["maxItems"] = json!(max);
            Spec::JsonSchema(json!({
                "type": "object",
                "properties": {"tool_calls": calls},
                "required": ["tool_calls"],
                "additionalProperties": false,
            }))
        }
        CallFormat::Llama3 => Spec::JsonSchema(call_schema(tools, "parameters")),
        CallFormat::Hermes => {
            let call = format!(
                "\"{}\\n\" %json {} \"\\n{}\"",
                "<tool_call>",
                call_schema(tools, "arguments"),
                "</tool_call>"
            );
            let rep = if max == 1 {
                String::new()
            } else {
                format!("(\"\\n\" call){{0,{}}}", max - 1)
            };
            Spec::Lark(format!("start: call {rep}\ncall: {call}\n"))
        }
        CallFormat::Mistral => {
            let mut calls =
                json!({"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1});
            calls["maxItems"] = json!(max);
            // The marker is a control token in Mistral's vocabularies: named by id.
            let marker = tok
                .vocab()
                .id("[TOOL_CALLS]")
                .map_or_else(|| "\"[TOOL_CALLS]\"".to_owned(), |id| format!("<[{id}]>"));
            Spec::Lark(format!("start: {marker} %json {calls}\n"))
        }
    }
}

/// A call parsed out of an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// The calls an answer makes, with the text around them; `None` when the answer is
/// not (or not only well-formed) calls of offered tools.
pub fn parse_calls(text: &str, format: CallFormat, tools: &Tools) -> Option<(String, Vec<Call>)> {
    let known = |c: &Call| tools.list.iter().any(|t| t.name == c.name);
    let (rest, calls) = match format {
        CallFormat::Generic => {
            let list = match serde_json::from_str::<Value>(text.trim()) {
                Ok(v) => match (v.get("tool_calls"), v.get("tool_call")) {
                    (Some(Value::Array(a)), _) => a.clone(),
                    (_, Some(one)) => vec![one.clone()],
                    _ if v.get("name").is_some() => vec![v.clone()],
                    _ => return None,
                },
                Err(_) => complete_items(text)?,
            };
            (
                String::new(),
                list.iter()
                    .map(|c| call_of(c, "arguments"))
                    .collect::<Option<Vec<_>>>()?,
            )
        }
        CallFormat::Llama3 => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
            let calls = body
                .split(';')
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    let v: Value = serde_json::from_str(s.trim()).ok()?;
                    call_of(&v, "parameters").or_else(|| call_of(&v, "arguments"))
                })
                .collect::<Option<Vec<_>>>()?;
            (String::new(), calls)
        }
        CallFormat::Hermes => {
            let (mut rest, mut calls, mut at) = (String::new(), Vec::new(), text);
            while let Some(start) = at.find("<tool_call>") {
                rest.push_str(&at[..start]);
                let after = &at[start + "<tool_call>".len()..];
                let Some(end) = after.find("</tool_call>") else {
                    // A last call cut off by the token budget is dropped when complete
                    // ones came before it.
                    match serde_json::from_str::<Value>(after.trim()) {
                        Ok(v) => calls.push(call_of(&v, "arguments")?),
                        Err(_) if !calls.is_empty() => {}
                        Err(_) => return None,
                    }
                    at = "";
                    break;
                };
                let v: Value = serde_json::from_str(after[..end].trim()).ok()?;
                calls.push(call_of(&v, "arguments")?);
                at = &after[end + "</tool_call>".len()..];
            }
            rest.push_str(at);
            (rest.trim().to_owned(), calls)
        }
        CallFormat::Mistral => {
            let start = text.find("[TOOL_CALLS]")?;
            let v: Value =
                serde_json::from_str(text[start + "[TOOL_CALLS]".len()..].trim()).ok()?;
            let list = v.as_array()?;
            (
                text[..start].trim().to_owned(),
                list.iter()
                    .map(|c| call_of(c, "arguments"))
                    .collect::<Option<Vec<_>>>()?,
            )
        }
    };
    // A model that repeats a call within one answer makes it once.
    let mut unique: Vec<Call> = Vec::with_capacity(calls.len());
    for c in calls {
        if !unique.contains(&c) {
            unique.push(c);
        }
    }
    (!unique.is_empty() && unique.iter().all(known)).then_some((rest, unique))
}

/// The complete calls of a generic answer cut off by the token budget inside its
/// `tool_calls` array; `None` when not even one is complete.
fn complete_items(text: &str) -> Option<Vec<Value>> {
    let t = text.trim_start().strip_prefix('{')?.trim_start();
    let t = t
        .strip_prefix("\"tool_calls\"")?
        .trim_start()
        .strip_prefix(':')?;
    let mut rest = t.trim_start().strip_prefix('[')?;
    let mut items = Vec::new();
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => {
                items.push(v);
                rest = &rest[values.byte_offset()..];
            }
            _ => break,
        }
    }
    (!items.is_empty()).then_some(items)
}

fn call_of(v: &Value, arguments_key: &str) -> Option<Call> {
    let o: &Map<String, Value> = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_owned();
    let arguments = match o.get(arguments_key)? {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(Call { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice) -> Tools {
        Tools {
            list: vec![
                Tool {
                    name: "get_weather".into(),
                    description: Some("Weather of a city".into()),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                },
                Tool {
                    name: "add".into(),
                    description: None,
                    parameters: json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}),
                },
            ],
            choice,
            parallel: true,
        }
    }

    #[test]
    fn calls_parse_in_each_format() {
        let t = tools(ToolChoice::Auto);
        let weather = Call {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        let add = Call {
            name: "add".into(),
            arguments: r#"{"a":1,"b":2}"#.into(),
        };
        assert_eq!(
            parse_calls(
                r#" {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]}"#,
                CallFormat::Generic,
                &t
            ),
            Some((String::new(), vec![weather.clone(), add.clone()]))
        );
        assert_eq!(
            parse_calls(
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                CallFormat::Hermes,
                &t
            ),
            Some(("Let me check.".into(), vec![weather.clone()]))
        );
        assert_eq!(
            parse_calls(
                "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}},\n {\"name\": \"add\", \"arg",
                CallFormat::Generic,
                &t
            ),
            Some((String::new(), vec![add.clone()]))
        );
        // Repeats made once; a last call cut off by the budget dropped.
        assert_eq!(
            parse_calls(
                "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n\
                 <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n\
                 <tool_call>\n{\"name\": \"get_weather\", \"argu",
                CallFormat::Hermes,
                &t
            ),
            Some((String::new(), vec![add.clone()]))
        );
        assert_eq!(
            parse_calls(
                r#"<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}"#,
                CallFormat::Llama3,
                &t
            ),
            Some((String::new(), vec![add.clone()]))
        );
        assert_eq!(
            parse_calls(
                r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
                CallFormat::Mistral,
                &t
            ),
            Some((String::new(), vec![weather]))
        );
        // Text, an unknown tool, broken JSON: not calls.
        for (text, format) in [
            ("The weather is fine.", CallFormat::Generic),
            (
                r#"{"tool_calls": [{"name": "launch", "arguments": {}}]}"#,
                CallFormat::Generic,
            ),
            (
                "<tool_call>\n{\"name\": \"add\", \"argu",
                CallFormat::Hermes,
            ),
            (r#"{"answer": 3}"#, CallFormat::Llama3),
        ] {
            assert_eq!(parse_calls(text, format, &t), None, "{text}");
        }
    }

    #[test]
    fn generic_prompt_carries_tools_calls_and_results() {
        let t = tools(ToolChoice::Required);
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]));
        let mut result = ChatMessage::new("tool", "18 C and sunny");
        result.tool_call_id = Some("call_1".into());
        let msgs = prepare_messages(
            &[ChatMessage::new("user", "Weather in Paris?"), call, result],
            Some(&t),
            CallFormat::Generic,
        );
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(
            msgs[0].content.contains("\"get_weather\"") && msgs[0].content.contains("must call")
        );
        assert_eq!(
            msgs[2].content,
            r#"I called the tool get_weather with {"city":"Paris"}."#
        );
        assert_eq!(
            msgs[3].content,
            "Result of tool get_weather:\n18 C and sunny"
        );
        assert!(msgs
            .iter()
            .all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none()));
        // In a template's own format, the calls keep their place with object arguments.
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(json!([{"id": "c", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 1}"}}]));
        let own = prepare_messages(&[call], Some(&t), CallFormat::Hermes);
        assert_eq!(
            own[0].tool_calls,
            Some(
                json!([{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}])
            )
        );
    }
}
