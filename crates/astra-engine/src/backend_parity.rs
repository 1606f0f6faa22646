//! Backend against backend, op by op: every operation of [`Backend`] run on random
//! inputs by a reference backend (the CPU) and a candidate (a GPU), with the relative
//! L2 distance and largest absolute difference of the results. `astra parity kernels
//! --backend cuda` reports it.

use std::path::Path;
use std::sync::Arc;

use astra_gguf::{GgmlType, GgufFile, GgufWriter, TensorSource};

use crate::attention::KvLayout;
use crate::backend::{Activation, Attend, Backend, FeedForward, Heads, Input, Rope, SeqRows};
use crate::config::{Arch, Config};
use crate::weights::MatRef;
use crate::EngineError;

/// One op's comparison, with the second backend's results (for saved baselines).
#[derive(Clone, Debug)]
pub struct OpReport {
    pub op: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub outputs: Vec<f32>,
}

/// Weight types compared, with the shapes used.
pub const TYPES: [GgmlType; 7] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::IQ2_S,
];
const ROWS: usize = 96;
/// Weight types of the attention-and-product comparison: one per activation format.
const ATTENTION_OUT_TYPES: [GgmlType; 3] = [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K];
/// Down matrices of the feed-forward comparison: one per 32-block activation format.
const FFN_DOWN_TYPES: [GgmlType; 2] = [GgmlType::Q4_1, GgmlType::Q8_0];
/// Gate, up and down types of the feed-forward comparison whose down matrix takes Q8_K
/// (256-blocks): gate and up of FFN_K_ROWS rows, the down matrix as wide.
const FFN_K_TYPES: [GgmlType; 2] = [GgmlType::Q4_K, GgmlType::Q6_K];
const FFN_K_ROWS: usize = 256;
pub(crate) const COLS: usize = 512;
/// Types and widths (in their blocks) of the long-row product comparison, WIDE_ROWS rows
/// (an odd count) each. The K-quants: 19 blocks (three CUDA warps to a row, the last
/// part-filled, in the kernels that hold the activations) and 65 (past the widest rows
/// those take). Q8_0: 20 blocks (two warps, rows 8-byte aligned in the CUDA layout),
/// 45 (odd: rows 2-byte aligned) and 130 (past the held kernel's widest, 4-byte
/// aligned).
const WIDE: [(GgmlType, usize); 7] = [
    (GgmlType::Q4_K, 19),
    (GgmlType::Q6_K, 19),
    (GgmlType::Q4_K, 65),
    (GgmlType::Q6_K, 65),
    (GgmlType::Q8_0, 20),
    (GgmlType::Q8_0, 45),
    (GgmlType::Q8_0, 130),
];
const WIDE_ROWS: usize = 37;
/// Expert types of the routed comparison, with its shape: EXPERTS experts of
/// EXPERT_FF × COLS (gate, up) and COLS × EXPERT_FF (down), EXPERTS_USED per row.
pub(crate) const EXPERT_TYPES: [GgmlType; 2] = [GgmlType::Q8_0, GgmlType::Q4_K];
pub(crate) const EXPERTS: usize = 6;
pub(crate) const EXPERTS_USED: usize = 2;
pub(crate) const EXPERT_FF: usize = 256;
/// Batch sizes of the product comparisons: a few tokens; batches that part-fill the
/// CUDA backend's token tiles of 8 (its tiled products take up to 8 tiles a CTA); and a
/// batch large enough for a backend to take another path (the CUDA backend's cuBLAS
/// products).
pub const BATCHES: [usize; 4] = [3, 19, 45, 64];

/// The relative L2 distance of `got` from `want` (the absolute one where `want` is all
/// zero; infinite for different lengths) and the largest absolute difference, in f64.
pub fn distance(want: &[f32], got: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in want.iter().zip(got) {
        let d = a as f64 - b as f64;
        num += d * d;
        den += (a as f64) * (a as f64);
        max_abs = max_abs.max(d.abs());
    }
    let rel_l2 = if want.len() != got.len() {
        f64::INFINITY
    } else if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (rel_l2, max_abs)
}

fn report(op: impl Into<String>, want: &[f32], got: &[f32]) -> OpReport {
    let (rel_l2, max_abs) = distance(want, got);
    OpReport {
        op: op.into(),
        rel_l2,
        max_abs,
        outputs: got.to_vec(),
    }
}

/// Uniform values in [-1, 1) from a 64-bit LCG: reproducible inputs for comparisons
/// (here and in the attention tests).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn attention_config() -> Config {
    attention_config_with(64, 2)
}

/// [`attention_config`] with heads of `head_dim` elements, `n_head_kv` KV heads for
/// its four query heads.
fn attention_config_with(head_dim: usize, n_head_kv: usize) -> Config {
    attention_layers(head_dim, 4, n_head_kv, Some(40), vec![true, false])
}

