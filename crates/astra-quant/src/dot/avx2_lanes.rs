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
//! Decode streams each group of eight rows once ([`dot1_groups`]); prefill decodes a
//! tile of sixteen rows once into scratch, and every token of the batch meets both
//! halves with the same broadcasts ([`tile_groups`]). Rows as stored are transposed as
//! they stream past; rows packed at load ([`pack`]) are stored block by block in lane
//! order already, so decoding a block is loads and masks, with the same results.
//!
//! Q8_0's codes are kept signed ([`Lanes8::SIGNED`]): offset, they would reach 255,
//! and 2 · 255 · 127 leaves i16, which `vpmaddubsw` would saturate. Its integer sums
//! are the same.
//!
//! Safety: every kernel here requires AVX2, FMA and F16C; they are reachable only
//! through [`kernels`], which `Kernels::new` calls after checking `Isa::available`.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::lanes::{
    group, lane_entries, tile_of, tile_shape, Act, LaneFormat, Q4_1Lanes, Q5_0Lanes, Q8_0Lanes,
};
use super::{ActRow, ActType, Packing, VecDot1Fn, VecDotFn, VecDotTileFn, TILE_ROWS};
use crate::blocks::*;
use crate::GgmlType;

/// Rows per vector.
pub(super) const LANES: usize = 8;

/// The entry points for a weight type, if it runs in lanes on AVX2: the dot on bytes,
/// decode, the batch tile, and the packing with its decode and tile.
pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, VecDot1Fn, VecDotTileFn, Packing)> {
    macro_rules! entries {
        ($f:ty, $act:expr) => {{
            let (dot, dot1, tile) = lane_entries!(dot1_groups, tile_groups, $f, $act, false);
            let (_, packed_dot1, packed_tile) =
                lane_entries!(dot1_groups, tile_groups, $f, $act, true);
            let packing = Packing {
                rows: LANES,
                pack: pack::<$f>,
                dot1: packed_dot1,
                tile: packed_tile,
            };
            Some((dot, dot1, tile, packing))
        }};
    }
    match weights {
        GgmlType::Q4_1 => entries!(Q4_1Lanes, ActType::Q8_1),
        GgmlType::Q5_0 => entries!(Q5_0Lanes, ActType::Q8_0),
        GgmlType::Q8_0 => entries!(Q8_0Lanes, ActType::Q8_0),
        _ => None,
    }
}

/// A [`LaneFormat`] whose codes these kernels can load and multiply in i16.
pub(crate) trait Lanes8: LaneFormat {
    /// How many `vpmaddubsw` results are added in i16 before widening: the largest
    /// n with n · 2 · max code · 127 < 2^15 that divides 8.
    const I16_RUN: usize;
    /// Whether the codes are the signed weights themselves, multiplied as |w| times
    /// the activation with w's sign, each pair of products widened at once (2 · 128 ·
    /// 127 < 2^15): the same integer sums as the offset codes with the offset's term.
    const SIGNED: bool = false;
    /// Block `b` of eight rows' codes (offset where signed) in lanes: vector k lane l
    /// is row l's codes 4k..4k+4.
    ///
    /// # Safety
    /// The module's features; `rows` has eight rows of more than `b` blocks.
    unsafe fn lane_codes(rows: &[&[Self::W]], b: usize) -> [__m256i; 8];
    /// Bytes a lane of a packed block has before the codes: its scale, then its
    /// minimum (Q4_1) or its fifth bits (Q5_0). A block of n lanes has n times as many.
    const HEAD_BYTES: usize;
    /// Writes the part of a packed block of `blocks.len()` lanes after the scales.
    fn pack_rest(blocks: &[&Self::W], out: &mut [u8]);
    /// [`Lanes8::lane_codes`] of the packed block at `p`.
    ///
    /// # Safety
    /// The module's features; `p` points at a packed block of this format.
    unsafe fn packed_codes(p: *const u8) -> [__m256i; 8];
}

/// A block of each of `blocks.len()` rows (one per lane) packed: the scales (f16, lane
/// order), then the rest as the format packs it.
fn pack_blocks<F: Lanes8>(blocks: &[&F::W], out: &mut [u8]) {
    for (l, b) in blocks.iter().enumerate() {
        out[2 * l..2 * l + 2].copy_from_slice(&F::d(b).to_le_bytes());
    }
    F::pack_rest(blocks, out);
}

