//! AVX2 kernels that put eight weight rows in the eight lanes of a vector: the lane
//! arithmetic of [`super::lanes`], bit for bit what AVX-512's sixteen lanes compute.
//!
//! A block (32 elements) of eight consecutive rows is decoded and transposed so that
//! vector k holds, in lane l, row l's codes 4k..4k+4. `vpmaddubsw` against the token's
//! quants 4k..4k+4, broadcast, leaves two products per i16 in every row's lane; a run
//! of such i16 sums is added before `vpmaddwd` widens it to i32, as long as the sum
//! cannot leave i16 ([`Lanes8::I16_RUN`]), so every lane ends with its row's exact
//! integer block sum and no horizontal sums are needed.
//!
//! Decode streams each group of eight rows once, transposing it as it goes
//! ([`rows_dot1`]); prefill transposes a tile of sixteen rows once into scratch, and
//! every token of the batch meets both halves with the same broadcasts ([`tile_dot`]).
//!
//! Q8_0 is not here: its offset codes reach 255, and 2 · 255 · 127 leaves i16, which
//! `vpmaddubsw` would saturate.
//!
//! Safety: every kernel here requires AVX2, FMA and F16C; they are reachable only
//! through [`kernels`], which `Kernels::new` calls after checking `Isa::available`.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::lanes::{group, lane_entries, tile_rows, Act, LaneFormat, Q4_1Lanes, Q5_0Lanes};
use super::{ActRow, ActType, VecDot1Fn, VecDotFn, VecDotTileFn, TILE_ROWS};
use crate::blocks::*;
use crate::GgmlType;

/// Rows per vector.
const LANES: usize = 8;

/// The entry points for a weight type, if it runs in lanes on AVX2: the dot on bytes,
/// decode, and the batch tile.
pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, VecDot1Fn, VecDotTileFn)> {
    match weights {
        GgmlType::Q4_1 => Some(lane_entries!(rows_dot1, tile_dot, Q4_1Lanes, ActType::Q8_1)),
        GgmlType::Q5_0 => Some(lane_entries!(rows_dot1, tile_dot, Q5_0Lanes, ActType::Q8_0)),
        _ => None,
    }
}

/// A [`LaneFormat`] whose codes these kernels can load and multiply in i16.
pub(crate) trait Lanes8: LaneFormat {
    /// How many `vpmaddubsw` results are added in i16 before widening: the largest
    /// n with n · 2 · max code · 127 < 2^15 that divides 8.
    const I16_RUN: usize;
    /// Block `b` of eight rows' codes (offset where signed) in lanes: vector k lane l
    /// is row l's codes 4k..4k+4.
    ///
    /// # Safety
    /// The module's features; `rows` has eight rows of more than `b` blocks.
    unsafe fn lane_codes(rows: &[&[Self::W]], b: usize) -> [__m256i; 8];
}

/// Eight rows' 16 bytes of nibbles as lane codes: the bytes transposed as dwords
/// (row l's dword k to lane l of vector k), then split, low nibbles (elements 4k..4k+4)
/// into vector k and high (16 + 4k..) into vector 4 + k. Cheaper than splitting each
/// row and transposing the 32 codes.
#[inline(always)]
unsafe fn nibble_lanes(qs: [&[u8; 16]; LANES]) -> [__m256i; 8] {
    // p[j]: row j in the low 128-bit half, row j + 4 in the high.
    let mut p = [_mm256_setzero_si256(); 4];
    for (j, p) in p.iter_mut().enumerate() {
        *p = _mm256_set_m128i(_mm_loadu_si128(qs[j + 4].as_ptr().cast()), _mm_loadu_si128(qs[j].as_ptr().cast()));
    }
    let t = [
        _mm256_unpacklo_epi32(p[0], p[1]),
        _mm256_unpackhi_epi32(p[0], p[1]),
        _mm256_unpacklo_epi32(p[2], p[3]),
        _mm256_unpackhi_epi32(p[2], p[3]),
    ];
    // Dword k of every row, rows 0..4 in the low half and 4..8 in the high.
    let d = [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
    ];
    let low = _mm256_set1_epi8(0x0F);
    let mut out = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        out[k] = _mm256_and_si256(d[k], low);
        out[4 + k] = _mm256_and_si256(_mm256_srli_epi16::<4>(d[k]), low);
    }
    out
}

