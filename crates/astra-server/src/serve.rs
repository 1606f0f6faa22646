//! Starting and stopping the server: the port opens first, the model loads behind it,
//! and a signal stops new connections while in-flight requests finish (within a bound).

use std::path::PathBuf;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use astra_engine::attention::KvLayout;
use astra_engine::{Backend, Config, KvType, Model, MAX_BATCH};
use astra_grammar::Grammars;
use astra_tokenizer::chat::TemplateKind;
use astra_tokenizer::{ChatTemplate, Tokenizer};

use crate::connection::{accept_loop, ConnectionLimits, MAX_CONNECTIONS};
use crate::http::{router, Access, AppState, Capabilities, ImagePolicy, Ready};
use crate::keep_awake::KeepAwake;
use crate::metrics::Metrics;
use crate::scheduler::{Limits, Loader, ModelStatus, Scheduler};
use crate::tools::CallFormat;

#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub model: PathBuf,
    /// The name `/v1/models` reports.
    pub model_name: String,
    pub host: String,
    pub port: u16,
    /// Sequences decoded together.
    pub parallel: usize,
    /// Positions per sequence (prompt and completion).
    pub ctx: usize,
    /// Memory for the sequences' KV caches, active and idle (the prompt cache), MiB.
    pub arena_mib: usize,
    pub threads: usize,
    /// Requests that may wait for a slot; more get 429.
    pub queue: usize,
    /// Largest request body, bytes.
    pub body_limit: usize,
    /// How long in-flight requests may run after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Thinking markers; `None`: from the chat template, else `<think>`/`</think>`.
    pub think_markers: Option<(String, String)>,
    /// A chat template (Jinja source) in place of the model's own.
    pub chat_template: Option<String>,
    /// Tokens of a thinking request's cap reserved for its answer, by default.
    pub answer_room: usize,
    pub images: ImagePolicy,
    /// Refuse new requests while available memory is below this many MiB.
    pub min_free_mem_mib: Option<u64>,
    /// Unload the model after this long without requests; `None`: never.
    pub keep_alive: Option<Duration>,
    /// Require `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// How long a request whose client stopped reading waits before it is cancelled (and
    /// a connection's stalled write before the connection is closed).
    pub stall_timeout: Duration,
    /// Open connections at most; more get 503.
    pub max_connections: usize,
    /// How long a request's head may take to arrive (and a keep-alive connection may
    /// stay idle).
    pub header_timeout: Duration,
    /// How long a request's body may take to arrive (408 after).
    pub body_timeout: Duration,
    /// What the backend's KV caches store (for the arena check before the port opens).
    pub kv_type: KvType,
    /// Host names answered besides loopback ones (bound to loopback), or instead of any
    /// (bound elsewhere).
    pub allowed_hosts: Vec<String>,
    /// Origins whose pages may call the server (`*`: any).
    pub cors_origins: Vec<String>,
}