/// A stack of attention layers (here and in [`crate::attention_parity`]): `n_head`
/// query heads of `head_dim` elements over `n_head_kv` KV heads, the layers
/// `layer_local` marks keeping a sliding `window`.
pub(crate) fn attention_layers(
    head_dim: usize,
    n_head: usize,
    n_head_kv: usize,
    window: Option<usize>,
    layer_local: Vec<bool>,
) -> Config {
    Config {
        arch: Arch::Gemma3,
        n_layer: layer_local.len(),
        n_embd: 256,
        n_head,
        n_head_kv,
        head_dim,
        n_ff: 512,
        n_vocab: 16,
        ctx_train: 4096,
        rms_eps: 1e-6,
        rope_base: 1e6,
        rope_dim: head_dim,
        embed_scale: None,
        sliding_window: window,
        layer_local,
        attn_scale: 1.0,
        moe: None,
    }
}

/// Random `rows × cols` matrices `{prefix}.{type}`, one of each type, seeds from `seed`.
fn add_random(
    w: &mut GgufWriter,
    prefix: &str,
    types: &[GgmlType],
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<(), EngineError> {
    let invalid = |e: &dyn std::fmt::Display| EngineError::Invalid(e.to_string());
    for (i, ty) in types.iter().enumerate() {
        let bytes = astra_quant::parity::random_weights(*ty, rows, cols, seed + i as u64)
            .map_err(|e| invalid(&e))?;
        w.add_tensor(
            format!("{prefix}.{}", ty.name()),
            &[cols as u64, rows as u64],
            *ty,
            TensorSource::Owned(bytes),
        )
        .map_err(|e| invalid(&e))?;
    }
    Ok(())
}

/// Random 3-D expert tensors `{prefix}.{type}` (`n` experts of `rows × cols`), one of
/// each type, seeds from `seed`.
pub(crate) fn add_random_experts(
    w: &mut GgufWriter,
    prefix: &str,
    types: &[GgmlType],
    [n, rows, cols]: [usize; 3],
    seed: u64,
) -> Result<(), EngineError> {
    let invalid = |e: &dyn std::fmt::Display| EngineError::Invalid(e.to_string());
    for (i, ty) in types.iter().enumerate() {
        // The experts lie one after another: the rows of one taller matrix.
        let bytes = astra_quant::parity::random_weights(*ty, n * rows, cols, seed + i as u64)
            .map_err(|e| invalid(&e))?;
        w.add_tensor(
            format!("{prefix}.{}", ty.name()),
            &[cols as u64, rows as u64, n as u64],
            *ty,
            TensorSource::Owned(bytes),
        )
        .map_err(|e| invalid(&e))?;
    }
    Ok(())
}

/// The expert tensors of the routed comparison: gate (`eg.`), up (`eu.`) and down
/// (`ed.`) of each of EXPERT_TYPES.
pub(crate) fn add_expert_tensors(w: &mut GgufWriter) -> Result<(), EngineError> {
    let up = [EXPERTS, EXPERT_FF, COLS];
    add_random_experts(w, "eg", &EXPERT_TYPES, up, 900)?;
    add_random_experts(w, "eu", &EXPERT_TYPES, up, 910)?;
    add_random_experts(w, "ed", &EXPERT_TYPES, [EXPERTS, COLS, EXPERT_FF], 920)
}

/// Runs every op on both backends; `dir` receives the random-weight GGUF the matrices
/// come from.
pub fn compare<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    dir: &Path,
) -> Result<Vec<OpReport>, EngineError> {
    let io = |e: std::io::Error| EngineError::Load(format!("writing the parity weights: {e}"));
    let mut w = GgufWriter::new();
    add_random(&mut w, "w", &TYPES, ROWS, COLS, 100)?;
    // Output projections of the attention below (its rows are 256 wide).
    add_random(&mut w, "wo", &ATTENTION_OUT_TYPES, ROWS, 256, 200)?;
    // Up matrices (gate is `w.`) and down matrices of the feed-forward below.
    add_random(&mut w, "wu", &TYPES, ROWS, COLS, 300)?;
    add_random(&mut w, "wd", &FFN_DOWN_TYPES, COLS, ROWS, 400)?;
    add_random(&mut w, "wgk", &FFN_K_TYPES, FFN_K_ROWS, COLS, 500)?;
    add_random(&mut w, "wuk", &FFN_K_TYPES, FFN_K_ROWS, COLS, 600)?;
    add_random(&mut w, "wdk", &FFN_K_TYPES, COLS, FFN_K_ROWS, 700)?;
    add_expert_tensors(&mut w)?;
    for (i, (ty, blocks)) in WIDE.into_iter().enumerate() {
        add_random(
            &mut w,
            &format!("wide{blocks}"),
            &[ty],
            WIDE_ROWS,
            ty.block_elems() as usize * blocks,
            800 + i as u64,
        )?;
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = dir.join("backend-parity.gguf");
    w.write_file(&path).map_err(io)?;
    let file = Arc::new(GgufFile::open(&path).map_err(|e| EngineError::Load(e.to_string()))?);
    let mut rng = Rng(42);
    let mut out = Vec::new();
    for tokens in BATCHES {
        out.extend(compare_products(a, b, &file, tokens, &mut rng)?);
    }
    let tokens = BATCHES[0];
    let Inputs {
        x,
        y,
        xa,
        xb,
        wa,
        wb,
        ya,
        yb,
    } = Inputs::new(a, b, tokens, &mut rng)?;
    let (mut na, mut nb) = (a.tensor(tokens, COLS)?, b.tensor(tokens, COLS)?);
    a.rms_norm(&xa, &wa, 1e-6, &mut na);
    b.rms_norm(&xb, &wb, 1e-6, &mut nb);
    out.push(report("rms_norm", &a.read(&na)?, &b.read(&nb)?));
    let hv = rng.vec(64);
    let (ha, hb) = (a.vector(&hv)?, b.vector(&hv)?);
    let (mut ga, mut gb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
    a.rms_norm_groups(&mut ga, &ha, 1e-6);
    b.rms_norm_groups(&mut gb, &hb, 1e-6);
    out.push(report("rms_norm per head", &a.read(&ga)?, &b.read(&gb)?));
    for neox in [false, true] {
        let (mut ra, mut rb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
        let rope = Rope {
            dims: 64,
            base: 10000.0,
            neox,
        };
        a.rope(&mut ra, 64, &a.ids(&[0, 7, 1000])?, rope);
        b.rope(&mut rb, 64, &b.ids(&[0, 7, 1000])?, rope);
        out.push(report(
            if neox { "rope neox" } else { "rope" },
            &a.read(&ra)?,
            &b.read(&rb)?,
        ));
    }
    for act in [Activation::Silu, Activation::GeluTanh] {
        let (mut pa, mut pb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
        a.glu(&mut pa, &ya, act);
        b.glu(&mut pb, &yb, act);
        out.push(report(format!("glu {act:?}"), &a.read(&pa)?, &b.read(&pb)?));
    }
    out.extend(compare_prepare_attention(
        a,
        b,
        (&ha, &hb),
        &file,
        &mut rng,
    )?);
    let (mut oa, mut ob) = (a.tensor_from(&y, COLS)?, b.tensor_from(&y, COLS)?);
    let (mut sa, mut sb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
    a.norm_add(&mut oa, &wa, 1e-6, &mut sa);
    b.norm_add(&mut ob, &wb, 1e-6, &mut sb);
    out.push(report("rms_norm, add", &a.read(&sa)?, &b.read(&sb)?));
    let (mut sa, mut sb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
    a.add(&mut sa, &ya);
    b.add(&mut sb, &yb);
    a.scale(&mut sa, 0.37);
    b.scale(&mut sb, 0.37);
    out.push(report("add, scale", &a.read(&sa)?, &b.read(&sb)?));
    let (mut ta, mut tb) = (a.gather(&xa, &[2, 0])?, b.gather(&xb, &[2, 0])?);
    out.push(report("gather", &a.read(&ta)?, &b.read(&tb)?));
    a.scale_rows(&mut ta, &[0.5, -3.0]);
    b.scale_rows(&mut tb, &[0.5, -3.0]);
    let (mut sa, mut sb) = (a.tensor_from(&y, COLS)?, b.tensor_from(&y, COLS)?);
    a.scatter(&ta, &[1, 2], &mut sa);
    b.scatter(&tb, &[1, 2], &mut sb);
    out.push(report("scale_rows, scatter", &a.read(&sa)?, &b.read(&sb)?));
    let (mut sa, mut sb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
    a.add_bias(&mut sa, &wa);
    b.add_bias(&mut sb, &wb);
    a.mul(&mut sa, &ya);
    b.mul(&mut sb, &yb);
    out.push(report("add_bias, mul", &a.read(&sa)?, &b.read(&sb)?));
    a.softcap(&mut sa, 0.6);
    b.softcap(&mut sb, 0.6);
    out.push(report("softcap", &a.read(&sa)?, &b.read(&sb)?));
    out.extend(compare_routed(a, b, &file, &mut rng)?);
    // Heads of 64, 128 and 256 elements (one, two and four CUDA threads per key), two or
    // four query heads to a KV head.
    for (head_dim, n_head_kv) in [(64, 2), (128, 2), (256, 2), (256, 1)] {
        out.extend(compare_attention(a, b, head_dim, n_head_kv, &mut rng)?);
    }
    out.extend(compare_feed_forward(a, b, &file, &mut rng)?);
    out.extend(compare_wide_products(a, b, &file, &mut rng)?);
    let _ = std::fs::remove_file(&path);
    Ok(out)
}

/// The same random inputs on both backends: `tokens` rows `x` and `y` of COLS values,
/// and a vector `w` of norm weights.
struct Inputs<A: Backend, B: Backend> {
    x: Vec<f32>,
    y: Vec<f32>,
    xa: A::Tensor,
    xb: B::Tensor,
    wa: A::Vector,
    wb: B::Vector,
    ya: A::Tensor,
    yb: B::Tensor,
}

impl<A: Backend, B: Backend> Inputs<A, B> {
    fn new(a: &A, b: &B, tokens: usize, rng: &mut Rng) -> Result<Self, EngineError> {
        let x = rng.vec(tokens * COLS);
        let (xa, xb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
        let wv = rng.vec(COLS);
        let (wa, wb) = (a.vector(&wv)?, b.vector(&wv)?);
        let y = rng.vec(tokens * COLS);
        let (ya, yb) = (a.tensor_from(&y, COLS)?, b.tensor_from(&y, COLS)?);
        Ok(Inputs {
            x,
            y,
            xa,
            xb,
            wa,
            wb,
            ya,
            yb,
        })
    }
}

/// Each weight type's product with `tokens` random rows, plain and in its fused forms
/// (normed rows; gated rows added to a residual). Ops of batches past the first are
/// named with their token count.
fn compare_products<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    file: &Arc<GgufFile>,
    tokens: usize,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let mut out = Vec::new();
    let first = tokens == BATCHES[0];
    let batch = if first {
        String::new()
    } else {
        format!(", {tokens} tokens")
    };
    let Inputs {
        x,
        xa,
        xb,
        wa,
        wb,
        ya,
        yb,
        ..
    } = Inputs::new(a, b, tokens, rng)?;
    let residual = rng.vec(tokens * ROWS);
    for ty in TYPES {
        let m = MatRef::locate(file, &format!("w.{}", ty.name()))?;
        let (ma, mb) = (a.matrix(file, &m)?, b.matrix(file, &m)?);
        let (mut oa, mut ob) = (a.tensor(tokens, ROWS)?, b.tensor(tokens, ROWS)?);
        a.matmul(&xa, &mut [(&ma, &mut oa)]);
        b.matmul(&xb, &mut [(&mb, &mut ob)]);
        out.push(report(
            format!("matmul {}{batch}", ty.name()),
            &a.read(&oa)?,
            &b.read(&ob)?,
        ));
        let (mut sa, mut sb) = (a.tensor(tokens, COLS)?, b.tensor(tokens, COLS)?);
        a.product(
            Input::Normed {
                x: &xa,
                w: &wa,
                eps: 1e-6,
                normed: &mut sa,
            },
            &mut [(&ma, &mut oa)],
            None,
        );
        b.product(
            Input::Normed {
                x: &xb,
                w: &wb,
                eps: 1e-6,
                normed: &mut sb,
            },
            &mut [(&mb, &mut ob)],
            None,
        );
        out.push(report(
            format!("rms_norm, matmul {}{batch}", ty.name()),
            &a.read(&oa)?,
            &b.read(&ob)?,
        ));
        let (mut ga, mut gb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
        let (mut ra, mut rb) = (
            a.tensor_from(&residual, ROWS)?,
            b.tensor_from(&residual, ROWS)?,
        );
        a.product(
            Input::Glu {
                gate: &mut ga,
                up: &ya,
                act: Activation::GeluTanh,
            },
            &mut [(&ma, &mut oa)],
            Some(&mut ra),
        );
        b.product(
            Input::Glu {
                gate: &mut gb,
                up: &yb,
                act: Activation::GeluTanh,
            },
            &mut [(&mb, &mut ob)],
            Some(&mut rb),
        );
        out.push(report(
            format!("glu, matmul {}, add{batch}", ty.name()),
            &a.read(&ra)?,
            &b.read(&rb)?,
        ));
        // The embedding lookup of the same matrix, once.
        if first {
            let ids = [0u32, 5, ROWS as u32 - 1];
            let (mut ea, mut eb) = (a.tensor(3, COLS)?, b.tensor(3, COLS)?);
            a.embed(&ma, &a.ids(&ids)?, Some(1.5), &mut ea);
            b.embed(&mb, &b.ids(&ids)?, Some(1.5), &mut eb);
            out.push(report(
                format!("embed {}", ty.name()),
                &a.read(&ea)?,
                &b.read(&eb)?,
            ));
        }
    }
    Ok(out)
}

/// A mixture-of-experts feed-forward of each expert type: a router's scores routed,
/// the gate and up products routed, gated, the down product routed per slot, the
/// slots mixed.
fn compare_routed<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    file: &Arc<GgufFile>,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let tokens = 5;
    let gating = crate::backend::Gating {
        experts: EXPERTS,
        k: EXPERTS_USED,
        renormalize: true,
    };
    let scores = rng.vec(tokens * EXPERTS);
    let ra = a.route(&a.tensor_from(&scores, EXPERTS)?, gating)?;
    let rb = b.route(&b.tensor_from(&scores, EXPERTS)?, gating)?;
    let mut out = vec![report("route", &ra.weights, &rb.weights)];
    if ra.experts != rb.experts {
        out.push(OpReport {
            op: "route: experts chosen".into(),
            rel_l2: f64::INFINITY,
            max_abs: f64::INFINITY,
            outputs: rb.weights.clone(),
        });
    }
    let x = rng.vec(tokens * COLS);
    let (xa, xb) = (a.tensor_from(&x, COLS)?, b.tensor_from(&x, COLS)?);
    let slots = tokens * EXPERTS_USED;
    for ty in EXPERT_TYPES {
        let load = |p: &str| {
            let name = format!("{p}.{}", ty.name());
            Ok::<_, EngineError>((
                crate::weights::load_experts(a, file, &name)?,
                crate::weights::load_experts(b, file, &name)?,
            ))
        };
        let ((ga, gb), (ua, ub), (da, db)) = (load("eg")?, load("eu")?, load("ed")?);
        let (mut gta, mut gtb) = (a.tensor(slots, EXPERT_FF)?, b.tensor(slots, EXPERT_FF)?);
        let (mut uta, mut utb) = (a.tensor(slots, EXPERT_FF)?, b.tensor(slots, EXPERT_FF)?);
        a.routed_matmul(&xa, false, &ga, &ra, &mut gta)?;
        b.routed_matmul(&xb, false, &gb, &ra, &mut gtb)?;
        out.push(report(
            format!("routed matmul {}", ty.name()),
            &a.read(&gta)?,
            &b.read(&gtb)?,
        ));
        a.routed_matmul(&xa, false, &ua, &ra, &mut uta)?;
        b.routed_matmul(&xb, false, &ub, &ra, &mut utb)?;
        a.glu(&mut gta, &uta, Activation::Silu);
        b.glu(&mut gtb, &utb, Activation::Silu);
        let (mut dta, mut dtb) = (a.tensor(slots, COLS)?, b.tensor(slots, COLS)?);
        a.routed_matmul(&gta, true, &da, &ra, &mut dta)?;
        b.routed_matmul(&gtb, true, &db, &ra, &mut dtb)?;
        let (mut ma, mut mb) = (a.tensor(tokens, COLS)?, b.tensor(tokens, COLS)?);
        a.mix_experts(&dta, &ra, &mut ma)?;
        b.mix_experts(&dtb, &ra, &mut mb)?;
        out.push(report(
            format!("routed feed-forward {}", ty.name()),
            &a.read(&ma)?,
            &b.read(&mb)?,
        ));
    }
    Ok(out)
}

/// Products with rows of many blocks (WIDE), of one token and of a few, and the
/// embedding lookup of their rows.
fn compare_wide_products<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    file: &Arc<GgufFile>,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let mut out = Vec::new();
    for (ty, blocks) in WIDE {
        let cols = ty.block_elems() as usize * blocks;
        let m = MatRef::locate(file, &format!("wide{blocks}.{}", ty.name()))?;
        let (ma, mb) = (a.matrix(file, &m)?, b.matrix(file, &m)?);
        for tokens in [1, BATCHES[0]] {
            let x = rng.vec(tokens * cols);
            let (xa, xb) = (a.tensor_from(&x, cols)?, b.tensor_from(&x, cols)?);
            let (mut oa, mut ob) = (a.tensor(tokens, WIDE_ROWS)?, b.tensor(tokens, WIDE_ROWS)?);
            a.matmul(&xa, &mut [(&ma, &mut oa)]);
            b.matmul(&xb, &mut [(&mb, &mut ob)]);
            out.push(report(
                format!(
                    "matmul {}, {blocks} blocks a row, {tokens} tokens",
                    ty.name()
                ),
                &a.read(&oa)?,
                &b.read(&ob)?,
            ));
        }
        let ids = [1u32, WIDE_ROWS as u32 - 1];
        let (mut ea, mut eb) = (a.tensor(ids.len(), cols)?, b.tensor(ids.len(), cols)?);
        a.embed(&ma, &a.ids(&ids)?, None, &mut ea);
        b.embed(&mb, &b.ids(&ids)?, None, &mut eb);
        out.push(report(
            format!("embed {}, {blocks} blocks a row", ty.name()),
            &a.read(&ea)?,
            &b.read(&eb)?,
        ));
    }
    Ok(out)
}

/// The feed-forward block of one row (a decode step's, which a backend may fuse) for
/// each gate and up type with each 32-block down type, and for the K-quants with each
/// Q8_K down type (256 gate rows): SwiGLU added to the row, and GeGLU post-normed
/// before the add.
fn compare_feed_forward<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    file: &Arc<GgufFile>,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let mut out = Vec::new();
    let x = rng.vec(COLS);
    // Norm weights a quarter of the inputs' size: the products of random gate and up rows
    // stay well inside the f16 range of a Q8_1 block's sum (ggml's format, which
    // overflows to infinity as the CPU kernels do).
    let (nv, pv) = (
        rng.vec(COLS).iter().map(|v| v * 0.25).collect::<Vec<_>>(),
        rng.vec(COLS),
    );
    let (na, nb) = (a.vector(&nv)?, b.vector(&nv)?);
    let (pa, pb) = (a.vector(&pv)?, b.vector(&pv)?);
    let down_32 = FFN_DOWN_TYPES.map(|t| (t, "wd"));
    let down_k = FFN_K_TYPES.map(|t| (t, "wdk"));
    let cases = TYPES
        .iter()
        .map(|&t| (t, "w", "wu", ROWS, &down_32[..]))
        .chain(
            FFN_K_TYPES
                .iter()
                .map(|&t| (t, "wgk", "wuk", FFN_K_ROWS, &down_k[..])),
        );
    for (ty, gate, up, rows, downs) in cases {
        let (g, u) = (
            MatRef::locate(file, &format!("{gate}.{}", ty.name()))?,
            MatRef::locate(file, &format!("{up}.{}", ty.name()))?,
        );
        let (ga, gb, ua, ub) = (
            a.matrix(file, &g)?,
            b.matrix(file, &g)?,
            a.matrix(file, &u)?,
            b.matrix(file, &u)?,
        );
        for &(down, name) in downs {
            let d = MatRef::locate(file, &format!("{name}.{}", down.name()))?;
            let (da, db) = (a.matrix(file, &d)?, b.matrix(file, &d)?);
            for post in [false, true] {
                let act = if post {
                    Activation::GeluTanh
                } else {
                    Activation::Silu
                };
                let want =
                    feed_forward_row(a, &x, &na, [&ga, &ua, &da], rows, act, post.then_some(&pa))?;
                let got =
                    feed_forward_row(b, &x, &nb, [&gb, &ub, &db], rows, act, post.then_some(&pb))?;
                let post = if post {
                    ", GeGLU, post-norm"
                } else {
                    ", SwiGLU"
                };
                out.push(report(
                    format!(
                        "feed-forward {} gate/up, {} down{post}",
                        ty.name(),
                        down.name()
                    ),
                    &want,
                    &got,
                ));
            }
        }
    }
    Ok(out)
}

/// Row `x` through `be`'s feed-forward block with matrices gate, up and down (gate and
/// up of `rows` rows).
fn feed_forward_row<B: Backend>(
    be: &B,
    x: &[f32],
    norm: &B::Vector,
    [gate, up, down]: [&B::Matrix; 3],
    rows: usize,
    act: Activation,
    post_norm: Option<&B::Vector>,
) -> Result<Vec<f32>, EngineError> {
    let (mut xt, mut normed, mut gate_rows, mut up_rows, mut out) = (
        be.tensor_from(x, COLS)?,
        be.tensor(1, COLS)?,
        be.tensor(1, rows)?,
        be.tensor(1, rows)?,
        be.tensor(1, COLS)?,
    );
    let (gate_rows, up_rows) = (&mut gate_rows, &mut up_rows);
    be.feed_forward(FeedForward {
        x: &mut xt,
        norm,
        eps: 1e-6,
        gate,
        up,
        down,
        act,
        post_norm,
        normed: &mut normed,
        gate_rows,
        up_rows,
        out: &mut out,
    });
    be.read(&xt)
}

/// Queries (four heads) and keys (two) normed per head, rotated and the queries
/// scaled; the keys and values stored, and read back through attention.
fn compare_prepare_attention<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    norm: (&A::Vector, &B::Vector),
    file: &Arc<GgufFile>,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let cfg = attention_config();
    let (qd, kd, n) = (cfg.q_dim(), cfg.kv_dim(), 3);
    let layout = KvLayout::new(&cfg, 64, 8);
    let (mut ca, mut cb) = (a.kv_cache(&layout)?, b.kv_cache(&layout)?);
    let (q, k, v) = (rng.vec(n * qd), rng.vec(n * kd), rng.vec(n * kd));
    let (mut qa, mut qb) = (a.tensor_from(&q, qd)?, b.tensor_from(&q, qd)?);
    let (mut ka, mut kb) = (a.tensor_from(&k, kd)?, b.tensor_from(&k, kd)?);
    let (va, vb) = (a.tensor_from(&v, kd)?, b.tensor_from(&v, kd)?);
    let (pa, pb) = (a.ids(&[0, 1, 2])?, b.ids(&[0, 1, 2])?);
    let rope = Rope {
        dims: 64,
        base: 10000.0,
        neox: true,
    };
    let heads_a = Heads {
        head_dim: 64,
        q_norm: Some(norm.0),
        k_norm: Some(norm.0),
        eps: 1e-6,
        rope,
        q_scale: Some(0.125),
    };
    let heads_b = Heads {
        head_dim: 64,
        q_norm: Some(norm.1),
        k_norm: Some(norm.1),
        eps: 1e-6,
        rope,
        q_scale: Some(0.125),
    };
    a.prepare_attention(
        1,
        &mut [SeqRows {
            kv: &mut ca,
            rows: 0..n,
            pos: 0,
        }],
        &pa,
        &mut qa,
        &mut ka,
        &va,
        &heads_a,
    );
    b.prepare_attention(
        1,
        &mut [SeqRows {
            kv: &mut cb,
            rows: 0..n,
            pos: 0,
        }],
        &pb,
        &mut qb,
        &mut kb,
        &vb,
        &heads_b,
    );
    let mut out = vec![
        report("prepare attention, queries", &a.read(&qa)?, &b.read(&qb)?),
        report("prepare attention, keys", &a.read(&ka)?, &b.read(&kb)?),
    ];
    let (mut oa, mut ob) = (a.tensor(n, qd)?, b.tensor(n, qd)?);
    a.attention(
        Attend {
            layer: 1,
            seqs: &mut [SeqRows {
                kv: &mut ca,
                rows: 0..n,
                pos: 0,
            }],
            positions: &pa,
            q: &qa,
            scale: 1.0,
        },
        &mut oa,
    );
    b.attention(
        Attend {
            layer: 1,
            seqs: &mut [SeqRows {
                kv: &mut cb,
                rows: 0..n,
                pos: 0,
            }],
            positions: &pb,
            q: &qb,
            scale: 1.0,
        },
        &mut ob,
    );
    out.push(report(
        "prepare attention, stored keys and values",
        &a.read(&oa)?,
        &b.read(&ob)?,
    ));
    // One more position decoded, its attention straight into an output projection
    // (added to a residual).
    let (q, k, v) = (rng.vec(qd), rng.vec(kd), rng.vec(kd));
    let (mut qa, mut qb) = (a.tensor_from(&q, qd)?, b.tensor_from(&q, qd)?);
    let (mut ka, mut kb) = (a.tensor_from(&k, kd)?, b.tensor_from(&k, kd)?);
    let (va, vb) = (a.tensor_from(&v, kd)?, b.tensor_from(&v, kd)?);
    let (pa, pb) = (a.ids(&[3])?, b.ids(&[3])?);
    a.prepare_attention(
        1,
        &mut [SeqRows {
            kv: &mut ca,
            rows: 0..1,
            pos: 3,
        }],
        &pa,
        &mut qa,
        &mut ka,
        &va,
        &heads_a,
    );
    b.prepare_attention(
        1,
        &mut [SeqRows {
            kv: &mut cb,
            rows: 0..1,
            pos: 3,
        }],
        &pb,
        &mut qb,
        &mut kb,
        &vb,
        &heads_b,
    );
    let residual = rng.vec(ROWS);
    for ty in ATTENTION_OUT_TYPES {
        let m = MatRef::locate(file, &format!("wo.{}", ty.name()))?;
        let (ma, mb) = (a.matrix(file, &m)?, b.matrix(file, &m)?);
        let (mut ta, mut tb) = (a.tensor(1, qd)?, b.tensor(1, qd)?);
        let (mut oa, mut ob) = (a.tensor(1, ROWS)?, b.tensor(1, ROWS)?);
        let (mut ra, mut rb) = (
            a.tensor_from(&residual, ROWS)?,
            b.tensor_from(&residual, ROWS)?,
        );
        let seq_a = &mut [SeqRows {
            kv: &mut ca,
            rows: 0..1,
            pos: 3,
        }];
        let seq_b = &mut [SeqRows {
            kv: &mut cb,
            rows: 0..1,
            pos: 3,
        }];
        a.attention_product(
            Attend {
                layer: 1,
                seqs: seq_a,
                positions: &pa,
                q: &qa,
                scale: 1.0,
            },
            &mut ta,
            &ma,
            &mut oa,
            Some(&mut ra),
        );
        b.attention_product(
            Attend {
                layer: 1,
                seqs: seq_b,
                positions: &pb,
                q: &qb,
                scale: 1.0,
            },
            &mut tb,
            &mb,
            &mut ob,
            Some(&mut rb),
        );
        out.push(report(
            format!("attention, matmul {}, add", ty.name()),
            &a.read(&ra)?,
            &b.read(&rb)?,
        ));
    }
    Ok(out)
}

/// Attention with heads of `head_dim` (`n_head_kv` KV heads) over a sliding-window layer (window 40, its ring
/// wrapped) and a global layer, fed in batches of 70, 1, 29, 64, 64 and 100 positions,
/// then single rows deep enough for a backend to spread a row's chunks.
fn compare_attention<A: Backend, B: Backend>(
    a: &A,
    b: &B,
    head_dim: usize,
    n_head_kv: usize,
    rng: &mut Rng,
) -> Result<Vec<OpReport>, EngineError> {
    let cfg = attention_config_with(head_dim, n_head_kv);
    let (qd, kd) = (cfg.q_dim(), cfg.kv_dim());
    let layout = KvLayout::new(&cfg, 512, 100);
    let (mut ka, mut kb) = (a.kv_cache(&layout)?, b.kv_cache(&layout)?);
    let mut out = Vec::new();
    let mut pos = 0;
    for n in [70usize, 1, 29, 64, 64, 100, 1, 1] {
        let (q, k, v) = (rng.vec(n * qd), rng.vec(n * kd), rng.vec(n * kd));
        for layer in 0..2 {
            let (qa, kta, va) = (
                a.tensor_from(&q, qd)?,
                a.tensor_from(&k, kd)?,
                a.tensor_from(&v, kd)?,
            );
            let (qb, ktb, vb) = (
                b.tensor_from(&q, qd)?,
                b.tensor_from(&k, kd)?,
                b.tensor_from(&v, kd)?,
            );
            let (mut oa, mut ob) = (a.tensor(n, qd)?, b.tensor(n, qd)?);
            let positions: Vec<u32> = (pos as u32..(pos + n) as u32).collect();
            let (pa, pb) = (a.ids(&positions)?, b.ids(&positions)?);
            a.kv_store(
                layer,
                &mut [SeqRows {
                    kv: &mut ka,
                    rows: 0..n,
                    pos,
                }],
                &pa,
                &kta,
                &va,
            );
            b.kv_store(
                layer,
                &mut [SeqRows {
                    kv: &mut kb,
                    rows: 0..n,
                    pos,
                }],
                &pb,
                &ktb,
                &vb,
            );
            a.attention(
                Attend {
                    layer,
                    seqs: &mut [SeqRows {
                        kv: &mut ka,
                        rows: 0..n,
                        pos,
                    }],
                    positions: &pa,
                    q: &qa,
                    scale: 0.125,
                },
                &mut oa,
            );
            b.attention(
                Attend {
                    layer,
                    seqs: &mut [SeqRows {
                        kv: &mut kb,
                        rows: 0..n,
                        pos,
                    }],
                    positions: &pb,
                    q: &qb,
                    scale: 0.125,
                },
                &mut ob,
            );
            let kind = if layer == 0 { "window 40" } else { "global" };
            let shape = format!("head {head_dim}, {} per KV head", cfg.n_head / n_head_kv);
            out.push(report(
                format!("attention {kind}, {shape}, {n} at {pos}"),
                &a.read(&oa)?,
                &b.read(&ob)?,
            ));
        }
        pos += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;

    #[test]
    fn distance_is_relative_to_the_first_argument() {
        let (rel, max) = distance(&[3.0, 4.0], &[3.0, 4.5]);
        assert!((rel - 0.1).abs() < 1e-12, "{rel}");
        assert_eq!(max, 0.5);
        assert_eq!(distance(&[1.0, -2.0], &[1.0, -2.0]), (0.0, 0.0));
        assert_eq!(
            distance(&[0.0, 0.0], &[0.0, 0.5]),
            (0.5, 0.5),
            "absolute against zeros"
        );
        assert_eq!(distance(&[1.0], &[1.0, 2.0]).0, f64::INFINITY);
    }

    /// The harness itself: the CPU backend against itself on 1 and 3 threads agrees to
    /// the bit (its ops do not depend on the thread count), so every distance is zero.
    #[test]
    fn cpu_against_cpu_is_exact() {
        let dir = std::env::temp_dir().join(format!("astra-backend-parity-{}", std::process::id()));
        let reports = compare(&CpuBackend::new(1), &CpuBackend::new(3), &dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(reports.len() > 20);
        for r in reports {
            assert_eq!((r.rel_l2, r.max_abs), (0.0, 0.0), "{}", r.op);
        }
    }
}