impl Lanes8 for Q4_1Lanes {
    // 8 · 2 · 15 · 127 = 30,480.
    const I16_RUN: usize = 8;
    #[inline(always)]
    unsafe fn lane_codes(rows: &[&[BlockQ4_1]], b: usize) -> [__m256i; 8] {
        nibble_lanes(std::array::from_fn(|l| &rows.get_unchecked(l).get_unchecked(b).qs))
    }
}

impl Lanes8 for Q5_0Lanes {
    // 4 · 2 · 31 · 127 = 31,496.
    const I16_RUN: usize = 4;
    #[inline(always)]
    unsafe fn lane_codes(rows: &[&[BlockQ5_0]], b: usize) -> [__m256i; 8] {
        let block = |l: usize| rows.get_unchecked(l).get_unchecked(b);
        let mut codes = nibble_lanes(std::array::from_fn(|l| &block(l).qs));
        // Bit e of a row's qh is its element e's fifth bit: code + 16 where set. Lane
        // l of `qh` holds row l's; vector k takes bits 4k..4k+4 (byte k / 2 of the
        // lane, from bit 4(k % 2)) into bytes 0..4 of the lane.
        let qh = _mm256_loadu_si256(std::array::from_fn::<u32, LANES, _>(|l| u32::from_le_bytes(block(l).qh)).as_ptr().cast());
        let dword_base = _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
        );
        let (bits_low, bits_high) = (_mm256_set1_epi32(0x0804_0201), _mm256_set1_epi32(0x8040_2010u32 as i32));
        for (k, c) in codes.iter_mut().enumerate() {
            let bytes = _mm256_shuffle_epi8(qh, _mm256_add_epi8(dword_base, _mm256_set1_epi8((k / 2) as i8)));
            let bit = if k % 2 == 0 { bits_low } else { bits_high };
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
            *c = _mm256_or_si256(*c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        codes
    }
}

/// One block of eight rows in lanes: `codes[k]` lane l is row l's codes 4k..4k+4; `d`
/// and `m` lane l are row l's scale and minimum.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct LaneBlock {
    codes: [__m256i; 8],
    d: __m256,
    m: __m256,
}

// `lane_block` reads a row's first four bytes as d and (Q4_1) m: both blocks begin so.
const _: () = assert!(
    std::mem::offset_of!(BlockQ4_1, d) == 0 && std::mem::offset_of!(BlockQ4_1, m) == 2 && std::mem::offset_of!(BlockQ5_0, d) == 0
);

/// Block `b` of the eight rows `rows`, in lanes.
#[inline(always)]
unsafe fn lane_block<F: Lanes8>(rows: &[&[F::W]], b: usize) -> LaneBlock {
    // Both formats start with d (f16); Q4_1 follows it with m. Lane l: row l's first
    // four bytes.
    let word = |l: usize| std::ptr::from_ref(rows.get_unchecked(l).get_unchecked(b)).cast::<i32>().read_unaligned();
    let words = _mm256_setr_epi32(word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7));
    LaneBlock {
        codes: F::lane_codes(rows, b),
        d: _mm256_cvtph_ps(low_halves(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF)))),
        m: if F::SHIFT.is_none() { _mm256_cvtph_ps(low_halves(_mm256_srli_epi32::<16>(words))) } else { _mm256_setzero_ps() },
    }
}

/// The eight dwords of `v` (each below 2^16) as eight u16.
#[inline(always)]
unsafe fn low_halves(v: __m256i) -> __m128i {
    // Per 128-bit half: its four values twice; then the halves' first copies together.
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(v, v)))
}

