//! `astra parity moe`: a mixture-of-experts feed-forward on a backend (the router's
//! product, the softmax and top-k, the routed gate and up products, SwiGLU, the routed
//! down product, the weighted sum) against two references computed from the same
//! weights as the backend reads them (dequantized): one in f64 throughout, and one as
//! an fp16 engine computes it (inputs, weights and each product's output rounded to
//! fp16, sums in f32).

use std::path::Path;
use std::sync::Arc;

use astra_gguf::{GgmlType, GgufFile, GgufWriter, TensorSource};
use half::f16;

use crate::backend::{Activation, Backend, Gating};
use crate::backend_parity::{add_random_experts, distance, Rng};
use crate::weights::{load_experts, MatRef};
use crate::EngineError;

/// One routed feed-forward: its experts' types (gate, up, down), its shape and batch.
#[derive(Clone, Debug)]
pub struct MoeCase {
    pub types: [GgmlType; 3],
    pub n_embd: usize,
    pub n_ff: usize,
    pub experts: usize,
    pub used: usize,
    pub tokens: usize,
}

impl MoeCase {
    pub fn name(&self) -> String {
        let [g, u, d] = self.types.map(|t| t.name());
        let ty = if g == u && u == d {
            g.to_owned()
        } else {
            format!("{g}/{u}/{d}")
        };
        format!(
            "{ty} {}×{} of {} experts, {} used, {} tokens",
            self.n_ff, self.n_embd, self.experts, self.used, self.tokens
        )
    }

    /// The largest relative L2 distance from the f64 reference a backend may show, set
    /// by how its products round their activations (the widest rounding of the three
    /// weight types). F16 experts take f32 activations: what is left is f32 summation
    /// (2e-7 measured). The other types quantize activations to 8 bits per block, as
    /// llama.cpp does: each moves by up to half a step, 1/254 of its block's largest
    /// magnitude. Twice in a row (the input, then the gated rows, whose products of
    /// two near-normal values have heavy tails), that comes to about 1e-2 over blocks
    /// of 32 (Q8_0: up to 1.1e-2 measured over these cases) and 2e-2 over Q8_K's blocks
    /// of 256 (up to 2.04e-2); the bounds leave a quarter more.
    pub fn bound(&self) -> f64 {
        use astra_quant::ActType;
        self.types
            .iter()
            .map(|&t| match ActType::for_weights(t) {
                Ok(ActType::F32) => 1e-5,
                Ok(ActType::Q8_0 | ActType::Q8_1) => 1.4e-2,
                Ok(ActType::Q8K) | Err(_) => 2.6e-2,
            })
            .fold(0.0, f64::max)
    }
}

/// The cases `astra parity moe` runs: F16 experts and the 2-bit expert types of
/// mixture-of-experts files (IQ2_S, IQ2_XS, Q2_0, Q2_K) and Q4_K, Q8_0, in a small
/// shape of 8 experts with 2 used and a wider one of 32 with 8 used (as Qwen3-30B-A3B
/// routes), over one token and over batches whose experts take many rows.
pub fn default_cases() -> Vec<MoeCase> {
    use GgmlType::*;
    let mut cases = Vec::new();
    let types = [
        [F16; 3],
        [IQ2_S; 3],
        [IQ2_S, IQ2_S, Q2_0],
        [Q2_0; 3],
        [IQ2_XS; 3],
        [Q2_K; 3],
        [Q4_K; 3],
        [Q8_0; 3],
    ];
    for t in types {
        for (n_embd, n_ff, experts, used, tokens) in [
            (256, 256, 8, 2, 1),
            (256, 256, 8, 2, 7),
            (512, 256, 32, 8, 33),
        ] {
            cases.push(MoeCase {
                types: t,
                n_embd,
                n_ff,
                experts,
                used,
                tokens,
            });
        }
    }
    cases
}

/// What a case gave: the backend's output, its distance from each reference, and
/// whether it chose the reference's experts.
pub struct MoeReport {
    pub case: MoeCase,
    pub routes_equal: bool,
    /// Relative L2 of the backend's output from the f64 reference.
    pub rel_l2_f64: f64,
    /// Relative L2 of the backend's output from the fp16 reference.
    pub rel_l2_f16: f64,
    /// Relative L2 of the fp16 reference from the f64 one: what fp16 itself loses (not
    /// finite where a value overflows fp16, as random Q4_K weights' can).
    pub f16_vs_f64: f64,
    pub outputs: Vec<f32>,
}

impl MoeReport {
    pub fn passed(&self) -> bool {
        self.routes_equal && self.rel_l2_f64 <= self.case.bound()
    }
}

