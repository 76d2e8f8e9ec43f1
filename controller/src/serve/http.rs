//! The routes of `archipelago serve`: `POST /v1/completions` and `POST /v1/chat/completions`
//! (whole answers, or server-sent events in OpenAI's chunk format ending with `data: [DONE]`),
//! `GET /v1/models`, `GET /health` and `GET /metrics`. Every refusal is an HTTP 4xx in OpenAI's
//! error shape naming the field, and the server goes on serving the others: a body over
//! `--max-body-bytes` (413), JSON that does not parse (400), a prompt or `max_tokens` past the
//! context (400), more requests at once than `--max-connections` (503). A client that goes
//! away mid-stream drops its receiver, and its replica cancels it at its next token.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::sync::mpsc::UnboundedReceiver;

use archipelago_actors::generate::{Finish, Request as GenerateRequest};
use archipelago_actors::serving::{Router as ReplicaRouter, Update};
use archipelago_actors::text_tokens::Encode;

use super::chat::ChatTemplate;
use super::metrics::Metrics;
use super::openai::{self, Answer, ApiError, Params, Prompt, usage};

/// Everything the routes share.
pub struct Service {
    /// The replicas.
    pub replicas: ReplicaRouter,
    /// The tokenizer's encoder.
    pub encode: Box<Encode>,
    /// Chat messages to a prompt.
    pub template: ChatTemplate,
    /// The name `/v1/models` gives and answers carry.
    pub name: String,
    /// The model's positions.
    pub ctx: usize,
    /// The model's vocabulary.
    pub vocab: usize,
    /// `/metrics`.
    pub metrics: Metrics,
    /// The largest body read.
    pub max_body_bytes: usize,
    /// Requests served at once (`--max-connections`).
    pub connections: Arc<Semaphore>,
    /// The cluster token every request must carry as `Authorization: Bearer`, if any.
    pub token: Option<Arc<str>>,
    /// Answers so far (their ids).
    pub answered: AtomicU64,
    /// Seeds drawn for requests that name none: each its own, even when requests arrive together.
    pub seeds_drawn: AtomicU64,
    /// Unix seconds at start.
    pub created: u64,
}

/// The service's routes.
pub fn app(service: Arc<Service>) -> Router {
    let generation = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .layer(middleware::from_fn_with_state(service.clone(), limit_connections));
    let app = Router::new()
        .merge(generation)
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found);
    let app = match service.token.clone() {
        Some(_) => app.layer(middleware::from_fn_with_state(service.clone(), require_token)),
        None => app,
    };
    app.with_state(service)
}

/// 401 in OpenAI's shape without the cluster token (OpenAI clients send their `api_key` so).
async fn require_token(State(service): State<Arc<Service>>, request: Request, next: Next) -> Response {
    let token = service.token.as_deref().unwrap_or_default();
    match refused_without(&request, token, "server") {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

/// The 401 (OpenAI's shape) for a request to this `what` (server, router) that does not carry
/// `token` as `Authorization: Bearer`; `None` when it does.
pub(crate) fn refused_without(request: &Request, token: &str, what: &str) -> Option<Response> {
    let given =
        (request.headers().get(header::AUTHORIZATION)).and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    if given.is_some_and(|g| crate::dashboard::access::same(g, token.as_bytes())) {
        return None;
    }
    let why = format!(
        "this {what} needs the cluster token: send `Authorization: Bearer <token>` (the OpenAI clients' api_key)"
    );
    Some(
        ApiError::status(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            why,
        )
        .into_response(),
    )
}

/// 503 past `--max-connections` requests at once; the permit lives as long as the answer's body.
async fn limit_connections(State(service): State<Arc<Service>>, request: Request, next: Next) -> Response {
    let Ok(permit) = service.connections.clone().try_acquire_owned() else {
        service.metrics.outcome("overloaded");
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "overloaded",
            "the server is answering as many requests as --max-connections allows: retry later",
        )
        .into_response();
    };
    let response = next.run(request).await;
    response.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _held = &permit;
            chunk
        }))
    })
}

async fn completions(State(service): State<Arc<Service>>, request: Request) -> Response {
    answer(&service, request, false).await
}

async fn chat_completions(State(service): State<Arc<Service>>, request: Request) -> Response {
    answer(&service, request, true).await
}