/// Rows' codes, four bytes at a time, as `n` vectors of `lanes` lanes: vector k lane l
/// holds `dword(l, k)`, row l's bytes 4k..4k+4 (what the transposes build in registers).
fn pack_dwords(lanes: usize, n: usize, out: &mut [u8], dword: impl Fn(usize, usize) -> [u8; 4]) {
    for l in 0..lanes {
        for k in 0..n {
            let at = 4 * (lanes * k + l);
            out[at..at + 4].copy_from_slice(&dword(l, k));
        }
    }
}

/// `out` is `w` (whole rows) with each whole group of eight rows packed, block by
/// block, in the group's place; the rows after the last whole group are copied.
pub(super) fn pack<F: Lanes8>(w: &[u8], row_bytes: usize, out: &mut [u8]) {
    pack_groups::<F>(w, row_bytes, LANES, out);
}

/// As [`pack`], in groups of `lanes` rows (at most [`TILE_ROWS`]): a block of a group
/// is its rows' blocks packed as one vector of `lanes` lanes would take them.
pub(super) fn pack_groups<F: Lanes8>(w: &[u8], row_bytes: usize, lanes: usize, out: &mut [u8]) {
    assert!(
        row_bytes > 0
            && w.len().is_multiple_of(row_bytes)
            && out.len() == w.len()
            && (1..=TILE_ROWS).contains(&lanes),
        "packing whole rows"
    );
    let (span, block) = (lanes * row_bytes, std::mem::size_of::<F::W>());
    let whole = w.len() / span * span;
    for (g, out) in w[..whole]
        .chunks_exact(span)
        .zip(out[..whole].chunks_exact_mut(span))
    {
        let rows: [&[F::W]; TILE_ROWS] = std::array::from_fn(|l| {
            let l = l.min(lanes - 1);
            as_blocks::<F::W>(&g[l * row_bytes..(l + 1) * row_bytes])
        });
        for (b, out) in out.chunks_exact_mut(lanes * block).enumerate() {
            let blocks: [&F::W; TILE_ROWS] = std::array::from_fn(|l| &rows[l][b]);
            pack_blocks::<F>(&blocks[..lanes], out);
        }
    }
    out[whole..].copy_from_slice(&w[whole..]);
}

/// The nibbles of a packed block (at `p`) as lane codes: low nibbles of vector k are
/// codes 4k..4k+4, high ones codes 16 + 4k...
#[inline(always)]
unsafe fn packed_nibbles(p: *const u8) -> [__m256i; 8] {
    let mut d = [_mm256_setzero_si256(); 4];
    for (k, d) in d.iter_mut().enumerate() {
        *d = _mm256_loadu_si256(p.add(32 * k).cast());
    }
    split_nibbles(d)
}

/// Four vectors of nibble bytes in lanes (vector k lane l: row l's nibble bytes
/// 4k..4k+4) as lane codes: low nibbles into vector k (elements 4k..4k+4), high ones
/// into vector 4 + k (elements 16 + 4k..).
#[inline(always)]
unsafe fn split_nibbles(d: [__m256i; 4]) -> [__m256i; 8] {
    let low = _mm256_set1_epi8(0x0F);
    let mut out = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        out[k] = _mm256_and_si256(d[k], low);
        out[4 + k] = _mm256_and_si256(_mm256_srli_epi16::<4>(d[k]), low);
    }
    out
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
        *p = _mm256_set_m128i(
            _mm_loadu_si128(qs[j + 4].as_ptr().cast()),
            _mm_loadu_si128(qs[j].as_ptr().cast()),
        );
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
    split_nibbles(d)
}

