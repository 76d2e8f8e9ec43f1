//! OpenAI's HTTP shapes for `/v1/completions` and `/v1/chat/completions`: the request's fields
//! checked one by one (an error names the field, in OpenAI's `{"error": {...}}` shape), and the
//! answers and stream chunks built as OpenAI's servers write them, so that the official client
//! libraries work unchanged.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use archipelago_actors::generate::Finish;
use archipelago_actors::sampling::Sampling;

/// An answer in OpenAI's error shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What is wrong and what to change.
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `server_error`, …).
    pub kind: &'static str,
    /// The field at fault.
    pub param: Option<String>,
    /// OpenAI's `code`, where one fits.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn field(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// Any status, no field.
    pub fn status(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// With OpenAI's `code`.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Its text.
    pub content: String,
}

/// What the client asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// `/v1/completions`: text, or token ids.
    Text(String),
    /// Token ids given as such.
    Ids(Vec<u32>),
    /// `/v1/chat/completions`: the conversation.
    Chat(Vec<Message>),
}

/// A request's fields, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// What to continue.
    pub prompt: Prompt,
    /// `max_tokens` / `max_completion_tokens`, if given.
    pub max_tokens: Option<usize>,
    /// How to pick tokens (the seed drawn by the server when not given).
    pub sampling: Sampling,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Fields OpenAI has that this server refuses unless left at their default, and why.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "n",
        "one choice per request: leave n out or give 1, and send several requests",
    ),
    ("best_of", "no best-of search: leave best_of out or give 1"),
    (
        "logprobs",
        "log-probabilities are not returned: leave logprobs out",
    ),
    (
        "top_logprobs",
        "log-probabilities are not returned: leave top_logprobs out",
    ),
    ("echo", "the prompt is not echoed: leave echo out"),
    ("suffix", "no insertion after a suffix: leave suffix out"),
    ("logit_bias", "no logit bias: leave logit_bias out"),
    (
        "presence_penalty",
        "no presence penalty: leave presence_penalty out or give 0",
    ),
    (
        "frequency_penalty",
        "no frequency penalty: leave frequency_penalty out or give 0",
    ),
    ("tools", "no tool calls: leave tools out"),
    ("functions", "no function calls: leave functions out"),
    (
        "response_format",
        "no structured output: leave response_format out",
    ),
];

/// Whether an unsupported field holds its default (absent, null, false, 1 for counts, 0 for
/// penalties, empty for maps and lists).
fn at_default(name: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => match name {
            "n" | "best_of" => n.as_f64() == Some(1.0),
            "presence_penalty" | "frequency_penalty" => n.as_f64() == Some(0.0),
            _ => false,
        },
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        _ => false,
    }
}

/// The fields of a completions (`chat` false) or chat request.
pub fn parse(body: &Value, chat: bool, default_seed: u64) -> Result<Params, ApiError> {
    let Value::Object(fields) = body else {
        return Err(ApiError::field("body", "the body must be a JSON object"));
    };
    for (name, why) in UNSUPPORTED {
        if let Some(value) = fields.get(*name)
            && !at_default(name, value)
        {
            return Err(ApiError::field(name, format!("`{name}` is not supported: {why}")));
        }
    }
    if let Some(model) = fields.get("model")
        && !model.is_string()
    {
        return Err(ApiError::field("model", "model must be a string"));
    }
    let prompt = if chat {
        messages(fields.get("messages"))?
    } else {
        prompt(fields.get("prompt"))?
    };
    let max_tokens = match (fields.get("max_completion_tokens"), fields.get("max_tokens")) {
        (Some(v), _) if !v.is_null() => Some(count("max_completion_tokens", v)?),
        (_, Some(v)) if !v.is_null() => Some(count("max_tokens", v)?),
        _ => None,
    };
    let temperature = number(fields, "temperature")?.unwrap_or(1.0);
    if temperature < 0.0 {
        return Err(ApiError::field(
            "temperature",
            format!("temperature {temperature} is negative: give 0 (greedy) or more"),
        ));
    }
    let top_p = number(fields, "top_p")?;
    if let Some(p) = top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(ApiError::field("top_p", format!("top_p {p} is outside (0, 1]")));
    }
    let top_k = match fields.get("top_k") {
        None | Some(Value::Null) => None,
        // vLLM's "all tokens".
        Some(v) if v.as_i64() == Some(-1) || v.as_i64() == Some(0) => None,
        Some(v) => Some(count("top_k", v)?),
    };
    let seed = match fields.get("seed") {
        None | Some(Value::Null) => default_seed,
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| ApiError::field("seed", "seed must be an integer"))?,
    };
    let stream = match fields.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::field("stream", "stream must be true or false")),
    };
    let include_usage = fields
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Params {
        prompt,
        max_tokens,
        sampling: Sampling {
            temperature: temperature as f32,
            top_k,
            top_p: top_p.map(|p| p as f32),
            seed,
        },
        stop: stops(fields.get("stop"))?,
        stream,
        include_usage,
    })
}

