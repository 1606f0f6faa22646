//! The HTTP surface: routes, body limits, OpenAI response and stream shapes, and the
//! hand-off of each request to the scheduler's queue.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use sha2::Digest;

use astra_grammar::{Constraint, Grammars};
use astra_tokenizer::{ChatTemplate, EncodeOptions, Tokenizer};

use crate::api::{self, ApiError, CompletionRequest, Prompt};
use crate::generation::{FinishReason, GenParams, ThinkingParams, TokenLogprob, WRAP_UP};
use crate::keep_awake::{AwakeGuard, KeepAwake};
use crate::metrics::{Metrics, Outcome};
use crate::scheduler::{
    event_channel, Event, EventReceiver, Job, ModelStatus, PromptKey, Status, Usage,
};
use crate::tools::{self, Call, CallFormat, Tools};

mod anthropic;
mod responses;

/// What a text-only model does with image content parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImagePolicy {
    /// 400, naming the missing capability.
    Reject,
    /// Dropped, with a warning in the response.
    Omit,
}

/// The wrap-up injected when a thinking budget runs out, ending the thinking with `end`:
/// its text and tokens.
pub fn wrap_up(tok: &Tokenizer, end: &str) -> (String, Vec<u32>) {
    injected(tok, format!("\n{WRAP_UP}\n{end}\n\n"))
}

/// The end of the thinking injected when a model ends its turn inside it: its text and
/// tokens.
pub fn close_thinking(tok: &Tokenizer, end: &str) -> (String, Vec<u32>) {
    injected(tok, format!("\n{end}\n\n"))
}

/// `text`, to be fed as if generated, and its tokens (markers as special tokens).
fn injected(tok: &Tokenizer, text: String) -> (String, Vec<u32>) {
    let tokens = tok.encode(
        &text,
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    );
    (text, tokens)
}

/// What the server knows once the model has loaded.
pub struct Ready {
    pub tok: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// How the model writes tool calls.
    pub call_format: CallFormat,
    /// The grammar compiler over the vocabulary; `None` where it could not be built.
    pub grammars: Option<Arc<Grammars>>,
    pub queue: SyncSender<Job>,
    pub model_name: String,
    /// The model's file name (never its path: `/props` is readable by any client).
    pub model_file: String,
    pub ctx: usize,
    pub n_vocab: usize,
    pub ctx_train: usize,
    pub slots: usize,
    pub capabilities: Capabilities,
    pub think_markers: (String, String),
    /// The thinking wrap-up (sentence and end marker), as text and tokens.
    pub wrap_up: (String, Vec<u32>),
    /// The end of the thinking injected at an end of turn inside it: text and tokens.
    pub close_thinking: (String, Vec<u32>),
    pub answer_room: usize,
    pub images: ImagePolicy,
    /// New requests get 503 while available memory is below this (bytes).
    pub min_free_mem: Option<u64>,
}

/// What the loaded model and backend can do, as `/props` and the start-up line say.
#[derive(Clone, Debug)]
pub struct Capabilities {
    pub logit_bias: bool,
    pub images: bool,
    pub thinking: bool,
    pub tools: bool,
    pub structured_output: bool,
    pub backend: String,
}

impl Capabilities {
    pub fn line(&self) -> String {
        let b = |x: bool| u8::from(x);
        format!(
            "capabilities: logit_bias={} images={} thinking={} tools={} structured_output={} backend={}",
            b(self.logit_bias),
            b(self.images),
            b(self.thinking),
            b(self.tools),
            b(self.structured_output),
            self.backend
        )
    }

    fn has(&self, name: &str) -> bool {
        match name {
            "tools" => self.tools,
            "structured_output" => self.structured_output,
            "images" => self.images,
            _ => false,
        }
    }

    fn json(&self) -> Value {
        json!({"logit_bias": self.logit_bias, "images": self.images, "thinking": self.thinking, "tools": self.tools,
               "structured_output": self.structured_output, "backend": self.backend})
    }
}

fn missing_capability(name: &str, hint: &str) -> ApiError {
    ApiError {
        status: 400,
        message: format!("this model lacks the '{name}' capability ({name}=0 in /props){hint}"),
        kind: "invalid_request_error",
        param: Some(name.to_owned()),
    }
}

pub struct AppState {
    pub ready: OnceLock<Ready>,
    pub metrics: Arc<Metrics>,
    pub status: Arc<ModelStatus>,
    pub keep_awake: Arc<KeepAwake>,
    pub body_limit: usize,
    /// How long a request's body may take to arrive.
    pub body_timeout: std::time::Duration,
    /// SHA-256 of the API key, when one is required.
    pub api_key: Option<[u8; 32]>,
    pub access: Access,
    pub drain: Drain,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    pub fn new(
        metrics: Arc<Metrics>,
        keep_awake: Arc<KeepAwake>,
        body_limit: usize,
        body_timeout: std::time::Duration,
        api_key: Option<&str>,
        access: Access,
    ) -> AppState {
        AppState {
            ready: OnceLock::new(),
            metrics,
            status: Arc::new(ModelStatus::default()),
            keep_awake,
            body_limit,
            body_timeout,
            api_key: api_key.map(|k| sha2::Sha256::digest(k.as_bytes()).into()),
            access,
            drain: Drain::default(),
            next_id: AtomicU64::new(1),
            started: unix_now(),
        }
    }
}

