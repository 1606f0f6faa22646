//! Block layouts, bit-exact with ggml's `block_*` structs (ggml-common.h).
//!
//! Every field is a byte array, so every block has alignment 1 and every bit pattern
//! is a valid block: a byte slice of whole blocks can be viewed as a block slice
//! wherever it lies in a memory map. Multi-byte fields are little-endian and read
//! through accessors.

use half::f16;

/// An f16 stored as two little-endian bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(transparent)]
pub struct F16Le(pub [u8; 2]);

impl F16Le {
    #[inline(always)]
    pub fn get(self) -> f32 {
        f16::from_bits(u16::from_le_bytes(self.0)).to_f32()
    }
    pub fn from_f32(x: f32) -> Self {
        F16Le(f16::from_f32(x).to_bits().to_le_bytes())
    }
}

/// A block type: plain bytes of a fixed size.
///
/// # Safety
/// Implementors are `#[repr(C)]` structs of byte arrays (alignment 1, no padding, every
/// bit pattern valid), so that [`as_blocks`] may reinterpret bytes as blocks.
pub unsafe trait Block: Copy + 'static {
    /// Weights per block.
    const ELEMS: usize;
}

/// Views `bytes` as blocks. Panics when `bytes` is not a whole number of blocks, which
/// callers rule out from the tensor's shape.
#[inline]
pub fn as_blocks<B: Block>(bytes: &[u8]) -> &[B] {
    let size = std::mem::size_of::<B>();
    assert!(
        bytes.len().is_multiple_of(size),
        "{} bytes is not a whole number of {size}-byte blocks",
        bytes.len()
    );
    // SAFETY: B has alignment 1 and no invalid bit patterns (the Block contract), and
    // the length is a whole number of blocks.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), bytes.len() / size) }
}

/// Views `bytes` as mutable blocks; panics as [`as_blocks`] does.
#[inline]
pub fn as_blocks_mut<B: Block>(bytes: &mut [u8]) -> &mut [B] {
    let size = std::mem::size_of::<B>();
    assert!(
        bytes.len().is_multiple_of(size),
        "{} bytes is not a whole number of {size}-byte blocks",
        bytes.len()
    );
    // SAFETY: as in `as_blocks`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<B>(), bytes.len() / size) }
}

/// Views a block slice as its bytes.
#[inline]
pub fn block_bytes<B: Block>(blocks: &[B]) -> &[u8] {
    // SAFETY: blocks are plain bytes without padding (the Block contract).
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

macro_rules! block {
    ($(#[$doc:meta])* $name:ident, $elems:expr, $bytes:expr, { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        #[repr(C)]
        pub struct $name { $(pub $field: $ty),* }
        // SAFETY: a repr(C) struct of byte arrays.
        unsafe impl Block for $name { const ELEMS: usize = $elems; }
        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);
        const _: () = assert!(std::mem::align_of::<$name>() == 1);
    };
}

/// Super-block size of the K-quants and IQ types.
pub const QK_K: usize = 256;

block!(/// 32 weights: `(q - 8) * d`, q a nibble; low nibbles are weights 0..16.
    BlockQ4_0, 32, 18, { d: F16Le, qs: [u8; 16] });
block!(/// 32 weights: `q * d + m`.
    BlockQ4_1, 32, 20, { d: F16Le, m: F16Le, qs: [u8; 16] });
block!(/// 32 weights: `(q - 16) * d`, q five bits (fifth bits in `qh`, weight j at bit j).
    BlockQ5_0, 32, 22, { d: F16Le, qh: [u8; 4], qs: [u8; 16] });
block!(/// 32 weights: `q * d + m`, q five bits.
    BlockQ5_1, 32, 24, { d: F16Le, m: F16Le, qh: [u8; 4], qs: [u8; 16] });
block!(/// 32 weights: `q * d`, q a signed byte. Also the activation type of 32-blocks.
    BlockQ8_0, 32, 34, { d: F16Le, qs: [i8; 32] });
block!(/// 32 activations: `q * d`, with `s = d · Σq` (rounded to f16): the activation
    /// type of the asymmetric 32-blocks (Q4_1, Q5_1), whose minimum multiplies Σq.
    BlockQ8_1, 32, 36, { d: F16Le, s: F16Le, qs: [i8; 32] });
block!(/// 256 weights in 16 groups of 16: `d * (sc & 15) * q - dmin * (sc >> 4)`, q two bits.
    BlockQ2K, QK_K, 84, { scales: [u8; 16], qs: [u8; 64], d: F16Le, dmin: F16Le });
block!(/// 256 weights in 16 groups of 16: `d * (sc - 32) * (q - 4 * !h)`, six-bit scales.
    BlockQ3K, QK_K, 110, { hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: F16Le });
block!(/// 256 weights in 8 groups of 32: `d * sc * q - dmin * m`, six-bit scales and mins.
    BlockQ4K, QK_K, 144, { d: F16Le, dmin: F16Le, scales: [u8; 12], qs: [u8; 128] });
block!(/// As Q4_K with a fifth bit per weight in `qh`.
    BlockQ5K, QK_K, 176, { d: F16Le, dmin: F16Le, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] });
