//! Weight rows in vector lanes: the formats and the arithmetic that the lane kernels
//! of every instruction set share (`avx512`: sixteen rows per 512-bit vector,
//! `avx2_lanes`: eight per 256-bit vector).
//!
//! Each row's integer sum over a 32-element block is exact; each output is then one
//! float chain over the blocks in order, `acc ← fma(isum_b, d_w·d_a, acc)` (and, for
//! formats with a minimum, `min ← fma(m_w, s_a, min)`, added at the end): one fixed
//! sequence per (row, token), written out in scalar code in [`reference`], which the
//! kernels of both sets match bit for bit. So a model gives the same bits on either.
//!
//! Signed codes are offset into unsigned bytes, `c + 2^SHIFT`; the offset comes back
//! through the activations' block sums, in exact integers: Σ c·a = Σ (c + 2^SHIFT)·a −
//! 2^SHIFT·Σ a.

use super::{ActRow, TILE_ROWS};
#[cfg(test)]
use super::{ActType, Packing, VecDot1Fn, VecDotFn, VecDotTileFn};
use crate::blocks::*;
#[cfg(test)]
use crate::GgmlType;

/// A weight format of 32-element blocks that the lane kernels take.
pub(crate) trait LaneFormat {
    type W: Block;
    /// log2 of the offset added to signed codes; `None` for unsigned codes with a
    /// minimum (`value = d·c + m`).
    const SHIFT: Option<u32>;
    /// The block's scale and (formats with a minimum) minimum, as f16 bits.
    fn d(b: &Self::W) -> u16;
    fn m(b: &Self::W) -> u16;
    /// A block's 32 codes (offset where signed), in element order.
    #[cfg(test)]
    fn codes(b: &Self::W) -> [u8; 32];
}

/// The entry points of a lane kernel family for format `$f` over rows as stored
/// (`$packed` false) or packed at load (true): the dot on bytes, decode
/// (`$dot1::<$f, $packed>`) and the batch tile (`$tile::<$f, $packed>`), both unsafe
/// fns that need the features of the set whose `kernels` hands these out.
macro_rules! lane_entries {
    ($dot1:ident, $tile:ident, $f:ty, $act:expr, $packed:expr) => {{
        fn dot1(w: &[u8], row_bytes: usize, a: ActRow, out: &mut [f32]) {
            // SAFETY: handed out only where the set's features are present (the calling
            // module's doc).
            unsafe { $dot1::<$f, $packed>(w, row_bytes, a, out) }
        }
        fn tile(w: &[u8], row_bytes: usize, a: &[ActRow], out: &mut [[f32; TILE_ROWS]]) {
            // SAFETY: as for `dot1`.
            unsafe { $tile::<$f, $packed>(w, row_bytes, a, out) }
        }
        fn dot(w: &[u8], a: &[u8]) -> f32 {
            let mut out = [0.0];
            $crate::dot::with_act_row($act, a, |row| dot1(w, w.len(), row, &mut out));
            out[0]
        }
        (dot as VecDotFn, dot1 as VecDot1Fn, tile as VecDotTileFn)
    }};
}
pub(crate) use lane_entries;

pub(crate) struct Q4_1Lanes;
pub(crate) struct Q5_0Lanes;
pub(crate) struct Q8_0Lanes;

/// A block's nibbles in element order (scalar).
#[cfg(test)]
fn nibbles(qs: &[u8; 16]) -> [u8; 32] {
    std::array::from_fn(|j| {
        if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        }
    })
}

impl LaneFormat for Q4_1Lanes {
    type W = BlockQ4_1;
    const SHIFT: Option<u32> = None;
    fn d(b: &BlockQ4_1) -> u16 {
        u16::from_le_bytes(b.d.0)
    }
    fn m(b: &BlockQ4_1) -> u16 {
        u16::from_le_bytes(b.m.0)
    }
    #[cfg(test)]
    fn codes(b: &BlockQ4_1) -> [u8; 32] {
        nibbles(&b.qs)
    }
}