/// The token's quants 4k..4k+4 of block b, each broadcast to every lane.
#[inline(always)]
unsafe fn broadcasts(a: Act, b: usize) -> [__m256i; 8] {
    let q = a.q.add(32 * b).cast::<i32>();
    let mut y = [_mm256_setzero_si256(); 8];
    for (k, y) in y.iter_mut().enumerate() {
        *y = _mm256_set1_epi32(q.add(k).read_unaligned());
    }
    y
}

/// The eight rows' exact integer sums of block b (offset included) in lanes.
#[inline(always)]
unsafe fn block_sums<F: Lanes8>(x: &LaneBlock, y: &[__m256i; 8], a: Act, b: usize) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut isum = match F::SHIFT {
        Some(shift) => _mm256_set1_epi32(*a.neg.add(b) << shift),
        None => _mm256_setzero_si256(),
    };
    for run in (0..8).step_by(F::I16_RUN) {
        let mut pairs = _mm256_maddubs_epi16(x.codes[run], y[run]);
        for (&c, &y) in x.codes[run + 1..run + F::I16_RUN].iter().zip(&y[run + 1..]) {
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(c, y));
        }
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
    }
    isum
}

/// The float chains (value, minimum) of eight rows against one token, advanced by
/// block b whose integer sums are `isum`.
#[inline(always)]
unsafe fn step<F: Lanes8>(x: &LaneBlock, isum: __m256i, a: Act, b: usize, acc: &mut __m256, min: &mut __m256) {
    let (da, sa) = match F::SHIFT {
        Some(_) => (*a.s.add(b), 0.0),
        None => (*a.s.add(2 * b), *a.s.add(2 * b + 1)),
    };
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(x.d, _mm256_set1_ps(da)), *acc);
    if F::SHIFT.is_none() {
        *min = _mm256_fmadd_ps(x.m, _mm256_set1_ps(sa), *min);
    }
}

/// The eight results of a pair of chains.
#[inline(always)]
unsafe fn finish<F: Lanes8>(acc: __m256, min: __m256) -> [f32; LANES] {
    let v = if F::SHIFT.is_none() { _mm256_add_ps(acc, min) } else { acc };
    std::mem::transmute::<__m256, [f32; LANES]>(v)
}

/// `out[i] = K·(row i of w, a)` for consecutive rows of `row_bytes`, eight at a time,
/// each group transposed as it streams past while the next one is prefetched.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot1<F: Lanes8>(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    assert!(row_bytes > 0 && w.len() == row_bytes * out.len(), "weights are not out.len() rows");
    let blocks = row_bytes / std::mem::size_of::<F::W>();
    let act = Act::new::<F>(&a, blocks);
    // The next group's bytes are asked for a block's share at a time.
    let span = LANES * row_bytes;
    let per_block = span.div_ceil(blocks);
    for (g, out) in out.chunks_mut(LANES).enumerate() {
        let rows = group::<F::W, LANES>(w, row_bytes, g * LANES, out.len());
        let (mut acc, mut min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let next = (g + 1) * span;
        for b in 0..blocks {
            super::avx2::prefetch_ahead(w, next + b * per_block, per_block);
            let x = lane_block::<F>(&rows, b);
            let isum = block_sums::<F>(&x, &broadcasts(act, b), act, b);
            step::<F>(&x, isum, act, b, &mut acc, &mut min);
        }
        out.copy_from_slice(&finish::<F>(acc, min)[..out.len()]);
    }
}

thread_local! {
    /// A thread's transposed tile (both halves of each block), reused from call to call.
    static TILE: RefCell<Vec<[LaneBlock; 2]>> = const { RefCell::new(Vec::new()) };
}

