//! `astra parity kernels`: every CPU kernel against its f64 reference and the scalar
//! kernel, or every CUDA backend op against the CPU backend's, then the attention cases
//! on the backend's caches; `--save` / `--bitwise` compare builds (or kernel variants
//! and cache layouts chosen by environment variables) bit for bit.
//! `astra parity layers` (in `parity_layers`) compares whole models block by block;
//! `astra parity moe` the routed expert feed-forward with its f64 and fp16 references.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use astra_quant::parity::{case_seed, default_cases, run_case, SIMD_VS_SCALAR_BOUND};
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
    /// A prompt's residual stream after every block, its log-probabilities and greedy
    /// tokens on the CUDA backend against the CPU backend's.
    Layers(super::parity_layers::LayerArgs),
    /// The routed expert feed-forward (router, top-k, gated experts, weighted sum)
    /// against an f64 and an fp16 reference, per expert type and shape.
    Moe(MoeArgs),
}

#[derive(clap::Args)]
struct MoeArgs {
    /// Write every case's outputs into DIR (a baseline for --bitwise).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Compare every case's outputs bit for bit with those saved in DIR.
    #[arg(long, value_name = "DIR")]
    bitwise: Option<PathBuf>,
    /// The backend the feed-forward runs on.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
}

#[derive(clap::Args)]
struct KernelArgs {
    /// Only these weight types (e.g. q4_k), or `attention` for the attention cases;
    /// repeatable. Default: every supported type, then the attention cases.
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

/// The CUDA backend's modes, each with the name its baselines carry.
const CUDA_MODES: [(astra_cuda::Mode, &str); 2] = [
    (astra_cuda::Mode::Deterministic, "deterministic"),
    (astra_cuda::Mode::Fast, "default"),
];

/// Every backend op, on the CUDA backend in its deterministic mode and in its default
/// one, against the CPU backend; each op's CUDA results saved or compared as `baselines`
/// says.
fn backend_ops(baselines: &Baselines<'_>) -> Result<()> {
    let cpu = astra_engine::CpuBackend::new(super::run::default_threads());
    let dir = std::env::temp_dir().join(format!("astra-parity-{}", std::process::id()));
    let (mut failed, mut total) = (0, 0);
    for (mode, mode_name) in CUDA_MODES {
        let cuda = astra_cuda::CudaBackend::new(0, mode).map_err(|e| anyhow::anyhow!("{e}"))?;
        let before = cuda.gemm_products();
        let reports = astra_engine::backend_parity::compare(&cpu, &cuda, &dir)?;
        // The products that went through cuBLAS are those of the larger batch.
        let through_gemm = cuda.gemm_products() > before;
        let bound = |op: &str| {
            if through_gemm && op.ends_with(" tokens") {
                GEMM_BOUND
            } else {
                BACKEND_BOUND
            }
        };
        println!(
            "{} against {}",
            astra_engine::Backend::describe(&cuda),
            astra_engine::Backend::describe(&cpu)
        );
        println!("| op | rel L2 | max abs | bound | result |");
        println!("|----|-------:|--------:|------:|--------|");
        for (i, r) in reports.iter().enumerate() {
            let problems = baselines.problems(
                &format!("cuda-{mode_name}-{i:03}-{}", slug(&r.op)),
                r.rel_l2 <= bound(&r.op),
                &r.outputs,
            )?;
            failed += usize::from(!problems.is_empty());
            let result = verdict(&problems);
            println!(
                "| {} | {:.3e} | {:.3e} | {:.0e} | {result} |",
                r.op,
                r.rel_l2,
                r.max_abs,
                bound(&r.op)
            );
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
        What::Layers(l) => super::parity_layers::layers(l),
        What::Moe(m) => moe(m),
    }
}

/// `astra parity moe` on the chosen backend.
fn moe(args: MoeArgs) -> Result<()> {
    let baselines = Baselines::new(args.save.as_deref(), args.bitwise.as_deref())?;
    match args.backend {
        BackendKind::Cpu => moe_on(
            &astra_engine::CpuBackend::new(super::run::default_threads()),
            &baselines,
        ),
        BackendKind::Cuda => moe_on(
            &astra_cuda::CudaBackend::new(0, astra_cuda::Mode::Deterministic)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
            &baselines,
        ),
    }
}

/// A case's result column: "ok", or what failed.
fn verdict(problems: &[String]) -> String {
    if problems.is_empty() {
        "ok".to_owned()
    } else {
        format!("FAIL: {}", problems.join("; "))
    }
}

/// A distance involving the fp16 reference: "overflow" where a value left fp16's range.
fn fp16(d: f64) -> String {
    if d.is_finite() {
        format!("{d:.3e}")
    } else {
        "overflow".to_owned()
    }
}

fn moe_on<B: astra_engine::Backend>(be: &B, baselines: &Baselines<'_>) -> Result<()> {
    use astra_engine::moe_parity::{default_cases, run};
    let dir = std::env::temp_dir().join(format!("astra-parity-moe-{}", std::process::id()));
    println!("{}", be.describe());
    println!("| case | experts as the f64 reference | rel L2 vs f64 | bound | vs fp16 ref | fp16 ref vs f64 | result |");
    println!("|------|------------------------------|--------------:|------:|------------:|----------------:|--------|");
    let cases = default_cases();
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        let (line, ok) = match run(be, case, &dir, 7000 + i as u64) {
            Ok(r) => {
                let name = format!("moe-{i:02}-{}", slug(&case.name()));
                let problems = baselines.problems(&name, r.passed(), &r.outputs)?;
                let result = verdict(&problems);
                (
                    format!(
                        "| {} | {} | {:.3e} | {:.1e} | {} | {} | {result} |",
                        case.name(),
                        if r.routes_equal { "yes" } else { "no" },
                        r.rel_l2_f64,
                        case.bound(),
                        fp16(r.rel_l2_f16),
                        fp16(r.f16_vs_f64)
                    ),
                    problems.is_empty(),
                )
            }
            Err(e) => (format!("| {} | | | | | | FAIL: {e} |", case.name()), false),
        };
        println!("{line}");
        failed += usize::from(!ok);
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{} cases, {failed} failed", cases.len());
    if failed > 0 {
        bail!(
            "{failed} of {} routed feed-forwards are out of bound",
            cases.len()
        );
    }
    Ok(())
}

fn selected_isas(name: Option<&str>) -> Result<Vec<Isa>> {
    let Some(name) = name else {
        return Ok(Isa::available_sets());
    };
    let isa = Isa::from_name(name)
        .with_context(|| format!("unknown instruction set {name:?} (scalar, avx2, avx512vnni)"))?;
    if !isa.available() {
        bail!("this CPU cannot run {} kernels", isa.name());
    }
    Ok(vec![isa])
}

fn selected_types(names: &[String]) -> Result<Vec<GgmlType>> {
    names
        .iter()
        .map(|n| {
            let ty =
                GgmlType::from_name(n).with_context(|| format!("unknown tensor type {n:?}"))?;
            if !astra_quant::SUPPORTED_TYPES.contains(&ty) {
                bail!("{ty} has no CPU kernels");
            }
            Ok(ty)
        })
        .collect()
}

/// An op's name as a file name: letters and digits kept, every other run of characters
/// one `_`.
fn slug(op: &str) -> String {
    let mut out = String::new();
    for c in op.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    out.trim_matches('_').to_owned()
}

/// Where each case's outputs are written (`--save`) and compared bit for bit
/// (`--bitwise`), as `NAME.bin`: little-endian f32s.
struct Baselines<'a> {
    save: Option<&'a Path>,
    bitwise: Option<&'a Path>,
}

impl Baselines<'_> {
    fn new<'a>(save: Option<&'a Path>, bitwise: Option<&'a Path>) -> Result<Baselines<'a>> {
        for dir in [save, bitwise].into_iter().flatten() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(Baselines { save, bitwise })
    }