impl LaneFormat for Q5_0Lanes {
    type W = BlockQ5_0;
    const SHIFT: Option<u32> = Some(4);
    fn d(b: &BlockQ5_0) -> u16 {
        u16::from_le_bytes(b.d.0)
    }
    fn m(_: &BlockQ5_0) -> u16 {
        0
    }
    #[cfg(test)]
    fn codes(b: &BlockQ5_0) -> [u8; 32] {
        let (low, high) = (nibbles(&b.qs), u32::from_le_bytes(b.qh));
        std::array::from_fn(|j| low[j] | (((high >> j) & 1) as u8) << 4)
    }
}

impl LaneFormat for Q8_0Lanes {
    type W = BlockQ8_0;
    const SHIFT: Option<u32> = Some(7);
    fn d(b: &BlockQ8_0) -> u16 {
        u16::from_le_bytes(b.d.0)
    }
    fn m(_: &BlockQ8_0) -> u16 {
        0
    }
    #[cfg(test)]
    fn codes(b: &BlockQ8_0) -> [u8; 32] {
        b.qs.map(|q| (q as u8) ^ 0x80)
    }
}

/// A token's view for these kernels: its contiguous quants, f32 scales and block sums.
#[derive(Clone, Copy)]
pub(crate) struct Act {
    pub q: *const i8,
    pub s: *const f32,
    pub neg: *const i32,
}

impl Act {
    pub fn new<F: LaneFormat>(a: &ActRow, blocks: usize) -> Act {
        let scales = if F::SHIFT.is_none() {
            2 * blocks
        } else {
            blocks
        };
        let sums = if F::SHIFT.is_none() { 0 } else { blocks };
        assert!(
            a.quants.len() == 32 * blocks && a.scales.len() == scales && a.neg_sums.len() == sums,
            "activation row does not match the weights"
        );
        Act {
            q: a.quants.as_ptr(),
            s: a.scales.as_ptr(),
            neg: a.neg_sums.as_ptr(),
        }
    }
}

/// The N rows starting at row `first` of `w`, the last one repeated past `n` rows.
#[inline(always)]
pub(crate) fn group<W: Block, const N: usize>(
    w: &[u8],
    row_bytes: usize,
    first: usize,
    n: usize,
) -> [&[W]; N] {
    std::array::from_fn(|l| {
        let r = first + l.min(n - 1);
        as_blocks::<W>(&w[r * row_bytes..(r + 1) * row_bytes])
    })
}

/// The rows of a tile (`w`: 1..=16 rows of `row_bytes`) and their blocks per row,
/// checked against a batch of `tokens` and its outputs.
pub(crate) fn tile_shape<W: Block>(
    w: &[u8],
    row_bytes: usize,
    tokens: usize,
    outs: usize,
) -> (usize, usize) {
    let n = w.len() / row_bytes.max(1);
    assert!(
        row_bytes > 0
            && w.len() == row_bytes * n
            && (1..=TILE_ROWS).contains(&n)
            && row_bytes.is_multiple_of(std::mem::size_of::<W>()),
        "weights are not 1..=16 rows of whole blocks"
    );
    assert_eq!(tokens, outs, "one output row per token");
    (n, row_bytes / std::mem::size_of::<W>())
}

/// A thread's tile of `blocks` entries, each written before it is read: `tile` grown
/// to hold them where it is short (a tile is kilobytes, so it is written in place
/// rather than pushed, which copies each entry through the stack).
pub(crate) fn tile_of<T>(tile: &mut Vec<T>, blocks: usize, zero: impl FnMut() -> T) -> &mut [T] {
    if tile.len() < blocks {
        tile.resize_with(blocks, zero);
    }
    &mut tile[..blocks]
}

