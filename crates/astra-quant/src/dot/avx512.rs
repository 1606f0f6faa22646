//! AVX-512 VNNI kernels that put sixteen weight rows in the sixteen lanes of a vector.
//!
//! A block (32 elements) of 16 consecutive rows is decoded and transposed so that
//! vector k holds, in lane l, row l's codes 4k..4k+4. One `vpdpbusd` against the token's
//! quants 4k..4k+4, broadcast, adds four products to every row's lane; eight of them
//! leave each row's exact integer block sum in its lane, with no horizontal sums. Each
//! output is then the float chains of [`super::lanes`], which `lanes::reference` writes
//! out in scalar code and the kernels match bit for bit (as do AVX2's eight lanes,
//! `avx2_lanes`).
//!
//! Decode streams each 16-row group once, transposing it as it goes ([`dot1_groups`]);
//! prefill transposes a group once into a scratch tile that every token of the batch
//! then meets ([`tile_groups`]). Both run the same per-lane arithmetic. Rows packed at
//! load ([`pack16`]: AVX2's packing, in blocks of sixteen lanes for Q4_1 and Q8_0 and
//! as two of AVX2's groups of eight for Q5_0) are already in lane order, so decoding a
//! block of them is loads and masks, with the same results.
//!
//! Q4_K and Q6_K batches run the same way over super-blocks ([`k_tile_dot`]): exact
//! integer super-block sums (group sums times their integer scales), then AVX2's float
//! chains, so that a batch equals AVX2's single-token kernel bit for bit. A single
//! token instead takes four rows at a time as they are stored ([`q4k_dot1`],
//! [`q6k_dot1`]: a super-block in four 512-bit vectors, the four rows' sums reduced
//! together), with the same sums and chains; Q5_K rows likewise ([`q5k_dot1`]), in
//! AVX2's eight lanes of sums, and IQ2_XS and IQ2_S rows two groups a vector
//! ([`iq2_dot1`]).
//!
//! Signed codes (Q5_0, Q8_0) are read as unsigned `c + 2^SHIFT` so that `vpdpbusd` can
//! take them (`lanes` says how the offset comes back).
//!
//! Safety: every kernel here requires AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C. They are
//! reachable only through [`kernels`], which `Kernels::new` calls for
//! `Isa::Avx512Vnni` after checking `Isa::available`.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2;
use super::avx2_lanes::{self, Lanes8};
use super::lanes::{
    group, lane_entries, tile_of, tile_shape, Act, LaneFormat, Q4_1Lanes, Q5_0Lanes, Q8_0Lanes,
};
use super::{ActRow, ActType, Packing, VecDot1Fn, VecDotFn, VecDotTileFn, TILE_ROWS};
use crate::blocks::*;
use crate::iq2xs_grid::IQ2XS_GRID;
use crate::GgmlType;

/// A weight type's AVX-512 kernels: the batch tile where the type has one, and the
/// single-token entry points.
pub(crate) struct LaneKernels {
    pub single: Option<(VecDotFn, VecDot1Fn)>,
    /// The batch tile, where the type has one (Q5_K's batches take `single` a token
    /// at a time).
    pub tile: Option<VecDotTileFn>,
    /// The packing at load, where the type has one.
    pub packing: Option<Packing>,
}

/// A type's kernels where only single tokens have one of their own: its batches take
/// it a token at a time.
fn rows_only(single: (VecDotFn, VecDot1Fn)) -> LaneKernels {
    LaneKernels {
        single: Some(single),
        tile: None,
        packing: None,
    }
}

pub(crate) fn kernels(weights: GgmlType) -> Option<LaneKernels> {
    macro_rules! entries {
        ($f:ty, $act:expr) => {{
            let (dot, dot1, tile) = lane_entries!(dot1_groups, tile_groups, $f, $act, false);
            let (_, packed_dot1, packed_tile) =
                lane_entries!(dot1_groups, tile_groups, $f, $act, true);
            LaneKernels {
                single: Some((dot, dot1)),
                tile: Some(tile),
                packing: Some(Packing {
                    rows: TILE_ROWS,
                    pack: pack16::<$f>,
                    dot1: packed_dot1,
                    tile: packed_tile,
                }),
            }
        }};
    }
    macro_rules! k_tile {
        ($f:ty) => {{
            fn tile(w: &[u8], row_bytes: usize, a: &[ActRow], out: &mut [[f32; TILE_ROWS]]) {
                // SAFETY: as for `dot1` above.
                unsafe { k_tile_dot::<$f>(w, row_bytes, a, out) }
            }
            LaneKernels {
                single: None,
                tile: Some(tile as VecDotTileFn),
                packing: None,
            }
        }};
    }
    macro_rules! rows {
        ($dot1:ident) => {{
            fn dot1(w: &[u8], row_bytes: usize, a: ActRow, out: &mut [f32]) {
                // SAFETY: handed out only where the set's features are present (the
                // module's doc).
                unsafe { $dot1(w, row_bytes, a, out) }
            }
            fn dot(w: &[u8], a: &[u8]) -> f32 {
                let mut out = [0.0];
                super::with_act_row(ActType::Q8K, a, |row| dot1(w, w.len(), row, &mut out));
                out[0]
            }
            (dot as VecDotFn, dot1 as VecDot1Fn)
        }};
    }
    match weights {
        GgmlType::Q4_1 => Some(entries!(Q4_1Lanes, ActType::Q8_1)),
        GgmlType::Q5_0 => Some(entries!(Q5_0Lanes, ActType::Q8_0)),
        GgmlType::Q8_0 => Some(entries!(Q8_0Lanes, ActType::Q8_0)),
        GgmlType::Q4_K => Some(LaneKernels {
            single: Some(rows!(q4k_dot1)),
            ..k_tile!(Q4KLanes)
        }),
        GgmlType::Q5_K => Some(rows_only(rows!(q5k_dot1))),
        GgmlType::Q6_K => Some(LaneKernels {
            single: Some(rows!(q6k_dot1)),
            ..k_tile!(Q6KLanes)
        }),
        GgmlType::IQ2_XS => Some(rows_only(rows!(iq2xs_dot1))),
        GgmlType::IQ2_S => Some(rows_only(rows!(iq2s_dot1))),
        _ => None,
    }
}

/// A [`LaneFormat`] whose codes these kernels can load.
pub(crate) trait Lanes16: LaneFormat {
    /// Two blocks' codes as [`LaneFormat::codes`] gives them: `b0`'s in bytes 0..32,
    /// `b1`'s in 32..64.
    ///
    /// # Safety
    /// The module's features.
    unsafe fn codes2(b0: &Self::W, b1: &Self::W) -> __m512i;
}

/// Two blocks' 16 bytes of nibbles as 64 codes in element order: block 0's low
/// nibbles, its high nibbles, then block 1's.
#[inline(always)]
unsafe fn nibbles2(qs0: &[u8; 16], qs1: &[u8; 16]) -> __m512i {
    let x = _mm256_set_m128i(
        _mm_loadu_si128(qs1.as_ptr().cast()),
        _mm_loadu_si128(qs0.as_ptr().cast()),
    );
    let y = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), _mm256_srli_epi16::<4>(x));
    _mm512_and_si512(
        _mm512_shuffle_i64x2::<0b11_01_10_00>(y, y),
        _mm512_set1_epi8(0x0F),
    )
}

impl Lanes16 for Q4_1Lanes {
    #[inline(always)]
    unsafe fn codes2(b0: &BlockQ4_1, b1: &BlockQ4_1) -> __m512i {
        nibbles2(&b0.qs, &b1.qs)
    }
}

impl Lanes16 for Q5_0Lanes {
    #[inline(always)]
    unsafe fn codes2(b0: &BlockQ5_0, b1: &BlockQ5_0) -> __m512i {
        let nibbles = nibbles2(&b0.qs, &b1.qs);
        // Bit j of a block's qh is its element j's fifth bit: code + 16 where set.
        let high = u32::from_le_bytes(b0.qh) as u64 | (u32::from_le_bytes(b1.qh) as u64) << 32;
        _mm512_mask_add_epi8(nibbles, high, nibbles, _mm512_set1_epi8(16))
    }
}

impl Lanes16 for Q8_0Lanes {
    #[inline(always)]
    unsafe fn codes2(b0: &BlockQ8_0, b1: &BlockQ8_0) -> __m512i {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(b0.qs.as_ptr().cast()));
        let x = _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b1.qs.as_ptr().cast()));
        _mm512_xor_si512(x, _mm512_set1_epi8(-128))
    }
}

