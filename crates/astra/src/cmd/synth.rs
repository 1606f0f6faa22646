//! `astra synth`: a random-weight GGUF of a known model's shape.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use astra_gguf::GgmlType;

#[derive(clap::Args)]
pub struct Args {
    /// Architecture (checked against the shape's).
    #[arg(long)]
    arch: Option<String>,
    /// The shape: llama3-8b, llama3-1b, smollm2-135m, gemma3-270m, qwen2.5-0.5b,
    /// qwen3-0.6b, qwen3-30b-a3b, mixtral-8x7b.
    #[arg(long)]
    like: String,
    /// Weight type of the matrices (q4_0, q4_1, q5_0, q8_0, q4_k, q6_k, iq2_s, iq3_s); matrices whose
    /// rows are not whole blocks of it get q5_0, as llama.cpp's quantizer does.
    #[arg(long = "type", default_value = "q4_k")]
    ty: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Context length written to the file's metadata, in place of the shape's own.
    #[arg(long)]
    ctx: Option<usize>,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
}

pub fn run(args: Args) -> Result<()> {
    let mut shape = astra_synth::shape(&args.like)?.clone();
    if let Some(ctx) = args.ctx {
        if !(1..=u32::MAX as usize).contains(&ctx) {
            bail!("--ctx {ctx} is out of range (1 to {})", u32::MAX);
        }
        shape.ctx = ctx;
    }
    if let Some(arch) = &args.arch {
        if arch != shape.arch {
            bail!(
                "--like {} is a {} shape, not {arch}",
                shape.name,
                shape.arch
            );
        }
    }
    let ty = GgmlType::from_name(&args.ty)
        .with_context(|| format!("unknown tensor type {:?}", args.ty))?;
    let t0 = std::time::Instant::now();
    astra_synth::write(&shape, ty, args.seed, &args.output)?;
    let bytes = std::fs::metadata(&args.output)
        .map(|m| m.len())
        .unwrap_or(0);
    eprintln!(
        "wrote {} ({} {}, {:.1} GiB) in {:.1} s",
        args.output.display(),
        shape.name,
        ty.name(),
        bytes as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
