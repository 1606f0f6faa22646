//! Quantized weights × f32 activations, multithreaded and deterministic.
//!
//! Protocol:
//! 1. Each token's activation row is quantized to the weights' activation type by the
//!    one scalar quantizer ([`crate::ActType::quantize`]), independently of the others.
//! 2. The weight rows are cut into chunks, handed to the current rayon pool.
//! 3. A task computes, for each of its rows and each token, one output element with one
//!    call of the dot kernel.
//!
//! Invariant: an output element is a function of one weight row and one token's
//! quantized activations only, computed in a fixed order by one thread. Thread count,
//! chunking and batch size change which thread computes it and when, never its value.

use rayon::prelude::*;

use crate::dot::{ActRow, ActType, Kernels};
use crate::{row_bytes, GgmlType, QuantError};

/// A row-major matrix of quantized weights, borrowed (usually from a memory map).
/// GGUF stores a `[rows, cols]` weight with dims `[cols, rows]`.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: &'a [u8],
    row_bytes: usize,
}

impl<'a> QuantMatrix<'a> {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        let row_bytes = row_bytes(ty, cols)?;
        let expected = row_bytes * rows;
        if data.len() != expected {
            return Err(QuantError::WrongLength { ty, expected, actual: data.len() });
        }
        Ok(QuantMatrix { ty, rows, cols, data, row_bytes })
    }

    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }
}

/// A batch of activation rows quantized for one activation type, with each row's block
/// scales in f32 where the type keeps them in f16 ([`ActRow`]).
pub struct QuantizedActivations {
    pub act: ActType,
    pub tokens: usize,
    row_bytes: usize,
    data: Vec<u8>,
    row_scales: usize,
    scales: Vec<f32>,
    row_quants: usize,
    quants: Vec<i8>,
    row_sums: usize,
    neg_sums4: Vec<i32>,
}

impl QuantizedActivations {
    /// Quantizes `x` (`tokens` rows of `cols` values).
    pub fn new(act: ActType, x: &[f32], cols: usize) -> Result<Self, QuantError> {
        let row_bytes = act.row_bytes(cols)?;
        let tokens = if cols == 0 { 0 } else { x.len() / cols };
        let mut data = vec![0u8; row_bytes * tokens];
        let (mut scales, mut quants, mut neg_sums4) = (Vec::new(), Vec::new(), Vec::new());
        for (xr, out) in x.chunks_exact(cols.max(1)).zip(data.chunks_exact_mut(row_bytes.max(1))) {
            act.quantize(xr, out);
            act.row_scales(out, &mut scales);
            act.row_quants(out, &mut quants);
            act.row_neg_sums4(out, &mut neg_sums4);
        }
        let per_token = |n: usize| n.checked_div(tokens).unwrap_or(0);
        let (row_scales, row_quants, row_sums) = (per_token(scales.len()), per_token(quants.len()), per_token(neg_sums4.len()));
        Ok(QuantizedActivations { act, tokens, row_bytes, data, row_scales, scales, row_quants, quants, row_sums, neg_sums4 })
    }

    #[inline]
    pub fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    #[inline]
    pub fn act_row(&self, t: usize) -> ActRow<'_> {
        ActRow {
            bytes: self.row(t),
            scales: &self.scales[t * self.row_scales..(t + 1) * self.row_scales],
            quants: &self.quants[t * self.row_quants..(t + 1) * self.row_quants],
            neg_sums4: &self.neg_sums4[t * self.row_sums..(t + 1) * self.row_sums],
        }
    }
}

/// Runs `tasks` independent tasks, `f(0)` … `f(tasks - 1)`, possibly in parallel, and
/// returns when all are done. Which thread runs a task must not matter to its result.
pub trait Parallel: Sync {
    fn threads(&self) -> usize;
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync));
}

/// The current rayon pool.
pub struct Rayon;

impl Parallel for Rayon {
    fn threads(&self) -> usize {
        rayon::current_num_threads()
    }
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        (0..tasks).into_par_iter().for_each(f);
    }
}

