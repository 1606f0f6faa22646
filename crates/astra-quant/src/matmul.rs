//! Quantized weights × f32 activations, multithreaded and deterministic.
//!
//! Protocol:
//! 1. Each token's activation row is quantized to the weights' activation type by the
//!    one scalar quantizer ([`crate::ActType::quantize`]), independently of the others.
//! 2. The weight rows are cut into chunks, handed to the current rayon pool.
//! 3. A task computes its rows' outputs for every token: where the kernels have a
//!    tile variant and the batch has four tokens or more, a tile of rows at a time
//!    against the whole batch; else a run of rows per call against one token (decode)
//!    or four.
//!
//! Invariant: an output element is a function of one weight row and one token's
//! quantized activations only, computed in a fixed order by one thread. Thread count,
//! chunking and batch size change which thread computes it and when, never its value.

use rayon::prelude::*;

use crate::dot::{ActRow, ActType, Kernels, TILE_ROWS};
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
    /// Whether `data` is packed ([`pack`]) for the kernels' [`Packing`](crate::dot::Packing).
    packed: bool,
}

impl<'a> QuantMatrix<'a> {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        let row_bytes = row_bytes(ty, cols)?;
        let expected = row_bytes * rows;
        if data.len() != expected {
            return Err(QuantError::WrongLength {
                ty,
                expected,
                actual: data.len(),
            });
        }
        Ok(QuantMatrix {
            ty,
            rows,
            cols,
            data,
            row_bytes,
            packed: false,
        })
    }

    /// A matrix whose bytes [`pack`] made: only the kernels that packed them (the same
    /// weight type and instruction set) read it.
    pub fn packed(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, QuantError> {
        Ok(QuantMatrix {
            packed: true,
            ..Self::new(ty, rows, cols, data)?
        })
    }

    /// Row `r` as stored (not for a packed matrix, whose rows are interleaved).
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert!(!self.packed, "a packed matrix has no rows as stored");
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }
}

/// `w`'s bytes packed for `kernels` ([`Packing`](crate::dot::Packing)), where they
/// have a packing for its type; the result is read through [`QuantMatrix::packed`]
/// with the same kernels.
pub fn pack(w: &QuantMatrix, kernels: &Kernels) -> Option<Vec<u8>> {
    kernels.packing?;
    let mut out = vec![0u8; w.data.len()];
    pack_into_on(&Rayon, w, kernels, &mut out).then_some(out)
}

/// As [`pack`], into `out` (as long as `w`'s bytes), spread over `par` in runs of whole
/// groups; `false`, `out` untouched, where `kernels` have no packing for `w`.
pub fn pack_into_on(
    par: &dyn Parallel,
    w: &QuantMatrix,
    kernels: &Kernels,
    out: &mut [u8],
) -> bool {
    let Some(p) = kernels
        .packing
        .filter(|_| kernels.weights == w.ty && !w.packed)
    else {
        return false;
    };
    assert_eq!(out.len(), w.data.len(), "packing into as many bytes");
    // Four runs a thread, each whole groups (the last one takes the rows past them).
    let run_rows = w
        .rows
        .div_ceil(4 * par.threads())
        .next_multiple_of(p.rows)
        .max(p.rows);
    let run_bytes = (run_rows * w.row_bytes).max(1);
    let outs: Vec<std::sync::Mutex<&mut [u8]>> = out
        .chunks_mut(run_bytes)
        .map(std::sync::Mutex::new)
        .collect();
    par.run(outs.len(), &|i| {
        let mut out = outs[i].lock().expect("one task per run");
        let start = i * run_bytes;
        (p.pack)(&w.data[start..start + out.len()], w.row_bytes, &mut out);
    });
    true
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
    neg_sums: Vec<i32>,
}

