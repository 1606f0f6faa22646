//! llama.cpp's CPU arithmetic for the operations around the matrix products, as ggml
//! computes them on AVX2 machines (x86-64 with FMA and F16C, built by GCC, which fuses
//! a multiply into the add that uses it): RMSNorm, RoPE, SwiGLU, GeGLU and flash
//! attention over an f16 KV cache. [`crate::Arithmetic::Ggml`] runs these, with the
//! matrix kernels of `astra_quant::dot::ggml_x86`, to give llama.cpp's logits bit for
//! bit. Each function names the ggml routine whose arithmetic it states.
//!
//! Flash attention takes one of three paths in ggml, chosen by the batch: a prompt
//! batch of 64 or more tokens runs 64×64 tiles in f32 (`flash_attn_ext_tiled`); one
//! token against 512 or more cache cells splits the cells over the threads and merges
//! (`split_kv`); anything else runs each query row alone, accumulating the values in f16
//! (`one_chunk`). So unlike astra's own arithmetic, results depend on the batch and,
//! for long caches, on the thread count, as llama.cpp's do.

use std::ops::Range;

use astra_quant::dot::ggml_x86::hsum8;
use astra_quant::Isa;
use half::f16;

/// `ggml_compute_forward_rms_norm_f32`'s scale 1/√(mean square + eps): the squares
/// rounded to f32, summed in f64 in order.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt()
}

/// RMSNorm as ggml's, with the weight multiply (fused or not): x · scale, then · w.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    out.iter_mut()
        .zip(x)
        .zip(w)
        .for_each(|((o, &v), &w)| *o = v * scale * w);
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    x.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * scale * w);
}

/// `ggml_compute_forward_rope_flt` of a token's row of heads (of `head_dim` values) at
/// `pos` (no frequency scaling): the angles by repeated multiplication from `pos`, sine
/// and cosine from libm, once for the row (ggml's rope cache), each pair rotated with
/// the fusions GCC makes of `x0·cos − x1·sin` and `x0·sin + x1·cos`: the products with
/// x0 fused, those with x1 rounded first.
pub fn rope(row: &mut [f32], head_dim: usize, pos: usize, dims: usize, base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    let mut theta = pos as f32;
    for i in 0..dims / 2 {
        let (sin, cos) = (theta.sin(), theta.cos());
        let (a, b) = crate::ops::rope_pair(i, dims, neox);
        for head in row.chunks_exact_mut(head_dim) {
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
        theta *= theta_scale;
    }
}

/// `ggml_v_expf` (AVX2): eˣ by Arm's optimized-routines method, to 1.5 ulp, with its
/// handling of large magnitudes (under −104 it gives 0, over 88.38 infinity).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let c = |bits: u32| f32::from_bits(bits);
    let r = c(0x4b40_0000); // 1.5 · 2^23
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `ggml_vec_swiglu_f32`: silu(gate) · up, silu(x) = x / (1 + [`exp`](−x)) in the
/// vector loop and with libm's `expf` for the last `n mod 8`, in place in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    let whole = gate.len() / 8 * 8;
    for (i, (g, &u)) in gate.iter_mut().zip(up).enumerate() {
        let e = if i < whole {
            exp(0.0 - *g)
        } else {
            (-*g).exp()
        };
        *g = *g / (1.0 + e) * u;
    }
}

/// ggml's GELU table (`ggml_table_gelu_f16`): for every f16 x, the tanh
/// approximation 0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²))) rounded to f16.
fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|i| {
                let x = f16::from_bits(i).to_f32();
                let inner = (0.044_715f32 * x).mul_add(x, 1.0);
                f16::from_f32(0.5 * x * (1.0 + (0.797_884_6f32 * x * inner).tanh()))
            })
            .collect()
    })
}

/// `ggml_vec_geglu_f32` with `GGML_GELU_FP16`: gelu(gate) · up, gelu read from
/// [`gelu_table`] at gate rounded to f16, 0 at or below −10 and the identity at or
/// above 10; in place in `gate`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = if *g <= -10.0 {
            0.0
        } else if *g >= 10.0 {
            *g * u
        } else {
            table[f16::from_f32(*g).to_bits() as usize].to_f32() * u
        };
    }
}