/// A case's weights, dequantized: the router, then each expert's gate, up and down.
struct Weights {
    router: Vec<f32>,
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
}

/// Runs `case` on `be` (weights and inputs from `seed`, their GGUF written in `dir`)
/// and compares it with the references.
pub fn run<B: Backend>(
    be: &B,
    case: &MoeCase,
    dir: &Path,
    seed: u64,
) -> Result<MoeReport, EngineError> {
    let invalid = |e: &dyn std::fmt::Display| EngineError::Invalid(e.to_string());
    let MoeCase {
        types: [tg, tu, td],
        n_embd: e,
        n_ff: ff,
        experts: n,
        used: k,
        tokens,
    } = *case;
    let mut w = GgufWriter::new();
    w.set(
        "general.architecture",
        astra_gguf::Value::String("moe".into()),
    );
    let router =
        astra_quant::parity::random_weights(GgmlType::F32, n, e, seed).map_err(|e| invalid(&e))?;
    w.add_tensor(
        "router",
        &[e as u64, n as u64],
        GgmlType::F32,
        TensorSource::Owned(router),
    )
    .map_err(|e| invalid(&e))?;
    add_random_experts(&mut w, "gate", &[tg], [n, ff, e], seed + 1)?;
    add_random_experts(&mut w, "up", &[tu], [n, ff, e], seed + 2)?;
    add_random_experts(&mut w, "down", &[td], [n, e, ff], seed + 3)?;
    std::fs::create_dir_all(dir).map_err(|e| invalid(&e))?;
    let path = dir.join(format!("moe-{seed}.gguf"));
    w.write_file(&path).map_err(|e| invalid(&e))?;
    let file = Arc::new(GgufFile::open(&path).map_err(|e| invalid(&e))?);

    // The backend's feed-forward.
    let x = Rng(seed).vec(tokens * e);
    let xt = be.tensor_from(&x, e)?;
    let router = be.matrix(&file, &MatRef::locate(&file, "router")?)?;
    let load = |name: &str, ty: GgmlType| load_experts(be, &file, &format!("{name}.{}", ty.name()));
    let (gate, up, down) = (load("gate", tg)?, load("up", tu)?, load("down", td)?);
    let mut scores = be.tensor(tokens, n)?;
    be.matmul(&xt, &mut [(&router, &mut scores)]);
    let gating = Gating {
        experts: n,
        k,
        renormalize: true,
    };
    let routes = be.route(&scores, gating)?;
    let slots = tokens * k;
    let (mut g, mut u) = (be.tensor(slots, ff)?, be.tensor(slots, ff)?);
    be.routed_matmul(&xt, false, &gate, &routes, &mut g)?;
    be.routed_matmul(&xt, false, &up, &routes, &mut u)?;
    be.glu(&mut g, &u, Activation::Silu);
    let mut d = be.tensor(slots, e)?;
    be.routed_matmul(&g, true, &down, &routes, &mut d)?;
    let mut out = be.tensor(tokens, e)?;
    be.mix_experts(&d, &routes, &mut out)?;
    let outputs = be.read(&out)?;
    be.check()?;

    // The references, from the weights as stored.
    let dequant = |name: &str, ty: GgmlType, rows: usize, cols: usize| {
        let t = file
            .tensor(name)
            .ok_or_else(|| EngineError::Invalid(format!("no tensor {name}")))?;
        let bytes = file.tensor_data(t);
        let mut all = vec![0.0f32; n * rows * cols];
        astra_quant::dequantize(ty, bytes, &mut all).map_err(|e| invalid(&e))?;
        Ok::<_, EngineError>(all.chunks_exact(rows * cols).map(<[f32]>::to_vec).collect())
    };
    let weights = Weights {
        router: {
            let t = file.tensor("router").expect("written above");
            let mut r = vec![0.0f32; n * e];
            astra_quant::dequantize(GgmlType::F32, file.tensor_data(t), &mut r)
                .map_err(|e| invalid(&e))?;
            r
        },
        gate: dequant(&format!("gate.{}", tg.name()), tg, ff, e)?,
        up: dequant(&format!("up.{}", tu.name()), tu, ff, e)?,
        down: dequant(&format!("down.{}", td.name()), td, e, ff)?,
    };
    let (want, chosen) = reference_f64(&weights, &x, case);
    let want_f16 = reference_f16(&weights, &x, case, &chosen);
    let rel_l2 = |want: &[f64]| {
        let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
        distance(&want, &outputs).0
    };
    let routes_equal = chosen
        .iter()
        .flatten()
        .map(|&(e, _)| e as u32)
        .eq(routes.experts.iter().copied());
    Ok(MoeReport {
        case: case.clone(),
        routes_equal,
        rel_l2_f64: rel_l2(&want),
        rel_l2_f16: rel_l2(&want_f16),
        f16_vs_f64: {
            let a: Vec<f32> = want.iter().map(|&v| v as f32).collect();
            let b: Vec<f32> = want_f16.iter().map(|&v| v as f32).collect();
            distance(&a, &b).0
        },
        outputs,
    })
}