    /// What fails in case `name`: its distance out of bound unless `in_bound`, and
    /// its outputs against their baseline ([`Baselines::check`]).
    fn problems(&self, name: &str, in_bound: bool, outputs: &[f32]) -> Result<Vec<String>> {
        let mut problems = Vec::new();
        if !in_bound {
            problems.push("out of bound".to_owned());
        }
        problems.extend(self.check(name, outputs)?);
        Ok(problems)
    }

    /// Saves case `name`'s outputs where asked; what differs from its baseline, if one
    /// is compared and anything does.
    fn check(&self, name: &str, outputs: &[f32]) -> Result<Option<String>> {
        let now: Vec<u8> = outputs.iter().flat_map(|v| v.to_le_bytes()).collect();
        let file = format!("{name}.bin");
        if let Some(dir) = self.save {
            std::fs::write(dir.join(&file), &now)
                .with_context(|| format!("writing {}", dir.join(&file).display()))?;
        }
        let Some(dir) = self.bitwise else {
            return Ok(None);
        };
        let path = dir.join(&file);
        let Ok(saved) = std::fs::read(&path) else {
            return Ok(Some(format!("no baseline at {}", path.display())));
        };
        if saved.len() != now.len() {
            return Ok(Some(format!(
                "baseline has {} outputs, this build {}",
                saved.len() / 4,
                now.len() / 4
            )));
        }
        let differing = saved
            .chunks_exact(4)
            .zip(now.chunks_exact(4))
            .filter(|(a, b)| a != b)
            .count();
        Ok((differing > 0).then(|| {
            format!(
                "{differing} of {} outputs differ in some bit",
                now.len() / 4
            )
        }))
    }
}

/// The `--type` that selects the attention cases.
const ATTENTION: &str = "attention";