/// `ggml_vec_dot_f16` (AVX2, F16C): four accumulators of eight lanes over steps of 32
/// elements, reduced as `GGML_F32x8_REDUCE` reduces them, the rest added in f64.
#[inline(always)]
pub fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let whole = x.len() / 32 * 32;
    let mut acc = [[0.0f32; 8]; 4];
    for i in (0..whole).step_by(32) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, a) in acc.iter_mut().enumerate() {
                let e = i + 8 * j + l;
                *a = x[e].to_f32().mul_add(y[e].to_f32(), *a);
            }
        }
    }
    let v: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let h: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    let mut sum = ((h[0] + h[1]) + (h[2] + h[3])) as f64;
    for e in whole..x.len() {
        sum += (x[e].to_f32() * y[e].to_f32()) as f64;
    }
    sum as f32
}

/// One KV head of one layer as flash attention reads it: f16 rows by position, in
/// chunks of `chunk` positions (position p is row p mod `chunk` of chunk p / `chunk`;
/// a chunk no query reads may be empty), visited in the order of llama.cpp's cache
/// cells: cell c holds position c, or, for a sliding-window layer, the position
/// [`SwaCells`] placed there.
pub struct KvHead<'a> {
    /// Each chunk's keys and values.
    pub chunks: Vec<(&'a [f16], &'a [f16])>,
    pub chunk: usize,
    pub dim: usize,
    /// The position each cell holds, where cells are not positions.
    pub cells: Option<&'a [Option<usize>]>,
}

impl KvHead<'_> {
    /// The position cell `c` holds, where a query attending to `valid` sees it.
    #[inline(always)]
    fn attends(&self, c: usize, valid: &Range<usize>) -> Option<usize> {
        let p = match self.cells {
            Some(cells) => cells.get(c).copied().flatten()?,
            None => c,
        };
        valid.contains(&p).then_some(p)
    }

    #[inline(always)]
    fn k(&self, pos: usize) -> &[f16] {
        &self.chunks[pos / self.chunk].0[(pos % self.chunk) * self.dim..][..self.dim]
    }

    #[inline(always)]
    fn v(&self, pos: usize) -> &[f16] {
        &self.chunks[pos / self.chunk].1[(pos % self.chunk) * self.dim..][..self.dim]
    }
}

/// A query row's attention over some cells before normalization: the largest score,
/// the sum of exponentials relative to it, and the weighted sum of values.
pub struct Partial {
    pub max: f32,
    pub sum: f32,
    pub acc: Vec<f32>,
}

impl Partial {
    /// The normalized output (`V /= S`, 0 where nothing was attended).
    pub fn finish(mut self, out: &mut [f32]) {
        let inv = if self.sum == 0.0 { 0.0 } else { 1.0 / self.sum };
        self.acc.iter_mut().for_each(|v| *v *= inv);
        out.copy_from_slice(&self.acc);
    }
}

/// `ggml_compute_forward_flash_attn_ext_f16_one_chunk` for one query row over `cells`,
/// attending to the positions in `valid`: the query rounded to f16, scores by
/// [`dot_f16`], an online softmax with libm's `expf`, values accumulated in f16.
#[inline(always)]
pub fn one_chunk(
    q: &[f32],
    kv: &KvHead,
    cells: Range<usize>,
    valid: &Range<usize>,
    scale: f32,
) -> Partial {
    let q16: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
    let mut acc = vec![f16::ZERO; kv.dim];
    let (mut sum, mut max) = (0.0f32, f32::NEG_INFINITY);
    for c in cells.filter_map(|c| kv.attends(c, valid)) {
        let s = dot_f16(kv.k(c), &q16) * scale + 0.0;
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if s > max {
            ms = (max - s).exp();
            max = s;
            acc.iter_mut()
                .for_each(|a| *a = f16::from_f32(a.to_f32() * ms));
        } else {
            vs = (s - max).exp();
        }
        for (a, v) in acc.iter_mut().zip(kv.v(c)) {
            *a = f16::from_f32(v.to_f32().mul_add(vs, a.to_f32()));
        }
        sum = sum.mul_add(ms, vs);
    }
    Partial {
        max,
        sum,
        acc: acc.iter().map(|a| a.to_f32()).collect(),
    }
}

