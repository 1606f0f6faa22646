//! Dot-product kernels and their run-time dispatch.
//!
//! A weight type is paired with one activation type, as in ggml: 32-element blocks
//! with Q8_0 (Q8_1, which carries the block sum, for the types with a minimum),
//! 256-element super-blocks with Q8_K, float weights with f32. [`Kernels`]
//! resolves the dot product for a weight type on an instruction set, falling back to
//! the scalar reference where that set has no kernel for the type.

/// A [`VecDotFn`] for an AVX2 kernel (an `unsafe fn` that needs AVX2, FMA and F16C),
/// for the kernel tables handed out only where `Isa::Avx2.available()`.
#[cfg(target_arch = "x86_64")]
macro_rules! avx2_dot_fn {
    ($f:path) => {{
        fn wrapper(w: &[u8], a: &[u8]) -> f32 {
            // SAFETY: only handed out where AVX2, FMA and F16C are present.
            unsafe { $f(w, a) }
        }
        wrapper as VecDotFn
    }};
}

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx2_lanes;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod ggml_x86;
pub(crate) mod lanes;
pub mod scalar;

use std::sync::OnceLock;

use crate::blocks::{BlockQ8K, BlockQ8_0};
use crate::{row_bytes, GgmlType, QuantError};

/// A dot product of one weight row (bytes as stored) with one activation row (bytes
/// of the paired activation type); both cover the same number of elements.
pub type VecDotFn = fn(w: &[u8], a: &[u8]) -> f32;

/// An activation row as the matmul kernels take it: the quantized bytes and, for the
/// 32-element formats, every block's f16 scale (Q8_1: scale and sum, interleaved)
/// already in f32, converted once per row instead of once per weight row it meets.
#[derive(Clone, Copy, Debug)]
pub struct ActRow<'a> {
    pub bytes: &'a [u8],
    pub scales: &'a [f32],
    /// The 32-element formats' quants, contiguous (the blocks' `qs` without their
    /// scales between), so that one 64-byte load covers two blocks; empty otherwise.
    pub quants: &'a [i8],
    /// For Q8_0: minus the sum of each block's 32 quants, the offset term of
    /// unsigned-times-signed products; empty otherwise.
    pub neg_sums: &'a [i32],
}

/// Consecutive weight rows (`w`: `out.len()` rows of `row_bytes`) against one
/// activation row with its converted scales: `out[i]` is bitwise what [`VecDotFn`]
/// gives for row i. Whole runs of rows per call keep the per-row cost to the dot itself.
pub type VecDot1Fn = fn(w: &[u8], row_bytes: usize, a: ActRow, out: &mut [f32]);

/// As [`VecDot1Fn`], against four activation rows at once (each weight block decoded
/// once for all four): `out[i][t]` is bitwise what [`VecDotFn`] gives for row i and
/// token t alone.
pub type VecDot4Fn = fn(w: &[u8], row_bytes: usize, a: [ActRow; 4], out: &mut [[f32; 4]]);

/// Weight rows per tile of [`VecDotTileFn`]: one per lane of a 512-bit vector of f32.
pub const TILE_ROWS: usize = 16;

/// Up to [`TILE_ROWS`] consecutive weight rows (`w`, rows of `row_bytes`) against every
/// token of a batch, the rows rearranged once for all of them: `out[t][i]` is bitwise
/// what [`VecDotFn`] gives for row i and token t alone (lanes past the rows are junk).
pub type VecDotTileFn = fn(w: &[u8], row_bytes: usize, a: &[ActRow], out: &mut [[f32; TILE_ROWS]]);

/// The activation format a weight type's dot product consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActType {
    Q8_0,
    /// Q8_0 with the block sum: for the weight types with a minimum (Q4_1, Q5_1).
    Q8_1,
    Q8K,
    F32,
}