/// Thinking markers known from chat templates, checked in order.
const KNOWN_THINK_MARKERS: [(&str, &str); 2] = [
    ("<think>", "</think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
];

/// The thinking markers: given, else the first known pair the template uses, else
/// `<think>`/`</think>`.
fn think_markers(opts: &ServeOptions, template_source: Option<&str>) -> (String, String) {
    if let Some(m) = &opts.think_markers {
        return m.clone();
    }
    let found = template_source.and_then(|t| {
        KNOWN_THINK_MARKERS
            .iter()
            .find(|(a, b)| t.contains(a) && t.contains(b))
    });
    let (a, b) = found.copied().unwrap_or(KNOWN_THINK_MARKERS[0]);
    (a.to_owned(), b.to_owned())
}

/// Makes the backend a model is loaded onto (again after an idle unload).
pub type BackendFactory<B> = Arc<dyn Fn() -> Result<B, String> + Send + Sync>;

/// Loads the model and starts the scheduler; returns what the HTTP side needs.
fn load<B: Backend>(
    opts: &ServeOptions,
    backend: BackendFactory<B>,
    metrics: Arc<Metrics>,
    status: Arc<ModelStatus>,
) -> Result<(Ready, Scheduler<B>), String> {
    let path = opts.model.clone();
    let loader: Loader<B> =
        Box::new(move || Model::load_on(backend()?, &path).map_err(|e| e.to_string()));
    let model = loader()?;
    let tok = Arc::new(Tokenizer::from_metadata(model.file.metadata()).map_err(|e| e.to_string())?);
    let template = match &opts.chat_template {
        Some(source) => {
            let text =
                |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
            ChatTemplate::new(
                source,
                TemplateKind::FromFile,
                &text(tok.bos()),
                &text(tok.eos()),
            )
        }
        None => ChatTemplate::for_model(model.file.metadata(), &tok),
    }
    .map_err(|e| e.0)?;
    let ctx = opts.ctx.min(model.cfg.ctx_train.max(1));
    let per_sequence = model.session(ctx).map_err(|e| e.to_string())?.kv_bytes();
    let budget = opts.arena_mib.saturating_mul(1 << 20);
    let sequences = match model.backend.kv_usage() {
        Some(_) => 1,
        None => opts.parallel,
    };
    check_arena(opts, sequences, ctx, per_sequence)?;
    let (queue, jobs) = sync_channel(opts.queue);
    let grammars = match Grammars::new(&tok) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            eprintln!("astra: WARN no structured output or tool calls: {e}");
            None
        }
    };
    let capabilities = Capabilities {
        logit_bias: true,
        images: false,
        thinking: true,
        tools: grammars.is_some(),
        structured_output: grammars.is_some(),
        backend: model.backend.name().to_owned(),
    };
    eprintln!("astra: INFO {}", capabilities.line());
    let think_markers = think_markers(opts, Some(template.source()));
    let ready = Ready {
        tok: Arc::clone(&tok),
        call_format: CallFormat::of(&template),
        template,
        grammars,
        queue,
        model_name: opts.model_name.clone(),
        model_file: opts
            .model
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        ctx,
        n_vocab: model.cfg.n_vocab,
        ctx_train: model.cfg.ctx_train,
        slots: opts.parallel,
        capabilities,
        wrap_up: crate::http::wrap_up(&tok, &think_markers.1),
        close_thinking: crate::http::close_thinking(&tok, &think_markers.1),
        think_markers,
        answer_room: opts.answer_room,
        images: opts.images,
        min_free_mem: opts.min_free_mem_mib.map(|m| m << 20),
    };
    let limits = Limits {
        parallel: opts.parallel,
        ctx,
        budget,
        keep_alive: opts.keep_alive,
        stall_timeout: opts.stall_timeout,
    };
    let scheduler = Scheduler::new(model, loader, status, tok, jobs, metrics, limits);
    Ok((ready, scheduler))
}

/// That `sequences` sequences of `ctx` positions, `per_sequence` bytes of KV cache each,
/// fit in `--arena-mib`; the error says what would. A backend that pages its caches
/// needs room for one (a request holds only the pages its tokens use, and others
/// pause while it runs); one that does not, for `--parallel`.
fn check_arena(
    opts: &ServeOptions,
    sequences: usize,
    ctx: usize,
    per_sequence: usize,
) -> Result<(), String> {
    let budget = opts.arena_mib.saturating_mul(1 << 20);
    let need = sequences.saturating_mul(per_sequence);
    if need <= budget {
        return Ok(());
    }
    let need_mib = need.div_ceil(1 << 20);
    let lower = match sequences {
        1 => "lower --ctx",
        _ => "lower --parallel or --ctx",
    };
    Err(format!(
        "{sequences} sequence(s) of {ctx} positions need {need_mib} MiB of KV cache; \
         --arena-mib {} holds {} ({lower}, or raise --arena-mib to {need_mib})",
        opts.arena_mib,
        budget / per_sequence.max(1),
    ))
}