/// One block of 16 rows in lanes: `codes[k]` lane l is row l's codes 4k..4k+4; `d`
/// and `m` lane l are row l's scale and minimum.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct LaneBlock {
    codes: [__m512i; 8],
    d: __m512,
    m: __m512,
}

/// Sixteen 32-byte rows, row j + 8h in half h of `p[j]`, as eight vectors of sixteen
/// dwords: vector k lane l is row l's dword k.
#[inline(always)]
unsafe fn transpose(p: [__m512i; 8]) -> [__m512i; 8] {
    // In each 128-bit lane L of p[j]: row j + 8(L / 2), dwords 4(L % 2)..+4.
    let t = [
        _mm512_unpacklo_epi32(p[0], p[1]),
        _mm512_unpackhi_epi32(p[0], p[1]),
        _mm512_unpacklo_epi32(p[2], p[3]),
        _mm512_unpackhi_epi32(p[2], p[3]),
        _mm512_unpacklo_epi32(p[4], p[5]),
        _mm512_unpackhi_epi32(p[4], p[5]),
        _mm512_unpacklo_epi32(p[6], p[7]),
        _mm512_unpackhi_epi32(p[6], p[7]),
    ];
    // u[i] (v[i]): in 128-bit lane L, rows 0..4 (4..8) + 8(L / 2), dword 4(L % 2) + i.
    let u = [
        _mm512_unpacklo_epi64(t[0], t[2]),
        _mm512_unpackhi_epi64(t[0], t[2]),
        _mm512_unpacklo_epi64(t[1], t[3]),
        _mm512_unpackhi_epi64(t[1], t[3]),
    ];
    let v = [
        _mm512_unpacklo_epi64(t[4], t[6]),
        _mm512_unpackhi_epi64(t[4], t[6]),
        _mm512_unpacklo_epi64(t[5], t[7]),
        _mm512_unpackhi_epi64(t[5], t[7]),
    ];
    // Dword i takes 128-bit lanes 0 and 2 of u[i] and v[i]; dword 4 + i, lanes 1 and 3.
    let low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    let mut out = [_mm512_setzero_si512(); 8];
    for i in 0..4 {
        out[i] = _mm512_permutex2var_epi64(u[i], low, v[i]);
        out[4 + i] = _mm512_permutex2var_epi64(u[i], high, v[i]);
    }
    out
}

/// Block `b` of the 16 rows `rows`, in lanes.
#[inline(always)]
unsafe fn lane_block<F: Lanes16>(rows: &[&[F::W]; TILE_ROWS], b: usize) -> LaneBlock {
    let mut p = [_mm512_setzero_si512(); 8];
    for (j, pj) in p.iter_mut().enumerate() {
        *pj = F::codes2(rows[j].get_unchecked(b), rows[j + 8].get_unchecked(b));
    }
    let (mut d, mut m) = ([0u16; TILE_ROWS], [0u16; TILE_ROWS]);
    for l in 0..TILE_ROWS {
        let block = rows[l].get_unchecked(b);
        d[l] = F::d(block);
        if F::SHIFT.is_none() {
            m[l] = F::m(block);
        }
    }
    LaneBlock {
        codes: transpose(p),
        d: _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().cast())),
        m: if F::SHIFT.is_none() {
            _mm512_cvtph_ps(_mm256_loadu_si256(m.as_ptr().cast()))
        } else {
            _mm512_setzero_ps()
        },
    }
}

/// The float chains (value, minimum) of 16 rows against one token, advanced by block b.
///
/// # Safety
/// The module's features; `a` fits the rows and `b` is one of their blocks.
#[inline(always)]
unsafe fn step<F: Lanes16>(x: &LaneBlock, a: Act, b: usize, acc: &mut __m512, min: &mut __m512) {
    // The block's integer sum in four independent chains of two `vpdpbusd`s rather
    // than one of eight (its latency bounded decode), added at the end: integer sums,
    // exact in any order.
    let mut isum = [_mm512_setzero_si512(); 4];
    if let Some(shift) = F::SHIFT {
        isum[0] = _mm512_set1_epi32(*a.neg.add(b) << shift);
    }
    let q = a.q.add(32 * b).cast::<i32>();
    for k in 0..8 {
        isum[k % 4] = _mm512_dpbusd_epi32(
            isum[k % 4],
            x.codes[k],
            _mm512_set1_epi32(q.add(k).read_unaligned()),
        );
    }
    let isum = _mm512_add_epi32(
        _mm512_add_epi32(isum[0], isum[1]),
        _mm512_add_epi32(isum[2], isum[3]),
    );
    let (da, sa) = match F::SHIFT {
        Some(_) => (*a.s.add(b), 0.0),
        None => (*a.s.add(2 * b), *a.s.add(2 * b + 1)),
    };
    *acc = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(isum),
        _mm512_mul_ps(x.d, _mm512_set1_ps(da)),
        *acc,
    );
    if F::SHIFT.is_none() {
        *min = _mm512_fmadd_ps(x.m, _mm512_set1_ps(sa), *min);
    }
}

/// The 16 results of a pair of chains.
#[inline(always)]
unsafe fn finish<F: Lanes16>(acc: __m512, min: __m512) -> [f32; TILE_ROWS] {
    let v = if F::SHIFT.is_none() {
        _mm512_add_ps(acc, min)
    } else {
        acc
    };
    std::mem::transmute::<__m512, [f32; TILE_ROWS]>(v)
}

/// `out[i] = K·(row i of w, a)` for consecutive rows of `row_bytes`, 16 at a time, each
/// group decoded as it streams past (from packed groups where `PACKED`; the last rows,
/// short of a group, as stored; `w` begins at a group) while the next one is prefetched.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot1_groups<F: Packed16, const PACKED: bool>(
    w: &[u8],
    row_bytes: usize,
    a: ActRow<'_>,
    out: &mut [f32],
) {
    assert!(
        row_bytes > 0 && w.len() == row_bytes * out.len(),
        "weights are not out.len() rows"
    );
    let blocks = row_bytes / std::mem::size_of::<F::W>();
    let act = Act::new::<F>(&a, blocks);
    let span = TILE_ROWS * row_bytes;
    for (g, out) in out.chunks_mut(TILE_ROWS).enumerate() {
        let rows = group::<F::W, TILE_ROWS>(w, row_bytes, g * TILE_ROWS, out.len());
        let packed = (PACKED && out.len() == TILE_ROWS).then(|| w.as_ptr().add(g * span));
        let (mut acc, mut min) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let next = (g + 1) * span;
        for b in 0..blocks {
            super::avx2::prefetch_ahead(w, next + b * span / blocks, span / blocks);
            let x = match packed {
                Some(p) => F::packed_lane_block(p, row_bytes, b),
                None => lane_block::<F>(&rows, b),
            };
            step::<F>(&x, act, b, &mut acc, &mut min);
        }
        out.copy_from_slice(&finish::<F>(acc, min)[..out.len()]);
    }
}

thread_local! {
    /// A thread's transposed tile, reused from call to call.
    static TILE: RefCell<Vec<LaneBlock>> = const { RefCell::new(Vec::new()) };
}