/// A number field, if given.
fn number(fields: &serde_json::Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::field(name, format!("{name} must be a number"))),
    }
}

/// A positive integer field.
fn count(name: &str, value: &Value) -> Result<usize, ApiError> {
    match value.as_u64() {
        Some(n) if n >= 1 => Ok(n as usize),
        _ => Err(ApiError::field(
            name,
            format!("{name} must be an integer ≥ 1, not {value}"),
        )),
    }
}

/// `prompt`: a string, a list of one string, or a list of token ids.
fn prompt(value: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::field(
            "prompt",
            "prompt must be a string, a list of one string, or a list of token ids",
        )
    };
    match value {
        None | Some(Value::Null) => Err(ApiError::field("prompt", "prompt is missing")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [] => Err(ApiError::field("prompt", "prompt is an empty list")),
            items if items.iter().all(Value::is_u64) => Ok(Prompt::Ids(
                items
                    .iter()
                    .map(|v| v.as_u64().unwrap_or(0).min(u32::MAX as u64) as u32)
                    .collect(),
            )),
            items if items.iter().all(Value::is_string) => Err(ApiError::field(
                "prompt",
                format!("{} prompts in one request: send one per request", items.len()),
            )),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// `messages`: objects with a `role` and a `content` (a string, or a list of text parts).
fn messages(value: Option<&Value>) -> Result<Prompt, ApiError> {
    let Some(Value::Array(items)) = value else {
        return Err(ApiError::field(
            "messages",
            "messages must be a list of {role, content} objects",
        ));
    };
    if items.is_empty() {
        return Err(ApiError::field("messages", "messages is empty"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = item.get("role").and_then(Value::as_str);
        let Some(role) = role else {
            return Err(ApiError::field(&param, format!("{param} has no string `role`")));
        };
        let content = match item.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::field(
                                &param,
                                format!("{param}.content: only parts of type `text` are supported"),
                            ));
                        }
                    }
                }
                text
            }
            None | Some(Value::Null) => String::new(),
            Some(_) => {
                return Err(ApiError::field(
                    &param,
                    format!("{param}.content must be a string"),
                ));
            }
        };
        out.push(Message {
            role: role.to_string(),
            content,
        });
    }
    Ok(Prompt::Chat(out))
}

/// `stop`: a string or a list of up to 4.
fn stops(value: Option<&Value>) -> Result<Vec<String>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if items.len() <= 4 && items.iter().all(Value::is_string) => Ok(items
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect()),
        Some(_) => Err(ApiError::field(
            "stop",
            "stop must be a string or a list of up to 4 strings",
        )),
    }
}

/// OpenAI's name for why an answer ended.
pub fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::Stop => "stop",
    }
}

