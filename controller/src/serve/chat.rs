//! Chat messages to one prompt. A model that has a Jinja `chat_template` (in the
//! `tokenizer_config.json` beside its `tokenizer.json`, or given with `--chat-template FILE`) is
//! rendered as Hugging Face renders it (`messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, `raise_exception`), through `minijinja`; a template it cannot compile is refused
//! at start with the fix. A model without one (GPT-2) gets the plain template: each message as
//! `role: content` on its own line, then `assistant:` for the answer to follow.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, context};
use serde_json::Value;

use super::openai::Message;

/// How messages become a prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatTemplate {
    /// `role: content\n` per message, then `assistant:`.
    Plain,
    /// A Jinja template, with the special tokens it may name.
    Jinja {
        /// The template's source.
        source: String,
        /// `bos_token`.
        bos: String,
        /// `eos_token`.
        eos: String,
    },
}

impl ChatTemplate {
    /// The template `flag` names (`plain`, or a Jinja file), else the one in the
    /// `tokenizer_config.json` beside `tokenizer`, else plain.
    pub fn choose(flag: Option<&str>, tokenizer: Option<&Path>) -> Result<ChatTemplate, String> {
        let template = match flag {
            Some("plain") => return Ok(ChatTemplate::Plain),
            Some(file) => {
                let source = std::fs::read_to_string(file)
                    .map_err(|e| format!("cannot read --chat-template {file}: {e}"))?;
                ChatTemplate::Jinja {
                    source,
                    bos: String::new(),
                    eos: String::new(),
                }
            }
            None => match tokenizer.map(|t| t.with_file_name("tokenizer_config.json")) {
                Some(config) if config.exists() => from_config(&config)?,
                _ => return Ok(ChatTemplate::Plain),
            },
        };
        template.render(&[Message {
            role: "user".into(),
            content: "hello".into(),
        }])
        .map_err(|e| {
            format!("the chat template does not render ({e}): give --chat-template plain, or a Jinja file it can")
        })?;
        Ok(template)
    }

    /// The prompt for `messages`, ready for the answer.
    pub fn render(&self, messages: &[Message]) -> Result<String, String> {
        match self {
            ChatTemplate::Plain => {
                let mut text = String::new();
                for m in messages {
                    text.push_str(&format!("{}: {}\n", m.role, m.content));
                }
                text.push_str("assistant:");
                Ok(text)
            }
            ChatTemplate::Jinja { source, bos, eos } => {
                let mut env = Environment::new();
                env.add_function("raise_exception", |message: String| -> Result<String, Error> {
                    Err(Error::new(ErrorKind::InvalidOperation, message))
                });
                env.render_str(
                    source,
                    context! {
                        messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                        add_generation_prompt => true,
                        bos_token => bos,
                        eos_token => eos,
                    },
                )
                .map_err(|e| format!("chat template: {e:#}"))
            }
        }
    }
}

/// The template of a `tokenizer_config.json` (plain when it has none).
fn from_config(path: &Path) -> Result<ChatTemplate, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    let token = |name: &str| match config.get(name) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.get("content").and_then(Value::as_str).unwrap_or("").to_string(),
        None => String::new(),
    };
    match config.get("chat_template") {
        Some(Value::String(source)) => Ok(ChatTemplate::Jinja {
            source: source.clone(),
            bos: token("bos_token"),
            eos: token("eos_token"),
        }),
        None | Some(Value::Null) => Ok(ChatTemplate::Plain),
        Some(_) => Err(format!(
            "{}: chat_template is not one string (named templates are not supported): give --chat-template FILE",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages() -> Vec<Message> {
        vec![
            Message {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            Message {
                role: "user".into(),
                content: "Hi".into(),
            },
        ]
    }

    #[test]
    fn plain_template_is_role_colon_content() {
        let text = ChatTemplate::Plain.render(&messages()).unwrap();
        assert_eq!(text, "system: Be brief.\nuser: Hi\nassistant:");
    }

    #[test]
    fn a_models_jinja_template_renders_as_hugging_face_does() {
        let dir = tempfile::tempdir().unwrap();
        // ChatML, as Qwen's and many other tokenizer_config.json files carry it.
        let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let config = serde_json::json!({"chat_template": chatml, "eos_token": {"content": "<|im_end|>"}});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let tokenizer = dir.path().join("tokenizer.json");
        let template = ChatTemplate::choose(None, Some(&tokenizer)).unwrap();
        let text = template.render(&messages()).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let raising = "{{ raise_exception('Conversation roles must alternate') }}";
        std::fs::write(dir.path().join("bad.jinja"), raising).unwrap();
        let bad = dir.path().join("bad.jinja");
        let err = ChatTemplate::choose(Some(bad.to_str().unwrap()), None).unwrap_err();
        assert!(
            err.contains("--chat-template plain") && err.contains("alternate"),
            "{err}"
        );
    }
}