/// `out[t][i] = K·(row i of w, a[t])` for the (at most 16) rows of `w`: the rows are
/// decoded once (from a packed group where `PACKED` and the rows are a whole group),
/// then every token runs its chains over the tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_groups<F: Packed16, const PACKED: bool>(
    w: &[u8],
    row_bytes: usize,
    a: &[ActRow<'_>],
    out: &mut [[f32; TILE_ROWS]],
) {
    let (n, blocks) = tile_shape::<F::W>(w, row_bytes, a.len(), out.len());
    // Taken out of the thread-local rather than used in a closure: a closure would not
    // inherit this function's target features.
    let mut whole = TILE.take();
    let tile = tile_of(&mut whole, blocks, || std::mem::zeroed());
    if PACKED && n == TILE_ROWS {
        for (b, x) in tile.iter_mut().enumerate() {
            *x = F::packed_lane_block(w.as_ptr(), row_bytes, b);
        }
    } else {
        let rows = group::<F::W, TILE_ROWS>(w, row_bytes, 0, n);
        for (b, x) in tile.iter_mut().enumerate() {
            *x = lane_block::<F>(&rows, b);
        }
    }
    // Tokens TILE_TOKENS at a time, their chains side by side over each block, so that
    // the block's codes are loaded once for all of them (loads of the tile, not the
    // products, bounded a token at a time). Each chain is a token's alone, in block
    // order: the results are the same for any grouping.
    let mut ahead = super::avx2::Ahead::new(w, a.len() / TILE_TOKENS * blocks);
    let mut groups = a
        .chunks_exact(TILE_TOKENS)
        .zip(out.chunks_exact_mut(TILE_TOKENS));
    for (a, out) in groups.by_ref() {
        let act: [Act; TILE_TOKENS] = std::array::from_fn(|t| Act::new::<F>(&a[t], blocks));
        let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
        let mut min = [_mm512_setzero_ps(); TILE_TOKENS];
        for (b, x) in tile.iter().enumerate() {
            ahead.step();
            let x = *x;
            for t in 0..TILE_TOKENS {
                step::<F>(&x, act[t], b, &mut acc[t], &mut min[t]);
            }
        }
        for t in 0..TILE_TOKENS {
            out[t] = finish::<F>(acc[t], min[t]);
        }
    }
    let rest = a.len() / TILE_TOKENS * TILE_TOKENS;
    for (a, out) in a[rest..].iter().zip(out[rest..].iter_mut()) {
        let act = Act::new::<F>(a, blocks);
        let (mut acc, mut min) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (b, x) in tile.iter().enumerate() {
            step::<F>(x, act, b, &mut acc, &mut min);
        }
        *out = finish::<F>(acc, min);
    }
    TILE.set(whole);
}

/// Tokens a tile's blocks are run against together ([`tile_groups`]).
const TILE_TOKENS: usize = 4;

/// A [`Lanes16`] format whose rows are packed at load by AVX2's packing
/// ([`avx2_lanes::pack_groups`]), in groups of sixteen rows. By default as AVX2's
/// kernels take them: two of AVX2's groups of eight, one after the other. AVX2 puts in
/// lane l of its vector k what the transposes here put in lane l (or l + 8) of vector
/// k, so a packed block is two loads and a join per vector. A format may instead pack
/// each block of sixteen rows as one group of sixteen lanes, for fewer instructions a
/// block.
trait Packed16: Lanes16 + Lanes8 + Sized {
    /// Lanes of a packed block: AVX2's eight, or sixteen.
    const PACKED_LANES: usize = avx2_lanes::LANES;

    /// Block `b` of the packed group of sixteen rows of `row_bytes` at `g`: the same
    /// values [`lane_block`] makes of the rows it was packed from.
    ///
    /// # Safety
    /// The module's features; `g` is a packed group of more than `b` blocks.
    #[inline(always)]
    unsafe fn packed_lane_block(g: *const u8, row_bytes: usize, b: usize) -> LaneBlock {
        let at = b * avx2_lanes::LANES * std::mem::size_of::<<Self as LaneFormat>::W>();
        let low = avx2_lanes::packed_block::<Self>(g.add(at));
        let high = avx2_lanes::packed_block::<Self>(g.add(avx2_lanes::LANES * row_bytes + at));
        let mut codes = [_mm512_setzero_si512(); 8];
        for (k, c) in codes.iter_mut().enumerate() {
            *c = join_i(low.codes[k], high.codes[k]);
        }
        LaneBlock {
            codes,
            d: join_f(low.d, high.d),
            m: join_f(low.m, high.m),
        }
    }
}

/// Q4_1 packs blocks of sixteen lanes: the sixteen scales, the sixteen minimums, then
/// four 64-byte vectors of the nibble bytes (vector k lane l: row l's bytes 4k..4k+4).
/// A block is then six loads (four of codes), the split into low and high nibbles and
/// two conversions, where two of AVX2's groups take twelve loads and ten joins.
impl Packed16 for Q4_1Lanes {
    const PACKED_LANES: usize = TILE_ROWS;

    #[inline(always)]
    unsafe fn packed_lane_block(g: *const u8, _row_bytes: usize, b: usize) -> LaneBlock {
        let p = g.add(b * TILE_ROWS * std::mem::size_of::<BlockQ4_1>());
        let low = _mm512_set1_epi8(0x0F);
        let mut codes = [_mm512_setzero_si512(); 8];
        for k in 0..4 {
            let at = Self::HEAD_BYTES * TILE_ROWS + 4 * TILE_ROWS * k;
            let bytes = _mm512_loadu_si512(p.add(at).cast());
            codes[k] = _mm512_and_si512(bytes, low);
            codes[4 + k] = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low);
        }
        LaneBlock {
            codes,
            d: _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            m: _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * TILE_ROWS).cast())),
        }
    }
}

impl Packed16 for Q5_0Lanes {}

/// Q8_0 packs blocks of sixteen lanes: the sixteen scales, then eight 64-byte vectors
/// of codes (vector k lane l: row l's codes 4k..4k+4), signed as AVX2 keeps them and
/// offset here by a flip of the sign bit. A block is then nine loads, eight flips and
/// a conversion, where two of AVX2's groups take eighteen loads and the joins of their
/// halves too.
impl Packed16 for Q8_0Lanes {
    const PACKED_LANES: usize = TILE_ROWS;

    #[inline(always)]
    unsafe fn packed_lane_block(g: *const u8, _row_bytes: usize, b: usize) -> LaneBlock {
        let p = g.add(b * TILE_ROWS * std::mem::size_of::<BlockQ8_0>());
        let mut codes = [_mm512_setzero_si512(); 8];
        for (k, c) in codes.iter_mut().enumerate() {
            let at = Self::HEAD_BYTES * TILE_ROWS + 4 * TILE_ROWS * k;
            *c = _mm512_xor_si512(_mm512_loadu_si512(p.add(at).cast()), _mm512_set1_epi8(-128));
        }
        LaneBlock {
            codes,
            d: _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            m: _mm512_setzero_ps(),
        }
    }
}

/// `out` is `w` (whole rows) with each whole group of sixteen rows packed (in blocks of
/// [`Packed16::PACKED_LANES`] lanes), the rows after the last whole group as stored.
fn pack16<F: Packed16>(w: &[u8], row_bytes: usize, out: &mut [u8]) {
    assert!(
        row_bytes > 0 && w.len().is_multiple_of(row_bytes) && out.len() == w.len(),
        "packing whole rows"
    );
    let whole = w.len() / (TILE_ROWS * row_bytes) * (TILE_ROWS * row_bytes);
    avx2_lanes::pack_groups::<F>(&w[..whole], row_bytes, F::PACKED_LANES, &mut out[..whole]);
    out[whole..].copy_from_slice(&w[whole..]);
}

/// Two halves of eight lanes as one vector.
#[inline(always)]
unsafe fn join_i(low: __m256i, high: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
}

/// Two halves of eight lanes as one vector.
#[inline(always)]
unsafe fn join_f(low: __m256, high: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(low)),
        _mm256_castps_pd(high),
    ))
}

// ------------------------------------------------------------- 256-element K-quants

/// A 256-element K-quant format whose batches run here in lanes, while single tokens
/// run the AVX2 kernel: both compute each super-block's sum exactly in integers and
/// then the same float chains (`avx2::dotn_q4_k_q8_k`), so they agree bit for bit.
pub(crate) trait KLaneFormat {
    type W: Block;
    /// Whether the format has a minimum (Q4_K); without one (Q6_K) the minimum chain
    /// stays zero and is not run.
    const HAS_MIN: bool;
    /// Super-block `b` of 16 rows in lanes.
    ///
    /// # Safety
    /// The module's features.
    unsafe fn lane_block(rows: &[&[Self::W]; TILE_ROWS], b: usize) -> KLaneBlock;
    /// The integer sum (lanes of `sum`) and minimum sum (`min`, zero without a
    /// minimum) of a super-block against a token's block.
    ///
    /// # Safety
    /// The module's features.
    unsafe fn sums(x: &KLaneBlock, a: &BlockQ8K) -> (__m512i, __m512i);
}