/// The server's shutdown: while draining, new requests get 503 and in-flight ones run
/// on; at the end of the grace the ones still running are cut.
pub struct Drain {
    draining: std::sync::atomic::AtomicBool,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain {
            draining: std::sync::atomic::AtomicBool::new(false),
            cut: tokio::sync::watch::channel(false).0,
        }
    }
}

impl Drain {
    /// New requests are refused from now on.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Requests still running end now: streams with an error event and `[DONE]`,
    /// whole responses with a server error.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// While the server drains, every new request gets 503 and its connection is closed.
async fn refuse_while_draining(
    State(state): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !state.drain.draining() {
        return next.run(req).await;
    }
    let mut r = unavailable("the server is shutting down".into()).into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

type Shared = Arc<AppState>;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut response = (status, axum::Json(self.body())).into_response();
        if self.retry_shortly() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// Who may reach the server from a browser: the host names it answers to (against DNS
/// rebinding) and the origins whose pages may call it (CORS).
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// Bound to a loopback address: only loopback host names are answered, and those
    /// of `allowed_hosts`.
    pub loopback: bool,
    /// More host names answered (any, when bound elsewhere and this is empty).
    pub allowed_hosts: Vec<String>,
    /// Origins whose cross-origin requests are served (`*`: any); others get 403.
    pub cors_origins: Vec<String>,
}

impl Access {
    /// Whether a request with this `Host` header is answered.
    fn host_allowed(&self, host: Option<&str>) -> bool {
        let Some(host) = host else {
            // HTTP/1.0 without a Host: no browser sends such a request.
            return true;
        };
        let name = host_name(host);
        if self
            .allowed_hosts
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name))
        {
            return true;
        }
        let loopback_name = name.eq_ignore_ascii_case("localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if self.loopback {
            loopback_name
        } else {
            self.allowed_hosts.is_empty() || loopback_name
        }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.cors_origins.iter().any(|o| o == "*" || o == origin)
    }
}

/// The name part of a `Host` header: without its port, an IPv6 address unbracketed.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

fn forbidden(message: String) -> Response {
    let e = ApiError {
        status: 403,
        message,
        kind: "permission_error",
        param: None,
    };
    e.into_response()
}

/// The host check and CORS, before any other work: a request for a host name the server
/// does not answer to, or from a page of an origin not allowed, gets 403; allowed
/// origins get their preflights answered and their responses marked.
async fn check_access(
    State(state): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let access = &state.access;
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("(not text)"));
    if !access.host_allowed(host) {
        return forbidden(format!(
            "host {:?} is not served here (--allowed-hosts names more)",
            host.unwrap_or_default()
        ));
    }
    let Some(origin) = req.headers().get(header::ORIGIN).cloned() else {
        return next.run(req).await;
    };
    let origin_text = origin.to_str().unwrap_or_default();
    if !access.origin_allowed(origin_text) {
        return forbidden(format!(
            "requests from pages of {origin_text:?} are not allowed (--cors-origins names them)"
        ));
    }
    let preflight = req.method() == axum::http::Method::OPTIONS;
    let mut response = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            header::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        // The headers the page asks to send (client libraries add their own).
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(header::HeaderValue::from_static(
                "authorization, content-type",
            ));
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            header::HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(req).await
    };
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.append(header::VARY, header::HeaderValue::from_static("Origin"));
    response
}

/// Compares SHA-256 digests in constant time (the digest also hides the key's length).
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Requires `Authorization: Bearer KEY` on every route but `/health` when a key is set.
async fn require_key(
    State(state): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(want) = &state.api_key else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().split_once(' '))
        // The scheme is case-insensitive (RFC 9110).
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k);
    // Anthropic's clients send the key as `x-api-key`.
    let given = bearer
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(|k| sha2::Sha256::digest(k.trim().as_bytes()).into());
    match given {
        Some(d) if same_digest(&d, want) => next.run(req).await,
        _ => {
            let e = ApiError {
                status: 401,
                message:
                    "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"
                        .into(),
                kind: "invalid_request_error",
                param: None,
            };
            let mut body = e.body();
            body["error"]["code"] = json!("invalid_api_key");
            (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
        }
    }
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/models/{id}", get(model))
        .route("/props", get(props))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async {
            ApiError {
                status: 404,
                message: "no such endpoint".into(),
                kind: "not_found_error",
                param: None,
            }
        })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: 405,
                message: "method not allowed on this endpoint".into(),
                kind: "invalid_request_error",
                param: None,
            }
        })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_key,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            check_access,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            refuse_while_draining,
        ))
        .with_state(state)
}

fn loading() -> ApiError {
    ApiError {
        status: 503,
        message: "the model is loading".into(),
        kind: "unavailable_error",
        param: None,
    }
}

fn ready(state: &AppState) -> Result<&Ready, ApiError> {
    state.ready.get().ok_or_else(loading)
}

async fn health(State(state): State<Shared>) -> Response {
    match (state.ready.get(), state.status.get()) {
        (None, _) | (_, Status::Loading) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading", "loaded": false})),
        )
            .into_response(),
        (Some(_), Status::Idle) => {
            axum::Json(json!({"status": "idle", "loaded": false})).into_response()
        }
        (Some(r), Status::Ready) => {
            let busy = state.metrics.slots_busy.load(Ordering::Relaxed) as usize;
            axum::Json(json!({
                "status": "ready", "loaded": true, "slots_idle": r.slots.saturating_sub(busy), "slots_processing": busy,
                "queue_depth": state.metrics.queue_depth.load(Ordering::Relaxed),
            }))
            .into_response()
        }
    }
}