/// The `usage` object.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Who answers: the id, the model's name and the time, shared by every chunk of one answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// The served model's name.
    pub model: String,
    /// Unix seconds.
    pub created: u64,
    /// A chat answer.
    pub chat: bool,
}

impl Answer {
    /// The whole answer (not streamed).
    pub fn whole(&self, text: &str, finish: Finish, usage_value: Value) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": finish_reason(finish)})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(finish)})
        };
        let object = if self.chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [choice], "usage": usage_value})
    }

    /// One stream chunk: `text` (a chat's first chunk also names the role), the finish reason on
    /// the last one; `usage` is null on each when the client asked for usage.
    pub fn chunk(&self, text: &str, first: bool, finish: Option<Finish>, include_usage: bool) -> Value {
        let reason = finish.map(finish_reason);
        let choice = if self.chat {
            let delta = match (first, finish) {
                (_, Some(_)) if text.is_empty() => json!({}),
                (true, _) => json!({"role": "assistant", "content": text}),
                _ => json!({"content": text}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
        };
        let mut chunk = self.chunk_head();
        chunk["choices"] = json!([choice]);
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The chunk after the last, with the usage and no choice (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage_value: Value) -> Value {
        let mut chunk = self.chunk_head();
        chunk["choices"] = json!([]);
        chunk["usage"] = usage_value;
        chunk
    }

    fn chunk_head(&self) -> Value {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value, chat: bool) -> ApiError {
        parse(&body, chat, 7).unwrap_err()
    }

    #[test]
    fn fields_parse_with_openai_defaults() {
        let p = parse(
            &json!({"model": "m", "prompt": "hi", "max_tokens": 5, "stop": "\n"}),
            false,
            7,
        )
        .unwrap();
        assert_eq!(p.prompt, Prompt::Text("hi".into()));
        assert_eq!(p.max_tokens, Some(5));
        assert_eq!(p.sampling.temperature, 1.0);
        assert_eq!(p.sampling.seed, 7);
        assert_eq!(p.stop, vec!["\n".to_string()]);
        let chat = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                          "max_completion_tokens": 3, "max_tokens": 9, "stream": true,
                          "stream_options": {"include_usage": true}, "n": 1, "seed": 3});
        let p = parse(&chat, true, 7).unwrap();
        assert_eq!(p.max_tokens, Some(3));
        assert!(p.stream && p.include_usage);
        assert_eq!(p.sampling.seed, 3);
    }

    #[test]
    fn each_bad_field_is_named() {
        for (body, param) in [
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "logprobs": 1}), "logprobs"),
            (json!({"prompt": "x", "echo": true}), "echo"),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": "x", "temperature": -0.5}), "temperature"),
            (json!({"prompt": "x", "top_p": 0}), "top_p"),
            (json!({"prompt": "x", "top_p": 1.5}), "top_p"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "stop": [1]}), "stop"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({}), "prompt"),
        ] {
            let e = refused(body.clone(), false);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
        let e = refused(json!({"messages": [{"content": "x"}]}), true);
        assert_eq!(e.param.as_deref(), Some("messages[0]"));
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("role"));
    }

    #[test]
    fn chunks_have_openai_shapes() {
        let a = Answer {
            id: "chatcmpl-1".into(),
            model: "m".into(),
            created: 1,
            chat: true,
        };
        assert_eq!(
            a.chunk("he", true, None, false)["choices"][0]["delta"]["role"],
            "assistant"
        );
        let last = a.chunk("", false, Some(Finish::Stop), true);
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert!(last["usage"].is_null() && last.as_object().unwrap().contains_key("usage"));
        assert_eq!(a.usage_chunk(usage(3, 2))["usage"]["total_tokens"], 5);
        let whole = a.whole("hey", Finish::Length, usage(1, 1));
        assert_eq!(whole["object"], "chat.completion");
        assert_eq!(whole["choices"][0]["message"]["content"], "hey");
    }
}