/// A super-block of 16 rows in lanes: `codes[g][k]` lane l is row l's codes 4k..4k+4 of
/// group g (32 elements); `scales` are per-lane integer scales of the groups' sums
/// (Q4_K: 8 groups of 32; Q6_K: 16 sub-blocks of 16); `pairs` per-lane pairs of i16
/// multiplying pairs of the activations' 16-element sums; `d` and `dmin` the scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct KLaneBlock {
    codes: [[__m512i; 8]; 8],
    scales: [__m512i; 16],
    pairs: [__m512i; 8],
    d: __m512,
    dmin: __m512,
}

pub(crate) struct Q4KLanes;
pub(crate) struct Q6KLanes;

/// Sixteen 32-byte pieces, one per row, as `transpose` takes them: row j in the low
/// half of vector j, row j + 8 in the high half.
#[inline(always)]
unsafe fn pieces(rows: &[&[u8]; TILE_ROWS], at: usize) -> [__m512i; 8] {
    // Loops, not closures, around intrinsics here: a closure would not inherit the
    // caller's target features.
    let mut p = [_mm512_setzero_si512(); 8];
    for (j, pj) in p.iter_mut().enumerate() {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(rows[j][at..at + 32].as_ptr().cast()));
        *pj = _mm512_inserti64x4::<1>(
            lo,
            _mm256_loadu_si256(rows[j + 8][at..at + 32].as_ptr().cast()),
        );
    }
    p
}

/// Sixteen i32 lanes from per-row values.
#[inline(always)]
unsafe fn lanes_i32(v: [i32; TILE_ROWS]) -> __m512i {
    _mm512_loadu_si512(v.as_ptr().cast())
}

/// Sixteen f32 lanes from per-row f16 bits.
#[inline(always)]
unsafe fn lanes_f16(v: [u16; TILE_ROWS]) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().cast()))
}

/// The activations' 16-element sums, a pair at a time, against `pairs`.
#[inline(always)]
unsafe fn pair_sums(pairs: &[__m512i; 8], a: &BlockQ8K) -> __m512i {
    let bsums = a.bsums.as_ptr().cast::<i32>();
    let mut s = _mm512_setzero_si512();
    for (j, p) in pairs.iter().enumerate() {
        s = _mm512_dpwssd_epi32(s, *p, _mm512_set1_epi32(bsums.add(j).read_unaligned()));
    }
    s
}

/// The sum of `groups` groups of `4 · K` quants from `q`, each scaled by its lane scale.
#[inline(always)]
unsafe fn scaled_sums<const K: usize>(x: &KLaneBlock, q: *const i32, groups: usize) -> __m512i {
    let mut t = _mm512_setzero_si512();
    for g in 0..groups {
        let mut s = _mm512_setzero_si512();
        for k in 0..K {
            let codes = x.codes[g * K / 8][(g * K) % 8 + k];
            s = _mm512_dpbusd_epi32(
                s,
                codes,
                _mm512_set1_epi32(q.add(g * K + k).read_unaligned()),
            );
        }
        t = _mm512_add_epi32(t, _mm512_mullo_epi32(s, x.scales[g]));
    }
    t
}

impl KLaneFormat for Q4KLanes {
    type W = BlockQ4K;
    const HAS_MIN: bool = true;
    #[inline(always)]
    unsafe fn lane_block(rows: &[&[BlockQ4K]; TILE_ROWS], b: usize) -> KLaneBlock {
        let blocks: [&BlockQ4K; TILE_ROWS] = std::array::from_fn(|l| rows[l].get_unchecked(b));
        let qs: [&[u8]; TILE_ROWS] = std::array::from_fn(|l| &blocks[l].qs[..]);
        let mut x: KLaneBlock = std::mem::zeroed();
        let m4 = _mm512_set1_epi8(0x0F);
        for c in 0..4 {
            // Bytes 32c..32c+32: group 2c in the low nibbles, 2c + 1 in the high ones.
            let p = pieces(&qs, 32 * c);
            let (mut low, mut high) = (p, p);
            for j in 0..8 {
                low[j] = _mm512_and_si512(p[j], m4);
                high[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(p[j]), m4);
            }
            x.codes[2 * c] = transpose(low);
            x.codes[2 * c + 1] = transpose(high);
        }
        for g in 0..8 {
            let sm: [(u8, u8); TILE_ROWS] =
                std::array::from_fn(|l| scale_min_k4(g, &blocks[l].scales));
            x.scales[g] = lanes_i32(sm.map(|(sc, _)| sc as i32));
            x.pairs[g] = lanes_i32(sm.map(|(_, m)| m as i32 | (m as i32) << 16));
        }
        x.d = lanes_f16(blocks.map(|b| u16::from_le_bytes(b.d.0)));
        x.dmin = lanes_f16(blocks.map(|b| u16::from_le_bytes(b.dmin.0)));
        x
    }
    #[inline(always)]
    unsafe fn sums(x: &KLaneBlock, a: &BlockQ8K) -> (__m512i, __m512i) {
        (
            scaled_sums::<8>(x, a.qs.as_ptr().cast(), 8),
            pair_sums(&x.pairs, a),
        )
    }
}

impl KLaneFormat for Q6KLanes {
    type W = BlockQ6K;
    const HAS_MIN: bool = false;
    #[inline(always)]
    unsafe fn lane_block(rows: &[&[BlockQ6K]; TILE_ROWS], b: usize) -> KLaneBlock {
        let blocks: [&BlockQ6K; TILE_ROWS] = std::array::from_fn(|l| rows[l].get_unchecked(b));
        let ql: [&[u8]; TILE_ROWS] = std::array::from_fn(|l| &blocks[l].ql[..]);
        let qh: [&[u8]; TILE_ROWS] = std::array::from_fn(|l| &blocks[l].qh[..]);
        let mut x: KLaneBlock = std::mem::zeroed();
        let (m4, m3) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
        for n in 0..2 {
            let (ql0, ql1, qh) = (
                pieces(&ql, 64 * n),
                pieces(&ql, 64 * n + 32),
                pieces(&qh, 32 * n),
            );
            // Quarter q of this half: four low bits from ql, two high bits from qh at 2q.
            for q in 0..4 {
                let mut p = [_mm512_setzero_si512(); 8];
                for j in 0..8 {
                    let low = if q % 2 == 0 { ql0[j] } else { ql1[j] };
                    let low = if q < 2 {
                        low
                    } else {
                        _mm512_srli_epi16::<4>(low)
                    };
                    let high = _mm512_and_si512(
                        _mm512_srl_epi16(qh[j], _mm_cvtsi32_si128(2 * q as i32)),
                        m3,
                    );
                    p[j] = _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_slli_epi16::<4>(high));
                }
                x.codes[4 * n + q] = transpose(p);
            }
        }
        for g in 0..16 {
            x.scales[g] = lanes_i32(blocks.map(|b| b.scales[g] as i32));
        }
        for j in 0..8 {
            x.pairs[j] = lanes_i32(blocks.map(|b| {
                (b.scales[2 * j] as i16 as u16 as i32) | (b.scales[2 * j + 1] as i32) << 16
            }));
        }
        x.d = lanes_f16(blocks.map(|b| u16::from_le_bytes(b.d.0)));
        x
    }
    #[inline(always)]
    unsafe fn sums(x: &KLaneBlock, a: &BlockQ8K) -> (__m512i, __m512i) {
        // Σ sc·(q − 32)·a = Σ sc·q·a − 32 · Σ sc·(16-element sums of a).
        let t = scaled_sums::<4>(x, a.qs.as_ptr().cast(), 16);
        (
            _mm512_sub_epi32(t, _mm512_slli_epi32::<5>(pair_sums(&x.pairs, a))),
            _mm512_setzero_si512(),
        )
    }
}