impl Lanes8 for Q4_1Lanes {
    // 8 · 2 · 15 · 127 = 30,480.
    const I16_RUN: usize = 8;
    #[inline(always)]
    unsafe fn lane_codes(rows: &[&[BlockQ4_1]], b: usize) -> [__m256i; 8] {
        nibble_lanes(std::array::from_fn(|l| {
            &rows.get_unchecked(l).get_unchecked(b).qs
        }))
    }
    // The scales, then the minimums.
    const HEAD_BYTES: usize = 4;
    fn pack_rest(blocks: &[&BlockQ4_1], out: &mut [u8]) {
        let n = blocks.len();
        for (l, b) in blocks.iter().enumerate() {
            out[2 * (n + l)..2 * (n + l) + 2].copy_from_slice(&b.m.0);
        }
        pack_dwords(n, 4, &mut out[Self::HEAD_BYTES * n..], |l, k| {
            std::array::from_fn(|j| blocks[l].qs[4 * k + j])
        });
    }
    #[inline(always)]
    unsafe fn packed_codes(p: *const u8) -> [__m256i; 8] {
        packed_nibbles(p.add(Self::HEAD_BYTES * LANES))
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
        let qh = _mm256_loadu_si256(
            std::array::from_fn::<u32, LANES, _>(|l| u32::from_le_bytes(block(l).qh))
                .as_ptr()
                .cast(),
        );
        let dword_base = _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8,
            12, 12, 12, 12,
        );
        let (bits_low, bits_high) = (
            _mm256_set1_epi32(0x0804_0201),
            _mm256_set1_epi32(0x8040_2010u32 as i32),
        );
        for (k, c) in codes.iter_mut().enumerate() {
            let bytes = _mm256_shuffle_epi8(
                qh,
                _mm256_add_epi8(dword_base, _mm256_set1_epi8((k / 2) as i8)),
            );
            let bit = if k % 2 == 0 { bits_low } else { bits_high };
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
            *c = _mm256_or_si256(*c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        codes
    }
    // The scales, then the fifth bits as four bytes a lane: bit k of byte 4l + j is
    // row l's fifth bit of element 4k + j, the code in byte j of lane l of vector k.
    const HEAD_BYTES: usize = 6;
    fn pack_rest(blocks: &[&BlockQ5_0], out: &mut [u8]) {
        let n = blocks.len();
        for (l, b) in blocks.iter().enumerate() {
            let qh = u32::from_le_bytes(b.qh);
            for j in 0..4 {
                out[2 * n + 4 * l + j] =
                    (0..8).map(|k| (((qh >> (4 * k + j)) & 1) as u8) << k).sum();
            }
        }
        pack_dwords(n, 4, &mut out[Self::HEAD_BYTES * n..], |l, k| {
            std::array::from_fn(|j| blocks[l].qs[4 * k + j])
        });
    }
    #[inline(always)]
    unsafe fn packed_codes(p: *const u8) -> [__m256i; 8] {
        let mut codes = packed_nibbles(p.add(Self::HEAD_BYTES * LANES));
        // Vector k's fifth bits are bit k of every byte: shifted to bit 4 (16-bit
        // shifts; the mask drops what crosses from the neighbouring byte).
        let bits = _mm256_loadu_si256(p.add(2 * LANES).cast());
        let sixteen = _mm256_set1_epi8(16);
        let at4 = [
            _mm256_slli_epi16::<4>(bits),
            _mm256_slli_epi16::<3>(bits),
            _mm256_slli_epi16::<2>(bits),
            _mm256_slli_epi16::<1>(bits),
            bits,
            _mm256_srli_epi16::<1>(bits),
            _mm256_srli_epi16::<2>(bits),
            _mm256_srli_epi16::<3>(bits),
        ];
        for (c, h) in codes.iter_mut().zip(at4) {
            *c = _mm256_or_si256(*c, _mm256_and_si256(h, sixteen));
        }
        codes
    }
}

impl Lanes8 for Q8_0Lanes {
    // Not used: the codes are signed.
    const I16_RUN: usize = 1;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn lane_codes(rows: &[&[BlockQ8_0]], b: usize) -> [__m256i; 8] {
        // An 8 × 8 transpose of dwords: row l's dword k to lane l of vector k.
        let mut r = [_mm256_setzero_si256(); LANES];
        for (l, r) in r.iter_mut().enumerate() {
            *r = _mm256_loadu_si256(rows.get_unchecked(l).get_unchecked(b).qs.as_ptr().cast());
        }
        // t[2i] / t[2i + 1]: rows 2i and 2i + 1 interleaved, dwords (0, 1 | 4, 5) / (2, 3 | 6, 7).
        let mut t = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // u[4h + j]: rows 4h..4h + 4's dword j in the low half and j + 4 in the high.
        let mut u = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let (a, c) = (4 * h, 4 * h + 2);
            u[4 * h] = _mm256_unpacklo_epi64(t[a], t[c]);
            u[4 * h + 1] = _mm256_unpackhi_epi64(t[a], t[c]);
            u[4 * h + 2] = _mm256_unpacklo_epi64(t[a + 1], t[c + 1]);
            u[4 * h + 3] = _mm256_unpackhi_epi64(t[a + 1], t[c + 1]);
        }
        let mut out = [_mm256_setzero_si256(); 8];
        for j in 0..4 {
            out[j] = _mm256_permute2x128_si256::<0x20>(u[j], u[4 + j]);
            out[4 + j] = _mm256_permute2x128_si256::<0x31>(u[j], u[4 + j]);
        }
        out
    }
    // The scales.
    const HEAD_BYTES: usize = 2;
    fn pack_rest(blocks: &[&BlockQ8_0], out: &mut [u8]) {
        let n = blocks.len();
        pack_dwords(n, 8, &mut out[Self::HEAD_BYTES * n..], |l, k| {
            std::array::from_fn(|j| blocks[l].qs[4 * k + j] as u8)
        });
    }
    #[inline(always)]
    unsafe fn packed_codes(p: *const u8) -> [__m256i; 8] {
        let mut codes = [_mm256_setzero_si256(); 8];
        for (k, c) in codes.iter_mut().enumerate() {
            *c = _mm256_loadu_si256(p.add(Self::HEAD_BYTES * LANES + 32 * k).cast());
        }
        codes
    }
}

