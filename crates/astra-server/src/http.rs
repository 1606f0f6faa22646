//! The HTTP surface: routes, body limits, OpenAI response and stream shapes, and the
//! hand-off of each request to the scheduler's queue.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use astra_tokenizer::{ChatTemplate, EncodeOptions, Tokenizer};

use crate::api::{self, ApiError, CompletionRequest, Prompt};
use crate::generation::{FinishReason, GenParams, TokenLogprob};
use crate::metrics::{Metrics, Outcome};
use crate::scheduler::{Event, Job, Usage};

/// What the server knows once the model has loaded.
pub struct Ready {
    pub tok: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub queue: SyncSender<Job>,
    pub model_name: String,
    pub model_path: String,
    pub ctx: usize,
    pub n_vocab: usize,
    pub ctx_train: usize,
    pub slots: usize,
}

pub struct AppState {
    pub ready: OnceLock<Ready>,
    pub metrics: Arc<Metrics>,
    pub body_limit: usize,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    pub fn new(metrics: Arc<Metrics>, body_limit: usize) -> AppState {
        AppState { ready: OnceLock::new(), metrics, body_limit, next_id: AtomicU64::new(1), started: unix_now() }
    }
}

type Shared = Arc<AppState>;

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        (status, axum::Json(self.body())).into_response()
    }
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/props", get(props))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async { ApiError { status: 404, message: "no such endpoint".into(), kind: "not_found_error", param: None } })
        .method_not_allowed_fallback(|| async {
            ApiError { status: 405, message: "method not allowed on this endpoint".into(), kind: "invalid_request_error", param: None }
        })
        .with_state(state)
}

fn loading() -> ApiError {
    ApiError { status: 503, message: "the model is loading".into(), kind: "unavailable_error", param: None }
}

fn ready(state: &AppState) -> Result<&Ready, ApiError> {
    state.ready.get().ok_or_else(loading)
}

async fn health(State(state): State<Shared>) -> Response {
    match state.ready.get() {
        None => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "loading", "loaded": false}))).into_response(),
        Some(r) => {
            let busy = state.metrics.slots_busy.load(Ordering::Relaxed) as usize;
            axum::Json(json!({
                "status": "ready", "loaded": true, "slots_idle": r.slots.saturating_sub(busy), "slots_processing": busy,
                "queue_depth": state.metrics.queue_depth.load(Ordering::Relaxed),
            }))
            .into_response()
        }
    }
}

async fn models(State(state): State<Shared>) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": r.model_name, "object": "model", "created": state.started, "owned_by": "astra",
            "meta": {"n_vocab": r.n_vocab, "n_ctx_train": r.ctx_train, "n_ctx": r.ctx},
        }],
    }))
    .into_response())
}

async fn props(State(state): State<Shared>) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let text = |id: Option<u32>| id.and_then(|i| r.tok.token_text(i)).unwrap_or("").to_owned();
    Ok(axum::Json(json!({
        "model_path": r.model_path,
        "total_slots": r.slots,
        "default_generation_settings": {"n_ctx": r.ctx, "params": {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}},
        "bos_token": text(r.tok.bos()),
        "eos_token": text(r.tok.eos()),
        "chat_template_kind": format!("{:?}", r.template.kind()),
        "build_info": concat!("astra ", env!("CARGO_PKG_VERSION")),
    }))
    .into_response())
}

