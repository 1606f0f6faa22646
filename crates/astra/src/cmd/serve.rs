//! `astra serve`: the OpenAI-compatible HTTP server.

use std::time::Duration;

use anyhow::{anyhow, Result};
use astra_server::ServeOptions;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together (slots).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Positions per sequence, prompt and completion together (at most the model's
    /// training context).
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Memory for KV caches in MiB: the slots' sequences, and idle ones kept as the
    /// prompt cache (least recently used dropped first).
    #[arg(long, default_value_t = 2048)]
    arena_mib: usize,
    /// Requests that may wait for a free slot; more are answered 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    body_limit: usize,
    /// Seconds in-flight requests may run after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
}

pub fn run(args: Args) -> Result<()> {
    let path = astra_models::resolve(&args.model)?;
    let model_name = if path.exists() && std::path::Path::new(&args.model).exists() {
        path.file_stem().map_or_else(|| args.model.clone(), |s| s.to_string_lossy().into_owned())
    } else {
        args.model.clone()
    };
    astra_server::serve(ServeOptions {
        model: path,
        model_name,
        host: args.host,
        port: args.port,
        parallel: args.parallel,
        ctx: args.ctx,
        arena_mib: args.arena_mib,
        threads: args.threads.unwrap_or_else(super::run::default_threads),
        queue: args.queue,
        body_limit: args.body_limit,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
    })
    .map_err(|e| anyhow!(e))
}