/// The served model as OpenAI's model object.
fn model_object(state: &AppState, r: &Ready) -> Value {
    json!({
        "id": r.model_name, "object": "model", "created": state.started, "owned_by": "astra",
        "meta": {"n_vocab": r.n_vocab, "n_ctx_train": r.ctx_train, "n_ctx": r.ctx},
    })
}

async fn models(State(state): State<Shared>) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    Ok(axum::Json(json!({"object": "list", "data": [model_object(&state, r)]})).into_response())
}

async fn model(
    State(state): State<Shared>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    if id != r.model_name {
        let e = ApiError {
            status: 404,
            message: format!(
                "the model {id:?} does not exist; this server serves {:?}",
                r.model_name
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
        };
        let mut body = e.body();
        body["error"]["code"] = json!("model_not_found");
        return Ok((StatusCode::NOT_FOUND, axum::Json(body)).into_response());
    }
    Ok(axum::Json(model_object(&state, r)).into_response())
}

async fn props(State(state): State<Shared>) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let text = |id: Option<u32>| {
        id.and_then(|i| r.tok.token_text(i))
            .unwrap_or("")
            .to_owned()
    };
    Ok(axum::Json(json!({
        "model_path": r.model_file,
        "total_slots": r.slots,
        "default_generation_settings": {"n_ctx": r.ctx, "params": {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}},
        "bos_token": text(r.tok.bos()),
        "eos_token": text(r.tok.eos()),
        "chat_template_kind": format!("{:?}", r.template.kind()),
        "capabilities": r.capabilities.json(),
        "think_markers": [r.think_markers.0, r.think_markers.1],
        "answer_room": r.answer_room,
        "build_info": concat!("astra ", env!("CARGO_PKG_VERSION")),
    }))
    .into_response())
}

async fn metrics(State(state): State<Shared>) -> Response {
    state
        .metrics
        .keep_awake_holders
        .store(state.keep_awake.holders() as u64, Ordering::Relaxed);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn read_body(state: &AppState, body: Body) -> Result<Map<String, Value>, ApiError> {
    let too_large = || ApiError {
        status: 413,
        message: format!(
            "the body is larger than {} bytes, or was cut off",
            state.body_limit
        ),
        kind: "invalid_request_error",
        param: None,
    };
    // A declared length over the limit is refused before any of the body is read.
    if body.size_hint().lower() > state.body_limit as u64 {
        return Err(too_large());
    }
    // A body dribbled in holds a connection: it must arrive within the timeout.
    let bytes = tokio::time::timeout(
        state.body_timeout,
        axum::body::to_bytes(body, state.body_limit),
    )
    .await
    .map_err(|_| ApiError {
        status: 408,
        message: format!("the body did not arrive within {:?}", state.body_timeout),
        kind: "invalid_request_error",
        param: None,
    })?
    .map_err(|_| too_large())?;
    api::parse_object(&bytes)
}

/// Counts a request's outcome once, when it ends; one dropped before deciding (its
/// client went away) counts as cancelled.
/// It also keeps the host awake while the request is in flight.
struct Tracker {
    metrics: Arc<Metrics>,
    start: Instant,
    outcome: Option<Outcome>,
    _awake: AwakeGuard,
}

impl Tracker {
    fn new(state: &AppState) -> Tracker {
        Tracker {
            metrics: Arc::clone(&state.metrics),
            start: Instant::now(),
            outcome: None,
            _awake: KeepAwake::acquire(&state.keep_awake),
        }
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
            self.metrics
                .request_duration
                .observe(self.start.elapsed().as_secs_f64());
        }
    }
}

async fn tokenize(State(state): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let req = api::tokenize_request(&read_body(&state, body).await?)?;
    let ids = r.tok.encode(
        &req.content,
        EncodeOptions {
            add_special: req.add_special,
            parse_special: req.parse_special,
        },
    );
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
    events: EventReceiver,
    /// Set when the shutdown grace runs out.
    cut: tokio::sync::watch::Receiver<bool>,
    req: CompletionRequest,
    chat: bool,
    id: String,
    model: String,
    created: u64,
    tok: Arc<Tokenizer>,
    /// How the model writes tool calls.
    format: CallFormat,
    tracker: Tracker,
    warnings: Vec<String>,
}

async fn complete(state: Shared, body: Body, chat: bool) -> Response {
    let mut tracker = Tracker::new(&state);
    let parsed = parse_body(&state, body, |b, r| {
        api::completion_request(b, chat, r.n_vocab)
    })
    .await;
    match parsed.and_then(|req| accept(&state, req, chat)) {
        Err(e) => tracker.fail(e).into_response(),
        Ok(q) => {
            let a = Accepted::new(
                &state,
                q,
                tracker,
                chat,
                if chat { "chatcmpl-" } else { "cmpl-" },
            );
            if a.req.stream {
                stream_response(a)
            } else {
                whole_response(a).await
            }
        }
    }
}