/// The exact integer sum Σ sc·(q − 32)·a of one Q6_K super-block against its Q8_K
/// block, spread over sixteen i32 lanes, in four 64-element vectors. A 64-byte run of
/// `ql` holds, in its low nibbles, the low bits of 64 consecutive weights
/// (128n..128n+64 for run n) and in its high nibbles those of the next 64; the two
/// high bits of weight 128n + 32j + l are bits 2j, 2j + 1 of `qh[32n + l]`, so each
/// 32-byte half of `qh` is put in both halves of a vector and shifted by word (a
/// shift's bits that cross into the next byte fall outside the two kept).
#[inline(always)]
unsafe fn q6k_block_lanes(w: &BlockQ6K, a: &BlockQ8K) -> __m512i {
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // The high bits of the low-nibble vectors go up by 4 and 2, those of the
    // high-nibble ones by 0 and down by 2 (per 256-bit half).
    let (up, down) = (halves(4, 2), halves(0, 2));
    let qh = _mm512_loadu_si512(w.qh.as_ptr().cast());
    let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr().cast()));
    let sc = _mm512_castsi256_si512(sc16);
    let mut sum = _mm512_setzero_si512();
    for n in 0..2 {
        let ql = _mm512_loadu_si512(w.ql.as_ptr().add(64 * n).cast());
        let h = if n == 0 {
            _mm512_shuffle_i64x2::<0b01_00_01_00>(qh, qh)
        } else {
            _mm512_shuffle_i64x2::<0b11_10_11_10>(qh, qh)
        };
        // A | (B & C): the nibble with the two high bits in place.
        let codes = [
            _mm512_ternarylogic_epi32::<0xF8>(
                _mm512_and_si512(ql, m4),
                _mm512_sllv_epi16(h, up),
                m30,
            ),
            _mm512_ternarylogic_epi32::<0xF8>(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_srlv_epi16(h, down),
                m30,
            ),
        ];
        for (c, codes) in codes.into_iter().enumerate() {
            // Weights 64v..64v+64 (v = 2n + c): 128-bit lane L is sub-block 4v + L.
            let v = 2 * n + c;
            let y = _mm512_loadu_si512(a.qs.as_ptr().add(64 * v).cast());
            let word_scale = _mm512_loadu_si512(SUB_BLOCK_OF_WORD[v].as_ptr().cast());
            let scales = _mm512_permutexvar_epi16(word_scale, sc);
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(codes, y), scales);
        }
    }
    // Σ sc·(q − 32)·a = Σ sc·q·a − 32 · Σ sc·(16-element sums of a), exactly.
    let offset = _mm256_madd_epi16(_mm256_loadu_si256(a.bsums.as_ptr().cast()), sc16);
    _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_slli_epi32::<5>(offset)))
}

/// For each of a super-block's four 64-element vectors, the sub-block (16 elements) of
/// each of its 32 pairs: word j of vector v reads scale 4v + j / 8.
const SUB_BLOCK_OF_WORD: [[u16; 32]; 4] = {
    let mut t = [[0u16; 32]; 4];
    let mut w = 0;
    while w < 128 {
        t[w / 32][w % 32] = (4 * (w / 32) + w % 32 / 8) as u16;
        w += 1;
    }
    t
};

/// The lane sums of four vectors, in order: four independent horizontal sums (exact in
/// any order, being integers) with their shuffles shared.
#[inline(always)]
unsafe fn reduce4_epi32(v: [__m512i; 4]) -> __m128i {
    let x = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let y = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // Each 128-bit lane: partial sums of v[0], v[1], v[2], v[3].
    let z = _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
    let z = _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64::<1>(z));
    _mm_add_epi32(_mm256_castsi256_si128(z), _mm256_extracti128_si256::<1>(z))
}

/// The super-blocks of `a` for the rows kernels ([`q4k_dot1`], [`q5k_dot1`],
/// [`q6k_dot1`]), checked against `rows` rows of `B` super-blocks in `w`.
fn k_rows_act<'a, B: Block>(
    w: &[u8],
    row_bytes: usize,
    a: &ActRow<'a>,
    rows: usize,
) -> &'a [BlockQ8K] {
    assert!(
        row_bytes > 0 && w.len() == row_bytes * rows,
        "weights are not out.len() rows"
    );
    let a = as_blocks::<BlockQ8K>(a.bytes);
    assert_eq!(
        a.len() * std::mem::size_of::<B>(),
        row_bytes,
        "activation row does not match the weights"
    );
    a
}

/// `out[i] = K·(row i of w, a)` for consecutive Q6_K rows of `row_bytes`: each
/// super-block's exact integer sum ([`q6k_block_lanes`]), then AVX2's float chain
/// `acc ← fma(Σ, d·d_a, acc)` over the super-blocks in order, so that a row gives
/// AVX2's single-token kernel's bits (and the tiles'). Four rows go together, their
/// sums reduced as one and their chains in the lanes of one vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_dot1(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    let a = k_rows_act::<BlockQ6K>(w, row_bytes, &a, out.len());
    for (rows, out) in w.chunks_exact(4 * row_bytes).zip(out.chunks_exact_mut(4)) {
        // Loops rather than closures around the intrinsics: a closure would not
        // inherit this function's target features.
        let rows = as_blocks::<BlockQ6K>(rows);
        let mut acc = _mm_setzero_ps();
        for (i, b) in a.iter().enumerate() {
            let mut lanes = [_mm512_setzero_si512(); 4];
            let mut d = [0u16; 4];
            for r in 0..4 {
                let x = &rows[r * a.len() + i];
                lanes[r] = q6k_block_lanes(x, b);
                d[r] = u16::from_le_bytes(x.d.0);
            }
            let totals = reduce4_epi32(lanes);
            let d = _mm_cvtph_ps(_mm_loadl_epi64(d.as_ptr().cast()));
            acc = _mm_fmadd_ps(
                _mm_cvtepi32_ps(totals),
                _mm_mul_ps(d, _mm_set1_ps(b.d())),
                acc,
            );
        }
        _mm_storeu_ps(out.as_mut_ptr(), acc);
    }
    let rest = out.len() / 4 * 4;
    for (row, out) in w[rest * row_bytes..]
        .chunks_exact(row_bytes)
        .zip(&mut out[rest..])
    {
        let mut acc = 0.0f32;
        for (x, a) in as_blocks::<BlockQ6K>(row).iter().zip(a) {
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes(x.d.0) as i32
            )));
            let total = _mm512_reduce_add_epi32(q6k_block_lanes(x, a));
            acc = (total as f32).mul_add(d * a.d(), acc);
        }
        *out = acc;
    }
}

/// A Q4_K or Q5_K super-block's scaled sums against its Q8_K block, exactly, in sixteen
/// i32 lanes: for each 64 weights 64j..64j+64, a vector carries group 2j in its low
/// half and group 2j + 1 in its high half (the low and high nibbles of the same 32
/// bytes of `qs`, and for Q5_K the fifth bits 2j and 2j + 1 of `qh`), and lane k of
/// either half gains that group's four weights 4k.. times its scale. Lane k plus lane
/// k + 8 is lane k of AVX2's Q5_K kernel (`avx2::dot_q5_k_q8_k`).
#[inline(always)]
unsafe fn k4_block_lanes(qs: &[u8; 128], qh: Option<&[u8; 32]>, sc: u64, a: &BlockQ8K) -> __m512i {
    let m4 = _mm512_set1_epi8(0x0F);
    let m10 = _mm512_set1_epi8(0x10);
    let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let mut sum = _mm512_setzero_si512();
    for j in 0..4 {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.as_ptr().add(32 * j).cast()));
        let mut codes = _mm512_and_si512(_mm512_srlv_epi16(q, halves(0, 4)), m4);
        if let Some(qh) = qh {
            // Fifth bit 2j (low half) or 2j + 1 (high half) of each byte, moved to bit 4.
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(qh.as_ptr().cast()));
            let shift = halves(2 * j as i16, 2 * j as i16 + 1);
            let fifth = _mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh, shift));
            codes = _mm512_ternarylogic_epi32::<0xF8>(codes, fifth, m10);
        }
        let y = _mm512_loadu_si512(a.qs.as_ptr().add(64 * j).cast());
        let scales = _mm512_permutexvar_epi16(halves(2 * j as i16, 2 * j as i16 + 1), sc);
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(codes, y), scales);
    }
    sum
}

/// The eight i32 lanes of AVX2's Q5_K kernel for one super-block ([`k4_block_lanes`]'s
/// halves added).
#[inline(always)]
unsafe fn q5k_block_lanes(w: &BlockQ5K, sc: u64, a: &BlockQ8K) -> __m256i {
    let sum = k4_block_lanes(&w.qs, Some(&w.qh), sc, a);
    _mm256_add_epi32(
        _mm512_castsi512_si256(sum),
        _mm512_extracti64x4_epi64::<1>(sum),
    )
}

