//! `astra bench`: prefill (pp) and decode (tg) speed, repeated, as llama-bench reports
//! them: pp = a batch of `p` tokens into an empty context; tg = `n` tokens decoded one
//! at a time into an empty context (with `--sequences N`, N sequences decoded together,
//! one token of each per step, their tokens/s counted in all).

use std::time::Instant;

use anyhow::{bail, Result};
use std::sync::Arc;

use astra_engine::{Backend, Logits, Model, Step, MAX_BATCH};

use super::backend::{with_model, BackendArgs, OnModel};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// Prompt tokens for the prefill test (0 skips it).
    #[arg(short = 'p', long, default_value_t = 512)]
    n_prompt: usize,
    /// Tokens for the decode test (0 skips it).
    #[arg(short = 'n', long, default_value_t = 128)]
    n_gen: usize,
    /// Tokens already in the cache when each test starts (prefilled, not timed), as
    /// llama-bench's `-d`: the speed at that depth of a conversation.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Sequences decoded together in the decode test, one token of each per step (as a
    /// server's continuous batching runs them); its speed is then their tokens/s in all.
    #[arg(short = 's', long, default_value_t = 1)]
    sequences: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Prefill and decode as a request runs them, for `astra ab`: each sequence's
    /// prompt of `-p` tokens prefilled (all sequences in one call, timed), then `-n`
    /// tokens decoded greedily from it, one step for all sequences (timed); JSON with
    /// the times of each repetition and the ids generated (the first from the prefill's
    /// logits, then one per decode step).
    #[arg(long)]
    greedy: bool,
    #[command(flatten)]
    backend: BackendArgs,
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Deterministic pseudo-random token ids (as llama-bench, the content does not matter).
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

pub fn run(args: Args) -> Result<()> {
    if args.repetitions == 0 || args.repetitions > 1000 {
        bail!("--repetitions must be between 1 and 1000");
    }
    if args.sequences == 0 || args.sequences > MAX_BATCH {
        bail!("--sequences must be between 1 and {MAX_BATCH} (the tokens of one batch)");
    }
    let path = astra_models::resolve(&args.model)?;
    let threads = args.threads.unwrap_or_else(super::run::default_threads);
    with_model(
        args.backend,
        &path.clone(),
        threads,
        Bench {
            args,
            path,
            threads,
        },
    )
}

struct Bench {
    args: Args,
    path: std::path::PathBuf,
    threads: usize,
}

impl OnModel for Bench {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()> {
        let Bench {
            args,
            path,
            threads,
        } = self;
        bench(&args, &path, threads, &model)
    }
}