impl QuantizedActivations {
    /// Quantizes `x` (`tokens` rows of `cols` values).
    pub fn new(act: ActType, x: &[f32], cols: usize) -> Result<Self, QuantError> {
        let row_bytes = act.row_bytes(cols)?;
        let tokens = x.len().checked_div(cols).unwrap_or(0);
        let mut data = vec![0u8; row_bytes * tokens];
        let (mut scales, mut quants, mut neg_sums) = (Vec::new(), Vec::new(), Vec::new());
        for (t, (xr, out)) in x
            .chunks_exact(cols.max(1))
            .zip(data.chunks_exact_mut(row_bytes.max(1)))
            .enumerate()
        {
            act.quantize(xr, out);
            act.row_scales(out, &mut scales);
            act.row_quants(out, &mut quants);
            act.row_neg_sums(out, &mut neg_sums);
            if t == 0 {
                // Every row adds as many as the first: room for the rest at once.
                scales.reserve_exact(scales.len() * tokens.saturating_sub(1));
                quants.reserve_exact(quants.len() * tokens.saturating_sub(1));
                neg_sums.reserve_exact(neg_sums.len() * tokens.saturating_sub(1));
            }
        }
        let per_token = |n: usize| n.checked_div(tokens).unwrap_or(0);
        let (row_scales, row_quants, row_sums) = (
            per_token(scales.len()),
            per_token(quants.len()),
            per_token(neg_sums.len()),
        );
        Ok(QuantizedActivations {
            act,
            tokens,
            row_bytes,
            data,
            row_scales,
            scales,
            row_quants,
            quants,
            row_sums,
            neg_sums,
        })
    }

