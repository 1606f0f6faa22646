//! ggml's tensor block formats on the CPU: what the bytes mean and how to compute with
//! them fast.
//!
//! Design: the scalar code is the reference and the definition. `dequant` gives each
//! format's values exactly as ggml does; `dot::scalar` gives each weight row × quantized
//! activation dot product as exact integer sums per block combined in f32; SIMD
//! kernels (`dot::avx2`, `dot::avx512`) must agree with it (parity tests and `astra
//! parity kernels`). Kernels are chosen at run time from a table ([`Kernels`]) filled
//! once from CPU feature detection; every entry resolves through AVX2 and then the
//! scalar fallback, so a new instruction set (NEON) slots in as one more column.
//!
//! Determinism: [`matmul`] computes every output element with one call of one kernel on
//! one thread, from activations quantized by one scalar routine. The value of an
//! output therefore depends on neither the thread count nor the batch it is in.

pub mod blocks;
pub mod dequant;
pub mod dot;
mod iq2s_grid;
mod iq2xs_grid;
mod iq3s_grid;

pub use iq2s_grid::IQ2S_GRID;
pub mod matmul;
pub mod parity;
pub mod quantize;
pub mod quantize_k;
pub mod recipe;

pub use astra_gguf::GgmlType;
pub use dot::{ActType, Isa, Kernels, VecDotFn};
pub use matmul::{matmul, QuantMatrix};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    #[error("tensor type {0} is not supported by the CPU kernels")]
    Unsupported(GgmlType),
    #[error("{ty}: {elems} elements is not a whole number of {block}-element blocks")]
    NotWholeBlocks {
        ty: GgmlType,
        elems: usize,
        block: usize,
    },
    #[error("{ty}: expected {expected} bytes, got {actual}")]
    WrongLength {
        ty: GgmlType,
        expected: usize,
        actual: usize,
    },
}

/// The weight types the CPU kernels handle (SPEC section 1).
pub const SUPPORTED_TYPES: [GgmlType; 20] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::Q2_0,
];

/// Bytes of `elems` elements of `ty`, checking the block size.
pub fn row_bytes(ty: GgmlType, elems: usize) -> Result<usize, QuantError> {
    ty.bytes_for(elems as u64)
        .map(|b| b as usize)
        .ok_or(QuantError::NotWholeBlocks {
            ty,
            elems,
            block: ty.block_elems() as usize,
        })
}

/// Dequantizes `bytes` of type `ty` into `out` (whose length is the element count).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    use blocks::as_blocks as b;
    use dequant::*;
    let expected = row_bytes(ty, out.len())?;
    if bytes.len() != expected {
        return Err(QuantError::WrongLength {
            ty,
            expected,
            actual: bytes.len(),
        });
    }
    match ty {
        GgmlType::F32 => dequantize_f32(bytes, out),
        GgmlType::F16 => dequantize_f16(bytes, out),
        GgmlType::BF16 => dequantize_bf16(bytes, out),
        GgmlType::Q4_0 => dequantize_q4_0(b(bytes), out),
        GgmlType::Q4_1 => dequantize_q4_1(b(bytes), out),
        GgmlType::Q5_0 => dequantize_q5_0(b(bytes), out),
        GgmlType::Q5_1 => dequantize_q5_1(b(bytes), out),
        GgmlType::Q8_0 => dequantize_q8_0(b(bytes), out),
        GgmlType::Q8_1 => dequantize_q8_1(b(bytes), out),
        GgmlType::Q2_K => dequantize_q2_k(b(bytes), out),
        GgmlType::Q3_K => dequantize_q3_k(b(bytes), out),
        GgmlType::Q4_K => dequantize_q4_k(b(bytes), out),
        GgmlType::Q5_K => dequantize_q5_k(b(bytes), out),
        GgmlType::Q6_K => dequantize_q6_k(b(bytes), out),
        GgmlType::Q8_K => dequantize_q8_k(b(bytes), out),
        GgmlType::IQ2_XXS => dequantize_iq2_xxs(b(bytes), out),
        GgmlType::IQ2_XS => dequantize_iq2_xs(b(bytes), out),
        GgmlType::IQ2_S => dequantize_iq2_s(b(bytes), out),
        GgmlType::IQ3_S => dequantize_iq3_s(b(bytes), out),
        GgmlType::IQ4_NL => dequantize_iq4_nl(b(bytes), out),
        GgmlType::Q2_0 => dequantize_q2_0(b(bytes), out),
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

/// The types [`quantize_weights`] writes.
pub const WEIGHT_TYPES: [GgmlType; 12] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Weights `x` (whole rows) in `ty`, as llama-quantize writes them without an importance
/// matrix: ggml's reference quantizers, bit for bit.
pub fn quantize_weights(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    use blocks::as_blocks_mut as b;
    match ty {
        GgmlType::Q8_0 => {
            let mut out = vec![0u8; row_bytes(ty, x.len())?];
            quantize_k::quantize_q8_0_ref(x, b(&mut out));
            Ok(out)
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            let mut out = vec![0u8; row_bytes(ty, x.len())?];
            match ty {
                GgmlType::Q4_K => quantize_k::quantize_q4_k_ref(x, b(&mut out)),
                GgmlType::Q5_K => quantize_k::quantize_q5_k_ref(x, b(&mut out)),
                _ => quantize_k::quantize_q6_k_ref(x, b(&mut out)),
            }
            Ok(out)
        }
        _ if WEIGHT_TYPES.contains(&ty) => quantize(ty, x),
        other => Err(QuantError::Unsupported(other)),
    }
}

/// Whether [`quantize`] can produce `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Q8_K | Q2_0
    )
}

/// Quantizes `x` into `ty` for the types with a quantizer here (the activation types
/// and the simple weight types); returns the bytes.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    use blocks::as_blocks_mut as b;
    use quantize::*;
    let mut out = vec![0u8; row_bytes(ty, x.len())?];
    match ty {
        GgmlType::F32 => quantize_f32(x, &mut out),
        GgmlType::F16 => quantize_f16(x, &mut out),
        GgmlType::BF16 => quantize_bf16(x, &mut out),
        GgmlType::Q4_0 => quantize_q4_0(x, b(&mut out)),
        GgmlType::Q4_1 => quantize_q4_1(x, b(&mut out)),
        GgmlType::Q5_0 => quantize_q5_0(x, b(&mut out)),
        GgmlType::Q5_1 => quantize_q5_1(x, b(&mut out)),
        GgmlType::Q8_0 => quantize_q8_0(x, b(&mut out)),
        GgmlType::Q8_1 => quantize_q8_1(x, b(&mut out)),
        GgmlType::Q8_K => quantize_q8_k(x, b(&mut out)),
        GgmlType::Q2_0 => quantize_q2_0(x, b(&mut out)),
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(out)
}