fn kernels(args: KernelArgs) -> Result<()> {
    let baselines = Baselines::new(args.save.as_deref(), args.bitwise.as_deref())?;
    let attention = args.types.is_empty() || args.types.iter().any(|t| t == ATTENTION);
    let weight_types: Vec<String> = args
        .types
        .iter()
        .filter(|t| *t != ATTENTION)
        .cloned()
        .collect();
    let dots = args.types.is_empty() || !weight_types.is_empty();
    let mut failures = Vec::new();
    if args.backend == BackendKind::Cuda {
        if dots {
            failures.extend(backend_ops(&baselines).err());
        }
        if attention {
            for (mode, name) in CUDA_MODES {
                let cases = astra_cuda::CudaBackend::new(0, mode)
                    .map_err(|e| anyhow::anyhow!("{e}"))
                    .and_then(|cuda| attention_cases(&cuda, &format!("cuda-{name}"), &baselines));
                failures.extend(cases.err());
            }
        }
    } else {
        if dots {
            failures.extend(dot_kernels(&args, &weight_types, &baselines).err());
        }
        if attention {
            let threads = super::run::default_threads();
            for kv in [astra_engine::KvType::F16, astra_engine::KvType::F32] {
                let cpu = astra_engine::CpuBackend::with_kv_type(threads, kv);
                failures
                    .extend(attention_cases(&cpu, &format!("cpu-{}", kv.name()), &baselines).err());
            }
        }
    }
    // The same failure (no GPU, say) is reported once.
    let mut messages: Vec<String> = failures.iter().map(|e| format!("{e:#}")).collect();
    messages.dedup();
    match messages.len() {
        0 => Ok(()),
        _ => bail!("{}", messages.join("; ")),
    }
}

/// The attention cases on `be` against their f64 reference, each case's outputs saved
/// or compared as `baselines` says under names starting with `prefix`.
fn attention_cases<B: astra_engine::Backend>(
    be: &B,
    prefix: &str,
    baselines: &Baselines<'_>,
) -> Result<()> {
    use astra_engine::attention_parity::{default_cases, run, ATTN_BOUND};
    println!();
    println!(
        "attention on {}: relative L2 vs the f64 reference ≤ {ATTN_BOUND:e}",
        be.describe()
    );
    println!("| case | rel L2 (f64) | max abs | result |");
    println!("|------|-------------:|--------:|--------|");
    let cases = default_cases();
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        let line = match run(be, case, 9000 + i as u64) {
            Ok(r) => {
                let name = format!("attn-{prefix}-{i:02}-{}", slug(&case.name()));
                let problems = baselines.problems(&name, r.passed(), &r.outputs)?;
                failed += usize::from(!problems.is_empty());
                format!(
                    "| {} | {:.3e} | {:.3e} | {} |",
                    case.name(),
                    r.rel_l2,
                    r.max_abs,
                    verdict(&problems)
                )
            }
            Err(e) => {
                failed += 1;
                format!("| {} | | | FAIL: {e} |", case.name())
            }
        };
        println!("{line}");
    }
    println!("{} attention cases, {failed} failed", cases.len());
    if failed > 0 {
        bail!("{failed} of {} attention cases failed", cases.len());
    }
    Ok(())
}

/// Every dot kernel of `types` (all where empty) on the chosen instruction sets
/// against its f64 reference and the scalar kernel.
fn dot_kernels(args: &KernelArgs, types: &[String], baselines: &Baselines<'_>) -> Result<()> {
    let isas = selected_isas(args.isa.as_deref())?;
    let types = selected_types(types)?;
    if args.tokens == 0 || args.tokens > 64 {
        bail!("--tokens must be between 1 and 64");
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
            let problems = baselines.problems(&r.name(), r.passed(), &r.outputs)?;
            total += 1;
            failed += usize::from(!problems.is_empty());
            let result = verdict(&problems);
            println!(
                "| {:<6} | {:<6} | {:>5} × {:<5} | {:>12.3e} | {:>9.2e} | {:>9.2e} | {result} |",
                ty.name(),
                isa.name(),
                cols,
                rows,
                r.rel_l2,
                r.bound,
                r.vs_scalar
            );
        }
    }
    println!("{} cases, {} failed", total, failed);
    if failed > 0 {
        bail!("{failed} of {total} kernel parity cases failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_become_file_names() {
        assert_eq!(
            slug("decode attention, matmul Q4_1, post-norm, add"),
            "decode_attention_matmul_Q4_1_post_norm_add"
        );
        assert_eq!(
            slug("feed-forward Q6_K gate/up, Q4_1 down, SwiGLU"),
            "feed_forward_Q6_K_gate_up_Q4_1_down_SwiGLU"
        );
    }

    /// A saved baseline compares equal to the same outputs and names what differs.
    #[test]
    fn baselines_compare_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let save = Baselines::new(Some(dir.path()), None).unwrap();
        assert_eq!(save.check("case", &[1.0, -0.0, 3.5]).unwrap(), None);
        let compare = Baselines::new(None, Some(dir.path())).unwrap();
        assert_eq!(compare.check("case", &[1.0, -0.0, 3.5]).unwrap(), None);
        assert_eq!(
            compare.check("case", &[1.0, 0.0, 3.5]).unwrap().as_deref(),
            Some("1 of 3 outputs differ in some bit")
        );
        assert_eq!(
            compare.check("case", &[1.0]).unwrap().as_deref(),
            Some("baseline has 3 outputs, this build 1")
        );
        assert!(compare
            .check("other", &[1.0])
            .unwrap()
            .unwrap()
            .starts_with("no baseline at "));
    }
}