async fn metrics(State(state): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

async fn read_body(state: &AppState, body: Body) -> Result<Map<String, Value>, ApiError> {
    let bytes = axum::body::to_bytes(body, state.body_limit).await.map_err(|_| ApiError {
        status: 413,
        message: format!("the body is larger than {} bytes, or was cut off", state.body_limit),
        kind: "invalid_request_error",
        param: None,
    })?;
    api::parse_object(&bytes)
}

/// Counts a request's outcome once, when it ends; one dropped before deciding (its
/// client went away) counts as cancelled.
struct Tracker {
    metrics: Arc<Metrics>,
    start: Instant,
    outcome: Option<Outcome>,
}

impl Tracker {
    fn new(state: &AppState) -> Tracker {
        Tracker { metrics: Arc::clone(&state.metrics), start: Instant::now(), outcome: None }
    }

    fn fail(&mut self, e: ApiError) -> ApiError {
        self.outcome = Some(match e.status {
            429 => Outcome::Rejected,
            s if s >= 500 => Outcome::Error,
            _ => Outcome::Invalid,
        });
        e
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(Outcome::Cancelled);
        self.metrics.request(outcome);
        if matches!(outcome, Outcome::Ok | Outcome::Cancelled) {
            self.metrics.request_duration.observe(self.start.elapsed().as_secs_f64());
        }
    }
}

async fn tokenize(State(state): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let req = api::tokenize_request(&read_body(&state, body).await?)?;
    let ids = r.tok.encode(&req.content, EncodeOptions { add_special: req.add_special, parse_special: req.parse_special });
    let tokens: Vec<Value> = if req.with_pieces {
        ids.iter()
            .map(|&id| {
                let mut bytes = Vec::new();
                r.tok.token_bytes(id, true, &mut bytes);
                match String::from_utf8(bytes) {
                    Ok(s) => json!({"id": id, "piece": s}),
                    Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                }
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(axum::Json(json!({"tokens": tokens})).into_response())
}

async fn detokenize(State(state): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let ids = api::detokenize_request(&read_body(&state, body).await?, r.n_vocab)?;
    Ok(axum::Json(json!({"content": r.tok.decode(&ids, true)})).into_response())
}

async fn chat_completions(State(state): State<Shared>, body: Body) -> Response {
    complete(state, body, true).await
}

async fn completions(State(state): State<Shared>, body: Body) -> Response {
    complete(state, body, false).await
}

/// A request accepted into the queue: its jobs' events and what the response needs.
struct Accepted {
    events: UnboundedReceiver<Event>,
    req: CompletionRequest,
    chat: bool,
    id: String,
    model: String,
    created: u64,
    tok: Arc<Tokenizer>,
    tracker: Tracker,
}

async fn complete(state: Shared, body: Body, chat: bool) -> Response {
    let mut tracker = Tracker::new(&state);
    match accept(&state, body, chat).await {
        Err(e) => tracker.fail(e).into_response(),
        Ok((req, events)) => {
            let r = state.ready.get().expect("accepted only when ready");
            let n = state.next_id.fetch_add(1, Ordering::Relaxed);
            let a = Accepted {
                events,
                id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
                model: r.model_name.clone(),
                created: unix_now(),
                tok: Arc::clone(&r.tok),
                chat,
                tracker,
                req,
            };
            if a.req.stream {
                stream_response(a)
            } else {
                whole_response(a).await
            }
        }
    }
}

/// Validates, tokenizes and queues a completion request.
async fn accept(state: &AppState, body: Body, chat: bool) -> Result<(CompletionRequest, UnboundedReceiver<Event>), ApiError> {
    let r = ready(state)?;
    let body = read_body(state, body).await?;
    let req = api::completion_request(&body, chat, r.n_vocab)?;
    let prompt = match &req.prompt {
        Prompt::Chat(messages) => {
            let text = r
                .template
                .prompt(messages, r.tok.vocab().add_bos)
                .map_err(|e| ApiError::invalid("messages", format!("the chat template failed: {}", e.0)))?;
            r.tok.encode(&text, EncodeOptions::default())
        }
        Prompt::Text(text) => r.tok.encode(text, EncodeOptions::default()),
        Prompt::Tokens(ids) => ids.clone(),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if prompt.len() >= r.ctx {
        return Err(ApiError::invalid(
            if chat { "messages" } else { "prompt" },
            format!("the prompt is {} tokens; the context holds {} (prompt and completion together)", prompt.len(), r.ctx),
        ));
    }
    let room = r.ctx - prompt.len();
    let max_tokens = match req.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("max_tokens {m} and the prompt's {} tokens exceed the context of {}", prompt.len(), r.ctx),
            ))
        }
        Some(m) => m,
        None => room,
    };
    let (tx, rx) = unbounded_channel();
    for index in 0..req.n {
        let mut sampler = req.sampler.clone();
        sampler.seed = sampler.seed.wrapping_add(index as u64);
        let job = Job {
            prompt: prompt.clone(),
            params: GenParams { sampler, max_tokens, stop: req.stop.clone(), logprobs: req.logprobs },
            index,
            events: tx.clone(),
            received: Instant::now(),
        };
        // Counted before sending: the scheduler counts it out when it takes the job.
        state.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = r.queue.try_send(job) {
            state.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            return Err(match e {
                TrySendError::Full(_) => ApiError {
                    status: 429,
                    message: "the server is busy: every slot is taken and the queue is full; retry later".into(),
                    kind: "rate_limit_error",
                    param: None,
                },
                TrySendError::Disconnected(_) => ApiError { status: 503, message: "the server is shutting down".into(), kind: "unavailable_error", param: None },
            });
        }
    }
    Ok((req, rx))
}

fn token_piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let mut bytes = Vec::new();
    tok.token_bytes(id, true, &mut bytes);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// A token's entry in a chat response's `logprobs.content` (with llama-server's `id`).
fn chat_logprob(tok: &Tokenizer, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (text, bytes) = token_piece(tok, id);
        json!({"id": id, "token": text, "logprob": logprob, "bytes": bytes})
    };
    let mut v = entry(lp.id, lp.logprob);
    v["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
    v
}

fn usage_json(usage: &[Usage]) -> Value {
    let prompt = usage.first().map_or(0, |u| u.prompt_tokens);
    let cached = usage.first().map_or(0, |u| u.cached_tokens);
    let completion: usize = usage.iter().map(|u| u.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// llama-server's `timings` block, for the first choice.
fn timings_json(usage: &[Usage]) -> Value {
    let u = usage.first().cloned().unwrap_or_default();
    let prompt_n = u.prompt_tokens - u.cached_tokens;
    let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let rate = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    json!({
        "cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": u.prompt_ms,
        "prompt_per_token_ms": per(u.prompt_ms, prompt_n), "prompt_per_second": rate(u.prompt_ms, prompt_n),
        "predicted_n": u.completion_tokens, "predicted_ms": u.predicted_ms,
        "predicted_per_token_ms": per(u.predicted_ms, u.completion_tokens),
        "predicted_per_second": rate(u.predicted_ms, u.completion_tokens),
    })
}

/// One choice of a whole (non-streamed) response, as it accumulates.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
}

fn server_error(message: String) -> ApiError {
    ApiError { status: 500, message, kind: "server_error", param: None }
}

async fn whole_response(mut a: Accepted) -> Response {
    let mut choices: Vec<Choice> = (0..a.req.n).map(|_| Choice::default()).collect();
    let mut left = a.req.n;
    while left > 0 {
        match a.events.recv().await {
            Some(Event::Token { index, emitted }) => {
                let c = &mut choices[index];
                c.text.push_str(&emitted.text);
                c.logprobs.extend(emitted.logprob);
            }
            Some(Event::Done { index, finish, usage }) => {
                choices[index].finish = Some(finish);
                choices[index].usage = Some(usage);
                left -= 1;
            }
            Some(Event::Failed { message, .. }) => return a.tracker.fail(server_error(message)).into_response(),
            None => return a.tracker.fail(server_error("the scheduler stopped".into())).into_response(),
        }
    }
    let usage: Vec<Usage> = choices.iter_mut().filter_map(|c| c.usage.take()).collect();
    let tok = &a.tok;
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.map(FinishReason::as_str);
            if a.chat {
                let logprobs = a
                    .req
                    .logprobs
                    .map(|_| json!({"content": c.logprobs.iter().map(|l| chat_logprob(tok, l)).collect::<Vec<_>>()}));
                json!({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs, "finish_reason": finish})
            } else {
                let logprobs = a.req.logprobs.map(|_| completion_logprobs(tok, &c.logprobs));
                json!({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": finish})
            }
        })
        .collect();
    a.tracker.outcome = Some(Outcome::Ok);
    axum::Json(json!({
        "id": a.id, "object": if a.chat { "chat.completion" } else { "text_completion" }, "created": a.created,
        "model": a.model, "system_fingerprint": concat!("astra-", env!("CARGO_PKG_VERSION")), "choices": list,
        "usage": usage_json(&usage), "timings": timings_json(&usage),
    }))
    .into_response()
}

/// The legacy completions `logprobs` object.
fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let mut offset = 0;
    let mut offsets = Vec::new();
    let mut tokens = Vec::new();
    for l in lps {
        let (text, _) = token_piece(tok, l.id);
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
    }
    let top: Vec<Value> = lps
        .iter()
        .map(|l| Value::Object(l.top.iter().map(|&(id, lp)| (token_piece(tok, id).0, json!(lp))).collect()))
        .collect();
    json!({"tokens": tokens, "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(), "top_logprobs": top, "text_offset": offsets})
}

/// The state of a streamed response between events.
struct Streaming {
    a: Accepted,
    left: usize,
    /// Finished choices' usage, by choice index.
    usage: Vec<(usize, Usage)>,
    finished: bool,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl Streaming {
    fn chunk(&self, index: usize, delta: Value, logprobs: Option<Value>, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = if self.a.chat {
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": logprobs, "finish_reason": finish})
        };
        json!({
            "id": self.a.id, "object": if self.a.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.a.created, "model": self.a.model, "choices": [choice],
        })
    }

    /// The bytes for the next event, `None` at the end of the stream.
    async fn next(&mut self) -> Option<Bytes> {
        if self.finished {
            return None;
        }
        if self.left == 0 {
            self.finished = true;
            self.a.tracker.outcome = Some(Outcome::Ok);
            let mut out = String::new();
            if self.a.req.include_usage {
                self.usage.sort_by_key(|(i, _)| *i);
                let usage: Vec<Usage> = self.usage.iter().map(|(_, u)| u.clone()).collect();
                let last = json!({
                    "id": self.a.id, "object": if self.a.chat { "chat.completion.chunk" } else { "text_completion" },
                    "created": self.a.created, "model": self.a.model, "choices": [],
                    "usage": usage_json(&usage), "timings": timings_json(&usage),
                });
                out.push_str(&format!("data: {last}\n\n"));
            }
            out.push_str("data: [DONE]\n\n");
            return Some(Bytes::from(out));
        }
        loop {
            match self.a.events.recv().await {
                Some(Event::Token { index, emitted }) => {
                    let logprobs = match (&emitted.logprob, self.a.req.logprobs) {
                        (Some(l), Some(_)) if self.a.chat => Some(json!({"content": [chat_logprob(&self.a.tok, l)]})),
                        (Some(l), Some(_)) => Some(completion_logprobs(&self.a.tok, std::slice::from_ref(l))),
                        _ => None,
                    };
                    if emitted.text.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    return Some(sse(&self.chunk(index, json!({"content": emitted.text}), logprobs, None)));
                }
                Some(Event::Done { index, finish, usage }) => {
                    self.left -= 1;
                    self.usage.push((index, usage));
                    return Some(sse(&self.chunk(index, json!({}), None, Some(finish))));
                }
                Some(Event::Failed { message, .. }) => {
                    self.finished = true;
                    self.a.tracker.outcome = Some(Outcome::Error);
                    return Some(sse(&server_error(message).body()));
                }
                None => {
                    self.finished = true;
                    self.a.tracker.outcome = Some(Outcome::Error);
                    return Some(sse(&server_error("the scheduler stopped".into()).body()));
                }
            }
        }
    }
}

fn stream_response(a: Accepted) -> Response {
    let left = a.req.n;
    let s = Streaming { a, left, usage: Vec::new(), finished: false };
    // Each choice opens with the assistant's role (chat), as OpenAI's streams do.
    let opening: Vec<Bytes> = if s.a.chat {
        (0..left).map(|i| sse(&s.chunk(i, json!({"role": "assistant", "content": ""}), None, None))).collect()
    } else {
        Vec::new()
    };
    let first = futures_util::stream::iter(opening.into_iter().map(Ok::<_, Infallible>));
    let rest = futures_util::stream::unfold(s, |mut s| async move { s.next().await.map(|b| (Ok::<_, Infallible>(b), s)) });
    let body = Body::from_stream(futures_util::StreamExt::chain(first, rest));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("static headers")
}