/// A completion or chat request, answered or refused.
async fn answer(service: &Arc<Service>, request: Request, chat: bool) -> Response {
    let arrived = Instant::now();
    match start(service, request, chat).await {
        Ok((params, prompt_tokens, updates)) => {
            let n = service.answered.fetch_add(1, Ordering::Relaxed);
            let answer = Answer {
                id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
                model: service.name.clone(),
                created: unix_seconds(),
                chat,
            };
            let timing = Timing { arrived, last: None };
            if params.stream {
                stream(service.clone(), answer, params.include_usage, updates, timing)
            } else {
                whole(service, &answer, prompt_tokens, updates, timing).await
            }
        }
        Err(e) => {
            service.metrics.outcome("refused");
            e.into_response()
        }
    }
}

/// Reads and checks the request and hands it to a replica: its parameters, prompt length and
/// the receiver of its updates.
async fn start(
    service: &Service,
    request: Request,
    chat: bool,
) -> Result<(Params, usize, UnboundedReceiver<Update>), ApiError> {
    let limit = service.max_body_bytes;
    let bytes = axum::body::to_bytes(request.into_body(), limit)
        .await
        .map_err(|_| {
            ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                format!("the body is over {limit} bytes (the server's --max-body-bytes): shorten the prompt"),
            )
        })?;
    let body: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::field("body", format!("the body is not valid JSON: {e}")).with_code("invalid_json")
    })?;
    let draw = service.seeds_drawn.fetch_add(1, Ordering::Relaxed);
    let default_seed = service.created ^ draw.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let params = openai::parse(&body, chat, default_seed)?;
    let (prompt, param) = prompt_ids(service, &params.prompt)?;
    let ctx = service.ctx;
    if prompt.len() >= ctx {
        return Err(ApiError::field(
            param,
            format!(
                "the prompt is {} tokens and the model's context is {ctx}: shorten it to {} tokens or fewer",
                prompt.len(),
                ctx - 1
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match params.max_tokens {
        Some(m) if m > room => {
            let name = if body.get("max_completion_tokens").is_some_and(|v| !v.is_null()) {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(ApiError::field(
                name,
                format!(
                    "{name} {m} after a prompt of {} tokens is past the model's context of {ctx}: give at most {room}",
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Some(m) => m,
        // OpenAI's completions default to 16 tokens; a chat answer may fill the context.
        None if chat => room,
        None => room.min(16),
    };
    let prompt_tokens = prompt.len();
    let request = GenerateRequest {
        prompt,
        max_tokens,
        sampling: params.sampling,
        stop: params.stop.clone(),
    };
    let updates = (service.replicas.submit(request).await).map_err(|e| {
        ApiError::status(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            e,
        )
    })?;
    Ok((params, prompt_tokens, updates))
}

/// The prompt's token ids and the field they came from.
fn prompt_ids(service: &Service, prompt: &Prompt) -> Result<(Vec<u32>, &'static str), ApiError> {
    let (ids, param) = match prompt {
        Prompt::Text(text) => (
            (service.encode)(text).map_err(|e| ApiError::field("prompt", e))?,
            "prompt",
        ),
        Prompt::Ids(ids) => {
            if let Some(id) = ids.iter().find(|&&id| id as usize >= service.vocab) {
                return Err(ApiError::field(
                    "prompt",
                    format!("token id {id} is past the vocabulary of {}", service.vocab),
                ));
            }
            (ids.clone(), "prompt")
        }
        Prompt::Chat(messages) => {
            let text = (service.template.render(messages)).map_err(|e| ApiError::field("messages", e))?;
            (
                (service.encode)(&text).map_err(|e| ApiError::field("messages", e))?,
                "messages",
            )
        }
    };
    if ids.is_empty() {
        return Err(ApiError::field(
            param,
            format!("the {param} has no tokens: give some text"),
        ));
    }
    Ok((ids, param))
}

/// When a request arrived and when its last token came, for the latency histograms.
struct Timing {
    arrived: Instant,
    last: Option<Instant>,
}

impl Timing {
    fn token(&mut self, metrics: &Metrics) {
        let now = Instant::now();
        match self.last {
            None => metrics
                .time_to_first_token
                .observe((now - self.arrived).as_secs_f64()),
            Some(last) => metrics.inter_token_latency.observe((now - last).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

/// Waits for the whole answer.
async fn whole(
    service: &Service,
    answer: &Answer,
    prompt_tokens: usize,
    mut updates: UnboundedReceiver<Update>,
    mut timing: Timing,
) -> Response {
    let mut text = String::new();
    while let Some(update) = updates.recv().await {
        match update {
            Update::Token { text: piece } => {
                timing.token(&service.metrics);
                text.push_str(&piece);
            }
            Update::Done {
                text: rest,
                finish,
                completion_tokens,
                ..
            } => {
                text.push_str(&rest);
                service.metrics.outcome("ok");
                let body = answer.whole(&text, finish, usage(prompt_tokens, completion_tokens));
                return axum::Json(body).into_response();
            }
            Update::Failed(e) => return failed(service, e),
        }
    }
    failed(service, "the replica stopped before the answer ended".into())
}

fn failed(service: &Service, message: String) -> Response {
    service.metrics.outcome("failed");
    ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "generation_failed",
        message,
    )
    .into_response()
}

/// Where a streamed answer is.
struct Streaming {
    service: Arc<Service>,
    answer: Answer,
    include_usage: bool,
    updates: UnboundedReceiver<Update>,
    timing: Timing,
    first: bool,
    ended: bool,
}

/// Streams the answer as server-sent events.
fn stream(
    service: Arc<Service>,
    answer: Answer,
    include_usage: bool,
    updates: UnboundedReceiver<Update>,
    timing: Timing,
) -> Response {
    let state = Streaming {
        service,
        answer,
        include_usage,
        updates,
        timing,
        first: true,
        ended: false,
    };
    let events = futures::stream::unfold(state, |mut s| async move {
        if s.ended {
            return None;
        }
        let events = next_events(&mut s).await;
        Some((futures::stream::iter(events), s))
    })
    .flatten()
    .map(Ok::<Event, Infallible>);
    Sse::new(events).into_response()
}

/// The events of the next update: a chunk per token, the last chunk, the usage chunk and
/// `[DONE]` at the end.
async fn next_events(s: &mut Streaming) -> Vec<Event> {
    let data = |value: Value| Event::default().data(value.to_string());
    let chunk = |s: &mut Streaming, text: &str, finish: Option<Finish>| {
        let value = s.answer.chunk(text, s.first, finish, s.include_usage);
        s.first = false;
        data(value)
    };
    match s.updates.recv().await {
        Some(Update::Token { text }) => {
            s.timing.token(&s.service.metrics);
            // One chunk per token, its text empty while a partial character or a possible stop
            // sequence is held back (as vLLM sends): a client times every token.
            vec![chunk(s, &text, None)]
        }
        Some(Update::Done {
            text,
            finish,
            prompt_tokens,
            completion_tokens,
        }) => {
            s.ended = true;
            s.service.metrics.outcome("ok");
            // The text still held back goes out with the finish reason, as vLLM's last chunk.
            let mut events = vec![chunk(s, &text, Some(finish))];
            if s.include_usage {
                events.push(data(
                    s.answer.usage_chunk(usage(prompt_tokens, completion_tokens)),
                ));
            }
            events.push(Event::default().data("[DONE]"));
            events
        }
        Some(Update::Failed(message)) => stream_failed(s, message),
        None => stream_failed(s, "the replica stopped before the answer ended".into()),
    }
}

/// The error event a stream ends with when its replica failed.
fn stream_failed(s: &mut Streaming, message: String) -> Vec<Event> {
    s.ended = true;
    s.service.metrics.outcome("failed");
    let error = ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "generation_failed",
        message,
    );
    vec![
        Event::default().data(error.body().to_string()),
        Event::default().data("[DONE]"),
    ]
}

async fn models(State(service): State<Arc<Service>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": service.name,
        "object": "model",
        "created": service.created,
        "owned_by": "archipelago",
        "max_model_len": service.ctx,
    }]}))
    .into_response()
}

async fn health(State(service): State<Arc<Service>>) -> Response {
    axum::Json(json!({"status": "ok", "replicas": service.replicas.replicas().len()})).into_response()
}

async fn metrics(State(service): State<Arc<Service>>, headers: HeaderMap) -> Response {
    let accept = (headers.get(header::ACCEPT))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let (text, content_type) = service.metrics.render(accept);
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

async fn not_found(request: Request) -> Response {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!(
            "no route {} {}: this server answers POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}

/// Seconds since the Unix epoch.
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