/// Each token's experts and weights: the softmax of the router's scores in f64, the
/// `used` most probable (ties to the lower expert), renormalized.
type Chosen = Vec<Vec<(usize, f64)>>;

fn dot(w: &[f32], x: &[f64]) -> f64 {
    w.iter().zip(x).map(|(&w, &x)| w as f64 * x).sum()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The feed-forward in f64 throughout, and the experts it chose.
fn reference_f64(w: &Weights, x: &[f32], case: &MoeCase) -> (Vec<f64>, Chosen) {
    let (e, ff, n, k) = (case.n_embd, case.n_ff, case.experts, case.used);
    let mut out = vec![0.0f64; x.len()];
    let mut chosen = Vec::new();
    for (t, xt) in x.chunks_exact(e).enumerate() {
        let xt: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
        let scores: Vec<f64> = w.router.chunks_exact(e).map(|r| dot(r, &xt)).collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
        let top: Vec<(usize, f64)> = order[..k].iter().map(|&i| (i, exps[i] / sum)).collect();
        let norm: f64 = top.iter().map(|&(_, p)| p).sum();
        let top: Vec<(usize, f64)> = top.into_iter().map(|(i, p)| (i, p / norm)).collect();
        for &(ex, weight) in &top {
            let h: Vec<f64> = (0..ff)
                .map(|r| {
                    let row = |m: &[f32]| dot(&m[r * e..(r + 1) * e], &xt);
                    silu(row(&w.gate[ex])) * row(&w.up[ex])
                })
                .collect();
            for (c, o) in out[t * e..(t + 1) * e].iter_mut().enumerate() {
                *o += weight * dot(&w.down[ex][c * ff..(c + 1) * ff], &h);
            }
        }
        chosen.push(top);
    }
    (out, chosen)
}

/// The feed-forward over the experts `chosen`, as an fp16 engine computes it: the
/// input, weights, routing weights and each product's output rounded to fp16, every
/// sum of products in f32.
fn reference_f16(w: &Weights, x: &[f32], case: &MoeCase, chosen: &Chosen) -> Vec<f64> {
    let (e, ff) = (case.n_embd, case.n_ff);
    let r16 = |v: f32| f16::from_f32(v).to_f32();
    let dot16 = |w: &[f32], x: &[f32]| {
        r16(w
            .iter()
            .zip(x)
            .fold(0.0f32, |a, (&w, &x)| r16(w).mul_add(x, a)))
    };
    let mut out = vec![0.0f64; x.len()];
    for (t, (xt, top)) in x.chunks_exact(e).zip(chosen).enumerate() {
        let xt: Vec<f32> = xt.iter().map(|&v| r16(v)).collect();
        let mut acc = vec![0.0f32; e];
        for &(ex, weight) in top {
            let h: Vec<f32> = (0..ff)
                .map(|r| {
                    let g = dot16(&w.gate[ex][r * e..(r + 1) * e], &xt);
                    let u = dot16(&w.up[ex][r * e..(r + 1) * e], &xt);
                    r16(g / (1.0 + (-g).exp()) * u)
                })
                .collect();
            for (c, a) in acc.iter_mut().enumerate() {
                let d = dot16(&w.down[ex][c * ff..(c + 1) * ff], &h);
                *a = r16(weight as f32).mul_add(d, *a);
            }
        }
        for (o, a) in out[t * e..(t + 1) * e].iter_mut().zip(acc) {
            *o = r16(a) as f64;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    /// Every default case of the small shape on the CPU backend within its bound, with
    /// the reference's experts (the wide shape's are `astra parity moe`'s).
    #[test]
    fn cpu_routed_feed_forward_is_within_bounds() {
        let be = CpuBackend::new(2);
        let dir = std::env::temp_dir().join(format!("astra-moe-parity-{}", std::process::id()));
        let small = default_cases().into_iter().filter(|c| c.experts == 8);
        for (i, case) in small.enumerate() {
            let r = run(&be, &case, &dir, 100 + i as u64).unwrap();
            assert!(r.routes_equal, "{}: experts chosen", case.name());
            assert!(
                r.rel_l2_f64 <= case.bound(),
                "{}: relative L2 {} from f64 (bound {})",
                case.name(),
                r.rel_l2_f64,
                case.bound()
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