block!(/// 256 weights in 16 groups of 16: `d * sc * (q - 32)`, q six bits, sc a signed byte.
    BlockQ6K, QK_K, 210, { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: F16Le });
block!(/// 256 activations: `q * d` (d an f32), with sums of each 16 in `bsums`.
    BlockQ8K, QK_K, 292, { d: [u8; 4], qs: [i8; 256], bsums: [[u8; 2]; 16] });
block!(/// 256 weights in 8 groups of 32, each two halves of 16 with a 4-bit scale; weights
    /// from the 1024-entry IQ2_S grid, eight at a time, with explicit signs.
    BlockIq2S, QK_K, 82, { d: F16Le, qs: [u8; 64], qh: [u8; 8], scales: [u8; 8] });
block!(/// 256 weights in 8 groups of 32, each with a 4-bit scale (two to a byte); weights
    /// from the 512-entry IQ3_S grid, four at a time (eight index bytes and a ninth-bit
    /// byte a group), with explicit signs.
    BlockIq3S, QK_K, 110, { d: F16Le, qs: [u8; 64], qh: [u8; 8], signs: [u8; 32], scales: [u8; 4] });
block!(/// 256 weights in 8 groups of 32: each group's four grid indices (a byte each) and
    /// its four 7-bit sign codes and 4-bit scale packed in two u32s; weights from the
    /// 256-entry IQ2_XXS grid, eight at a time.
    BlockIq2Xxs, QK_K, 66, { d: F16Le, qs: [[u8; 2]; 32] });
block!(/// 256 weights in 8 groups of 32, each two halves of 16 with a 4-bit scale; each
    /// eight weights a u16: a 9-bit index into the 512-entry IQ2_XS grid and a 7-bit
    /// sign code.
    BlockIq2Xs, QK_K, 74, { d: F16Le, qs: [[u8; 2]; 32], scales: [u8; 8] });
block!(/// 32 weights: `d * KVALUES_IQ4NL[q]`, q a nibble laid out as in Q4_0.
    BlockIq4Nl, 32, 18, { d: F16Le, qs: [u8; 16] });
block!(/// 64 weights: `(q - 1) * d`, q two bits, four per byte from the low bits up.
    BlockQ2_0, 64, 18, { d: F16Le, qs: [u8; 16] });

impl BlockQ8K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    #[inline(always)]
    pub fn bsum(&self, i: usize) -> i32 {
        i16::from_le_bytes(self.bsums[i]) as i32
    }
}

/// The IQ4_NL codebook (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The six-bit scale and min of group `j` (0..8) of a Q4_K/Q5_K block (ggml's
/// `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen six-bit scales of a Q3_K block, already offset by -32.
#[inline(always)]
pub fn q3k_scales(packed: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        // Low four bits: bytes 0..8, low nibbles for j < 8, high nibbles after.
        let low = if j < 8 {
            packed[j] & 0xF
        } else {
            packed[j - 8] >> 4
        };
        // High two bits: byte 8 + j % 4, bit pair j / 4.
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}