/// The kernels' arithmetic in scalar code, for one row and one token: what they must
/// equal bit for bit.
#[cfg(test)]
pub(crate) fn reference<F: LaneFormat>(w: &[u8], a: &ActRow) -> f32 {
    let blocks = as_blocks::<F::W>(w);
    let (mut acc, mut min) = (0.0f32, 0.0f32);
    for (b, block) in blocks.iter().enumerate() {
        let codes = F::codes(block);
        let mut isum: i32 = codes
            .iter()
            .zip(&a.quants[32 * b..32 * b + 32])
            .map(|(&c, &q)| c as i32 * q as i32)
            .sum();
        let d = half::f16::from_bits(F::d(block)).to_f32();
        let da = match F::SHIFT {
            Some(shift) => {
                isum += a.neg_sums[b] << shift;
                a.scales[b]
            }
            None => {
                min = half::f16::from_bits(F::m(block))
                    .to_f32()
                    .mul_add(a.scales[2 * b + 1], min);
                a.scales[2 * b]
            }
        };
        acc = (isum as f32).mul_add(d * da, acc);
    }
    if F::SHIFT.is_none() {
        acc + min
    } else {
        acc
    }
}

/// A lane kernel family's entry points (dot on bytes, decode, tile, and with a packing
/// its decode and tile over packed rows) equal [`reference`] bit for bit for format
/// `F`, on ragged row counts and a batch of five tokens.
#[cfg(test)]
pub(crate) fn check_kernels<F: LaneFormat>(
    ty: GgmlType,
    act: ActType,
    (dot, dot1, tile): (VecDotFn, VecDot1Fn, VecDotTileFn),
    packing: Option<Packing>,
) {
    use crate::matmul::QuantizedActivations;
    use crate::parity::{random_weights, SplitMix};
    for (rows, cols) in [(1, 32), (8, 64), (16, 64), (21, 96), (40, 640)] {
        let weights = random_weights(ty, rows, cols, 5).unwrap();
        let row_bytes = weights.len() / rows;
        let mut rng = SplitMix::new(6);
        let x: Vec<f32> = (0..5 * cols).map(|_| rng.activation()).collect();
        let quantized = QuantizedActivations::new(act, &x, cols).unwrap();
        let acts: Vec<ActRow> = (0..quantized.tokens)
            .map(|t| quantized.act_row(t))
            .collect();
        let want: Vec<Vec<u32>> = acts
            .iter()
            .map(|a| {
                (0..rows)
                    .map(|r| {
                        reference::<F>(&weights[r * row_bytes..(r + 1) * row_bytes], a).to_bits()
                    })
                    .collect()
            })
            .collect();
        let packed = packing.map(|p| {
            let mut out = vec![0u8; weights.len()];
            (p.pack)(&weights, row_bytes, &mut out);
            (p, out)
        });
        let mut variants = vec![("stored", weights.as_slice(), dot1, tile)];
        if let Some((p, bytes)) = &packed {
            variants.push(("packed", bytes.as_slice(), p.dot1, p.tile));
        }
        for (t, (a, want)) in acts.iter().zip(&want).enumerate() {
            for &(name, w, dot1, _) in &variants {
                let mut got1 = vec![0.0f32; rows];
                dot1(w, row_bytes, *a, &mut got1);
                assert_eq!(
                    got1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    *want,
                    "{ty} {rows}x{cols} token {t} (decode, {name})"
                );
            }
            let single: Vec<u32> = (0..rows)
                .map(|r| dot(&weights[r * row_bytes..(r + 1) * row_bytes], a.bytes).to_bits())
                .collect();
            assert_eq!(single, *want, "{ty} {rows}x{cols} token {t} (one row)");
        }
        // Every token of the batch at once, tile by tile.
        for &(name, w, _, tile) in &variants {
            for first in (0..rows).step_by(TILE_ROWS) {
                let n = TILE_ROWS.min(rows - first);
                let mut out = vec![[0.0f32; TILE_ROWS]; acts.len()];
                tile(
                    &w[first * row_bytes..(first + n) * row_bytes],
                    row_bytes,
                    &acts,
                    &mut out,
                );
                for (t, got) in out.iter().enumerate() {
                    let got: Vec<u32> = got[..n].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        got,
                        want[t][first..first + n],
                        "{ty} {rows}x{cols} rows {first}.. token {t} (tile, {name})"
                    );
                }
            }
        }
    }
}
