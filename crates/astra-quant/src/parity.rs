//! Kernel parity: every dot kernel against an f64 reference, and every SIMD kernel
//! against the scalar one, over seeded random weights and activations in the shapes the
//! real models use and ragged ones. Used by the tests and by `astra parity kernels`.
//!
//! The reference is Σ_k w_k · a_k in f64, where w_k are the dequantized weights (ggml's
//! values) and a_k the dequantized *quantized* activations: kernel and reference see
//! the same inputs, so the only differences are the kernels' f32 roundings.
//!
//! Bound (per output, then as relative L2 over the case): a kernel computes exact
//! integer sums per block, then per block at most four f32 roundings (scale products,
//! int→float, the multiply-add), and accumulates `nb` block partials. Each partial is
//! at most Σ_{k∈block} |a_k| (|w_k| + 2|o_k|), where o_k is the block's offset (the
//! weight its code 0 stands for; zero for symmetric types), because an asymmetric
//! block's partial is a difference of a scale term and an offset term. The reference's
//! weights are themselves rounded to f32 (≤ u·|w_k|). Float weights count as blocks of
//! 32 (the kernels keep 32 lanes), plus the reduction and the tail. So, with u = 2⁻²⁴:
//!
//!   |kernel − ref| ≤ (nb + 5) · u · Σ_k |a_k| (|w_k| + 2|o_k|)
//!
//! and a case passes when its relative L2 error is at most the L2 norm of these bounds
//! over the L2 norm of the reference.

use crate::dot::{ActType, Isa, Kernels};
use crate::matmul::{matmul_quantized, QuantMatrix, QuantizedActivations};
use crate::{dequantize, row_bytes, GgmlType, QuantError, SUPPORTED_TYPES};

/// SIMD kernels against the scalar reference, as relative L2 (issue bound).
pub const SIMD_VS_SCALAR_BOUND: f64 = 1e-6;

const UNIT_ROUNDOFF: f64 = 1.0 / (1u64 << 24) as f64;

/// (cols, rows) of the cases: the real models' matrices (SmolLM2: 576 and 1536;
/// Gemma 3: 640, 1024 and 2048), a long reduction, and ragged shapes.
pub const SHAPES: [(usize, usize); 13] = [
    (576, 576),
    (576, 1536),
    (1536, 576),
    (640, 1024),
    (1024, 640),
    (640, 2048),
    (2048, 640),
    (4096, 16),
    (96, 5),
    (256, 7),
    (512, 33),
    (1056, 19),
    (2304, 3),
];

/// One case: a weight type on an instruction set at one shape.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub ty: GgmlType,
    pub isa: Isa,
    pub cols: usize,
    pub rows: usize,
    pub tokens: usize,
    /// Relative L2 error against the f64 reference.
    pub rel_l2: f64,
    /// The derived bound on `rel_l2` (module doc).
    pub bound: f64,
    /// Relative L2 difference from the scalar kernel (0 for the scalar kernel itself).
    pub vs_scalar: f64,
    /// Outputs, token-major, for bitwise comparison between builds.
    pub outputs: Vec<f32>,
}

impl CaseReport {
    pub fn passed(&self) -> bool {
        self.outputs.iter().all(|v| v.is_finite())
            && self.rel_l2 <= self.bound
            && self.vs_scalar <= SIMD_VS_SCALAR_BOUND
    }

    /// A stable file name for the outputs of this case.
    pub fn name(&self) -> String {
        format!(
            "{}_{}_{}x{}x{}",
            self.ty.name(),
            self.isa.name(),
            self.cols,
            self.rows,
            self.tokens
        )
    }
}

/// A small, fast, seedable generator (splitmix64): parity inputs must be the same on
/// every machine and build.
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly normal (sum of four uniforms), scaled; one value in 64 is a 6× outlier,
    /// as activations have.
    pub fn activation(&mut self) -> f32 {
        let v = (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0;
        if self.next_u64().is_multiple_of(64) {
            6.0 * v
        } else {
            v
        }
    }
}