    /// As [`Self::new`], the tokens of a batch quantized in parallel on `par` (each row
    /// by the same scalar quantizer, so the result is the same).
    pub fn new_on(
        par: &dyn Parallel,
        act: ActType,
        x: &[f32],
        cols: usize,
    ) -> Result<Self, QuantError> {
        let tokens = x.len().checked_div(cols).unwrap_or(0);
        let per_task = tokens.div_ceil(2 * par.threads()).max(8);
        if tokens <= per_task {
            return Self::new(act, x, cols);
        }
        let tasks = tokens.div_ceil(per_task);
        let parts: Vec<std::sync::Mutex<Option<Result<Self, QuantError>>>> =
            (0..tasks).map(|_| Default::default()).collect();
        par.run(tasks, &|i| {
            let rows = &x[i * per_task * cols..((i + 1) * per_task).min(tokens) * cols];
            *parts[i].lock().expect("own slot") = Some(Self::new(act, rows, cols));
        });
        let parts = parts
            .into_iter()
            .map(|p| p.into_inner().expect("own slot").expect("every task ran"))
            .collect::<Result<Vec<Self>, QuantError>>()?;
        // Joined into buffers of the whole batch's size, each allocated once.
        fn joined<T: Copy>(
            parts: &[QuantizedActivations],
            part: impl Fn(&QuantizedActivations) -> &[T],
        ) -> Vec<T> {
            let mut whole = Vec::with_capacity(parts.iter().map(|p| part(p).len()).sum());
            for p in parts {
                whole.extend_from_slice(part(p));
            }
            whole
        }
        let first = &parts[0];
        Ok(QuantizedActivations {
            act: first.act,
            tokens,
            row_bytes: first.row_bytes,
            data: joined(&parts, |p| &p.data),
            row_scales: first.row_scales,
            scales: joined(&parts, |p| &p.scales),
            row_quants: first.row_quants,
            quants: joined(&parts, |p| &p.quants),
            row_sums: first.row_sums,
            neg_sums: joined(&parts, |p| &p.neg_sums),
        })
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
            neg_sums: &self.neg_sums[t * self.row_sums..(t + 1) * self.row_sums],
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

/// Rows per task: two tasks per thread (a thread that falls behind leaves the other
/// one to take over half its share; more tasks cost more claims per step than they
/// win back in decode), whole cache lines of output (and so whole groups of a
/// [`Packing`](crate::dot::Packing), which has eight or sixteen rows).
fn chunk_rows(rows: usize, threads: usize) -> usize {
    rows.div_ceil(2 * threads).next_multiple_of(16).max(16)
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `x` of `tokens × w.cols` and `out` of
/// `tokens × w.rows`, on the current rayon pool.
pub fn matmul(
    w: &QuantMatrix,
    x: &[f32],
    out: &mut [f32],
    kernels: &Kernels,
) -> Result<(), QuantError> {
    if kernels.weights != w.ty {
        return Err(QuantError::Unsupported(w.ty));
    }
    let tokens = x.len().checked_div(w.cols).unwrap_or(0);
    assert_eq!(
        x.len(),
        tokens * w.cols,
        "activations are not whole rows of {}",
        w.cols
    );
    assert_eq!(out.len(), tokens * w.rows, "output is not tokens × rows");
    let acts = QuantizedActivations::new(kernels.act, x, w.cols)?;
    matmul_quantized(w, &acts, out, kernels);
    Ok(())
}

/// As [`matmul`], with activations already quantized (several matrices of the same
/// input, such as Q, K and V, share one quantization), on the current rayon pool.
pub fn matmul_quantized(
    w: &QuantMatrix,
    acts: &QuantizedActivations,
    out: &mut [f32],
    kernels: &Kernels,
) {
    matmul_quantized_on(&Rayon, w, acts, out, kernels)
}

/// As [`matmul_quantized`], on the given executor.
pub fn matmul_quantized_on(
    par: &dyn Parallel,
    w: &QuantMatrix,
    acts: &QuantizedActivations,
    out: &mut [f32],
    kernels: &Kernels,
) {
    matmul_many_on(
        par,
        &mut [MatmulJob {
            w: *w,
            acts,
            out,
            kernels,
        }],
    );
}

/// One matrix of a [`matmul_many_on`] call: `out = w · acts` as in [`matmul`].
pub struct MatmulJob<'a> {
    pub w: QuantMatrix<'a>,
    pub acts: &'a QuantizedActivations,
    pub out: &'a mut [f32],
    pub kernels: &'a Kernels,
}

/// Several matrices (such as Q, K and V of one input) in one parallel step: their row
/// chunks are the tasks of one job, so the pool synchronises once for all of them.
/// Each output is computed as [`matmul_quantized_on`] computes it alone.
pub fn matmul_many_on(par: &dyn Parallel, jobs: &mut [MatmulJob]) {
    struct Plan<'a> {
        w: QuantMatrix<'a>,
        acts: &'a QuantizedActivations,
        out: SharedOut,
        kernels: &'a Kernels,
        chunk: usize,
        first_task: usize,
    }
    let mut plans = Vec::with_capacity(jobs.len());
    let mut tasks = 0;
    for j in jobs.iter_mut() {
        assert_eq!(j.acts.act, j.kernels.act);
        assert_eq!(j.out.len(), j.acts.tokens * j.w.rows);
        let chunk = chunk_rows(j.w.rows, par.threads());
        plans.push(Plan {
            w: j.w,
            acts: j.acts,
            out: SharedOut(j.out.as_mut_ptr()),
            kernels: j.kernels,
            chunk,
            first_task: tasks,
        });
        tasks += j.w.rows.div_ceil(chunk);
    }
    par.run(tasks, &|task| {
        let p = &plans[plans.partition_point(|p| p.first_task <= task) - 1];
        let c = task - p.first_task;
        let task_rows = c * p.chunk..((c + 1) * p.chunk).min(p.w.rows);
        run_rows(&p.w, p.acts, p.out, p.kernels, task_rows);
    });
}

/// Rows `task_rows` of `out = w · acts`, for every token.
fn run_rows(
    w: &QuantMatrix,
    acts: &QuantizedActivations,
    out: SharedOut,
    kernels: &Kernels,
    task_rows: std::ops::Range<usize>,
) {
    let (rows, tokens, dot, mut dot1, mut dot4, mut tile) = (
        w.rows,
        acts.tokens,
        kernels.dot,
        kernels.dot1,
        kernels.dot4,
        kernels.tile,
    );
    if w.packed {
        // Packed rows are read only by the packing's own variants, from a group's start.
        let p = kernels
            .packing
            .expect("packed rows meet the kernels that packed them");
        assert_eq!(task_rows.start % p.rows, 0, "a task starts at a group");
        (dot1, dot4, tile) = (Some(p.dot1), None, Some(p.tile));
    }
    // SAFETY (every write): t * rows + r < out.len() (checked by the caller), and row r
    // belongs to this task only.
    let put = |t: usize, r: usize, v: f32| unsafe { *out.0.add(t * rows + r) = v };
    if let (Some(tile_fn), TILE_MIN_TOKENS..) = (tile, tokens) {
        // Each tile of rows is rearranged once and meets every token of the batch.
        let a: Vec<ActRow> = (0..tokens).map(|t| acts.act_row(t)).collect();
        let mut tile_out = vec![[0.0f32; TILE_ROWS]; tokens];
        for tile in task_rows.clone().step_by(TILE_ROWS) {
            let tile = tile..(tile + TILE_ROWS).min(task_rows.end);
            tile_fn(
                &w.bytes()[tile.start * w.row_bytes..tile.end * w.row_bytes],
                w.row_bytes,
                &a,
                &mut tile_out,
            );
            for (t, v) in tile_out.iter().enumerate() {
                // SAFETY: as for `put`: token t's outputs for this tile's rows, in bounds
                // and written by this task only. A whole tile is one fixed-size store
                // rather than a call to copy a run of any length.
                unsafe {
                    let to = out.0.add(t * rows + tile.start);
                    if tile.len() == TILE_ROWS {
                        to.cast::<[f32; TILE_ROWS]>().write_unaligned(*v);
                    } else {
                        std::ptr::copy_nonoverlapping(v.as_ptr(), to, tile.len());
                    }
                };
            }
        }
        return;
    }
    // A tile of weight rows meets every block of four tokens in turn, so that both
    // stay in L1 rather than the whole batch of activations streaming past each row.
    let mut t = 0;
    if let Some(dot4) = dot4 {
        for tile in task_rows.clone().step_by(ROW_TILE) {
            let tile = tile..(tile + ROW_TILE).min(task_rows.end);
            let tile_w = &w.bytes()[tile.start * w.row_bytes..tile.end * w.row_bytes];
            let mut out4 = [[0.0f32; 4]; ROW_TILE];
            for t in (0..tokens / 4 * 4).step_by(4) {
                let a = [
                    acts.act_row(t),
                    acts.act_row(t + 1),
                    acts.act_row(t + 2),
                    acts.act_row(t + 3),
                ];
                dot4(tile_w, w.row_bytes, a, &mut out4[..tile.len()]);
                for (r, v) in tile.clone().zip(&out4) {
                    (0..4).for_each(|i| put(t + i, r, v[i]));
                }
            }
        }
        t = tokens / 4 * 4;
    }
    // The remaining tokens (all of them in decode) meet the task's rows in one call,
    // which streams them once and writes the token's outputs in place.
    for t in t..tokens {
        match dot1 {
            Some(dot1) => {
                let task_w = &w.bytes()[task_rows.start * w.row_bytes..task_rows.end * w.row_bytes];
                // SAFETY: token t's outputs for this task's rows: in bounds, contiguous,
                // and written by this task only.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(
                        out.0.add(t * rows + task_rows.start),
                        task_rows.len(),
                    )
                };
                dot1(task_w, w.row_bytes, acts.act_row(t), o);
            }
            None => {
                let dot = match kernels.dot_in_fours {
                    Some(in_fours) if t < tokens / 4 * 4 => in_fours,
                    _ => dot,
                };
                task_rows
                    .clone()
                    .for_each(|r| put(t, r, dot(w.row(r), acts.row(t))))
            }
        }
    }
}

