//! `astra serve`: the OpenAI-compatible HTTP server.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Result};
use std::sync::Arc;

use astra_server::http::ImagePolicy;
use astra_server::ServeOptions;

use super::backend::{BackendArgs, BackendKind};

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
    /// Thinking markers as START,END (default: from the chat template, else
    /// <think>,</think>).
    #[arg(long, value_parser = parse_markers)]
    think_markers: Option<(String, String)>,
    /// A Jinja chat template file used in place of the model's own.
    #[arg(long)]
    chat_template_file: Option<PathBuf>,
    /// Tokens of a thinking request's max_tokens reserved for the answer when the
    /// request sets neither answer_room nor thinking_budget (0: no reservation).
    #[arg(long, default_value_t = 512)]
    answer_room: usize,
    /// What a text-only model does with image content parts: reject (400) or omit
    /// (dropped, with a warning in the response).
    #[arg(long, value_enum, default_value = "reject")]
    images: Images,
    /// Refuse new requests (503) while the system's available memory is below this.
    #[arg(long)]
    min_free_mem_mib: Option<u64>,
    /// Unload the model after this long without requests ("30s", "5m", "1h"; default:
    /// never); the next request loads it again.
    #[arg(long, value_parser = parse_duration)]
    keep_alive: Option<Duration>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "ASTRA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Seconds a client may stop reading: a streamed request waits that long (its
    /// generation paused, a bounded backlog of output held) before it is cancelled, and
    /// a connection whose writes make no progress for that long is closed.
    #[arg(long, default_value_t = 30)]
    stall_timeout: u64,
    /// Open connections at most; one more is answered 503 (with Retry-After) and
    /// closed.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a request's head may take to arrive; the connection is closed after
    /// that. Also how long an idle keep-alive connection stays open.
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Seconds a request's body may take to arrive once its head has (408 after).
    #[arg(long, default_value_t = 30)]
    body_timeout: u64,
    /// Host names the server answers to besides loopback ones (comma-separated): a
    /// request naming another host gets 403 (against DNS rebinding). Bound to a
    /// non-loopback address with none given, any host is answered.
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Origins whose web pages may call the server (comma-separated, `*` for any):
    /// their preflights are answered; a cross-origin request from any other origin gets
    /// 403 before any work is done. Default: none.
    #[arg(long, value_delimiter = ',')]
    cors_origins: Vec<String>,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Images {
    Reject,
    Omit,
}

fn parse_markers(s: &str) -> Result<(String, String), String> {
    match s.split_once(',') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_owned(), b.to_owned())),
        _ => Err("expected START,END (two non-empty markers)".into()),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    astra_server::api::parse_duration_secs(s)
        .filter(|&x| x >= 0.0)
        .and_then(|x| Duration::try_from_secs_f64(x).ok())
        .ok_or_else(|| format!("{s:?} is not a duration such as 30s, 5m or 1h"))
}

pub fn run(args: Args) -> Result<()> {
    let path = astra_models::resolve(&args.model)?;
    let model_name = if path.exists() && std::path::Path::new(&args.model).exists() {
        path.file_stem()
            .map_or_else(|| args.model.clone(), |s| s.to_string_lossy().into_owned())
    } else {
        args.model.clone()
    };
    let backend = args.backend;
    let opts = ServeOptions {
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
        think_markers: args.think_markers,
        chat_template: args
            .chat_template_file
            .map(|p| {
                std::fs::read_to_string(&p)
                    .map_err(|e| anyhow!("cannot read the chat template {}: {e}", p.display()))
            })
            .transpose()?,
        answer_room: args.answer_room,
        images: match args.images {
            Images::Reject => ImagePolicy::Reject,
            Images::Omit => ImagePolicy::Omit,
        },
        min_free_mem_mib: args.min_free_mem_mib,
        keep_alive: args.keep_alive,
        api_key: args.api_key.filter(|k| !k.is_empty()),
        kv_type: args.backend.kv_type.into(),
        max_connections: args.max_connections,
        stall_timeout: Duration::from_secs(args.stall_timeout),
        header_timeout: Duration::from_secs(args.header_timeout),
        body_timeout: Duration::from_secs(args.body_timeout),
        allowed_hosts: args.allowed_hosts,
        cors_origins: args.cors_origins,
    };
    match backend.backend {
        BackendKind::Cpu => {
            let threads = opts.threads;
            backend.check().map_err(|e| anyhow!(e))?;
            astra_server::serve_on(opts, Arc::new(move || backend.cpu(threads)))
        }
        BackendKind::Cuda => {
            // Fail before opening the port when there is no GPU.
            backend.check().map_err(|e| anyhow!(e))?;
            if let Some(why) = astra_cuda::unavailable_reason() {
                return Err(anyhow!(why));
            }
            astra_server::serve_on(opts, Arc::new(move || backend.cuda()))
        }
    }
    .map_err(|e| anyhow!(e))
}