/// One block of eight rows in lanes: `codes[k]` lane l is row l's codes 4k..4k+4; `d`
/// and `m` lane l are row l's scale and minimum.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(super) struct LaneBlock {
    pub(super) codes: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) m: __m256,
}

// `lane_block` reads a row's first four bytes as d and (Q4_1) m: both blocks begin so.
const _: () = assert!(
    std::mem::offset_of!(BlockQ4_1, d) == 0
        && std::mem::offset_of!(BlockQ4_1, m) == 2
        && std::mem::offset_of!(BlockQ5_0, d) == 0
        && std::mem::offset_of!(BlockQ8_0, d) == 0
);

/// Block `b` of the eight rows `rows`, in lanes.
#[inline(always)]
unsafe fn lane_block<F: Lanes8>(rows: &[&[F::W]], b: usize) -> LaneBlock {
    // Both formats start with d (f16); Q4_1 follows it with m. Lane l: row l's first
    // four bytes.
    let word = |l: usize| {
        std::ptr::from_ref(rows.get_unchecked(l).get_unchecked(b))
            .cast::<i32>()
            .read_unaligned()
    };
    let words = _mm256_setr_epi32(
        word(0),
        word(1),
        word(2),
        word(3),
        word(4),
        word(5),
        word(6),
        word(7),
    );
    LaneBlock {
        codes: F::lane_codes(rows, b),
        d: _mm256_cvtph_ps(low_halves(_mm256_and_si256(
            words,
            _mm256_set1_epi32(0xFFFF),
        ))),
        m: if F::SHIFT.is_none() {
            _mm256_cvtph_ps(low_halves(_mm256_srli_epi32::<16>(words)))
        } else {
            _mm256_setzero_ps()
        },
    }
}

/// The eight dwords of `v` (each below 2^16) as eight u16.
#[inline(always)]
unsafe fn low_halves(v: __m256i) -> __m128i {
    // Per 128-bit half: its four values twice; then the halves' first copies together.
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(
        v, v,
    )))
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
    if F::SIGNED {
        let mut isum = _mm256_setzero_si256();
        for (&w, &y) in x.codes.iter().zip(y) {
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
        }
        return isum;
    }
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
unsafe fn step<F: Lanes8>(
    x: &LaneBlock,
    isum: __m256i,
    a: Act,
    b: usize,
    acc: &mut __m256,
    min: &mut __m256,
) {
    let (da, sa) = match F::SHIFT {
        Some(_) => (*a.s.add(b), 0.0),
        None => (*a.s.add(2 * b), *a.s.add(2 * b + 1)),
    };
    *acc = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(isum),
        _mm256_mul_ps(x.d, _mm256_set1_ps(da)),
        *acc,
    );
    if F::SHIFT.is_none() {
        *min = _mm256_fmadd_ps(x.m, _mm256_set1_ps(sa), *min);
    }
}