impl ActType {
    pub fn for_weights(ty: GgmlType) -> Result<ActType, QuantError> {
        use GgmlType::*;
        Ok(match ty {
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL | Q2_0 => ActType::Q8_0,
            Q4_1 | Q5_1 => ActType::Q8_1,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_S => {
                ActType::Q8K
            }
            F32 | F16 | BF16 => ActType::F32,
            other => return Err(QuantError::Unsupported(other)),
        })
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            ActType::Q8_0 => GgmlType::Q8_0,
            ActType::Q8_1 => GgmlType::Q8_1,
            ActType::Q8K => GgmlType::Q8_K,
            ActType::F32 => GgmlType::F32,
        }
    }

    /// Bytes of a row of `n` activations.
    pub fn row_bytes(self, n: usize) -> Result<usize, QuantError> {
        row_bytes(self.ggml_type(), n)
    }

    /// The f32 scales an [`ActRow`] carries for a quantized row: one per block for
    /// Q8_0, (scale, sum) per block for Q8_1, none for the others (Q8_K keeps f32).
    pub fn row_scales(self, row: &[u8], out: &mut Vec<f32>) {
        use crate::blocks::{as_blocks, BlockQ8_1};
        match self {
            ActType::Q8_0 => out.extend(as_blocks::<BlockQ8_0>(row).iter().map(|b| b.d.get())),
            ActType::Q8_1 => as_blocks::<BlockQ8_1>(row)
                .iter()
                .for_each(|b| out.extend([b.d.get(), b.s.get()])),
            ActType::Q8K | ActType::F32 => {}
        }
    }

    /// The contiguous quants an [`ActRow`] carries for a quantized row (Q8_0 and Q8_1;
    /// none for the others).
    pub fn row_quants(self, row: &[u8], out: &mut Vec<i8>) {
        use crate::blocks::{as_blocks, BlockQ8_1};
        match self {
            ActType::Q8_0 => as_blocks::<BlockQ8_0>(row)
                .iter()
                .for_each(|b| out.extend_from_slice(&b.qs)),
            ActType::Q8_1 => as_blocks::<BlockQ8_1>(row)
                .iter()
                .for_each(|b| out.extend_from_slice(&b.qs)),
            ActType::Q8K | ActType::F32 => {}
        }
    }

    /// The negated block sums an [`ActRow`] carries (Q8_0 only).
    pub fn row_neg_sums(self, row: &[u8], out: &mut Vec<i32>) {
        use crate::blocks::as_blocks;
        if self == ActType::Q8_0 {
            out.extend(
                as_blocks::<BlockQ8_0>(row)
                    .iter()
                    .map(|b| -b.qs.iter().map(|&q| q as i32).sum::<i32>()),
            );
        }
    }

    /// Quantizes a row of activations into `out` (`row_bytes(x.len())` bytes). One
    /// scalar implementation everywhere: the same input gives the same bytes.
    pub fn quantize(self, x: &[f32], out: &mut [u8]) {
        use crate::blocks::as_blocks_mut;
        match self {
            ActType::Q8_0 => crate::quantize::quantize_q8_0(x, as_blocks_mut::<BlockQ8_0>(out)),
            ActType::Q8_1 => {
                crate::quantize::quantize_q8_1(x, as_blocks_mut::<crate::blocks::BlockQ8_1>(out))
            }
            ActType::Q8K => crate::quantize::quantize_q8_k(x, as_blocks_mut::<BlockQ8K>(out)),
            ActType::F32 => crate::quantize::quantize_f32(x, out),
        }
    }
}

/// Calls `f` with the [`ActRow`] of a quantized activation row (its scales and quants
/// converted here): the byte-level [`VecDotFn`] entry of the kernels that take rows.
pub(crate) fn with_act_row<R>(act: ActType, row: &[u8], f: impl FnOnce(ActRow) -> R) -> R {
    let (mut scales, mut quants, mut sums) = (Vec::new(), Vec::new(), Vec::new());
    act.row_scales(row, &mut scales);
    act.row_quants(row, &mut quants);
    act.row_neg_sums(row, &mut sums);
    f(ActRow {
        bytes: row,
        scales: &scales,
        quants: &quants,
        neg_sums: &sums,
    })
}

