//! `astra perplexity`: llama-perplexity's measurement over a text file.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use astra_engine::{Backend, Model};
use astra_tokenizer::{EncodeOptions, Tokenizer};

use super::backend::{with_model, BackendArgs, OnModel};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// The text to score (UTF-8).
    #[arg(long, short)]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn run(args: Args) -> Result<()> {
    let path = astra_models::resolve(&args.model)?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let threads = args.threads.unwrap_or_else(super::run::default_threads);
    with_model(
        args.backend,
        &path,
        threads,
        Scoring {
            ctx: args.ctx,
            text,
        },
    )
}

/// The text to score, and the chunk size.
struct Scoring {
    ctx: usize,
    text: String,
}

impl OnModel for Scoring {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()> {
        score(self, &model)
    }
}

fn score<B: Backend>(args: Scoring, model: &Model<B>) -> Result<()> {
    let text = args.text;
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    // As llama-perplexity: one trailing newline is not part of the text.
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let tokens = tok.encode(
        text,
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    let bos = if tok.vocab().add_bos { tok.bos() } else { None };
    eprintln!(
        "{} tokens, {} chunks of {}",
        tokens.len(),
        tokens.len() / args.ctx.max(1),
        args.ctx
    );
    let r =
        astra_engine::perplexity::perplexity(model, &tokens, args.ctx, bos, |done, total, ppl| {
            eprintln!("[{done}/{total}] {ppl:.4}");
        })?;
    println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.error);
    Ok(())
}