/// The eight results of a pair of chains.
#[inline(always)]
unsafe fn finish<F: Lanes8>(acc: __m256, min: __m256) -> [f32; LANES] {
    let v = if F::SHIFT.is_none() {
        _mm256_add_ps(acc, min)
    } else {
        acc
    };
    std::mem::transmute::<__m256, [f32; LANES]>(v)
}

/// A packed block (at `p`), in lanes: the same values [`lane_block`] makes of the
/// rows it was packed from.
#[inline(always)]
pub(super) unsafe fn packed_block<F: Lanes8>(p: *const u8) -> LaneBlock {
    LaneBlock {
        codes: F::packed_codes(p),
        d: _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        m: if F::SHIFT.is_none() {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()))
        } else {
            _mm256_setzero_ps()
        },
    }
}

/// Where a group of eight rows' blocks come from.
trait Blocks<F: Lanes8> {
    /// Block `b`, in lanes.
    ///
    /// # Safety
    /// The module's features; the group has more than `b` blocks.
    unsafe fn block(&self, b: usize) -> LaneBlock;
}

/// Eight rows as stored.
struct Stored<'a, W>([&'a [W]; LANES]);

impl<F: Lanes8> Blocks<F> for Stored<'_, F::W> {
    #[inline(always)]
    unsafe fn block(&self, b: usize) -> LaneBlock {
        lane_block::<F>(&self.0, b)
    }
}

/// A packed group starting at the pointer.
struct Packed(*const u8);

impl<F: Lanes8> Blocks<F> for Packed {
    #[inline(always)]
    unsafe fn block(&self, b: usize) -> LaneBlock {
        packed_block::<F>(self.0.add(b * LANES * std::mem::size_of::<F::W>()))
    }
}

/// `out[i] = K·(row i of w, a)` for consecutive rows of `row_bytes`, eight at a time,
/// each group decoded as it streams past (from packed groups where `PACKED`, the last
/// rows, short of a group, as stored; `w` begins at a group) while the next one is
/// prefetched.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot1_groups<F: Lanes8, const PACKED: bool>(
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
    // The next group's bytes are asked for a block's share at a time.
    let span = LANES * row_bytes;
    let per_block = span.div_ceil(blocks);
    for (g, out) in out.chunks_mut(LANES).enumerate() {
        let next = (g + 1) * span;
        let v = if PACKED && out.len() == LANES {
            group_dot::<F, _>(
                &Packed(w.as_ptr().add(g * span)),
                act,
                blocks,
                (w, next, per_block),
            )
        } else {
            let rows = group::<F::W, LANES>(w, row_bytes, g * LANES, out.len());
            group_dot::<F, _>(&Stored(rows), act, blocks, (w, next, per_block))
        };
        out.copy_from_slice(&v[..out.len()]);
    }
}