/// The body of a request read and parsed by `parse`, once a model is ready.
async fn parse_body<T>(
    state: &AppState,
    body: Body,
    parse: impl FnOnce(&Map<String, Value>, &Ready) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let r = ready(state)?;
    let body = read_body(state, body).await?;
    parse(&body, r)
}

impl Accepted {
    /// The response's side of a queued request; its id is `prefix` and a number.
    fn new(state: &AppState, q: Queued, tracker: Tracker, chat: bool, prefix: &str) -> Accepted {
        let r = state.ready.get().expect("accepted only when ready");
        let n = state.next_id.fetch_add(1, Ordering::Relaxed);
        Accepted {
            events: q.events,
            cut: state.drain.cut.subscribe(),
            id: format!("{prefix}{n}"),
            model: r.model_name.clone(),
            created: unix_now(),
            tok: Arc::clone(&r.tok),
            format: r.call_format,
            chat,
            tracker,
            req: q.req,
            warnings: q.warnings,
        }
    }
}

/// A request accepted into the queue, before the response starts.
struct Queued {
    req: CompletionRequest,
    events: EventReceiver,
    warnings: Vec<String>,
}

pub(crate) fn unavailable(message: String) -> ApiError {
    ApiError {
        status: 503,
        message,
        kind: "unavailable_error",
        param: None,
    }
}

/// The thinking of a request that thinks: its end marker, budget and wrap-up.
fn thinking_params(r: &Ready, req: &CompletionRequest) -> ThinkingParams {
    let end = r.think_markers.1.clone();
    let cap = req.max_tokens;
    let loggable = |c: usize| c <= 32768;
    let room = req.thinking.answer_room.unwrap_or(r.answer_room);
    // An end of turn inside the thinking closes it, unless no room is kept for answers.
    let close = (room > 0).then(|| r.close_thinking.clone());
    let (budget, log) = match (req.thinking.thinking_budget, cap) {
        (Some(b), cap) => (
            Some(b),
            cap.filter(|&c| loggable(c))
                .map(|c| format!("cap={c} answer_room=off thinking_budget={b} (requested)")),
        ),
        (None, Some(cap)) => {
            let budget = (room > 0).then(|| cap.saturating_sub(room));
            let shown = budget.map_or_else(|| "unlimited".to_owned(), |b| b.to_string());
            (
                budget,
                loggable(cap)
                    .then(|| format!("cap={cap} answer_room={room} thinking_budget={shown}")),
            )
        }
        (None, None) => (None, None),
    };
    ThinkingParams {
        end,
        budget,
        wrap_up: r.wrap_up.clone(),
        close,
        log,
    }
}

/// Validates, tokenizes and queues a completion request.
fn accept(state: &AppState, req: CompletionRequest, chat: bool) -> Result<Queued, ApiError> {
    let r = ready(state)?;
    if let Some(min) = r.min_free_mem {
        let available = state.metrics.available_memory.load(Ordering::Relaxed);
        if available < min {
            return Err(unavailable(format!(
                "available memory ({} MiB) is below --min-free-mem-mib ({} MiB); new requests are refused until memory frees up",
                available >> 20,
                min >> 20
            )));
        }
    }
    if let Some(need) = req.needs.iter().find(|n| !r.capabilities.has(n)) {
        return Err(missing_capability(need, ""));
    }
    let constraint = constraint_of(r, &req)?;
    let mut warnings = Vec::new();
    if !req.images.is_empty() && !r.capabilities.images {
        match r.images {
            ImagePolicy::Reject => {
                return Err(missing_capability(
                    "images",
                    "; send text only, or start the server with --images omit",
                ))
            }
            ImagePolicy::Omit => warnings.push(format!(
                "{} image part(s) omitted: this model lacks the 'images' capability",
                req.images.len()
            )),
        }
    }
    let media: Vec<[u8; 32]> = req.images.iter().map(|i| i.digest).collect();
    // Every prompt checked before any job is queued.
    let mut jobs = Vec::new();
    for prompt in req.prompt.each() {
        let (tokens, thinking) = encode_prompt(r, &req, prompt)?;
        let max_tokens = completion_room(r, &req, tokens.len(), chat)?;
        jobs.push((
            tokens,
            max_tokens,
            thinking.then(|| thinking_params(r, &req)),
        ));
    }
    let (tx, rx) = event_channel();
    for (p, (tokens, max_tokens, thinking)) in jobs.into_iter().enumerate() {
        for choice in 0..req.n {
            let index = p * req.n + choice;
            let mut sampler = req.sampler.clone();
            sampler.seed = sampler.seed.wrapping_add(index as u64);
            let job = Job {
                key: PromptKey {
                    tokens: tokens.clone(),
                    media: media.clone(),
                },
                params: GenParams {
                    sampler,
                    max_tokens,
                    stop: req.stop.clone(),
                    logprobs: req.logprobs,
                    thinking: thinking.clone(),
                    constraint: constraint.clone(),
                },
                index,
                events: tx.clone(),
                received: Instant::now(),
                keep_alive: req.keep_alive,
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
                    TrySendError::Disconnected(_) => unavailable("the server is shutting down".into()),
                });
            }
        }
    }
    Ok(Queued {
        req,
        events: rx,
        warnings,
    })
}