/// `out[i] = K·(row i of w, a)` for consecutive Q4_K rows of `row_bytes`: each
/// super-block's exact integer sums ([`k4_block_lanes`], and the minimums' against the
/// activations' 16-element sums), then AVX2's float chains `acc ← fma(Σ, d·d_a, acc)`,
/// `min ← fma(Σm, dmin·d_a, min)` and `acc − min` (`avx2::dotn_q4_k_q8_k`), so that a
/// row gives AVX2's single-token kernel's bits and the tiles'. Four rows go together,
/// their sums reduced as one and their chains in the lanes of a vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_dot1(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    let a = k_rows_act::<BlockQ4K>(w, row_bytes, &a, out.len());
    for (rows, out) in w.chunks_exact(4 * row_bytes).zip(out.chunks_exact_mut(4)) {
        // Loops rather than closures around the intrinsics: a closure would not
        // inherit this function's target features.
        let rows = as_blocks::<BlockQ4K>(rows);
        let (mut acc, mut min) = (_mm_setzero_ps(), _mm_setzero_ps());
        for (i, b) in a.iter().enumerate() {
            let mut sums = [_mm512_setzero_si512(); 4];
            let mut mins = [_mm512_setzero_si512(); 4];
            let (mut d, mut dmin) = ([0u16; 4], [0u16; 4]);
            for r in 0..4 {
                let x = &rows[r * a.len() + i];
                let (sc, mins16) = avx2::k4_scales_mins(&x.scales);
                sums[r] = k4_block_lanes(&x.qs, None, sc, b);
                mins[r] = _mm512_zextsi256_si512(avx2::k4_min_lanes(mins16, b));
                (d[r], dmin[r]) = (u16::from_le_bytes(x.d.0), u16::from_le_bytes(x.dmin.0));
            }
            let da = _mm_set1_ps(b.d());
            let d = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(d.as_ptr().cast())), da);
            let dmin = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(dmin.as_ptr().cast())), da);
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(reduce4_epi32(sums)), d, acc);
            min = _mm_fmadd_ps(_mm_cvtepi32_ps(reduce4_epi32(mins)), dmin, min);
        }
        _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, min));
    }
    let rest = out.len() / 4 * 4;
    for (row, out) in w[rest * row_bytes..]
        .chunks_exact(row_bytes)
        .zip(&mut out[rest..])
    {
        let (mut acc, mut min) = (0.0f32, 0.0f32);
        for (x, a) in as_blocks::<BlockQ4K>(row).iter().zip(a) {
            let (sc, mins16) = avx2::k4_scales_mins(&x.scales);
            let s = _mm512_reduce_add_epi32(k4_block_lanes(&x.qs, None, sc, a));
            let m = avx2::hsum_i32(avx2::k4_min_lanes(mins16, a));
            let ((wd, wdmin), da) = (avx2::f16_pair(x.d, x.dmin), a.d());
            acc = (s as f32).mul_add(wd * da, acc);
            min = (m as f32).mul_add(wdmin * da, min);
        }
        *out = acc - min;
    }
}

/// Sixteen words of `low` and then sixteen of `high`.
#[inline(always)]
unsafe fn halves(low: i16, high: i16) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi16(low), _mm256_set1_epi16(high))
}

/// `out[i] = K·(row i of w, a)` for consecutive Q5_K rows of `row_bytes`, in AVX2's
/// arithmetic (`avx2::dot_q5_k_q8_k`): its eight lanes of exact integer sums
/// ([`q5k_block_lanes`]), the same float chains, the same sums at the end. Four rows go
/// together, two to a vector: their chains in its halves, their minimums' sums and
/// their closing horizontal sums (AVX2's pairings, lane for lane) computed as one.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5k_dot1(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    let a = k_rows_act::<BlockQ5K>(w, row_bytes, &a, out.len());
    for (rows, out) in w.chunks_exact(4 * row_bytes).zip(out.chunks_exact_mut(4)) {
        // Loops rather than closures around the intrinsics: a closure would not
        // inherit this function's target features.
        let rows = as_blocks::<BlockQ5K>(rows);
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut mins = _mm_setzero_ps();
        for (i, b) in a.iter().enumerate() {
            let da = b.d();
            let mut sums = [_mm256_setzero_si256(); 4];
            let mut min_lanes = [_mm256_setzero_si256(); 4];
            let (mut d, mut dmin) = ([0.0f32; 4], [0.0f32; 4]);
            for r in 0..4 {
                let x = &rows[r * a.len() + i];
                let (sc, mins16) = avx2::k4_scales_mins(&x.scales);
                sums[r] = q5k_block_lanes(x, sc, b);
                min_lanes[r] = avx2::k4_min_lanes(mins16, b);
                let (wd, wdmin) = avx2::f16_pair(x.d, x.dmin);
                (d[r], dmin[r]) = (wd * da, wdmin * da);
            }
            for h in 0..2 {
                let sums =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(sums[2 * h]), sums[2 * h + 1]);
                let d = _mm512_mask_blend_ps(
                    0xFF00,
                    _mm512_set1_ps(d[2 * h]),
                    _mm512_set1_ps(d[2 * h + 1]),
                );
                acc[h] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums), acc[h]);
            }
            let mut wide = [_mm512_setzero_si512(); 4];
            for r in 0..4 {
                wide[r] = _mm512_zextsi256_si512(min_lanes[r]);
            }
            let m = _mm_cvtepi32_ps(reduce4_epi32(wide));
            mins = _mm_add_ps(mins, _mm_mul_ps(m, _mm_loadu_ps(dmin.as_ptr())));
        }
        // `avx2::hsum_f32` for each row: lanes i and i + 4, then pairs 0, 2 and 1, 3,
        // then the two.
        let x = _mm512_shuffle_f32x4::<0b10_00_10_00>(acc[0], acc[1]);
        let y = _mm512_shuffle_f32x4::<0b11_01_11_01>(acc[0], acc[1]);
        let s = _mm512_add_ps(x, y);
        let s = _mm512_add_ps(s, _mm512_permute_ps::<0b11_10_11_10>(s));
        let s = _mm512_add_ps(s, _mm512_movehdup_ps(s));
        let totals = _mm512_castps512_ps128(_mm512_permutexvar_ps(
            _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0),
            s,
        ));
        _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(totals, mins));
    }
    let rest = out.len() / 4 * 4;
    for (row, out) in w[rest * row_bytes..]
        .chunks_exact(row_bytes)
        .zip(&mut out[rest..])
    {
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0.0f32;
        for (x, a) in as_blocks::<BlockQ5K>(row).iter().zip(a) {
            let (sc, mins16) = avx2::k4_scales_mins(&x.scales);
            let sumi = q5k_block_lanes(x, sc, a);
            let ((wd, wdmin), da) = (avx2::f16_pair(x.d, x.dmin), a.d());
            acc = _mm256_fmadd_ps(_mm256_set1_ps(wd * da), _mm256_cvtepi32_ps(sumi), acc);
            mins += avx2::hsum_i32(avx2::k4_min_lanes(mins16, a)) as f32 * (wdmin * da);
        }
        *out = avx2::hsum_f32(acc) - mins;
    }
}

/// A 2-bit grid format's block as the rows kernel ([`iq2_dot1`]) reads it.
trait Iq2Block: Block {
    /// The grid its indices point into.
    const GRID: &'static [u64];

    /// The block's 32 grid indices and 32 sign bytes (bit j set: weight j of the
    /// point negative) into `index` and `signs`.
    ///
    /// # Safety
    /// The module's features.
    unsafe fn points(&self, index: &mut [u16; 32], signs: &mut [u8; 32]);

    /// The 4-bit multipliers of the groups' halves and the block's scale.
    fn scales(&self) -> (&[u8; 8], F16Le);
}

impl Iq2Block for BlockIq2Xs {
    const GRID: &'static [u64] = &IQ2XS_GRID;

    #[inline(always)]
    unsafe fn points(&self, index: &mut [u16; 32], signs: &mut [u8; 32]) {
        avx2::iq2xs_points(self, index, signs);
    }

    fn scales(&self) -> (&[u8; 8], F16Le) {
        (&self.scales, self.d)
    }
}

impl Iq2Block for BlockIq2S {
    const GRID: &'static [u64] = &crate::IQ2S_GRID;

