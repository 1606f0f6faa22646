//! Starting and stopping the server: the port opens first, the model loads behind it,
//! and a signal stops new connections while in-flight requests finish (within a bound).

use std::path::PathBuf;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use astra_engine::Model;
use astra_tokenizer::{ChatTemplate, Tokenizer};

use crate::http::{router, AppState, Ready};
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;

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
}

/// Loads the model and starts the scheduler; returns what the HTTP side needs.
fn load(opts: &ServeOptions, metrics: Arc<Metrics>) -> Result<(Ready, Scheduler), String> {
    let model = Model::load(&opts.model, opts.threads).map_err(|e| e.to_string())?;
    let tok = Arc::new(Tokenizer::from_metadata(model.file.metadata()).map_err(|e| e.to_string())?);
    let template = ChatTemplate::for_model(model.file.metadata(), &tok).map_err(|e| e.0)?;
    let ctx = opts.ctx.min(model.cfg.ctx_train.max(1));
    let per_sequence = model.session(ctx).map_err(|e| e.to_string())?.kv_bytes();
    let budget = opts.arena_mib << 20;
    if opts.parallel * per_sequence > budget {
        return Err(format!(
            "{} sequences of {ctx} positions need {} MiB of KV cache; --arena-mib is {} (lower --parallel or --ctx, or raise --arena-mib)",
            opts.parallel,
            (opts.parallel * per_sequence).div_ceil(1 << 20),
            opts.arena_mib
        ));
    }
    let (queue, jobs) = sync_channel(opts.queue);
    let ready = Ready {
        tok: Arc::clone(&tok),
        template,
        queue,
        model_name: opts.model_name.clone(),
        model_path: opts.model.display().to_string(),
        ctx,
        n_vocab: model.cfg.n_vocab,
        ctx_train: model.cfg.ctx_train,
        slots: opts.parallel,
    };
    let scheduler = Scheduler::new(model, tok, jobs, metrics, opts.parallel, ctx, budget);
    Ok((ready, scheduler))
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
/// requests. Prints `astra: listening on http://ADDR` once the port is open.
pub fn serve(opts: ServeOptions) -> Result<(), String> {
    if opts.parallel == 0 || opts.queue == 0 {
        return Err("--parallel and --queue must be at least 1".into());
    }
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
        let state = Arc::new(AppState::new(Arc::clone(&metrics), opts.body_limit));
        let loading = Arc::clone(&state);
        let load_opts = opts.clone();
        std::thread::Builder::new()
            .name("astra-scheduler".into())
            .spawn(move || match load(&load_opts, metrics) {
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
        let server = axum::serve(listener, router(state)).with_graceful_shutdown(async move {
            shutdown_signal().await;
            println!("astra: shutting down; finishing in-flight requests");
            let _ = stop_tx.send(true);
        });
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
            r = server => r.map_err(|e| format!("serving: {e}"))?,
            _ = bound => eprintln!("astra: requests still running after {grace:?}; exiting"),
        }
        Ok(())
    })
}