/// ggml's split-KV decode (`flash_attn_ext_f16` with `use_split_kv_path`, then
/// `ggml_flash_attn_ext_reduce_partials`): `n_kv` cells in `threads` equal chunks, each
/// a [`one_chunk`], merged in chunk order.
#[inline(always)]
pub fn split_kv(
    q: &[f32],
    kv: &KvHead,
    n_kv: usize,
    valid: &Range<usize>,
    scale: f32,
    threads: usize,
    out: &mut [f32],
) {
    let chunk = n_kv.div_ceil(threads);
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    let mut acc = vec![0.0f32; kv.dim];
    for t in 0..threads {
        let start = t * chunk;
        if start >= n_kv {
            continue;
        }
        let p = one_chunk(q, kv, start..(start + chunk).min(n_kv), valid, scale);
        if p.sum == 0.0 {
            continue;
        }
        let new = max.max(p.max);
        let (old_scale, new_scale) = ((max - new).exp(), (p.max - new).exp());
        for (a, &v) in acc.iter_mut().zip(&p.acc) {
            *a = a.mul_add(old_scale, v * new_scale);
        }
        sum = sum.mul_add(old_scale, p.sum * new_scale);
        max = new;
    }
    if sum != 0.0 {
        let inv = 1.0 / sum;
        acc.iter_mut().for_each(|v| *v *= inv);
    }
    out.copy_from_slice(&acc);
}

/// Cells per tile of ggml's tiled flash attention (`GGML_FA_TILE_KV`); prompt batches of
/// at least `GGML_FA_TILE_Q` (also 64) tokens take it.
pub const TILE: usize = 64;

/// `ggml_compute_forward_flash_attn_ext_tiled` for one query row over the first `n_kv`
/// cells: scores in f32 (a fused chain over the head), the softmax per tile with
/// [`exp`] (its sum in f64 from eight-lane sums), values in a fused chain per tile. A
/// tile where the row attends to nothing leaves it unchanged, as in ggml.
#[inline(always)]
pub fn tiled(
    q: &[f32],
    kv: &KvHead,
    n_kv: usize,
    valid: &Range<usize>,
    scale: f32,
    out: &mut [f32],
) {
    let (mut sum, mut max) = (0.0f32, f32::NEG_INFINITY);
    let mut acc = vec![0.0f32; kv.dim];
    let mut kq = [0.0f32; TILE];
    for start in (0..n_kv).step_by(TILE) {
        let cells = start..(start + TILE).min(n_kv);
        if !cells.clone().any(|c| kv.attends(c, valid).is_some()) {
            continue;
        }
        let seen = |t: usize| Some(start + t).filter(|c| cells.contains(c));
        for (t, s) in kq.iter_mut().enumerate() {
            *s = if let Some(p) = seen(t).and_then(|c| kv.attends(c, valid)) {
                let dot = kv
                    .k(p)
                    .iter()
                    .zip(q)
                    .fold(0.0f32, |a, (k, &q)| k.to_f32().mul_add(q, a));
                dot * scale + 0.0
            } else {
                f32::NEG_INFINITY
            };
        }
        let tile_max = kq
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| if m > s { m } else { s });
        let new = max.max(tile_max);
        if new > max {
            let ms = (max - new).exp();
            acc.iter_mut().for_each(|a| *a *= ms);
            sum *= ms;
        }
        max = new;
        let mut tile_sum = 0.0f64;
        for lanes in kq.chunks_exact_mut(8) {
            lanes.iter_mut().for_each(|s| *s = exp(*s - new));
            tile_sum += hsum8(lanes.try_into().expect("eight")) as f64;
        }
        sum = (sum as f64 + tile_sum) as f32;
        for (t, &w) in kq.iter().enumerate() {
            if let Some(p) = seen(t).and_then(|c| kv.attends(c, valid)) {
                for (a, v) in acc.iter_mut().zip(kv.v(p)) {
                    *a = v.to_f32().mul_add(w, *a);
                }
            }
        }
    }
    Partial { max, sum, acc }.finish(out);
}

/// llama.cpp's placement of one sequence's positions in the cells of a sliding-window
/// layer's cache (`llama_kv_cache::find_slot`, then `apply_ubatch`), which sets the
/// order its attention visits them in. A micro-batch's positions go to the cells from
/// the search head on that are empty or hold a position the window has left (relative
/// to the newest position held), wrapping at the end; overwriting purges every older
/// position, and the head moves past the last cell used.
#[derive(Clone)]
pub struct SwaCells {
    pos: Vec<Option<usize>>,
    head: usize,
    window: usize,
    /// The micro-batch placed last: every layer's store sees it, the first places it.
    last: Option<Range<usize>>,
}