fn bench<B: Backend>(
    args: &Args,
    path: &std::path::Path,
    threads: usize,
    model: &Model<B>,
) -> Result<()> {
    let longest = args.n_prompt.max(args.n_gen);
    if args.depth.saturating_add(longest) > model.cfg.ctx_train {
        bail!(
            "--depth {} plus the longest test ({longest} tokens) exceeds the model's context of {}",
            args.depth,
            model.cfg.ctx_train
        );
    }
    if args.greedy {
        return greedy(args, model);
    }
    let ctx = (args.depth + longest + 1).min(model.cfg.ctx_train);
    let vocab = model.cfg.n_vocab;
    // A session holding `depth` tokens (their prefill not timed).
    let session = |seed: u64| -> Result<_> {
        let mut s = model.session(ctx)?;
        if args.depth > 0 {
            model.forward(
                &mut s,
                &tokens(args.depth, vocab, seed ^ 0x5eed),
                args.depth - 1,
            )?;
        }
        Ok(s)
    };
    // One warm-up of each test, not counted.
    let run_pp = |seed| -> Result<f64> {
        let toks = tokens(args.n_prompt, vocab, seed);
        let mut s = session(seed)?;
        let t = Instant::now();
        model.forward(&mut s, &toks, args.n_prompt - 1)?;
        Ok(args.n_prompt as f64 / t.elapsed().as_secs_f64())
    };
    let run_tg = |seed: u64| -> Result<f64> {
        let n = args.sequences as u64;
        let streams: Vec<Vec<u32>> = (0..n)
            .map(|i| tokens(args.n_gen, vocab, seed * n + i))
            .collect();
        let mut sessions = (0..n)
            .map(|i| session(seed * n + i))
            .collect::<Result<Vec<_>>>()?;
        let mut logits = Logits::default();
        let t = Instant::now();
        for i in 0..args.n_gen {
            let mut steps: Vec<Step<'_, B>> = sessions
                .iter_mut()
                .zip(&streams)
                .map(|(session, toks)| Step {
                    session,
                    tokens: &toks[i..i + 1],
                    logits_from: 0,
                })
                .collect();
            model.forward_many(&mut steps, &mut logits)?;
        }
        Ok((args.n_gen * args.sequences) as f64 / t.elapsed().as_secs_f64())
    };
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    if args.n_prompt > 0 {
        run_pp(0)?;
        for r in 0..args.repetitions {
            pp.push(run_pp(r as u64 + 1)?);
        }
    }
    if args.n_gen > 0 {
        run_tg(0)?;
        for r in 0..args.repetitions {
            tg.push(run_tg(r as u64 + 1)?);
        }
    }
    let size_mib = model.file.len() as f64 / (1024.0 * 1024.0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if args.json {
        let (ppm, pps) = if pp.is_empty() {
            (0.0, 0.0)
        } else {
            mean_sd(&pp)
        };
        let (tgm, tgs) = if tg.is_empty() {
            (0.0, 0.0)
        } else {
            mean_sd(&tg)
        };
        println!(
            "{}",
            json!({
                "model": name, "backend": model.backend.describe(), "threads": threads, "n_prompt": args.n_prompt, "n_gen": args.n_gen, "depth": args.depth,
                "sequences": args.sequences,
                "pp_tokens_per_s": ppm, "pp_sd": pps, "tg_tokens_per_s": tgm, "tg_sd": tgs,
                "pp_samples": pp, "tg_samples": tg,
                "weight_bytes_per_token": model.weight_bytes_per_token(),
            })
        );
        return Ok(());
    }
    println!("| model | size | backend | threads | test | t/s |");
    println!("| ----- | ---: | ------- | ------: | ---: | --: |");
    let at = if args.depth > 0 {
        format!(" @ d{}", args.depth)
    } else {
        String::new()
    };
    let together = if args.sequences > 1 {
        format!(" × {}", args.sequences)
    } else {
        String::new()
    };
    for (test, samples) in [
        (format!("pp{}{at}", args.n_prompt), &pp),
        (format!("tg{}{together}{at}", args.n_gen), &tg),
    ] {
        if samples.is_empty() {
            continue;
        }
        let (m, sd) = mean_sd(samples);
        let backend = model.backend.name().to_uppercase();
        println!(
            "| {name} | {size_mib:.1} MiB | {backend} | {threads} | {test} | {m:.2} ± {sd:.2} |"
        );
    }
    Ok(())
}

/// `--greedy`: the prompts prefilled and their greedy continuations decoded, timed.
fn greedy<B: Backend>(args: &Args, model: &Model<B>) -> Result<()> {
    if args.n_prompt == 0 {
        bail!("--greedy needs a prompt (-p of at least 1): the first token comes from its logits");
    }
    let needed = args.depth + args.n_prompt + args.n_gen + 1;
    if needed > model.cfg.ctx_train {
        bail!(
            "--depth, -p and -n ({needed} tokens) exceed the model's context of {}",
            model.cfg.ctx_train
        );
    }
    let vocab = model.cfg.n_vocab;
    let prompts: Vec<Vec<u32>> = (0..args.sequences as u64)
        .map(|i| tokens(args.n_prompt, vocab, i + 1))
        .collect();
    let run = || -> Result<(f64, f64, Vec<Vec<u32>>)> {
        let mut sessions = Vec::with_capacity(args.sequences);
        for i in 0..args.sequences as u64 {
            let mut s = model.session(needed)?;
            if args.depth > 0 {
                model.forward(
                    &mut s,
                    &tokens(args.depth, vocab, i ^ 0x5eed),
                    args.depth - 1,
                )?;
            }
            sessions.push(s);
        }
        let t = Instant::now();
        let mut steps: Vec<Step<'_, B>> = sessions
            .iter_mut()
            .zip(&prompts)
            .map(|(session, p)| Step {
                session,
                tokens: p,
                logits_from: p.len() - 1,
            })
            .collect();
        let mut logits = Logits::default();
        model.forward_many(&mut steps, &mut logits)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut out: Vec<Vec<u32>> = (0..logits.len())
            .map(|i| vec![argmax(logits.get(i))])
            .collect();
        let t = Instant::now();
        for _ in 0..args.n_gen {
            let last: Vec<u32> = out.iter().map(|ids| ids[ids.len() - 1]).collect();
            let mut steps: Vec<Step<'_, B>> = sessions
                .iter_mut()
                .zip(&last)
                .map(|(session, tok)| Step {
                    session,
                    tokens: std::slice::from_ref(tok),
                    logits_from: 0,
                })
                .collect();
            model.forward_many(&mut steps, &mut logits)?;
            for (i, ids) in out.iter_mut().enumerate() {
                ids.push(argmax(logits.get(i)));
            }
        }
        Ok((prefill_s, t.elapsed().as_secs_f64(), out))
    };
    // One warm-up, not counted.
    run()?;
    let (mut prefill, mut decode, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.repetitions {
        let (p, d, t) = run()?;
        prefill.push(p);
        decode.push(d);
        ids = t;
    }
    println!(
        "{}",
        json!({
            "backend": model.backend.describe(), "n_prompt": args.n_prompt,
            "n_gen": args.n_gen, "depth": args.depth, "sequences": args.sequences,
            "prefill_s": prefill, "decode_s": decode, "tokens": ids,
        })
    );
    Ok(())
}

/// The index of the largest logit, the lowest of equal ones.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if v.total_cmp(&logits[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}
