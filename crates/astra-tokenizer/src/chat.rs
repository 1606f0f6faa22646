//! Chat templates: the Jinja template of the file (`tokenizer.chat_template`) rendered
//! with minijinja and Python-compatible string methods, or a built-in template when the
//! file has none (Gemma turns for Gemma models, ChatML otherwise).

use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

/// One chat message, with the tool fields templates read (as Hugging Face passes them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": {...}}}]`, the arguments as an object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A template that cannot be compiled or rendered for these messages: a client error
/// (bad roles, a template's `raise_exception`) or a broken template in the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(pub String);

/// Where the template came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateKind {
    /// `tokenizer.chat_template` of the file.
    FromFile,
    /// `<|im_start|>role\ncontent<|im_end|>\n`.
    ChatMl,
    /// `<start_of_turn>user\n…<end_of_turn>\n`, with `assistant` as `model` and a
    /// system message folded into the first user turn (as llama.cpp's built-in).
    GemmaTurns,
}

const CHATML: &str = "{%- for message in messages -%}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

const GEMMA_TURNS: &str = "{%- set ns = namespace(system='') -%}\
{%- for message in messages -%}\
{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'].strip() -%}\
{%- else -%}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
{{- '<start_of_turn>' + role + '\\n' -}}\
{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}\
{{- message['content'].strip() + '<end_of_turn>\\n' -}}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}";

pub struct ChatTemplate {
    env: Environment<'static>,
    kind: TemplateKind,
    /// The template reads a `tools` list (it has its own tool-call format).
    knows_tools: bool,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts templates may print.
    pub fn new(
        source: &str,
        kind: TemplateKind,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // As Hugging Face's apply_chat_template (and llama.cpp's Jinja engine) render.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| TemplateError(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            kind,
            knows_tools: source.contains("tools"),
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The built-in template of `kind` (not [`TemplateKind::FromFile`]).
    pub fn builtin(kind: TemplateKind, bos_token: &str, eos_token: &str) -> Self {
        let source = match kind {
            TemplateKind::GemmaTurns => GEMMA_TURNS,
            _ => CHATML,
        };
        Self::new(source, kind, bos_token, eos_token).expect("built-in templates compile")
    }

    /// The file's template, else the built-in one for the architecture.
    pub fn for_model(
        md: &astra_gguf::Metadata,
        tokenizer: &crate::Tokenizer,
    ) -> Result<Self, TemplateError> {
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_owned()
        };
        let (bos, eos) = (text(tokenizer.bos()), text(tokenizer.eos()));
        if let Ok(source) = md.str("tokenizer.chat_template") {
            return Self::new(source, TemplateKind::FromFile, &bos, &eos);
        }
        let arch = md.str("general.architecture").unwrap_or("");
        let kind = if arch.starts_with("gemma") {
            TemplateKind::GemmaTurns
        } else {
            TemplateKind::ChatMl
        };
        Ok(Self::builtin(kind, &bos, &eos))
    }

    pub fn kind(&self) -> TemplateKind {
        self.kind
    }

    /// Whether the template renders a `tools` list itself.
    pub fn knows_tools(&self) -> bool {
        self.knows_tools
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders the conversation with the request's tools (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) where there are any.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| TemplateError(e.to_string()))
    }

    /// The prompt text that opens the assistant's turn, ready to encode with special
    /// tokens added: when the tokenizer adds BOS itself, a BOS the template printed at
    /// the start is dropped (as llama.cpp does), so the prompt never starts with two.
    pub fn prompt(
        &self,
        messages: &[ChatMessage],
        tokenizer_adds_bos: bool,
    ) -> Result<String, TemplateError> {
        self.prompt_with_tools(messages, None, tokenizer_adds_bos)
    }

    /// [`ChatTemplate::prompt`] with the request's tools.
    pub fn prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        tokenizer_adds_bos: bool,
    ) -> Result<String, TemplateError> {
        let text = self.render_with_tools(messages, tools, true)?;
        match text.strip_prefix(self.bos_token.as_str()) {
            Some(rest) if tokenizer_adds_bos && !self.bos_token.is_empty() => Ok(rest.to_owned()),
            _ => Ok(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn chatml_builtin() {
        let t = ChatTemplate::builtin(TemplateKind::ChatMl, "", "");
        let out = t
            .render(&msgs(&[("system", "Be brief."), ("user", "Hi")]), true)
            .unwrap();
        assert_eq!(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        let out = t.render(&msgs(&[("user", "Hi")]), false).unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n");
    }

    /// As llama.cpp's built-in Gemma template: system folded into the first user turn,
    /// assistant called model, contents trimmed.
    #[test]
    fn gemma_builtin() {
        let t = ChatTemplate::builtin(TemplateKind::GemmaTurns, "<bos>", "<eos>");
        let out = t
            .render(
                &msgs(&[
                    ("system", " Be brief. "),
                    ("user", " Hi "),
                    ("assistant", "Hello."),
                    ("user", "Bye"),
                ]),
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn python_string_methods_and_template_errors() {
        let src = "{% for m in messages %}{% if not m['role'].startswith('u') %}{{ raise_exception('only user roles') }}{% endif %}{{ m['content'].upper().strip() }}{% endfor %}";
        let t = ChatTemplate::new(src, TemplateKind::FromFile, "", "").unwrap();
        assert_eq!(t.render(&msgs(&[("user", " hi ")]), false).unwrap(), "HI");
        let err = t.render(&msgs(&[("bot", "x")]), false).unwrap_err();
        assert!(err.to_string().contains("only user roles"), "{err}");
        let err = ChatTemplate::new("{% for %}", TemplateKind::FromFile, "", "")
            .err()
            .unwrap();
        assert!(err.to_string().starts_with("chat template:"), "{err}");
    }
}
