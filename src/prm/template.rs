//! A checkpoint's chat template (Jinja in tokenizer_config.json) rendered the way transformers
//! renders it: trim_blocks and lstrip_blocks on, Python string methods available.

use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;
use serde_json::Value;

const NAME: &str = "chat_template";

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Message {
    pub role: &'static str,
    pub content: String,
}

/// The compiled template plus the special tokens it may refer to.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// Reads a special token from tokenizer_config.json: a string, `{"content": ...}`, or absent.
pub(super) fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Why a chat template could not be compiled or rendered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateError {
    #[error("chat_template is a list without a \"default\" entry")]
    NoDefault,
    #[error("chat_template is neither a string nor a list")]
    NotATemplate,
    #[error("chat_template does not compile: {0}")]
    Compile(String),
    #[error("rendering the chat template: {0}")]
    Render(String),
}

impl ChatTemplate {
    /// Compiles `chat_template` from a parsed tokenizer_config.json; `None` when it has none.
    pub(super) fn from_config(config: &Value) -> Result<Option<ChatTemplate>, TemplateError> {
        let source = match config.get("chat_template") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            // A list of named templates: use "default", as transformers does.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or(TemplateError::NoDefault)?
                .to_string(),
            Some(_) => return Err(TemplateError::NotATemplate),
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, source)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(Some(ChatTemplate {
            env,
            bos_token: special_token(config, "bos_token").unwrap_or_default(),
            eos_token: special_token(config, "eos_token").unwrap_or_default(),
        }))
    }

    pub(super) fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(src: &str) -> ChatTemplate {
        let cfg = serde_json::json!({"chat_template": src, "bos_token": {"content": "<s>"}, "eos_token": "</s>"});
        ChatTemplate::from_config(&cfg).unwrap().unwrap()
    }

    #[test]
    fn renders_like_transformers() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}\n  {{ m['role'] }}: {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}",
        );
        let msgs = [Message {
            role: "user",
            content: " hi ".into(),
        }];
        // trim_blocks drops the newline after a block tag; lstrip_blocks the indent before one.
        assert_eq!(t.render(&msgs, false).unwrap(), "<s>  user: hi</s>\n");
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let t = template(
            "{% if messages[0]['content'].startswith('x') %}{{ raise_exception('no x') }}{% endif %}{{ messages[0]['content'].strip() }}",
        );
        assert_eq!(
            t.render(
                &[Message {
                    role: "user",
                    content: " a ".into()
                }],
                false
            )
            .unwrap(),
            "a"
        );
        let err = t
            .render(
                &[Message {
                    role: "user",
                    content: "x".into(),
                }],
                false,
            )
            .unwrap_err();
        assert!(err.to_string().contains("no x"), "{err}");
    }

    #[test]
    fn missing_or_broken_templates() {
        assert!(
            ChatTemplate::from_config(&serde_json::json!({}))
                .unwrap()
                .is_none()
        );
        assert!(
            ChatTemplate::from_config(&serde_json::json!({"chat_template": "{% if %}"})).is_err()
        );
    }
}