/// The grammar a request's answers follow: its output format, or the call format of a
/// required or named tool call. One that does not compile is a 400 naming the field.
fn constraint_of(r: &Ready, req: &CompletionRequest) -> Result<Option<Constraint>, ApiError> {
    let (param, spec) = match (&req.output, &req.tools) {
        (Some((param, spec)), _) => (*param, spec.clone()),
        (None, Some(t)) if t.forced() => ("tools", tools::forced_grammar(t, r.call_format, &r.tok)),
        _ => return Ok(None),
    };
    let grammars = r
        .grammars
        .as_ref()
        .ok_or_else(|| missing_capability("structured_output", ""))?;
    grammars
        .compile(&spec)
        .map(Some)
        .map_err(|e| ApiError::invalid(param, format!("'{param}' cannot be enforced: {e}")))
}

/// One prompt of a request as tokens (the chat template applied, the thinking opened
/// where asked), and whether the generation starts inside the thinking.
fn encode_prompt(
    r: &Ready,
    req: &CompletionRequest,
    prompt: &Prompt,
) -> Result<(Vec<u32>, bool), ApiError> {
    let start = r.think_markers.0.as_str();
    let (tokens, thinking) = match prompt {
        Prompt::Tokens(ids) => {
            let mut ids = ids.clone();
            if req.thinking.think {
                ids.extend(r.tok.encode(
                    start,
                    EncodeOptions {
                        add_special: false,
                        parse_special: true,
                    },
                ));
            }
            (ids, req.thinking.think)
        }
        Prompt::Chat(_) | Prompt::Text(_) => {
            let mut text = match prompt {
                Prompt::Chat(messages) => {
                    let messages =
                        tools::prepare_messages(messages, req.tools.as_ref(), r.call_format);
                    let list = req
                        .tools
                        .as_ref()
                        .filter(|t| t.active() && r.call_format.in_template())
                        .map(Tools::openai_list);
                    r.template
                        .prompt_with_tools(&messages, list.as_ref(), r.tok.vocab().add_bos)
                        .map_err(|e| {
                            ApiError::invalid(
                                "messages",
                                format!("the chat template failed: {}", e.0),
                            )
                        })?
                }
                Prompt::Text(t) => t.clone(),
                _ => unreachable!("matched above"),
            };
            if req.thinking.think && !text.trim_end().ends_with(start) {
                text.push_str(start);
            }
            let thinking = text.trim_end().ends_with(start);
            (r.tok.encode(&text, EncodeOptions::default()), thinking)
        }
        Prompt::Many(_) => unreachable!("a request's prompts are taken one by one"),
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    Ok((tokens, thinking))
}

/// The most tokens a completion of a `prompt_len`-token prompt may have: `max_tokens`,
/// or the rest of the context; an error where they do not fit.
fn completion_room(
    r: &Ready,
    req: &CompletionRequest,
    prompt_len: usize,
    chat: bool,
) -> Result<usize, ApiError> {
    if prompt_len >= r.ctx {
        return Err(ApiError::invalid(
            if chat { "messages" } else { "prompt" },
            format!("the prompt is {prompt_len} tokens; the context holds {} (prompt and completion together)", r.ctx),
        ));
    }
    let room = r.ctx - prompt_len;
    match req.max_tokens {
        Some(m) if m > room => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "max_tokens {m} and the prompt's {prompt_len} tokens exceed the context of {}",
                r.ctx
            ),
        )),
        Some(m) => Ok(m),
        None => Ok(room),
    }
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

/// The usage of a response whose choices' usage is `usage` (in choice order), `n`
/// choices per prompt: each prompt's tokens counted once.
fn usage_json(usage: &[Usage], n: usize) -> Value {
    let prompt: usize = usage
        .iter()
        .step_by(n.max(1))
        .map(|u| u.prompt_tokens)
        .sum();
    let cached: usize = usage
        .iter()
        .step_by(n.max(1))
        .map(|u| u.cached_tokens)
        .sum();
    let completion: usize = usage.iter().map(|u| u.completion_tokens).sum();
    let reasoning: usize = usage.iter().map(|u| u.reasoning_tokens).sum();
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
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
    reasoning: String,
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    /// The stop string that ended it, if one did.
    stop_string: Option<String>,
    usage: Option<Usage>,
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: 500,
        message,
        kind: "server_error",
        param: None,
    }
}

/// A call in OpenAI's shape.
fn call_json(id: &str, call: &Call) -> Value {
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
}

impl Accepted {
    /// The tool calls an answer makes, with the text around them, when the request
    /// offered tools.
    fn calls(&self, text: &str) -> Option<(String, Vec<Call>)> {
        let t = self.req.tools.as_ref().filter(|t| t.active())?;
        tools::parse_calls(text, self.format, t)
    }

    /// The id of choice `choice`'s call `k`.
    fn call_id(&self, choice: usize, k: usize) -> String {
        format!(
            "call_{}_{choice}_{k}",
            self.id.trim_start_matches("chatcmpl-")
        )
    }

    /// The scheduler's next event for this request, or a failure when the shutdown
    /// grace runs out first.
    async fn next_event(&mut self) -> Option<Event> {
        if *self.cut.borrow() {
            return Some(cut_event());
        }
        tokio::select! {
            e = self.events.recv() => e,
            _ = self.cut.wait_for(|cut| *cut) => Some(cut_event()),
        }
    }
}