/// Byte ranges of each block holding the scale fields: (offset, is f32) → set to
/// sane positive values in random blocks so that they are not NaN or infinite.
fn scale_fields(ty: GgmlType) -> &'static [(usize, bool)] {
    use GgmlType::*;
    match ty {
        Q2_K => &[(80, false), (82, false)],
        Q3_K => &[(108, false)],
        Q4_K | Q5_K => &[(0, false), (2, false)],
        Q6_K => &[(208, false)],
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_S | IQ4_NL => &[(0, false)],
        _ => &[],
    }
}

/// Byte range of each block holding the weight codes of an asymmetric type: zeroing
/// them leaves each weight at its block offset.
fn code_bytes(ty: GgmlType) -> Option<std::ops::Range<usize>> {
    use GgmlType::*;
    match ty {
        Q4_1 => Some(4..20),
        Q5_1 => Some(4..24),
        Q2_K => Some(16..80),
        Q4_K => Some(16..144),
        Q5_K => Some(16..176),
        _ => None,
    }
}

/// Sequential f32 accumulations a kernel makes over a row: one per block, or for float
/// weights (accumulated in 32 lanes, then reduced pairwise over five levels, then an
/// unvectorized tail of fewer than eight) n / 32 + 5 + 8.
fn accumulation_steps(ty: GgmlType, cols: usize) -> usize {
    match ty.block_elems() as usize {
        1 => cols.div_ceil(32) + 13,
        block => cols / block,
    }
}