/// A pointer to the output that tasks may share: each writes only its own rows.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements (each output row index belongs to one chunk).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Rows per task: enough tasks to balance the pool, whole cache lines of output.
fn chunk_rows(rows: usize, threads: usize) -> usize {
    rows.div_ceil(4 * threads).next_multiple_of(16).max(16)
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `x` of `tokens × w.cols` and `out` of
/// `tokens × w.rows`, on the current rayon pool.
pub fn matmul(w: &QuantMatrix, x: &[f32], out: &mut [f32], kernels: &Kernels) -> Result<(), QuantError> {
    if kernels.weights != w.ty {
        return Err(QuantError::Unsupported(w.ty));
    }
    let tokens = if w.cols == 0 { 0 } else { x.len() / w.cols };
    assert_eq!(x.len(), tokens * w.cols, "activations are not whole rows of {}", w.cols);
    assert_eq!(out.len(), tokens * w.rows, "output is not tokens × rows");
    let acts = QuantizedActivations::new(kernels.act, x, w.cols)?;
    matmul_quantized(w, &acts, out, kernels);
    Ok(())
}

/// As [`matmul`], with activations already quantized (several matrices of the same
/// input, such as Q, K and V, share one quantization), on the current rayon pool.
pub fn matmul_quantized(w: &QuantMatrix, acts: &QuantizedActivations, out: &mut [f32], kernels: &Kernels) {
    matmul_quantized_on(&Rayon, w, acts, out, kernels)
}

/// As [`matmul_quantized`], on the given executor.
pub fn matmul_quantized_on(par: &dyn Parallel, w: &QuantMatrix, acts: &QuantizedActivations, out: &mut [f32], kernels: &Kernels) {
    assert_eq!(acts.act, kernels.act);
    assert_eq!(out.len(), acts.tokens * w.rows);
    let (rows, tokens, dot, dot1, dot4) = (w.rows, acts.tokens, kernels.dot, kernels.dot1, kernels.dot4);
    let shared = SharedOut(out.as_mut_ptr());
    let chunk = chunk_rows(rows, par.threads());
    par.run(rows.div_ceil(chunk), &|c| {
        // Capture the Sync wrapper whole, not its raw pointer field.
        #[allow(clippy::redundant_locals)]
        let shared = shared;
        // SAFETY (both writes): t * rows + r < out.len(), and row r belongs to this
        // task only.
        let put = |t: usize, r: usize, v: f32| unsafe { *shared.0.add(t * rows + r) = v };
        let task_rows = c * chunk..((c + 1) * chunk).min(rows);
        // A tile of weight rows meets every block of four tokens in turn, so that both
        // stay in L1 rather than the whole batch of activations streaming past each row.
        for tile in task_rows.clone().step_by(ROW_TILE) {
            let tile = tile..(tile + ROW_TILE).min(task_rows.end);
            let tile_w = &w.bytes()[tile.start * w.row_bytes..tile.end * w.row_bytes];
            let n = tile.len();
            let mut t = 0;
            if let Some(dot4) = dot4 {
                let mut out4 = [[0.0f32; 4]; ROW_TILE];
                while t + 4 <= tokens {
                    let a = [acts.act_row(t), acts.act_row(t + 1), acts.act_row(t + 2), acts.act_row(t + 3)];
                    dot4(tile_w, w.row_bytes, a, &mut out4[..n]);
                    for (r, v) in tile.clone().zip(&out4) {
                        (0..4).for_each(|i| put(t + i, r, v[i]));
                    }
                    t += 4;
                }
            }
            for t in t..tokens {
                match dot1 {
                    Some(dot1) => {
                        let mut out1 = [0.0f32; ROW_TILE];
                        dot1(tile_w, w.row_bytes, acts.act_row(t), &mut out1[..n]);
                        tile.clone().zip(out1).for_each(|(r, v)| put(t, r, v));
                    }
                    None => tile.clone().for_each(|r| put(t, r, dot(w.row(r), acts.row(t)))),
                }
            }
        }
    });
}

/// Weight rows walked together per block of tokens (16 rows of a 4096-column Q4_K
/// matrix are 36 KiB). Outputs do not depend on it: each is one dot product.
const ROW_TILE: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Isa;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every output element is bitwise the same for thread counts 1, 2, 3, 7 and batch
    /// sizes 1, 2, 5, 17.
    #[test]
    fn outputs_do_not_depend_on_threads_or_batch() {
        let (rows, cols) = (100, 512);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F32, GgmlType::Q8_K] {
            let weights = crate::parity::random_weights(ty, rows, cols, 1).unwrap();
            let w = QuantMatrix::new(ty, rows, cols, &weights).unwrap();
            let x = pseudo_random(17 * cols, 2);
            for isa in Isa::available_sets() {
                let k = Kernels::new(ty, isa).unwrap();
                // Reference: each token alone, one thread.
                let pool1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                let alone: Vec<Vec<f32>> = (0..17)
                    .map(|t| {
                        let mut o = vec![0.0; rows];
                        pool1.install(|| matmul(&w, &x[t * cols..(t + 1) * cols], &mut o, &k)).unwrap();
                        o
                    })
                    .collect();
                for threads in [1, 2, 3, 7] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    for batch in [1, 2, 5, 17] {
                        let mut o = vec![0.0; batch * rows];
                        pool.install(|| matmul(&w, &x[..batch * cols], &mut o, &k)).unwrap();
                        for t in 0..batch {
                            let got: Vec<u32> = o[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                            let want: Vec<u32> = alone[t].iter().map(|v| v.to_bits()).collect();
                            assert_eq!(got, want, "{ty} {isa:?} threads {threads} batch {batch} token {t}");
                        }
                    }
                }
            }
        }
    }
}