/// An instruction set with kernels here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 with FMA and F16C (x86-64 since Haswell / Zen): Q4_1, Q5_0 and Q8_0 put
    /// eight weight rows in the lanes of a 256-bit vector (AVX-512's arithmetic, the
    /// same bits), packed at load; the other types run one row at a time.
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI (Ice Lake, Sapphire Rapids, Zen 4): Q4_1, Q5_0
    /// and Q8_0 put sixteen weight rows in the lanes of a 512-bit `vpdpbusd`, packed at
    /// load, as do batches of Q4_K and Q6_K; Q5_K and single Q4_K and Q6_K tokens take
    /// rows as stored, four at a time, in 512-bit vectors; the rest runs AVX2's
    /// kernels.
    Avx512Vnni,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Self::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }

    /// Whether this machine can run the set's kernels.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512Vnni => false,
        }
    }

    /// The sets this machine can run.
    pub fn available_sets() -> Vec<Isa> {
        Self::ALL.into_iter().filter(|i| i.available()).collect()
    }

    /// The set used by default: `ASTRA_ISA` when set (an unknown or unavailable name
    /// is reported once and ignored), else the best this machine has. Decided once.
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let best = *Self::available_sets()
                .last()
                .expect("scalar is always available");
            match std::env::var("ASTRA_ISA") {
                Ok(name) => match Isa::from_name(&name).filter(|i| i.available()) {
                    Some(isa) => isa,
                    None => {
                        eprintln!(
                            "warning: ASTRA_ISA={name} is not available here; using {}",
                            best.name()
                        );
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }
}

/// The kernels for one weight type on one instruction set.
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    pub weights: GgmlType,
    pub act: ActType,
    /// The set the dot product actually runs on (scalar where `requested` has none).
    pub isa: Isa,
    pub dot: VecDotFn,
    /// The variant taking converted scales, where the instruction set has one.
    pub dot1: Option<VecDot1Fn>,
    /// The four-token variant, where the instruction set has one for the type.
    pub dot4: Option<VecDot4Fn>,
    /// The whole-batch variant over tiles of rows, where the set has one.
    pub tile: Option<VecDotTileFn>,
    /// Where the set reads groups of rows faster rearranged at load: how, and the
    /// variants over rearranged rows.
    pub packing: Option<Packing>,
    /// Where a batch's whole groups of four tokens take other sums than `dot` (ggml's
    /// repacked Q4_K, four tokens at a time), their dot product; the tokens after
    /// the last whole group take `dot`. Used only by the one-token-at-a-time path
    /// (kernels with no `dot1`, `dot4` or `tile`).
    pub dot_in_fours: Option<VecDotFn>,
}

/// Weight rows rearranged once, at load, for kernels that read a group of rows
/// together: each whole group of [`Packing::rows`] consecutive rows keeps its bytes'
/// place in the matrix, but block by block in the order the kernels load them, so
/// that no transposition is left for every token; the rows past the last whole group
/// stay as stored. The variants over packed rows give bit for bit what [`Kernels`]'
/// `dot1` and `tile` give over stored rows; their slices begin at a group.
#[derive(Clone, Copy, Debug)]
pub struct Packing {
    /// Rows per group.
    pub rows: usize,
    /// `out` (as long as `w`, whole rows of `row_bytes` from a group's start) is `w`
    /// packed.
    pub pack: fn(w: &[u8], row_bytes: usize, out: &mut [u8]),
    pub dot1: VecDot1Fn,
    pub tile: VecDotTileFn,
}