/// Seeded weights of type `ty`: quantized from random values where a quantizer exists,
/// else random blocks with sane scales.
pub fn random_weights(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Vec<u8>, QuantError> {
    let mut rng = SplitMix::new(seed);
    if crate::can_quantize(ty) {
        let x: Vec<f32> = (0..rows * cols).map(|_| 0.05 * rng.activation()).collect();
        return crate::quantize(ty, &x);
    }
    let mut bytes: Vec<u8> = (0..row_bytes(ty, cols)? * rows)
        .map(|_| rng.next_u64() as u8)
        .collect();
    for block in bytes.chunks_exact_mut(ty.block_bytes() as usize) {
        for &(offset, _) in scale_fields(ty) {
            let scale = half::f16::from_f32(1e-3 + 1e-2 * rng.uniform());
            block[offset..offset + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    Ok(bytes)
}

fn dequantize_rows(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0.0f32; rows * cols];
    dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

/// Activations as the kernels see them, in f64 (exact: an f16 or f32 scale times a
/// small integer).
fn activations_f64(acts: &QuantizedActivations, tokens: usize, cols: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(tokens * cols);
    for t in 0..tokens {
        let row = acts.row(t);
        match acts.act {
            ActType::F32 => out.extend(
                row.chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64),
            ),
            ActType::Q8_1 => {
                for b in crate::blocks::as_blocks::<crate::blocks::BlockQ8_1>(row) {
                    let d = b.d.get() as f64;
                    out.extend(b.qs.iter().map(|&q| d * q as f64));
                }
            }
            ActType::Q8_0 => {
                for b in crate::blocks::as_blocks::<crate::blocks::BlockQ8_0>(row) {
                    let d = b.d.get() as f64;
                    out.extend(b.qs.iter().map(|&q| d * q as f64));
                }
            }
            ActType::Q8K => {
                for b in crate::blocks::as_blocks::<crate::blocks::BlockQ8K>(row) {
                    let d = b.d() as f64;
                    out.extend(b.qs.iter().map(|&q| d * q as f64));
                }
            }
        }
    }
    out
}

/// For Q8_1 activations, per block: the stored sum `s` minus the exact Σ d·q (empty
/// for the other activation types).
fn q8_1_sum_corrections(acts: &QuantizedActivations, token: usize) -> Vec<f64> {
    if acts.act != ActType::Q8_1 {
        return Vec::new();
    }
    crate::blocks::as_blocks::<crate::blocks::BlockQ8_1>(acts.row(token))
        .iter()
        .map(|b| b.s.get() as f64 - b.d.get() as f64 * b.qs.iter().map(|&q| q as f64).sum::<f64>())
        .collect()
}

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The f64 reference of a case and the bound its kernels must meet.
pub struct Reference {
    pub values: Vec<f64>,
    /// Bound on the relative L2 error (module doc).
    pub bound: f64,
}

impl Reference {
    /// The reference outputs (token-major) of `weights` (`rows × cols` of `ty`) applied
    /// to the quantized activations `acts`.
    pub fn compute(
        ty: GgmlType,
        weights: &[u8],
        rows: usize,
        cols: usize,
        acts: &QuantizedActivations,
    ) -> Result<Self, QuantError> {
        let wd = dequantize_rows(ty, weights, rows, cols)?;
        let offsets = match code_bytes(ty) {
            Some(range) => {
                let mut zeroed = weights.to_vec();
                for block in zeroed.chunks_exact_mut(ty.block_bytes() as usize) {
                    block[range.clone()].fill(0);
                }
                dequantize_rows(ty, &zeroed, rows, cols)?
            }
            None => vec![0.0; rows * cols],
        };
        let a = activations_f64(acts, acts.tokens, cols);
        let nb = accumulation_steps(ty, cols) as f64;
        let (mut values, mut bounds) = (Vec::new(), Vec::new());
        for (t, at) in a.chunks_exact(cols).enumerate() {
            let sums = q8_1_sum_corrections(acts, t);
            for (wr, or) in wd.chunks_exact(cols).zip(offsets.chunks_exact(cols)) {
                let mut sum = 0.0f64;
                let mut magnitude = 0.0f64;
                for k in 0..cols {
                    sum += wr[k] as f64 * at[k];
                    magnitude += at[k].abs() * (wr[k].abs() as f64 + 2.0 * or[k].abs() as f64);
                }
                // With Q8_1 activations the minimum meets the stored sum s of each
                // block, which is part of the format: the reference uses it too.
                for (b, corr) in sums.iter().enumerate() {
                    sum += or[32 * b] as f64 * corr;
                }
                values.push(sum);
                bounds.push((nb + 5.0) * UNIT_ROUNDOFF * magnitude);
            }
        }
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let (ref_norm, bound_norm) = (norm(&values), norm(&bounds));
        let bound = if ref_norm > 0.0 {
            bound_norm / ref_norm
        } else {
            bound_norm
        };
        Ok(Reference { values, bound })
    }

    pub fn rel_l2(&self, outputs: &[f32]) -> f64 {
        rel_l2(outputs, &self.values)
    }
}

/// Runs one case: `tokens` activation rows through a `rows × cols` matrix of `ty`.
pub fn run_case(
    ty: GgmlType,
    isa: Isa,
    cols: usize,
    rows: usize,
    tokens: usize,
    seed: u64,
) -> Result<CaseReport, QuantError> {
    let weights = random_weights(ty, rows, cols, seed)?;
    let kernels = Kernels::new(ty, isa)?;
    // The rows as the engine gives them to these kernels: packed where they pack.
    let stored = QuantMatrix::new(ty, rows, cols, &weights)?;
    let packed = crate::matmul::pack(&stored, &kernels);
    let w = match &packed {
        Some(bytes) => QuantMatrix::packed(ty, rows, cols, bytes)?,
        None => stored,
    };
    let mut rng = SplitMix::new(seed ^ 0x5eed);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.activation()).collect();
    let acts = QuantizedActivations::new(kernels.act, &x, cols)?;
    let mut outputs = vec![0.0f32; tokens * rows];
    matmul_quantized(&w, &acts, &mut outputs, &kernels);
    let mut scalar = vec![0.0f32; tokens * rows];
    matmul_quantized(&stored, &acts, &mut scalar, &Kernels::new(ty, Isa::Scalar)?);
    let reference = Reference::compute(ty, &weights, rows, cols, &acts)?;
    let scalar_f64: Vec<f64> = scalar.iter().map(|&v| v as f64).collect();
    Ok(CaseReport {
        ty,
        isa: kernels.isa,
        cols,
        rows,
        tokens,
        rel_l2: reference.rel_l2(&outputs),
        bound: reference.bound,
        vs_scalar: rel_l2(&outputs, &scalar_f64),
        outputs,
    })
}

/// Every (type, cols, rows) case: each supported type at each shape whose columns are
/// whole blocks of it.
pub fn default_cases() -> Vec<(GgmlType, usize, usize)> {
    let mut cases = Vec::new();
    for ty in SUPPORTED_TYPES {
        for (cols, rows) in SHAPES {
            if cols % ty.block_elems() as usize == 0 {
                cases.push((ty, cols, rows));
            }
        }
    }
    cases
}

/// Seed of a case, from its parameters, so a case is the same whatever else runs.
pub fn case_seed(ty: GgmlType, cols: usize, rows: usize) -> u64 {
    (ty.id() as u64) << 40 ^ (cols as u64) << 20 ^ rows as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel on this machine, at every shape, within its bounds; the SIMD ones
    /// within 1e-6 of the scalar reference.
    #[test]
    fn every_kernel_meets_its_bounds() {
        let mut failures = Vec::new();
        let mut count = 0;
        for (ty, cols, rows) in default_cases() {
            for isa in Isa::available_sets() {
                let r = run_case(ty, isa, cols, rows, 2, case_seed(ty, cols, rows)).unwrap();
                count += 1;
                if !r.passed() {
                    failures.push(format!(
                        "{} rel_l2 {:.3e} bound {:.3e} vs_scalar {:.3e}",
                        r.name(),
                        r.rel_l2,
                        r.bound,
                        r.vs_scalar
                    ));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {count} cases failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }

    /// Float weights: the SIMD kernels associate the sums exactly as the scalar
    /// reference does, so they agree to the bit.
    #[test]
    fn float_kernels_are_bitwise_identical_across_instruction_sets() {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            for (cols, rows) in [(576, 64), (1056, 19), (4096, 16), (100, 3)] {
                for isa in Isa::available_sets() {
                    let r = run_case(ty, isa, cols, rows, 3, case_seed(ty, cols, rows)).unwrap();
                    assert_eq!(r.vs_scalar, 0.0, "{}", r.name());
                }
            }
        }
    }

    /// The bound catches a kernel that is wrong in one weight of a row: the same
    /// weights with one code changed in one block give outputs the reference rejects.
    #[test]
    fn the_bound_rejects_a_single_wrong_weight() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::F16,
        ] {
            let (rows, cols) = (64, 2048);
            let weights = random_weights(ty, rows, cols, 7).unwrap();
            let kernels = Kernels::new(ty, Isa::Scalar).unwrap();
            let mut rng = SplitMix::new(8);
            let x: Vec<f32> = (0..cols).map(|_| rng.activation()).collect();
            let acts = QuantizedActivations::new(kernels.act, &x, cols).unwrap();
            let reference = Reference::compute(ty, &weights, rows, cols, &acts).unwrap();
            let mut wrong = weights.clone();
            // Flip one bit of one weight in the middle of each row: the lowest bit of a
            // code byte, or for F16 the top mantissa bit (the weight changes by half).
            let row_bytes = wrong.len() / rows;
            for r in 0..rows {
                wrong[r * row_bytes + row_bytes / 2 + 1] ^=
                    if ty == GgmlType::F16 { 0x02 } else { 0x01 };
            }
            let w = QuantMatrix::new(ty, rows, cols, &wrong).unwrap();
            let mut out = vec![0.0f32; rows];
            matmul_quantized(&w, &acts, &mut out, &kernels);
            let err = reference.rel_l2(&out);
            assert!(
                err > reference.bound,
                "{ty}: error {err:e} within bound {:e}",
                reference.bound
            );
        }
    }
}
