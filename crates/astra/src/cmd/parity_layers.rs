//! `astra parity layers`: one prompt through the CPU backend and through the others —
//! the CPU's matrix kernels of a second instruction set, and the CUDA backend in both
//! of its modes where there is a GPU — the residual stream compared after every block,
//! then the last token's log-probabilities and greedy continuations side by side:
//! where they part, and whether the distance grows as rounding carried on does (the
//! second instruction set shows how that looks) or jumps at one block (an op computing
//! something else).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use astra_cuda::{CudaBackend, Mode};
use astra_engine::backend_parity::distance;
use astra_engine::sampler::{argmax, softmax};
use astra_engine::{Backend, CpuBackend, Model, Trace};
use astra_quant::Isa;
use astra_tokenizer::{EncodeOptions, Tokenizer};

#[derive(clap::Args)]
pub struct LayerArgs {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// The prompt, traced as one batch (at most 512 tokens).
    #[arg(long, short)]
    prompt: String,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Greedy tokens to generate on each backend and compare.
    #[arg(short = 'n', long, default_value_t = 32)]
    n_predict: usize,
    /// CPU worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    /// A second instruction set for the CPU backend's matrix kernels, compared too:
    /// the same arithmetic with its sums associated differently, the distance that
    /// rounding alone makes.
    #[arg(long, default_value = "scalar")]
    isa: String,
}

/// What one backend gave for the prompt.
struct Run {
    name: String,
    trace: Trace,
    greedy: Vec<u32>,
    /// The logits before each greedy token (the last prompt token's first).
    steps: Vec<Vec<f32>>,
}

pub fn layers(args: LayerArgs) -> Result<()> {
    if args.n_predict > 4096 {
        bail!("-n must be at most 4096");
    }
    let other_isa = Isa::from_name(&args.isa).with_context(|| {
        format!(
            "unknown instruction set {:?} (scalar, avx2, avx512vnni)",
            args.isa
        )
    })?;
    if !other_isa.available() {
        bail!("this CPU cannot run {} kernels", other_isa.name());
    }
    let path = astra_models::resolve(&args.model)?;
    let threads = args.threads.unwrap_or_else(super::run::default_threads);
    let cpu = Model::load_on(CpuBackend::new(threads), &path)?;
    let tok = Tokenizer::from_metadata(cpu.file.metadata())?;
    let text = super::run::prompt_text(&cpu, &tok, &args.prompt, args.chat)?;
    let ids = tok.encode(&text, EncodeOptions::default());
    if ids.is_empty() || ids.len() > astra_engine::MAX_BATCH {
        bail!(
            "the prompt has {} tokens; a trace takes 1 to {}",
            ids.len(),
            astra_engine::MAX_BATCH
        );
    }
    println!("reference: {}", cpu.backend.describe());
    let reference = run_on(&cpu, "cpu", &ids, args.n_predict)?;
    drop(cpu);
    let mut others = Vec::new();
    if other_isa != Isa::selected() {
        let model = Model::load_on(CpuBackend::new(threads).with_isa(other_isa), &path)?;
        println!(
            "against cpu {}: {}",
            other_isa.name(),
            model.backend.describe()
        );
        others.push(run_on(
            &model,
            &format!("cpu {}", other_isa.name()),
            &ids,
            args.n_predict,
        )?);
    }
    match astra_cuda::unavailable_reason() {
        Some(why) => println!("not against cuda: {why}"),
        None => {
            for (mode, name) in [
                (Mode::Deterministic, "cuda deterministic"),
                (Mode::Fast, "cuda default"),
            ] {
                let model = Model::load_on(
                    CudaBackend::new(0, mode).map_err(|e| anyhow!("{e}"))?,
                    &path,
                )?;
                println!("against {name}: {}", model.backend.describe());
                others.push(run_on(&model, name, &ids, args.n_predict)?);
            }
        }
    }
    if others.is_empty() {
        bail!("nothing to compare: no GPU, and --isa names the instruction set the CPU backend already uses");
    }
    report(&path, &tok, ids.len(), &reference, &others);
    Ok(())
}

/// The prompt traced on `model`, then `n` greedy tokens after it.
fn run_on<B: Backend>(model: &Model<B>, name: &str, ids: &[u32], n: usize) -> Result<Run> {
    let ctx = (ids.len() + n).min(model.cfg.ctx_train);
    let mut session = model.session(ctx)?;
    let trace = model.trace(&mut session, ids)?;
    let vocab = model.cfg.n_vocab;
    let mut logits = trace.logits[(ids.len() - 1) * vocab..].to_vec();
    let (mut greedy, mut steps) = (Vec::new(), Vec::new());
    while greedy.len() < n && session.n_past() < ctx {
        let id = argmax(&logits);
        greedy.push(id);
        steps.push(std::mem::replace(
            &mut logits,
            model.forward(&mut session, &[id], 0)?,
        ));
    }
    Ok(Run {
        name: name.to_owned(),
        trace,
        greedy,
        steps,
    })
}

fn report(path: &Path, tok: &Tokenizer, prompt_tokens: usize, cpu: &Run, others: &[Run]) {
    println!(
        "{}: {prompt_tokens} prompt tokens, one batch; each against the reference",
        path.display()
    );
    print!("| stage |");
    for o in others {
        print!(" {} rel L2 | max abs |", o.name);
    }
    println!();
    println!("|---|{}", "---:|---:|".repeat(others.len()));
    // Every backend runs the same model code, so the stages come in the same order.
    for (i, (stage, values)) in cpu.trace.stages.iter().enumerate() {
        print!("| {stage} |");
        for o in others {
            let (rel, max) = distance(values, &o.trace.stages[i].1);
            print!(" {rel:.3e} | {max:.3e} |");
        }
        println!();
    }
    print!("| logits |");
    for o in others {
        let (rel, max) = distance(&cpu.trace.logits, &o.trace.logits);
        print!(" {rel:.3e} | {max:.3e} |");
    }
    println!();
    let piece = |id: u32| {
        let mut bytes = Vec::new();
        tok.token_bytes(id, false, &mut bytes);
        format!("{:?}", String::from_utf8_lossy(&bytes))
    };
    println!("\nthe last prompt token's top 5 (log-probability):");
    for r in std::iter::once(cpu).chain(others) {
        let Some(first) = r.steps.first() else { break };
        let p = softmax(first);
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let top: Vec<String> = order[..5.min(order.len())]
            .iter()
            .map(|&i| format!("{} {:.4}", piece(i as u32), p[i].ln()))
            .collect();
        println!("  {}: {}", r.name, top.join(", "));
    }
    println!("\ngreedy, {} tokens:", cpu.greedy.len());
    for o in others {
        match cpu.greedy.iter().zip(&o.greedy).position(|(a, b)| a != b) {
            None if o.greedy.len() == cpu.greedy.len() => println!("  {}: identical", o.name),
            None => println!(
                "  {}: {} tokens, the same as far as they go",
                o.name,
                o.greedy.len()
            ),
            Some(at) => {
                // How close the CPU's own choice was there: its top two log-probabilities.
                let p = softmax(&cpu.steps[at]);
                let mut top = p.clone();
                top.sort_by(|a, b| b.total_cmp(a));
                let gap = top[0].ln() - top.get(1).map_or(f64::NEG_INFINITY, |q| q.ln());
                println!(
                    "  {}: parts at token {at}: cpu {} against {} (the CPU's top two {gap:.4} apart in log-probability)",
                    o.name,
                    piece(cpu.greedy[at]),
                    piece(o.greedy[at])
                );
            }
        }
    }
}