impl Kernels {
    /// Kernels for `weights` on `isa`, which must be available.
    pub fn new(weights: GgmlType, isa: Isa) -> Result<Kernels, QuantError> {
        let act = ActType::for_weights(weights)?;
        assert!(
            isa.available(),
            "{} kernels requested on a machine without {}",
            isa.name(),
            isa.name()
        );
        let scalar = Kernels {
            weights,
            act,
            isa: Isa::Scalar,
            dot: scalar_dot_fn(weights)?,
            dot1: None,
            dot4: None,
            tile: None,
            packing: None,
            dot_in_fours: None,
        };
        Ok(match isa {
            Isa::Scalar => scalar,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni if avx512::kernels(weights).is_some() => {
                let own = avx512::kernels(weights).expect("just checked");
                // Batches run the tile where the type has one, else a token at a time;
                // single tokens AVX-512's entry points or AVX2's.
                let base = Kernels {
                    isa,
                    dot4: None,
                    tile: own.tile,
                    packing: own.packing,
                    ..Kernels::new(weights, Isa::Avx2)?
                };
                match own.single {
                    Some((dot, dot1)) => Kernels {
                        dot,
                        dot1: Some(dot1),
                        ..base
                    },
                    None => base,
                }
            }
            // Q4_1, Q5_0 and Q8_0 run in lanes: the arithmetic of AVX-512's lanes, bit for bit.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni if avx2_lanes::kernels(weights).is_some() => {
                let (dot, dot1, tile, packing) =
                    avx2_lanes::kernels(weights).expect("just checked");
                Kernels {
                    weights,
                    act,
                    isa: Isa::Avx2,
                    dot,
                    dot1: Some(dot1),
                    dot4: None,
                    tile: Some(tile),
                    packing: Some(packing),
                    dot_in_fours: None,
                }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni => match avx2::kernels(weights) {
                Some((dot, dot4)) => Kernels {
                    weights,
                    act,
                    isa: Isa::Avx2,
                    dot,
                    dot1: None,
                    dot4,
                    tile: None,
                    packing: None,
                    dot_in_fours: None,
                },
                None => scalar,
            },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512Vnni => scalar,
        })
    }

    /// llama.cpp's arithmetic for `weights` on AVX2 machines ([`ggml_x86`]), one row at
    /// a time, where astra has it: Q4_1, Q5_0, Q8_0, Q6_K (ggml's dot products), and
    /// Q4_K as ggml's repacked kernels compute it, a batch's whole groups of four
    /// tokens apart from the rest. On `isa` AVX2 or above (which must be available),
    /// ggml's own instruction sequences ([`ggml_x86::avx2`]); elsewhere their portable
    /// statement. The same bits either way.
    pub fn ggml(weights: GgmlType, isa: Isa) -> Result<Kernels, QuantError> {
        let act = ActType::for_weights(weights)?;
        assert!(
            isa.available(),
            "{} kernels requested on a machine without {}",
            isa.name(),
            isa.name()
        );
        let portable = ggml_x86::kernels(weights).ok_or(QuantError::Unsupported(weights))?;
        let (isa, (dot, dot_in_fours)) = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni => (
                Isa::Avx2,
                ggml_x86::avx2::kernels(weights).unwrap_or(portable),
            ),
            _ => (Isa::Scalar, portable),
        };
        Ok(Kernels {
            weights,
            act,
            isa,
            dot,
            dot1: None,
            dot4: None,
            tile: None,
            packing: None,
            dot_in_fours,
        })
    }

    /// Kernels for `weights` on [`Isa::selected`].
    pub fn best(weights: GgmlType) -> Result<Kernels, QuantError> {
        Self::new(weights, Isa::selected())
    }
}

/// The scalar reference dot product for a weight type.
pub fn scalar_dot_fn(weights: GgmlType) -> Result<VecDotFn, QuantError> {
    use scalar::*;
    use GgmlType::*;
    Ok(match weights {
        F32 => dot_f32_f32,
        F16 => dot_f16_f32,
        BF16 => dot_bf16_f32,
        Q4_0 => dot_q4_0_q8_0,
        Q4_1 => dot_q4_1_q8_1,
        Q5_0 => dot_q5_0_q8_0,
        Q5_1 => dot_q5_1_q8_1,
        Q8_0 => dot_q8_0_q8_0,
        IQ4_NL => dot_iq4_nl_q8_0,
        Q2_0 => dot_q2_0_q8_0,
        Q2_K => dot_q2_k_q8_k,
        Q3_K => dot_q3_k_q8_k,
        Q4_K => dot_q4_k_q8_k,
        Q5_K => dot_q5_k_q8_k,
        Q6_K => dot_q6_k_q8_k,
        Q8_K => dot_q8_k_q8_k,
        IQ2_XXS => dot_iq2_xxs_q8_k,
        IQ2_XS => dot_iq2_xs_q8_k,
        IQ2_S => dot_iq2_s_q8_k,
        IQ3_S => dot_iq3_s_q8_k,
        other => return Err(QuantError::Unsupported(other)),
    })
}