/// One group's eight results against one token, asking for `(w, at, per_block)`:
/// `per_block` bytes of `w` from `at + b · per_block` as block b is read.
#[inline(always)]
unsafe fn group_dot<F: Lanes8, S: Blocks<F>>(
    src: &S,
    act: Act,
    blocks: usize,
    (w, at, per_block): (&[u8], usize, usize),
) -> [f32; LANES] {
    let (mut acc, mut min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..blocks {
        super::avx2::prefetch_ahead(w, at + b * per_block, per_block);
        let x = src.block(b);
        let isum = block_sums::<F>(&x, &broadcasts(act, b), act, b);
        step::<F>(&x, isum, act, b, &mut acc, &mut min);
    }
    finish::<F>(acc, min)
}

thread_local! {
    /// A thread's decoded tile (both halves of each block), reused from call to call.
    static TILE: RefCell<Vec<[LaneBlock; 2]>> = const { RefCell::new(Vec::new()) };
}

/// `out[t][i] = K·(row i of w, a[t])` for the (at most 16) rows of `w`: the rows are
/// decoded once, in two halves of eight (from packed groups where `PACKED` and the
/// half is a whole group), then every token runs both halves' chains over the tile,
/// each block's broadcasts shared by the two.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_groups<F: Lanes8, const PACKED: bool>(
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
    let (p_first, p_second) = (
        Packed(w.as_ptr()),
        Packed(w.as_ptr().wrapping_add(LANES * row_bytes)),
    );
    if PACKED && n == TILE_ROWS {
        for (b, x) in tile.iter_mut().enumerate() {
            *x = [
                Blocks::<F>::block(&p_first, b),
                Blocks::<F>::block(&p_second, b),
            ];
        }
    } else {
        let rows = group::<F::W, TILE_ROWS>(w, row_bytes, 0, n);
        let (first, second) = (
            Stored(rows[..LANES].try_into().expect("eight")),
            Stored(rows[LANES..].try_into().expect("eight")),
        );
        for (b, x) in tile.iter_mut().enumerate() {
            let x0 = if PACKED && n >= LANES {
                Blocks::<F>::block(&p_first, b)
            } else {
                Blocks::<F>::block(&first, b)
            };
            *x = [x0, Blocks::<F>::block(&second, b)];
        }
    }
    let mut ahead = super::avx2::Ahead::new(w, a.len() * blocks);
    for (a, out) in a.iter().zip(out.iter_mut()) {
        let act = Act::new::<F>(a, blocks);
        let (mut acc, mut min) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
        for (b, x) in tile.iter().enumerate() {
            ahead.step();
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
    TILE.set(whole);
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
        for (ty, act) in [
            (GgmlType::Q4_1, ActType::Q8_1),
            (GgmlType::Q5_0, ActType::Q8_0),
            (GgmlType::Q8_0, ActType::Q8_0),
        ] {
            let (dot, dot1, tile, packing) = kernels(ty).unwrap();
            match ty {
                GgmlType::Q4_1 => {
                    check_kernels::<Q4_1Lanes>(ty, act, (dot, dot1, tile), Some(packing))
                }
                GgmlType::Q5_0 => {
                    check_kernels::<Q5_0Lanes>(ty, act, (dot, dot1, tile), Some(packing))
                }
                _ => check_kernels::<Q8_0Lanes>(ty, act, (dot, dot1, tile), Some(packing)),
            }
        }
    }

    /// The i16 sums stay exact at the extremes: every code at its largest magnitude
    /// against activations of ±127, where a longer run would wrap (or, for Q8_0's
    /// signed codes, -128 times 127 in every pair).
    #[test]
    fn extreme_codes_do_not_leave_i16() {
        if !crate::Isa::Avx2.available() {
            eprintln!("skipped: this machine has no AVX2");
            return;
        }
        for (ty, act) in [
            (GgmlType::Q5_0, ActType::Q8_0),
            (GgmlType::Q4_1, ActType::Q8_1),
            (GgmlType::Q8_0, ActType::Q8_0),
        ] {
            let (_, dot1, _, packing) = kernels(ty).unwrap();
            let cols = 64;
            // Every quant byte 0xFF (every nibble 15, every fifth bit set) or, for Q8_0,
            // 0x80 (-128).
            let fill = if ty == GgmlType::Q8_0 { 0x80 } else { 0xFF };
            let mut weights = random_weights(ty, 8, cols, 1).unwrap();
            let block = ty.block_bytes() as usize;
            for b in weights.chunks_exact_mut(block) {
                for byte in &mut b[2..] {
                    *byte = fill;
                }
                if ty == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.0).to_bits().to_le_bytes());
                }
            }
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; cols];
                let mut q = vec![0u8; act.row_bytes(cols).unwrap()];
                act.quantize(&x, &mut q);
                let row_bytes = weights.len() / 8;
                let mut packed = vec![0u8; weights.len()];
                (packing.pack)(&weights, row_bytes, &mut packed);
                let (mut got, mut got_packed) = ([0.0f32; 8], [0.0f32; 8]);
                super::super::with_act_row(act, &q, |a| dot1(&weights, row_bytes, a, &mut got));
                super::super::with_act_row(act, &q, |a| {
                    (packing.dot1)(&packed, row_bytes, a, &mut got_packed)
                });
                let want: Vec<f32> = (0..8)
                    .map(|r| {
                        let w = &weights[r * row_bytes..(r + 1) * row_bytes];
                        super::super::with_act_row(act, &q, |a| match ty {
                            GgmlType::Q5_0 => reference::<Q5_0Lanes>(w, &a),
                            GgmlType::Q4_1 => reference::<Q4_1Lanes>(w, &a),
                            _ => reference::<Q8_0Lanes>(w, &a),
                        })
                    })
                    .collect();
                assert_eq!(got.to_vec(), want, "{ty} sign {sign}");
                assert_eq!(got_packed.to_vec(), want, "{ty} sign {sign} (packed)");
            }
        }
    }
}