/// [`check_arena`] from the file's header alone, before the port opens.
fn check_arena_early(opts: &ServeOptions) -> Result<(), String> {
    let file = astra_gguf::GgufFile::open(&opts.model)
        .map_err(|e| format!("reading {}: {e}", opts.model.display()))?;
    let cfg = Config::from_metadata(file.metadata()).map_err(|e| e.to_string())?;
    let ctx = opts.ctx.min(cfg.ctx_train.max(1));
    let per_sequence = KvLayout::new(&cfg, ctx, MAX_BATCH).of(opts.kv_type).bytes();
    check_arena(opts, 1, ctx, per_sequence)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Runs the server until a shutdown signal (SIGTERM, Ctrl-C) and the end of in-flight
/// requests, the model on backends made by `backend`. Prints `astra: listening on
/// http://ADDR` once the port is open.
pub fn serve_on<B: Backend>(opts: ServeOptions, backend: BackendFactory<B>) -> Result<(), String> {
    if opts.parallel == 0 || opts.queue == 0 {
        return Err("--parallel and --queue must be at least 1".into());
    }
    if !(1..=MAX_CONNECTIONS).contains(&opts.max_connections) {
        return Err(format!(
            "--max-connections must be between 1 and {MAX_CONNECTIONS}"
        ));
    }
    if opts.header_timeout.is_zero() || opts.body_timeout.is_zero() || opts.stall_timeout.is_zero()
    {
        return Err(
            "--header-timeout, --body-timeout and --stall-timeout must be at least 1 second".into(),
        );
    }
    check_arena_early(&opts)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
            .await
            .map_err(|e| format!("binding {}:{}: {e}", opts.host, opts.port))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("astra: listening on http://{addr}");
        let metrics = Arc::new(Metrics::default());
        crate::telemetry::start(Arc::clone(&metrics));
        let keep_awake = Arc::new(KeepAwake::for_host());
        let state = Arc::new(AppState::new(
            Arc::clone(&metrics),
            keep_awake,
            opts.body_limit,
            opts.body_timeout,
            opts.api_key.as_deref(),
            Access {
                loopback: addr.ip().is_loopback(),
                allowed_hosts: opts.allowed_hosts.clone(),
                cors_origins: opts.cors_origins.clone(),
            },
        ));
        let status = Arc::clone(&state.status);
        let loading = Arc::clone(&state);
        let load_opts = opts.clone();
        std::thread::Builder::new()
            .name("astra-scheduler".into())
            .spawn(move || match load(&load_opts, backend, metrics, status) {
                Ok((ready, scheduler)) => {
                    let _ = loading.ready.set(ready);
                    println!("astra: model loaded; serving {}", load_opts.model_name);
                    scheduler.run();
                }
                Err(e) => {
                    eprintln!("astra: error: loading {}: {e}", load_opts.model.display());
                    std::process::exit(1);
                }
            })
            .map_err(|e| format!("starting the scheduler: {e}"))?;
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let connections = ConnectionLimits {
            max: opts.max_connections,
            header_timeout: opts.header_timeout,
            write_timeout: opts.stall_timeout,
        };
        let draining = Arc::clone(&state);
        let server = accept_loop(
            listener,
            router(Arc::clone(&state)),
            connections,
            async move {
                shutdown_signal().await;
                println!("astra: shutting down; finishing in-flight requests");
                draining.drain.start();
                let _ = stop_tx.send(true);
            },
        );
        tokio::pin!(server);
        let grace = opts.shutdown_grace;
        let bound = async move {
            while !*stop_rx.borrow() {
                if stop_rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            r = &mut server => r.map_err(|e| format!("serving: {e}"))?,
            _ = bound => {
                eprintln!("astra: requests still running after {grace:?}; ending them");
                state.drain.cut();
                // The cut responses' last bytes go out before the process ends.
                let _ = tokio::time::timeout(Duration::from_secs(2), &mut server).await;
            }
        }
        Ok(())
    })
}