/// The fewest tokens that take a tile kernel; fewer meet the task's rows one token at a
/// time, the rows still in cache for the next token (the same sums either way).
/// Below this many tokens, rearranging a tile of rows costs more than the tokens save
/// (measured on real SmolLM2, packed Q4_1 rows, AVX2, commit 809c5e7). To retune, time two to four sequences decoding together and short
/// prefills with this raised and lowered.
const TILE_MIN_TOKENS: usize = 4;

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
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Matrices run together in one step give what each gives alone, bit for bit.
    #[test]
    fn many_matrices_in_one_step_equal_each_alone() {
        let cols = 256;
        let shapes = [
            (GgmlType::Q4_K, 48),
            (GgmlType::Q5_0, 100),
            (GgmlType::Q8_0, 17),
        ];
        let weights: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(ty, rows)| crate::parity::random_weights(ty, rows, cols, 3).unwrap())
            .collect();
        let x = pseudo_random(5 * cols, 4);
        let kernels: Vec<Kernels> = shapes
            .iter()
            .map(|&(ty, _)| Kernels::best(ty).unwrap())
            .collect();
        let mats: Vec<QuantMatrix> = shapes
            .iter()
            .zip(&weights)
            .map(|(&(ty, rows), w)| QuantMatrix::new(ty, rows, cols, w).unwrap())
            .collect();
        let acts: Vec<QuantizedActivations> = kernels
            .iter()
            .map(|k| QuantizedActivations::new(k.act, &x, cols).unwrap())
            .collect();
        let alone: Vec<Vec<f32>> = (0..3)
            .map(|i| {
                let mut o = vec![0.0; 5 * mats[i].rows];
                matmul_quantized(&mats[i], &acts[i], &mut o, &kernels[i]);
                o
            })
            .collect();
        let mut outs: Vec<Vec<f32>> = alone.iter().map(|o| vec![0.0; o.len()]).collect();
        let mut jobs: Vec<MatmulJob> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, out)| MatmulJob {
                w: mats[i],
                acts: &acts[i],
                out,
                kernels: &kernels[i],
            })
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| matmul_many_on(&Rayon, &mut jobs));
        for (got, want) in outs.iter().zip(&alone) {
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    /// A packed matrix gives what the same rows as stored give, bit for bit, for every
    /// thread count and batch, whole groups or not.
    #[test]
    fn packed_rows_give_the_stored_results() {
        let cols = 640;
        let x = pseudo_random(17 * cols, 8);
        for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            for isa in Isa::available_sets() {
                let k = Kernels::new(ty, isa).unwrap();
                let Some(p) = k.packing else { continue };
                assert_eq!(16 % p.rows, 0, "tasks of 16 rows start at a group");
                for rows in [5, 8, 21, 64, 100] {
                    let weights =
                        crate::parity::random_weights(ty, rows, cols, rows as u64).unwrap();
                    let w = QuantMatrix::new(ty, rows, cols, &weights).unwrap();
                    let packed = pack(&w, &k).expect("a packing for the type");
                    let grouped = rows / p.rows * p.rows * w.row_bytes;
                    assert_eq!(
                        packed[grouped..],
                        weights[grouped..],
                        "rows past the groups as stored"
                    );
                    if rows >= p.rows {
                        assert_ne!(packed, weights, "{ty} {rows} rows: nothing packed");
                    }
                    let pw = QuantMatrix::packed(ty, rows, cols, &packed).unwrap();
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .unwrap();
                        for batch in [1, 2, 17] {
                            let (mut want, mut got) =
                                (vec![0.0; batch * rows], vec![0.0; batch * rows]);
                            pool.install(|| matmul(&w, &x[..batch * cols], &mut want, &k))
                                .unwrap();
                            pool.install(|| matmul(&pw, &x[..batch * cols], &mut got, &k))
                                .unwrap();
                            let bits =
                                |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{ty} {isa:?} rows {rows} threads {threads} batch {batch}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Quantizing a batch in parallel gives the bytes, scales and sums of doing it alone.
    #[test]
    fn parallel_quantization_equals_serial() {
        let cols = 512;
        let x = pseudo_random(37 * cols, 9);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for act in [ActType::Q8_0, ActType::Q8_1, ActType::Q8K, ActType::F32] {
            let serial = QuantizedActivations::new(act, &x, cols).unwrap();
            let parallel = pool
                .install(|| QuantizedActivations::new_on(&Rayon, act, &x, cols))
                .unwrap();
            assert_eq!(parallel.tokens, 37);
            assert_eq!(parallel.data, serial.data, "{act:?}");
            assert_eq!(
                parallel
                    .scales
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                serial
                    .scales
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
            assert_eq!(
                (&parallel.quants, &parallel.neg_sums),
                (&serial.quants, &serial.neg_sums)
            );
            for t in [0, 17, 36] {
                assert_eq!(parallel.act_row(t).quants, serial.act_row(t).quants);
            }
        }
    }

    /// Every output element is bitwise the same for thread counts 1, 2, 3, 7 and batch
    /// sizes 1, 2, 5, 17.
    #[test]
    fn outputs_do_not_depend_on_threads_or_batch() {
        let (rows, cols) = (100, 512);
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::F32,
            GgmlType::Q8_K,
        ] {
            let weights = crate::parity::random_weights(ty, rows, cols, 1).unwrap();
            let w = QuantMatrix::new(ty, rows, cols, &weights).unwrap();
            let x = pseudo_random(17 * cols, 2);
            for isa in Isa::available_sets() {
                let k = Kernels::new(ty, isa).unwrap();
                // Reference: each token alone, one thread.
                let pool1 = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                let alone: Vec<Vec<f32>> = (0..17)
                    .map(|t| {
                        let mut o = vec![0.0; rows];
                        pool1
                            .install(|| matmul(&w, &x[t * cols..(t + 1) * cols], &mut o, &k))
                            .unwrap();
                        o
                    })
                    .collect();
                for threads in [1, 2, 3, 7] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    for batch in [1, 2, 5, 17] {
                        let mut o = vec![0.0; batch * rows];
                        pool.install(|| matmul(&w, &x[..batch * cols], &mut o, &k))
                            .unwrap();
                        for t in 0..batch {
                            let got: Vec<u32> = o[t * rows..(t + 1) * rows]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            let want: Vec<u32> = alone[t].iter().map(|v| v.to_bits()).collect();
                            assert_eq!(
                                got, want,
                                "{ty} {isa:?} threads {threads} batch {batch} token {t}"
                            );
                        }
                    }
                }
            }
        }
    }
}