impl SwaCells {
    /// A cache of `size` cells for a window of `window` positions.
    pub fn new(size: usize, window: usize) -> SwaCells {
        SwaCells {
            pos: vec![None; size],
            head: 0,
            window,
            last: None,
        }
    }

    /// The position each cell holds.
    pub fn cells(&self) -> &[Option<usize>] {
        &self.pos
    }

    /// The cells llama.cpp's attention spans (`get_n_kv`): those up to the last one in
    /// use, rounded up to 256, at least 256, at most all.
    pub fn n_kv(&self) -> usize {
        let used_end = self
            .pos
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |i| i + 1);
        used_end.next_multiple_of(256).max(256).min(self.pos.len())
    }

    fn held(&self) -> impl Iterator<Item = usize> + '_ {
        self.pos.iter().flatten().copied()
    }

    /// `seq_rm` of positions `from..to`: their cells emptied, the head moved back to the
    /// first of them where that is before it.
    fn remove(&mut self, from: usize, to: usize) {
        let mut first = None;
        for (i, c) in self.pos.iter_mut().enumerate() {
            if c.is_some_and(|p| (from..to).contains(&p)) {
                *c = None;
                first.get_or_insert(i);
            }
        }
        if let Some(i) = first.filter(|&i| i < self.head) {
            self.head = i;
        }
    }

    /// Places the micro-batch of `positions` (a no-op when it is the one placed last;
    /// positions already held from its start on are removed first, as a rewind does).
    pub fn place(&mut self, positions: Range<usize>) {
        if self.last.as_ref() == Some(&positions) || positions.is_empty() {
            return;
        }
        self.remove(positions.start, usize::MAX);
        let (n, size) = (positions.len(), self.pos.len());
        let used = self.held().count();
        let newest_end = self.held().max().map_or(0, |p| p + 1);
        let mut head = if self.head > used + 2 * n {
            0
        } else {
            self.head
        };
        let (mut idxs, mut tested) = (Vec::with_capacity(n), 0);
        while idxs.len() < n && tested < size {
            if head >= size {
                tested += size - head;
                head = 0;
                continue;
            }
            let free = self.pos[head].is_none_or(|p| newest_end - p >= self.window);
            if free {
                idxs.push(head);
            }
            head += 1;
            tested += 1;
        }
        // A window smaller than a micro-batch leaves no room: llama.cpp fails the batch;
        // here the placement stays as it was (attention then reads positions directly).
        if idxs.len() < n {
            self.last = None;
            return;
        }
        let mut overwritten = None;
        for (&i, p) in idxs.iter().zip(positions.clone()) {
            overwritten = overwritten.max(self.pos[i]);
            self.pos[i] = Some(p);
        }
        if let (Some(old), Some(oldest)) = (overwritten, self.held().min()) {
            if oldest <= old {
                self.remove(oldest, old + 1);
            }
        }
        self.head = idxs.last().expect("n > 0") + 1;
        self.last = Some(positions);
    }
}

/// What picks ggml's flash-attention path: the micro-batch's tokens, the cells its view
/// of the cache spans, and the thread count.
#[derive(Clone, Copy, Debug)]
pub struct FlashShape {
    pub tokens: usize,
    pub n_kv: usize,
    pub threads: usize,
}

/// One query row of flash attention by the path ggml takes for `shape`: [`tiled`] for
/// 64 tokens or more, [`split_kv`] for one token over 512 cells or more, else
/// [`one_chunk`]. On `isa` AVX2 or above (which must be available) the code runs
/// compiled for AVX2 and FMA, each `mul_add` one instruction rather than a call: the
/// same operations in the same order, the same bits.
pub fn attend_row(
    q: &[f32],
    kv: &KvHead,
    valid: &Range<usize>,
    scale: f32,
    shape: FlashShape,
    isa: Isa,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        #[target_feature(enable = "avx2,fma")]
        fn compiled_for_avx2(
            q: &[f32],
            kv: &KvHead,
            valid: &Range<usize>,
            scale: f32,
            shape: FlashShape,
            out: &mut [f32],
        ) {
            attend_row_portable(q, kv, valid, scale, shape, out)
        }
        assert!(
            isa.available(),
            "{} requested on a machine without it",
            isa.name()
        );
        // SAFETY: the CPU has the features the copy is compiled for (just checked).
        return unsafe { compiled_for_avx2(q, kv, valid, scale, shape, out) };
    }
    attend_row_portable(q, kv, valid, scale, shape, out)
}

