//! `astra run`: one prompt through the model, text streamed as it is generated, then
//! timings.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use std::sync::Arc;

use astra_engine::{Backend, Model, Sampler, SamplerConfig, StopMatcher, StopOutcome};
use astra_tokenizer::{ChatMessage, ChatTemplate, EncodeOptions, StreamDecoder, Tokenizer};
use serde_json::json;

use super::backend::{with_model, BackendArgs, OnModel};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// The prompt (special tokens such as <|im_start|> are recognised).
    #[arg(long, short)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    n_predict: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Context size in tokens.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object {tokens, text, timings} instead of streaming.
    #[arg(long)]
    json: bool,
    /// Stop when the text contains this string (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    backend: BackendArgs,
}

/// The sampler's settings, as `astra run` and `astra chat` take them.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn sampler(&self) -> Sampler {
        Sampler::new(SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..SamplerConfig::default()
        })
    }
}

pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn run(args: Args) -> Result<()> {
    let path = astra_models::resolve(&args.model)?;
    let threads = args.threads.unwrap_or_else(default_threads);
    with_model(args.backend, &path, threads, args)
}

impl OnModel for Args {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()> {
        generate(&self, &model)
    }
}

/// `text`, or, with `chat`, `text` as a user message in the model's chat template.
pub fn prompt_text<B: Backend>(
    model: &Model<B>,
    tok: &Tokenizer,
    text: &str,
    chat: bool,
) -> Result<String> {
    if !chat {
        return Ok(text.to_owned());
    }
    let template = ChatTemplate::for_model(model.file.metadata(), tok)?;
    Ok(template.prompt(
        &[ChatMessage::new("user", text.to_owned())],
        tok.vocab().add_bos,
    )?)
}

fn generate<B: Backend>(args: &Args, model: &Model<B>) -> Result<()> {
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    let prompt = prompt_text(model, &tok, &args.prompt, args.chat)?;
    let ctx = args.ctx.min(model.cfg.ctx_train);
    let ids = tok.encode(&prompt, EncodeOptions::default());
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    if ids.len() + args.n_predict > ctx {
        bail!(
            "{} prompt tokens + {} to generate exceed the context of {ctx} (raise --ctx)",
            ids.len(),
            args.n_predict
        );
    }
    let mut sampler = args.sampling.sampler();
    sampler.accept(&ids);
    let mut session = model.session(ctx)?;
    let t0 = Instant::now();
    let mut logits = model.prefill(&mut session, &ids)?;
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;

    let mut out = std::io::stdout().lock();
    let mut stream = StreamDecoder::new();
    let mut stops = StopMatcher::new(args.stop.clone());
    let mut generated = Vec::new();
    let mut text = String::new();
    let t1 = Instant::now();
    while generated.len() < args.n_predict {
        let id = sampler.sample(&mut logits);
        if tok.vocab().eog.contains(&id) {
            break;
        }
        generated.push(id);
        let mut bytes = Vec::new();
        tok.token_bytes(id, false, &mut bytes);
        let (piece, stopped) = match stops.push(&stream.push(&bytes)) {
            StopOutcome::Continue(p) => (p, false),
            StopOutcome::Stopped(p) => (p, true),
        };
        if !args.json {
            write!(out, "{piece}")?;
            out.flush()?;
        }
        text.push_str(&piece);
        if stopped || generated.len() == args.n_predict {
            break;
        }
        logits = model.forward(&mut session, &[id], 0)?;
    }
    let tail = match stops.push(&stream.finish()) {
        StopOutcome::Continue(p) => p + &stops.finish(),
        StopOutcome::Stopped(p) => p,
    };
    text.push_str(&tail);
    let decode_s = t1.elapsed().as_secs_f64();
    let decode_tps = if decode_s > 0.0 {
        generated.len() as f64 / decode_s
    } else {
        0.0
    };
    if args.json {
        let timings = json!({
            "prompt_tokens": ids.len(), "prefill_ms": prefill_ms,
            "prefill_tokens_per_s": ids.len() as f64 / (prefill_ms / 1e3),
            "decoded_tokens": generated.len(), "decode_ms": decode_s * 1e3, "decode_tokens_per_s": decode_tps,
        });
        writeln!(
            out,
            "{}",
            json!({"tokens": generated, "text": text, "timings": timings})
        )?;
    } else {
        writeln!(out, "{tail}")?;
        eprintln!(
            "\nprompt tokens: {}  prefill: {:.1} ms ({:.1} tok/s)  decoded tokens: {}  decode: {:.1} tok/s",
            ids.len(),
            prefill_ms,
            ids.len() as f64 / (prefill_ms / 1e3),
            generated.len(),
            decode_tps
        );
    }
    Ok(())
}