fn cut_event() -> Event {
    Event::Failed {
        index: 0,
        message: "the server shut down before the request finished".into(),
    }
}

impl Accepted {
    /// Every choice, whole; the first failure fails them all.
    async fn collect(&mut self) -> Result<Vec<Choice>, ApiError> {
        let mut choices: Vec<Choice> = (0..self.req.choices()).map(|_| Choice::default()).collect();
        let mut left = choices.len();
        while left > 0 {
            match self.next_event().await {
                Some(Event::Token { index, emitted }) => {
                    let c = &mut choices[index];
                    c.reasoning.push_str(&emitted.reasoning);
                    c.text.push_str(&emitted.content);
                    c.logprobs.extend(emitted.logprob);
                    c.stop_string = emitted.stop_string.or(c.stop_string.take());
                }
                Some(Event::Done {
                    index,
                    finish,
                    usage,
                }) => {
                    choices[index].finish = Some(finish);
                    choices[index].usage = Some(usage);
                    left -= 1;
                }
                Some(Event::Failed { message, .. }) => {
                    return Err(self.tracker.fail(server_error(message)))
                }
                None => {
                    return Err(self
                        .tracker
                        .fail(server_error("the scheduler stopped".into())))
                }
            }
        }
        self.tracker.outcome = Some(Outcome::Ok);
        Ok(choices)
    }
}