/// `out[t][i] = K·(row i of w, a[t])` for the (at most 16) rows of `w`: the rows are
/// transposed once, in two halves of eight, then every token runs both halves' chains
/// over the tile, each block's broadcasts shared by the two.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_dot<F: Lanes8>(w: &[u8], row_bytes: usize, a: &[ActRow<'_>], out: &mut [[f32; TILE_ROWS]]) {
    let (rows, blocks) = tile_rows::<F::W>(w, row_bytes, a.len(), out.len());
    // Taken out of the thread-local rather than used in a closure: a closure would not
    // inherit this function's target features.
    let mut tile = TILE.take();
    tile.clear();
    for b in 0..blocks {
        tile.push([lane_block::<F>(&rows[..LANES], b), lane_block::<F>(&rows[LANES..], b)]);
    }
    for (a, out) in a.iter().zip(out.iter_mut()) {
        let act = Act::new::<F>(a, blocks);
        let (mut acc, mut min) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
        for (b, x) in tile.iter().enumerate() {
            let y = broadcasts(act, b);
            for h in 0..2 {
                let isum = block_sums::<F>(&x[h], &y, act, b);
                step::<F>(&x[h], isum, act, b, &mut acc[h], &mut min[h]);
            }
        }
        for h in 0..2 {
            out[h * LANES..(h + 1) * LANES].copy_from_slice(&finish::<F>(acc[h], min[h]));
        }
    }
    TILE.set(tile);
}

#[cfg(test)]
mod tests {
    use super::super::lanes::{check_kernels, reference};
    use super::*;
    use crate::parity::random_weights;

    /// Decode, single-row and tile entry points equal the scalar statement of the lane
    /// arithmetic bit for bit (so AVX-512's results too), on ragged row counts.
    #[test]
    fn kernels_equal_the_lane_arithmetic() {
        if !crate::Isa::Avx2.available() {
            eprintln!("skipped: this machine has no AVX2");
            return;
        }
        check_kernels::<Q4_1Lanes>(GgmlType::Q4_1, ActType::Q8_1, kernels(GgmlType::Q4_1).unwrap());
        check_kernels::<Q5_0Lanes>(GgmlType::Q5_0, ActType::Q8_0, kernels(GgmlType::Q5_0).unwrap());
    }

    /// The i16 runs stay exact at the extremes: every code at its largest against
    /// activations of ±127, where a longer run would wrap.
    #[test]
    fn extreme_codes_do_not_leave_i16() {
        if !crate::Isa::Avx2.available() {
            eprintln!("skipped: this machine has no AVX2");
            return;
        }
        for (ty, act) in [(GgmlType::Q5_0, ActType::Q8_0), (GgmlType::Q4_1, ActType::Q8_1)] {
            let (_, dot1, _) = kernels(ty).unwrap();
            let cols = 64;
            // All codes at their maximum: every quant byte 0xFF, every fifth bit set.
            let mut weights = random_weights(ty, 8, cols, 1).unwrap();
            let block = ty.block_bytes() as usize;
            for b in weights.chunks_exact_mut(block) {
                for byte in &mut b[2..] {
                    *byte = 0xFF;
                }
                if ty == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.0).to_bits().to_le_bytes());
                }
            }
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; cols];
                let mut q = vec![0u8; act.row_bytes(cols).unwrap()];
                act.quantize(&x, &mut q);
                let mut got = [0.0f32; 8];
                super::super::with_act_row(act, &q, |a| dot1(&weights, weights.len() / 8, a, &mut got));
                let row_bytes = weights.len() / 8;
                let want: Vec<f32> = (0..8)
                    .map(|r| {
                        let w = &weights[r * row_bytes..(r + 1) * row_bytes];
                        super::super::with_act_row(act, &q, |a| match ty {
                            GgmlType::Q5_0 => reference::<Q5_0Lanes>(w, &a),
                            _ => reference::<Q4_1Lanes>(w, &a),
                        })
                    })
                    .collect();
                assert_eq!(got.to_vec(), want, "{ty} sign {sign}");
            }
        }
    }
}