    /// Each index a byte of `qs` and, above it, two bits of its group's `qh` byte
    /// (bits 2l, 2l + 1 for point l, `dequant::iq2s_grid_point`); the sign bytes as
    /// stored.
    #[inline(always)]
    unsafe fn points(&self, index: &mut [u16; 32], signs: &mut [u8; 32]) {
        let low = _mm512_cvtepu8_epi16(_mm256_loadu_si256(self.qs.as_ptr().cast()));
        // Point i's qh byte (i / 4), moved so that its two bits for point i % 4 land
        // on bits 8 and 9.
        let qh =
            _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(self.qh.as_ptr().cast())));
        let group = _mm512_srli_epi16::<2>(_mm512_set_epi16(
            31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,
            9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        ));
        let shift = _mm512_set1_epi64(0x0002_0004_0006_0008);
        let high = _mm512_and_si512(
            _mm512_sllv_epi16(_mm512_permutexvar_epi16(group, qh), shift),
            _mm512_set1_epi16(0x300),
        );
        _mm512_storeu_si512(index.as_mut_ptr().cast(), _mm512_or_si512(low, high));
        signs.copy_from_slice(&self.qs[32..]);
    }

    fn scales(&self) -> (&[u8; 8], F16Le) {
        (&self.scales, self.d)
    }
}

/// `out[i] = K·(row i of w, a)` for consecutive rows of a 2-bit grid format (IQ2_XS,
/// IQ2_S) of `row_bytes`, in AVX2's arithmetic (`avx2::dot_iq2_xs_q8_k`,
/// `avx2::dot_iq2_s_q8_k`): two 32-weight groups a 512-bit vector, their eight grid
/// points gathered from the table by index, the activations negated under the groups'
/// 64 sign bits, the products summed in pairs and times each half-group's multiplier;
/// the two halves of the vector then added into AVX2's eight lanes (exact integer sums,
/// so the same lanes), and AVX2's float chain and closing sum.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn iq2_dot1<B: Iq2Block>(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    let a = k_rows_act::<B>(w, row_bytes, &a, out.len());
    // Where each lane of a pair of groups takes its multiplier from: the first group's
    // halves (multipliers 2k and 8 + 2k of the block's sixteen), then the second's.
    let pick = |k: i16| {
        let (a, b) = (2 * k, 2 * k + 1);
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(a), _mm_set1_epi16(8 + a))),
            _mm256_setr_m128i(_mm_set1_epi16(b), _mm_set1_epi16(8 + b)),
        )
    };
    let picks = [pick(0), pick(1), pick(2), pick(3)];
    let mut index = [0u16; 32];
    let mut signs = [0u8; 32];
    for (row, out) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
        let mut acc = _mm256_setzero_ps();
        for (w, a) in as_blocks::<B>(row).iter().zip(a) {
            w.points(&mut index, &mut signs);
            let (scales, d) = w.scales();
            // The multipliers 2s + 1 of the eight groups' halves: first halves (low
            // nibbles) in lanes 0..8, second halves in 8..16.
            let s = _mm_cvtepu8_epi16(_mm_loadl_epi64(scales.as_ptr().cast()));
            let s = _mm256_setr_m128i(
                _mm_and_si128(s, _mm_set1_epi16(0xF)),
                _mm_srli_epi16::<4>(s),
            );
            let s = _mm512_castsi256_si512(_mm256_add_epi16(
                _mm256_add_epi16(s, s),
                _mm256_set1_epi16(1),
            ));
            let mut sumi = _mm512_setzero_si512();
            for (k, pick) in picks.iter().enumerate() {
                let ix = _mm512_cvtepu16_epi64(_mm_loadu_si128(index.as_ptr().add(8 * k).cast()));
                let qx = _mm512_i64gather_epi64::<8>(ix, B::GRID.as_ptr().cast());
                let neg = u64::from_le_bytes(signs[8 * k..8 * k + 8].try_into().expect("8 bytes"));
                let y = _mm512_loadu_si512(a.qs.as_ptr().add(64 * k).cast());
                let y = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
                let sc = _mm512_permutexvar_epi16(*pick, s);
                sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(_mm512_maddubs_epi16(qx, y), sc));
            }
            let lanes = _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64::<1>(sumi),
            );
            let (wd, _) = avx2::f16_pair(d, d);
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(wd * a.d() * 0.125),
                _mm256_cvtepi32_ps(lanes),
                acc,
            );
        }
        *out = avx2::hsum_f32(acc);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn iq2xs_dot1(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    iq2_dot1::<BlockIq2Xs>(w, row_bytes, a, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn iq2s_dot1(w: &[u8], row_bytes: usize, a: ActRow<'_>, out: &mut [f32]) {
    iq2_dot1::<BlockIq2S>(w, row_bytes, a, out)
}

thread_local! {
    /// A thread's transposed K-quant tile, reused from call to call.
    static K_TILE: RefCell<Vec<KLaneBlock>> = const { RefCell::new(Vec::new()) };
}

/// As [`tile_groups`] for a [`KLaneFormat`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_tile_dot<F: KLaneFormat>(
    w: &[u8],
    row_bytes: usize,
    a: &[ActRow<'_>],
    out: &mut [[f32; TILE_ROWS]],
) {
    let (n, blocks) = tile_shape::<F::W>(w, row_bytes, a.len(), out.len());
    let rows = group::<F::W, TILE_ROWS>(w, row_bytes, 0, n);
    let mut whole = K_TILE.take();
    let tile = tile_of(&mut whole, blocks, || std::mem::zeroed());
    for (b, x) in tile.iter_mut().enumerate() {
        *x = F::lane_block(&rows, b);
    }
    let mut ahead = super::avx2::Ahead::new(w, a.len() * blocks);
    for (a, out) in a.iter().zip(out.iter_mut()) {
        let a = as_blocks::<BlockQ8K>(a.bytes);
        assert_eq!(a.len(), blocks, "activation row does not match the weights");
        let (mut acc, mut min) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (x, a) in tile.iter().zip(a) {
            ahead.step();
            let da = _mm512_set1_ps(a.d());
            let (sum, mins) = F::sums(x, a);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(x.d, da), acc);
            if F::HAS_MIN {
                min = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(x.dmin, da), min);
            }
        }
        *out = std::mem::transmute::<__m512, [f32; TILE_ROWS]>(_mm512_sub_ps(acc, min));
    }
    K_TILE.set(whole);
}

#[cfg(test)]
mod tests {
    use super::super::lanes::check_kernels;
    use super::*;
    use crate::parity::{random_weights, SplitMix};

    fn check<F: Lanes16>(ty: GgmlType, act: ActType) {
        if !crate::Isa::Avx512Vnni.available() {
            eprintln!("skipped: this machine has no AVX-512 VNNI");
            return;
        }
        let LaneKernels {
            single,
            tile,
            packing,
        } = kernels(ty).unwrap();
        let (dot, dot1) = single.expect("a whole set");
        let tile = tile.expect("a tile");
        check_kernels::<F>(ty, act, (dot, dot1, tile), Some(packing.expect("packed")));
    }

    /// Decode, single-row and tile entry points, over rows as stored and packed, equal
    /// the scalar statement of their arithmetic bit for bit, on ragged row counts.
    #[test]
    fn kernels_equal_their_scalar_statement() {
        check::<Q4_1Lanes>(GgmlType::Q4_1, ActType::Q8_1);
        check::<Q5_0Lanes>(GgmlType::Q5_0, ActType::Q8_0);
        check::<Q8_0Lanes>(GgmlType::Q8_0, ActType::Q8_0);
    }

    /// The K-quant tiles' arithmetic in scalar code: exact integer super-block sums,
    /// then the float chains.
    fn k_reference(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
        let a = as_blocks::<BlockQ8K>(a);
        let (mut acc, mut min) = (0.0f32, 0.0f32);
        let f16 = |b: F16Le| half::f16::from_bits(u16::from_le_bytes(b.0)).to_f32();
        match ty {
            GgmlType::Q4_K => {
                for (x, a) in as_blocks::<BlockQ4K>(w).iter().zip(a) {
                    let (mut t, mut m) = (0i32, 0i32);
                    for g in 0..8 {
                        let (sc, mn) = scale_min_k4(g, &x.scales);
                        let q = |e: usize| (x.qs[32 * (g / 2) + e] >> (4 * (g % 2))) & 0x0F;
                        t += sc as i32
                            * (0..32)
                                .map(|e| q(e) as i32 * a.qs[32 * g + e] as i32)
                                .sum::<i32>();
                        m += mn as i32 * (a.bsum(2 * g) + a.bsum(2 * g + 1));
                    }
                    acc = (t as f32).mul_add(f16(x.d) * a.d(), acc);
                    min = (m as f32).mul_add(f16(x.dmin) * a.d(), min);
                }
            }
            GgmlType::Q6_K => {
                for (x, a) in as_blocks::<BlockQ6K>(w).iter().zip(a) {
                    let mut t = 0i32;
                    for e in 0..256 {
                        let (n, quarter, l) = (e / 128, e % 128 / 32, e % 32);
                        let low =
                            (x.ql[64 * n + 32 * (quarter % 2) + l] >> (4 * (quarter / 2))) & 0x0F;
                        let high = (x.qh[32 * n + l] >> (2 * quarter)) & 3;
                        let q = (low | high << 4) as i32 - 32;
                        t += x.scales[e / 16] as i32 * q * a.qs[e] as i32;
                    }
                    acc = (t as f32).mul_add(f16(x.d) * a.d(), acc);
                }
            }
            _ => unreachable!("not a K-quant with lanes"),
        }
        acc - min
    }