#[inline(always)]
fn attend_row_portable(
    q: &[f32],
    kv: &KvHead,
    valid: &Range<usize>,
    scale: f32,
    shape: FlashShape,
    out: &mut [f32],
) {
    let FlashShape {
        tokens,
        n_kv,
        threads,
    } = shape;
    if tokens >= TILE {
        tiled(q, kv, n_kv, valid, scale, out);
    } else if tokens == 1 && n_kv >= 512 {
        split_kv(q, kv, n_kv, valid, scale, threads, out);
    } else {
        one_chunk(q, kv, 0..n_kv, valid, scale).finish(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_saturates_as_ggml() {
        let mut x = -103.0f32;
        while x < 88.3 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
            x += 0.01137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
    }

    #[test]
    fn dot_f16_is_the_dot_product() {
        for n in [64, 80, 256] {
            let x: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(((i * 37 % 19) as f32 - 9.0) / 7.0))
                .collect();
            let y: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(((i * 11 % 23) as f32 - 11.0) / 5.0))
                .collect();
            let want: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            assert!((dot_f16(&x, &y) as f64 - want).abs() < 1e-4, "{n}");
        }
    }

    /// The three attention paths against softmax attention in f64, within the f16
    /// rounding of the paths that keep f16; [`attend_row`] bit for bit on every set.
    #[test]
    fn attention_paths_are_attention() {
        let (dim, n) = (64, 700);
        let val = |i: usize, d: usize, m: usize| {
            f16::from_f32((((i * 31 + d * 17 + m) % 41) as f32 - 20.0) / 13.0)
        };
        let k: Vec<f16> = (0..n * dim).map(|e| val(e / dim, e % dim, 3)).collect();
        let v: Vec<f16> = (0..n * dim).map(|e| val(e / dim, e % dim, 7)).collect();
        let q: Vec<f32> = (0..dim)
            .map(|d| ((d * 13 % 29) as f32 - 14.0) / 9.0)
            .collect();
        // Chunks of 64 positions, as a paged cache holds them.
        let kv = KvHead {
            chunks: k.chunks(64 * dim).zip(v.chunks(64 * dim)).collect(),
            chunk: 64,
            dim,
            cells: None,
        };
        let scale = 0.125;
        let valid = 100..650;
        let want: Vec<f64> = {
            let s: Vec<f64> = valid
                .clone()
                .map(|c| {
                    (0..dim)
                        .map(|d| k[c * dim + d].to_f64() * q[d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            (0..dim)
                .map(|d| {
                    valid
                        .clone()
                        .zip(&w)
                        .map(|(c, w)| w * v[c * dim + d].to_f64())
                        .sum::<f64>()
                        / z
                })
                .collect()
        };
        let mut outs = vec![vec![0.0f32; dim]; 3];
        one_chunk(&q, &kv, 0..n, &valid, scale).finish(&mut outs[0]);
        split_kv(&q, &kv, n, &valid, scale, 3, &mut outs[1]);
        tiled(&q, &kv, n, &valid, scale, &mut outs[2]);
        for (path, out) in ["one_chunk", "split_kv", "tiled"].iter().zip(&outs) {
            let err = out
                .iter()
                .zip(&want)
                .map(|(&a, b)| (a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(err < 5e-3, "{path}: {err}");
        }
        // attend_row picks the same paths, with the same bits on every instruction set
        // this machine has.
        for isa in Isa::available_sets() {
            for (tokens, path) in [(2, 0), (1, 1), (64, 2)] {
                let mut o = vec![0.0f32; dim];
                attend_row(
                    &q,
                    &kv,
                    &valid,
                    scale,
                    FlashShape {
                        tokens,
                        n_kv: n,
                        threads: 3,
                    },
                    isa,
                    &mut o,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&o),
                    bits(&outs[path]),
                    "{} tokens {tokens}",
                    isa.name()
                );
            }
        }
    }
}
