//! Chat templates: a conversation rendered into the prompt text a model was tuned on.
//!
//! HuggingFace ships chat templates as Jinja source (`tokenizer_config.json`,
//! `chat_template.jinja`, GGUF `tokenizer.chat_template`) and renders them with Python's jinja2
//! in transformers' `apply_chat_template`. [`ChatTemplate`] compiles such a source once with
//! minijinja, set up to render exactly as transformers does:
//! - `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the source dropped;
//! - globals `raise_exception(message)` (an error whose message reaches the caller as
//!   [`ChatTemplateError::Raised`]) and `strftime_now(format)` (UTC; the clock can be fixed with
//!   [`ChatTemplate::render_at`]);
//! - Python string, list and dict methods (`.strip()`, `.split()`, `.items()`, ...) through
//!   minijinja-contrib's pycompat;
//! - `tojson` as transformers overrides it: `json.dumps` with `ensure_ascii=False`, Python's
//!   separators (`", "`, `": "`), no HTML escaping, and the `indent`, `separators`, `sort_keys`
//!   and `ensure_ascii` arguments;
//! - values printed the Python way (`True`, `False`, `None`, `['a', 1]`);
//! - `{% generation %}` blocks (transformers' assistant-mask extension) render their body;
//! - the render variables transformers passes: `messages`, `add_generation_prompt`,
//!   `bos_token`, `eos_token`, and `tools` / `documents` (none).
//!
//! The Python printing, `tojson` and `strftime` live in the `py` submodule; this file is the
//! glue: the environment, the render variables and the errors.
//!
//! Golden tests (`crates/model/tests/chat_golden.rs`) compare renders with transformers'.

mod py;

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde::{Deserialize, Serialize};

use self::py::{python_formatter, strftime, tojson};
use crate::tokenizer::Tokenizer;

/// Name of the one template in the environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Context variable carrying the render time to `strftime_now`.
const NOW_VAR: &str = "__tessera_now_unix_s";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Compiling or rendering a chat template failed.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template syntax error{}: {message}", at_line(*.line))]
    Syntax {
        line: Option<usize>,
        message: String,
    },
    #[error("the chat template raised an exception: {message}")]
    Raised { message: String },
    #[error("chat template rendering failed{}: {message}", at_line(*.line))]
    Render {
        line: Option<usize>,
        message: String,
    },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// The error `raise_exception` returns; found again in the error chain after rendering.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A compiled chat template with its special tokens.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token` and `eos_token` are the texts the template sees as
    /// `bos_token` / `eos_token` (undefined when `None`).
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let source = without_generation_tags(source);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ChatTemplateError::Syntax {
                line: e.line(),
                message: detail(&e),
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        })
    }

    /// The tokenizer's own template with its bos/eos tokens; `None` when it has no template.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>, ChatTemplateError> {
        tokenizer
            .chat_template()
            .map(|source| ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token()))
            .transpose()
    }

    /// Renders `messages`; with `add_generation_prompt`, ends with the header that opens the
    /// assistant's turn. `strftime_now` reads the system clock.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default();
        self.render_at(messages, add_generation_prompt, now)
    }

    /// [`ChatTemplate::render`] with `strftime_now` seeing `now_unix_s` (seconds since the Unix
    /// epoch, UTC).
    pub fn render_at(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        now_unix_s: i64,
    ) -> Result<String, ChatTemplateError> {
        let mut vars: Vec<(&str, Value)> = vec![
            ("messages", Value::from_serialize(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            (NOW_VAR, Value::from(now_unix_s)),
        ];
        if let Some(bos) = &self.bos_token {
            vars.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            vars.push(("eos_token", Value::from(eos.as_str())));
        }
        let ctx: Value = vars.into_iter().collect();
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        template.render(ctx).map_err(render_error)
    }
}

fn detail(err: &Error) -> String {
    err.detail()
        .map_or_else(|| err.kind().to_string(), str::to_string)
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(Raised(message)) = e.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised {
                message: message.clone(),
            };
        }
        source = e.source();
    }
    ChatTemplateError::Render {
        line: err.line(),
        message: detail(&err),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn strftime_now(state: &State<'_, '_>, format: String) -> Result<Value, Error> {
    let now = match state.lookup(NOW_VAR).and_then(|v| v.as_i64()) {
        Some(now) => now,
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default(),
    };
    Ok(Value::from(strftime(&format, now)))
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` tags (which only mark the
/// assistant's text for training masks) by an always-true `if`, keeping whitespace control.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (body, close) = match body.strip_suffix(['-', '+']) {
            Some(body) => (body, &inner[inner.len() - 1..]),
            None => (body, ""),
        };
        let word = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match word {
            Some(word) => {
                let _ = write!(out, "{{%{open} {word} {close}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
        ChatTemplate::new(source, Some("<s>"), Some("</s>"))?.render_at(messages, true, 0)
    }

    #[test]
    fn strftime_now_uses_the_render_clock() {
        let tpl = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None).unwrap();
        assert_eq!(
            tpl.render_at(&[], false, 86_400 * 365).unwrap(),
            "1971-01-01"
        );
    }

    #[test]
    fn syntax_error_names_the_line() {
        let err = ChatTemplate::new("ok\n{% if %}\n", None, None).unwrap_err();
        match &err {
            ChatTemplateError::Syntax { line, .. } => assert_eq!(*line, Some(2), "{err}"),
            other => panic!("expected a syntax error, got {other}"),
        }
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn raise_exception_gives_its_message() {
        let err = render("{{ raise_exception('no system role') }}", &[]).unwrap_err();
        match err {
            ChatTemplateError::Raised { message } => assert_eq!(message, "no system role"),
            other => panic!("expected Raised, got {other}"),
        }
    }

    #[test]
    fn other_render_errors_are_not_raised() {
        let err = render("{{ messages | nosuchfilter }}", &[]).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Render { .. }), "{err}");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let source = "{% for m in messages %}{%- generation -%} {{ m.content }} {%- endgeneration %}|{% endfor %}";
        let messages = [
            ChatMessage::new("assistant", "a"),
            ChatMessage::new("user", "b"),
        ];
        assert_eq!(render(source, &messages).unwrap(), "a|b|");
    }

    #[test]
    fn python_printing_and_tojson() {
        let source = "{{ true }} {{ none }} {{ ['a', 1, 2.0] }} {{ {'k': \"it's\"} }} \
                      {{ 'x' | tojson }} {{ [1, {'a': none}] | tojson(indent=1) }}";
        let expected =
            "True None ['a', 1, 2.0] {'k': \"it's\"} \"x\" [\n 1,\n {\n  \"a\": null\n }\n]";
        assert_eq!(render(source, &[]).unwrap(), expected);
        let source = "{{ {'b': 'é', 'a': 1} | tojson(sort_keys=true, ensure_ascii=true, separators=[',', ':']) }}";
        assert_eq!(render(source, &[]).unwrap(), "{\"a\":1,\"b\":\"\\u00e9\"}");
    }
}
