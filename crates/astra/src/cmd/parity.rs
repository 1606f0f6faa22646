//! `astra parity kernels`: every CPU kernel against its f64 reference and the scalar
//! kernel; `--save` / `--bitwise` compare builds bit for bit.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use astra_quant::parity::{case_seed, default_cases, run_case, CaseReport, SIMD_VS_SCALAR_BOUND};
use astra_quant::{GgmlType, Isa};

use super::backend::BackendKind;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Every dot kernel × instruction set × shape against the f64 reference.
    Kernels(KernelArgs),
}

#[derive(clap::Args)]
struct KernelArgs {
    /// Only these weight types (e.g. q4_k); repeatable. Default: every supported type.
    #[arg(long = "type", value_name = "TYPE")]
    types: Vec<String>,
    /// Only this instruction set (scalar, avx2, avx512vnni). Default: every one this CPU has.
    #[arg(long)]
    isa: Option<String>,
    /// Activation rows per case.
    #[arg(long, default_value_t = 2)]
    tokens: usize,
    /// Write every case's outputs into DIR (a baseline for --bitwise).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Compare every case's outputs bit for bit with those saved in DIR.
    #[arg(long, value_name = "DIR")]
    bitwise: Option<PathBuf>,
    /// cpu: the kernels against f64; cuda: every backend op on the GPU against the CPU
    /// backend's.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
}

/// Largest relative L2 distance between the CUDA and CPU backends' results for an op:
/// both compute the same integer block sums and differ only in how floats are
/// associated (and in the last bits of sin, cos, exp and tanh).
const BACKEND_BOUND: f64 = 1e-4;

/// The same for a batch's product through cuBLAS in TF32 (the CUDA default), which
/// rounds weights and activations to 11 significant bits where the CPU quantizes the
/// activations to 8-bit blocks: the distance is mostly the CPU's own rounding.
const GEMM_BOUND: f64 = 2e-2;

/// Every backend op, on the CUDA backend in its deterministic mode and in its default
/// one, against the CPU backend.
fn backend_ops() -> Result<()> {
    let cpu = astra_engine::CpuBackend::new(super::run::default_threads());
    let dir = std::env::temp_dir().join(format!("astra-parity-{}", std::process::id()));
    let (mut failed, mut total) = (0, 0);
    for mode in [astra_cuda::Mode::Deterministic, astra_cuda::Mode::Fast] {
        let cuda = astra_cuda::CudaBackend::new(0, mode).map_err(|e| anyhow::anyhow!("{e}"))?;
        let before = cuda.gemm_products();
        let reports = astra_engine::backend_parity::compare(&cpu, &cuda, &dir)?;
        // The products that went through cuBLAS are those of the larger batch.
        let through_gemm = cuda.gemm_products() > before;
        let bound = |op: &str| if through_gemm && op.ends_with(" tokens") { GEMM_BOUND } else { BACKEND_BOUND };
        println!("{} against {}", astra_engine::Backend::describe(&cuda), astra_engine::Backend::describe(&cpu));
        println!("| op | rel L2 | max abs | bound | result |");
        println!("|----|-------:|--------:|------:|--------|");
        for r in &reports {
            let ok = r.rel_l2 <= bound(&r.op);
            failed += usize::from(!ok);
            println!("| {} | {:.3e} | {:.3e} | {:.0e} | {} |", r.op, r.rel_l2, r.max_abs, bound(&r.op), if ok { "ok" } else { "FAIL" });
        }
        total += reports.len();
        println!();
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{total} ops, {failed} failed");
    if failed > 0 {
        bail!("{failed} of {total} backend ops are out of bound");
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Kernels(k) => kernels(k),
    }
}

fn selected_isas(name: Option<&str>) -> Result<Vec<Isa>> {
    let Some(name) = name else { return Ok(Isa::available_sets()) };
    let isa = Isa::from_name(name).with_context(|| format!("unknown instruction set {name:?} (scalar, avx2, avx512vnni)"))?;
    if !isa.available() {
        bail!("this CPU cannot run {} kernels", isa.name());
    }
    Ok(vec![isa])
}

fn selected_types(names: &[String]) -> Result<Vec<GgmlType>> {
    names
        .iter()
        .map(|n| {
            let ty = GgmlType::from_name(n).with_context(|| format!("unknown tensor type {n:?}"))?;
            if !astra_quant::SUPPORTED_TYPES.contains(&ty) {
                bail!("{ty} has no CPU kernels");
            }
            Ok(ty)
        })
        .collect()
}

fn outputs_bytes(r: &CaseReport) -> Vec<u8> {
    r.outputs.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Compares a case with its saved baseline: None when identical, else what differs.
fn bitwise_difference(dir: &std::path::Path, r: &CaseReport) -> Option<String> {
    let path = dir.join(format!("{}.bin", r.name()));
    let Ok(saved) = std::fs::read(&path) else {
        return Some(format!("no baseline at {}", path.display()));
    };
    let now = outputs_bytes(r);
    if saved.len() != now.len() {
        return Some(format!("baseline has {} outputs, this build {}", saved.len() / 4, now.len() / 4));
    }
    let differing = saved.chunks_exact(4).zip(now.chunks_exact(4)).filter(|(a, b)| a != b).count();
    (differing > 0).then(|| format!("{differing} of {} outputs differ in some bit", now.len() / 4))
}

fn kernels(args: KernelArgs) -> Result<()> {
    if args.backend == BackendKind::Cuda {
        return backend_ops();
    }
    let isas = selected_isas(args.isa.as_deref())?;
    let types = selected_types(&args.types)?;
    if args.tokens == 0 || args.tokens > 64 {
        bail!("--tokens must be between 1 and 64");
    }
    for dir in [&args.save, &args.bitwise].into_iter().flatten() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    println!("bound: relative L2 vs the f64 reference ≤ (blocks + 5)·2⁻²⁴·Σ|a|(|w| + 2|offset|) / ‖ref‖; SIMD vs scalar ≤ {SIMD_VS_SCALAR_BOUND:e}");
    println!("| type   | isa    | cols × rows | rel L2 (f64) | bound     | vs scalar | result |");
    println!("|--------|--------|-------------|--------------|-----------|-----------|--------|");
    let (mut failed, mut total) = (0, 0);
    for (ty, cols, rows) in default_cases() {
        if !types.is_empty() && !types.contains(&ty) {
            continue;
        }
        for &isa in &isas {
            let r = run_case(ty, isa, cols, rows, args.tokens, case_seed(ty, cols, rows))?;
            if r.isa != isa {
                continue; // no kernel of this set for the type: the scalar row covers it
            }
            let mut problems = Vec::new();
            if !r.passed() {
                problems.push("out of bound".to_owned());
            }
            if let Some(dir) = &args.save {
                std::fs::write(dir.join(format!("{}.bin", r.name())), outputs_bytes(&r))?;
            }
            if let Some(diff) = args.bitwise.as_deref().and_then(|dir| bitwise_difference(dir, &r)) {
                problems.push(diff);
            }
            total += 1;
            failed += usize::from(!problems.is_empty());
            let result = if problems.is_empty() { "ok".to_owned() } else { format!("FAIL: {}", problems.join("; ")) };
            println!(
                "| {:<6} | {:<6} | {:>5} × {:<5} | {:>12.3e} | {:>9.2e} | {:>9.2e} | {result} |",
                ty.name(), isa.name(), cols, rows, r.rel_l2, r.bound, r.vs_scalar
            );
        }
    }
    println!("{} cases, {} failed", total, failed);
    if failed > 0 {
        bail!("{failed} of {total} kernel parity cases failed");
    }
    Ok(())
}