    /// Sets every other super-block of `w` to the extremes its integer sums must hold:
    /// the largest codes and scales of either sign (Q6_K: codes 63 and 0, scales 127
    /// and −128; Q4_K: every bit set).
    fn extremes(ty: GgmlType, w: &mut [u8]) {
        match ty {
            GgmlType::Q6_K => {
                for (i, b) in as_blocks_mut::<BlockQ6K>(w).iter_mut().enumerate() {
                    if i % 2 == 0 {
                        let high = i % 4 == 0;
                        b.ql = [if high { 0xFF } else { 0 }; 128];
                        b.qh = [if high { 0xFF } else { 0 }; 64];
                        b.scales = std::array::from_fn(|g| if g % 3 == 0 { -128 } else { 127 });
                    }
                }
            }
            _ => {
                for b in as_blocks_mut::<BlockQ4K>(w).iter_mut().step_by(2) {
                    b.scales = [0xFF; 12];
                    b.qs = [0xFF; 128];
                }
            }
        }
    }

    /// K-quant tiles, AVX2's single-token kernel and this set's own single-token kernels
    /// equal the scalar statement of their arithmetic bit for bit: a batch gives
    /// what each token gives alone. Random rows, and rows at the codes' and scales'
    /// extremes.
    #[test]
    fn k_tiles_equal_the_single_token_kernels() {
        if !crate::Isa::Avx512Vnni.available() {
            eprintln!("skipped: this machine has no AVX-512 VNNI");
            return;
        }
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let LaneKernels {
                tile, single: own, ..
            } = kernels(ty).unwrap();
            let single = crate::Kernels::new(ty, crate::Isa::Avx2).unwrap().dot;
            for (rows, cols, extreme) in [
                (1, 256, false),
                (16, 512, false),
                (21, 768, false),
                (40, 2048, false),
                (19, 512, true),
            ] {
                let mut weights = random_weights(ty, rows, cols, 7).unwrap();
                if extreme {
                    extremes(ty, &mut weights);
                }
                let row_bytes = weights.len() / rows;
                let mut rng = SplitMix::new(8);
                let x: Vec<f32> = (0..3 * cols).map(|_| rng.activation()).collect();
                let quantized =
                    crate::matmul::QuantizedActivations::new(ActType::Q8K, &x, cols).unwrap();
                let acts: Vec<ActRow> = (0..quantized.tokens)
                    .map(|t| quantized.act_row(t))
                    .collect();
                let tokens: Vec<&[u8]> = acts.iter().map(|a| a.bytes).collect();
                {
                    let (dot, dot1) = own.expect("single-token kernels of its own");
                    for (t, a) in acts.iter().enumerate() {
                        let mut got = vec![0.0f32; rows];
                        dot1(&weights, row_bytes, *a, &mut got);
                        for (r, got) in got.iter().enumerate() {
                            let w = &weights[r * row_bytes..(r + 1) * row_bytes];
                            let want = k_reference(ty, w, a.bytes).to_bits();
                            let what = format!("{ty} {rows}x{cols} row {r} token {t}");
                            assert_eq!(got.to_bits(), want, "{what} (rows)");
                            assert_eq!(dot(w, a.bytes).to_bits(), want, "{what} (one row)");
                        }
                    }
                }
                let tile = tile.expect("a tile");
                for first in (0..rows).step_by(TILE_ROWS) {
                    let n = TILE_ROWS.min(rows - first);
                    let mut out = vec![[0.0f32; TILE_ROWS]; acts.len()];
                    tile(
                        &weights[first * row_bytes..(first + n) * row_bytes],
                        row_bytes,
                        &acts,
                        &mut out,
                    );
                    for (t, (a, got)) in tokens.iter().zip(&out).enumerate() {
                        for (r, got) in (first..first + n).zip(got) {
                            let w = &weights[r * row_bytes..(r + 1) * row_bytes];
                            let want = k_reference(ty, w, a);
                            assert_eq!(
                                single(w, a).to_bits(),
                                want.to_bits(),
                                "{ty} {rows}x{cols} row {r} token {t} (AVX2)"
                            );
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{ty} {rows}x{cols} row {r} token {t} (tile)"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The rows kernel of `ty` gives AVX2's kernel's bits, on random rows and on rows
    /// whose every other block `extreme` sets to its codes' extremes, for every row
    /// count from 1 to the shape's.
    fn rows_equal_avx2<B: Block>(ty: GgmlType, extreme: impl Fn(&mut B)) {
        if !crate::Isa::Avx512Vnni.available() {
            eprintln!("skipped: this machine has no AVX-512 VNNI");
            return;
        }
        let (dot, dot1) = kernels(ty).unwrap().single.unwrap();
        let avx2 = crate::Kernels::new(ty, crate::Isa::Avx2).unwrap().dot;
        for (rows, cols, extremes) in [(1, 256, false), (21, 768, false), (9, 512, true)] {
            let mut weights = random_weights(ty, rows, cols, 9).unwrap();
            if extremes {
                as_blocks_mut::<B>(&mut weights)
                    .iter_mut()
                    .step_by(2)
                    .for_each(&extreme);
            }
            let row_bytes = weights.len() / rows;
            let mut rng = SplitMix::new(10);
            let x: Vec<f32> = (0..2 * cols).map(|_| rng.activation()).collect();
            let quantized =
                crate::matmul::QuantizedActivations::new(ActType::Q8K, &x, cols).unwrap();
            for t in 0..quantized.tokens {
                let a = quantized.act_row(t);
                for n in 1..=rows {
                    let mut got = vec![0.0f32; n];
                    dot1(&weights[..n * row_bytes], row_bytes, a, &mut got);
                    for (r, got) in got.iter().enumerate() {
                        let w = &weights[r * row_bytes..(r + 1) * row_bytes];
                        let want = avx2(w, a.bytes).to_bits();
                        assert_eq!(
                            got.to_bits(),
                            want,
                            "{ty} {rows}x{cols} row {r} of {n} token {t}"
                        );
                        assert_eq!(
                            dot(w, a.bytes).to_bits(),
                            want,
                            "{ty} {rows}x{cols} row {r}"
                        );
                    }
                }
            }
        }
    }

    /// Q5_K's rows give AVX2's kernel's bits (its eight lanes rebuilt exactly).
    #[test]
    fn q5k_rows_equal_avx2() {
        rows_equal_avx2::<BlockQ5K>(GgmlType::Q5_K, |b| {
            (b.scales, b.qs, b.qh) = ([0xFF; 12], [0xFF; 128], [0xFF; 32]);
        });
    }

    /// IQ2_XS's rows give AVX2's kernel's bits (two groups a vector, their halves added
    /// into AVX2's lanes); the extremes are the last grid point, the sign code with
    /// every bit set and the largest multipliers.
    #[test]
    fn iq2xs_rows_equal_avx2() {
        rows_equal_avx2::<BlockIq2Xs>(GgmlType::IQ2_XS, |b| {
            (b.qs, b.scales) = ([[0xFF; 2]; 32], [0xFF; 8]);
        });
    }

    /// IQ2_S's rows likewise; the extremes are the last grid point (every index and
    /// high bit set), every weight negative and the largest multipliers.
    #[test]
    fn iq2s_rows_equal_avx2() {
        rows_equal_avx2::<BlockIq2S>(GgmlType::IQ2_S, |b| {
            (b.qs, b.qh, b.scales) = ([0xFF; 64], [0xFF; 8], [0xFF; 8]);
        });
    }
}