async fn whole_response(mut a: Accepted) -> Response {
    let mut choices = match a.collect().await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
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
                let mut message = json!({"role": "assistant", "content": c.text});
                let mut finish = json!(finish);
                if let Some((rest, calls)) = a.calls(&c.text) {
                    message["content"] = if rest.is_empty() { Value::Null } else { json!(rest) };
                    message["tool_calls"] = calls
                        .iter()
                        .enumerate()
                        .map(|(k, call)| call_json(&a.call_id(i, k), call))
                        .collect();
                    finish = json!("tool_calls");
                }
                if !c.reasoning.is_empty() {
                    message["reasoning_content"] = json!(c.reasoning);
                }
                json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            } else {
                let logprobs = a.req.logprobs.map(|_| completion_logprobs(tok, &c.logprobs));
                json!({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": finish})
            }
        })
        .collect();
    let mut body = json!({
        "id": a.id, "object": if a.chat { "chat.completion" } else { "text_completion" }, "created": a.created,
        "model": a.model, "system_fingerprint": concat!("astra-", env!("CARGO_PKG_VERSION")), "choices": list,
        "usage": usage_json(&usage, a.req.n), "timings": timings_json(&usage),
    });
    if !a.warnings.is_empty() {
        body["warnings"] = json!(a.warnings);
    }
    axum::Json(body).into_response()
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
        .map(|l| {
            Value::Object(
                l.top
                    .iter()
                    .map(|&(id, lp)| (token_piece(tok, id).0, json!(lp)))
                    .collect(),
            )
        })
        .collect();
    json!({"tokens": tokens, "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(), "top_logprobs": top, "text_offset": offsets})
}

/// The state of a streamed response between events.
struct Streaming {
    a: Accepted,
    left: usize,
    /// Finished choices' usage, by choice index.
    usage: Vec<(usize, Usage)>,
    /// Per choice, when the request offered tools: answer text held back while it may
    /// be a call.
    splits: Vec<Split>,
    finished: bool,
}

/// A streamed answer of a request with tools, as far as it is known to be text or a
/// call.
#[derive(Clone, Debug, PartialEq)]
enum Split {
    /// Nothing but blank space yet, or a prefix of a call's opening.
    Undecided(String),
    /// Text: streamed as it comes.
    Text,
    /// A call (or a forced answer): held until the choice ends, then parsed.
    Call(String),
}

impl Split {
    /// Where a request's streamed answer starts: a call when one is forced, undecided
    /// when tools are offered, else text.
    fn of(a: &Accepted) -> Split {
        match a.req.tools.as_ref().filter(|t| a.chat && t.active()) {
            Some(t) if t.forced() => Split::Call(String::new()),
            Some(_) => Split::Undecided(String::new()),
            None => Split::Text,
        }
    }

    /// Takes the next piece of the answer; returns the text to stream now.
    fn push(&mut self, piece: &str, format: CallFormat) -> String {
        match self {
            Split::Text => piece.to_owned(),
            Split::Call(held) => {
                held.push_str(piece);
                String::new()
            }
            Split::Undecided(held) => {
                held.push_str(piece);
                let t = held.trim_start();
                let openings = format.openings();
                if t.is_empty() || openings.iter().any(|o| o.starts_with(t)) {
                    String::new()
                } else if openings.iter().any(|o| t.starts_with(o)) {
                    *self = Split::Call(std::mem::take(held));
                    String::new()
                } else {
                    let out = std::mem::take(held);
                    *self = Split::Text;
                    out
                }
            }
        }
    }

    /// The text held back at the end of the answer.
    fn take(&mut self) -> String {
        match std::mem::replace(self, Split::Text) {
            Split::Undecided(held) | Split::Call(held) => held,
            Split::Text => String::new(),
        }
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl EventSource for Streaming {
    async fn next(&mut self) -> Option<Bytes> {
        self.next_events().await
    }
}

impl Streaming {
    fn chunk(
        &self,
        index: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
    ) -> Value {
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
    async fn next_events(&mut self) -> Option<Bytes> {
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
                let mut last = json!({
                    "id": self.a.id, "object": if self.a.chat { "chat.completion.chunk" } else { "text_completion" },
                    "created": self.a.created, "model": self.a.model, "choices": [],
                    "usage": usage_json(&usage, self.a.req.n), "timings": timings_json(&usage),
                });
                if !self.a.warnings.is_empty() {
                    last["warnings"] = json!(self.a.warnings);
                }
                out.push_str(&format!("data: {last}\n\n"));
            }
            out.push_str("data: [DONE]\n\n");
            return Some(Bytes::from(out));
        }
        loop {
            match self.a.next_event().await {
                Some(Event::Token { index, emitted }) => {
                    let logprobs = match (&emitted.logprob, self.a.req.logprobs) {
                        (Some(l), Some(_)) if self.a.chat => {
                            Some(json!({"content": [chat_logprob(&self.a.tok, l)]}))
                        }
                        (Some(l), Some(_)) => {
                            Some(completion_logprobs(&self.a.tok, std::slice::from_ref(l)))
                        }
                        _ => None,
                    };
                    let content = match self.splits.get_mut(index) {
                        Some(split) => split.push(&emitted.content, self.a.format),
                        None => emitted.content,
                    };
                    if content.is_empty() && emitted.reasoning.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    let mut delta = json!({});
                    if !emitted.reasoning.is_empty() {
                        delta["reasoning_content"] = json!(emitted.reasoning);
                    }
                    if !content.is_empty() || emitted.reasoning.is_empty() {
                        delta["content"] = json!(content);
                    }
                    return Some(sse(&self.chunk(index, delta, logprobs, None)));
                }
                Some(Event::Done {
                    index,
                    finish,
                    usage,
                }) => {
                    self.left -= 1;
                    self.usage.push((index, usage));
                    let held = self
                        .splits
                        .get_mut(index)
                        .map(Split::take)
                        .unwrap_or_default();
                    let mut out = Vec::new();
                    let mut finish = json!(finish.as_str());
                    match self.a.calls(&held) {
                        Some((rest, calls)) => {
                            if !rest.is_empty() {
                                out.extend_from_slice(&sse(&self.chunk(
                                    index,
                                    json!({"content": rest}),
                                    None,
                                    None,
                                )));
                            }
                            // Each call opens with its id and name, then its arguments.
                            for (k, call) in calls.iter().enumerate() {
                                let open = json!({"tool_calls": [{"index": k, "id": self.a.call_id(index, k), "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]});
                                let args = json!({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]});
                                out.extend_from_slice(&sse(&self.chunk(index, open, None, None)));
                                out.extend_from_slice(&sse(&self.chunk(index, args, None, None)));
                            }
                            finish = json!("tool_calls");
                        }
                        None if !held.is_empty() => {
                            out.extend_from_slice(&sse(&self.chunk(
                                index,
                                json!({"content": held}),
                                None,
                                None,
                            )));
                        }
                        None => {}
                    }
                    let mut last = self.chunk(index, json!({}), None, None);
                    last["choices"][0]["finish_reason"] = finish;
                    out.extend_from_slice(&sse(&last));
                    return Some(Bytes::from(out));
                }
                Some(Event::Failed { message, .. }) => {
                    self.finished = true;
                    self.a.tracker.outcome = Some(Outcome::Error);
                    let mut out = sse(&server_error(message).body()).to_vec();
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    return Some(Bytes::from(out));
                }
                None => {
                    self.finished = true;
                    self.a.tracker.outcome = Some(Outcome::Error);
                    let mut out =
                        sse(&server_error("the scheduler stopped".into()).body()).to_vec();
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    return Some(Bytes::from(out));
                }
            }
        }
    }
}

fn stream_response(a: Accepted) -> Response {
    let left = a.req.choices();
    let split = Split::of(&a);
    let splits = if split == Split::Text {
        Vec::new()
    } else {
        vec![split; left]
    };
    let s = Streaming {
        a,
        left,
        usage: Vec::new(),
        splits,
        finished: false,
    };
    // Each choice opens with the assistant's role (chat), as OpenAI's streams do.
    let opening: Vec<Bytes> = if s.a.chat {
        (0..left)
            .map(|i| sse(&s.chunk(i, json!({"role": "assistant", "content": ""}), None, None)))
            .collect()
    } else {
        Vec::new()
    };
    event_stream(opening, s)
}

/// A response's events as they are made, after `opening`.
trait EventSource: Send + 'static {
    /// The bytes of the next events; `None` at the end of the stream.
    fn next(&mut self) -> impl std::future::Future<Output = Option<Bytes>> + Send;
}

/// An event-stream response: `opening`, then what `source` makes.
fn event_stream(opening: Vec<Bytes>, source: impl EventSource) -> Response {
    let first = futures_util::stream::iter(opening.into_iter().map(Ok::<_, Infallible>));
    let rest = futures_util::stream::unfold(source, |mut s| async move {
        s.next().await.map(|b| (Ok::<_, Infallible>(b), s))
    });
    let body = Body::from_stream(futures_util::StreamExt::chain(first, rest));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("static headers")
}

/// How a one-choice answer streams in another API's shape (Anthropic's Messages,
/// Responses): [`AnswerStream`] runs the scheduler's events through it.
trait AnswerShape: Send + 'static {
    /// The events before the first token.
    fn start(&mut self, a: &Accepted, out: &mut Vec<u8>);
    fn reasoning(&mut self, a: &Accepted, text: &str, out: &mut Vec<u8>);
    fn text(&mut self, a: &Accepted, text: &str, out: &mut Vec<u8>);
    /// The end: text held back while it could be a call, and the calls parsed from it.
    fn done(&mut self, a: &Accepted, end: AnswerEnd, out: &mut Vec<u8>);
    fn fail(&mut self, a: &Accepted, message: String, out: &mut Vec<u8>);
}

/// How a streamed answer ended.
struct AnswerEnd {
    held: String,
    calls: Option<(String, Vec<Call>)>,
    finish: FinishReason,
    usage: Usage,
    stop_string: Option<String>,
}

/// A one-choice answer streamed through an [`AnswerShape`].
struct AnswerStream<S> {
    a: Accepted,
    shape: S,
    split: Split,
    stop_string: Option<String>,
    started: bool,
    finished: bool,
}

fn answer_stream(a: Accepted, shape: impl AnswerShape) -> Response {
    let split = Split::of(&a);
    event_stream(
        Vec::new(),
        AnswerStream {
            a,
            shape,
            split,
            stop_string: None,
            started: false,
            finished: false,
        },
    )
}

impl<S: AnswerShape> EventSource for AnswerStream<S> {
    async fn next(&mut self) -> Option<Bytes> {
        if self.finished {
            return None;
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            self.shape.start(&self.a, &mut out);
            return Some(Bytes::from(out));
        }
        loop {
            match self.a.next_event().await {
                Some(Event::Token { emitted, .. }) => {
                    if !emitted.reasoning.is_empty() {
                        self.shape.reasoning(&self.a, &emitted.reasoning, &mut out);
                    }
                    let text = self.split.push(&emitted.content, self.a.format);
                    if !text.is_empty() {
                        self.shape.text(&self.a, &text, &mut out);
                    }
                    self.stop_string = emitted.stop_string.or(self.stop_string.take());
                    if !out.is_empty() {
                        return Some(Bytes::from(out));
                    }
                }
                Some(Event::Done { finish, usage, .. }) => {
                    self.finished = true;
                    let held = self.split.take();
                    let end = AnswerEnd {
                        calls: self.a.calls(&held),
                        held,
                        finish,
                        usage,
                        stop_string: self.stop_string.take(),
                    };
                    self.shape.done(&self.a, end, &mut out);
                    self.a.tracker.outcome = Some(Outcome::Ok);
                    return Some(Bytes::from(out));
                }
                failed => {
                    let message = match failed {
                        Some(Event::Failed { message, .. }) => message,
                        _ => "the scheduler stopped".into(),
                    };
                    self.finished = true;
                    self.a.tracker.outcome = Some(Outcome::Error);
                    self.shape.fail(&self.a, message, &mut out);
                    return Some(Bytes::from(out));
                }
            }
        }
    }
}

/// Copies `body`'s fields `(from, to)` that are present into `out` under their new names.
fn copy_fields(body: &Map<String, Value>, out: &mut Map<String, Value>, names: &[(&str, &str)]) {
    for (from, to) in names {
        if let Some(v) = body.get(*from).filter(|v| !v.is_null()) {
            out.insert((*to).into(), v.clone());
        }
    }
}

/// A tool given flat (`{"name", "description", <schema_key>}`, as the Anthropic and
/// Responses APIs do) in Chat Completions' nested shape.
fn nested_tool(t: &Value, schema_key: &str) -> Value {
    let mut f = json!({"name": t.get("name"), "parameters": t.get(schema_key)});
    if let Some(d) = t.get("description") {
        f["description"] = d.clone();
    }
    json!({"type": "function", "function": f})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_and_unavailable_say_when_to_retry() {
        for (status, retry) in [(429, true), (503, true), (400, false), (404, false)] {
            let e = ApiError {
                status,
                message: "x".into(),
                kind: "invalid_request_error",
                param: None,
            };
            let r = e.into_response();
            assert_eq!(
                r.headers().get(header::RETRY_AFTER).is_some(),
                retry,
                "{status}"
            );
        }
    }

    #[test]
    fn host_names_are_checked_without_their_ports() {
        assert_eq!(host_name("localhost:8080"), "localhost");
        assert_eq!(host_name("[::1]:80"), "::1");
        assert_eq!(host_name("example.org"), "example.org");
        let local = Access {
            loopback: true,
            allowed_hosts: vec!["box.lan".into()],
            cors_origins: vec![],
        };
        for (host, ok) in [
            ("127.0.0.1:1", true),
            ("127.8.9.1", true),
            ("LOCALHOST", true),
            ("[::1]:9", true),
            ("box.lan:80", true),
            ("localhost.evil.example", false),
            ("10.0.0.2", false),
        ] {
            assert_eq!(local.host_allowed(Some(host)), ok, "{host}");
        }
        let open = Access::default();
        assert!(open.host_allowed(Some("anything.example")));
        let listed = Access {
            allowed_hosts: vec!["api.example".into()],
            ..Access::default()
        };
        assert!(!listed.host_allowed(Some("other.example")));
        assert!(listed.host_allowed(Some("api.example:443")));
    }
}
