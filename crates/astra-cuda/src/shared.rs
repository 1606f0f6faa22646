//! The constants the kernels of astra.cu and their Rust launchers share, defined once
//! here and written into the NVRTC source as a prelude of `#define`s ([`prelude`]), so
//! that a launcher and its kernel cannot disagree on a layout, a limit or a code.

use astra_gguf::GgmlType;
use astra_quant::ActType;

use astra_engine::backend::Activation;

/// Bytes of a Q8_K block as the kernels keep it: its 256 quants, then its 16 block sums
/// (i16) at [`Q8K_SUMS`], then d (f32) at [`Q8K_D`], then padding (the stored format's
/// values, reordered for aligned loads).
pub const Q8K_BYTES: usize = 304;
pub const Q8K_SUMS: usize = 256;
pub const Q8K_D: usize = 288;

/// The most warps of a held-activations CTA.
pub const HELD_WARPS: usize = 8;
/// The most rows a held-activations CTA takes with one token, and with eight.
pub const HELD_MAX_ROWS_1: usize = 128;
pub const HELD_MAX_ROWS_8: usize = 64;

/// Warps of a tiled-product CTA, which share its 16 rows' blocks.
pub const MMQ_WARPS: usize = 8;

/// KV positions per attention chunk: the engine's, which fixes where split attention
/// splits (and so the bits of its results).
pub const CHUNK: usize = astra_engine::attention::CHUNK;
/// The longest head the attention kernels take: a thread per element of a head, at most
/// four key lanes of a chunk each.
pub const MAX_HEAD_DIM: usize = 4 * CHUNK;

/// The weight types the kernels switch on, by their ggml type ids.
const WEIGHT_TYPES: [(&str, GgmlType); 9] = [
    ("T_F32", GgmlType::F32),
    ("T_F16", GgmlType::F16),
    ("T_Q4_0", GgmlType::Q4_0),
    ("T_Q4_1", GgmlType::Q4_1),
    ("T_Q5_0", GgmlType::Q5_0),
    ("T_Q8_0", GgmlType::Q8_0),
    ("T_Q4_K", GgmlType::Q4_K),
    ("T_Q6_K", GgmlType::Q6_K),
    ("T_IQ2_S", GgmlType::IQ2_S),
];

/// The ggml type id a kernel's `ty` argument holds.
pub fn type_code(ty: GgmlType) -> i32 {
    ty as i32
}

/// The codes of the activation quantizations (a kernel's `kind` argument).
const QUANT_KINDS: [(&str, ActType); 3] = [
    ("QUANT_Q8_0", ActType::Q8_0),
    ("QUANT_Q8_1", ActType::Q8_1),
    ("QUANT_Q8_K", ActType::Q8K),
];

/// The kernels' code for an activation quantization; `None` for float activations.
pub fn quant_kind(act: ActType) -> Option<i32> {
    QUANT_KINDS
        .iter()
        .position(|&(_, a)| a == act)
        .map(|i| i as i32)
}

/// The codes of the gated products' activations (a kernel's `act` argument).
const GLU_ACTS: [(&str, Activation); 2] = [
    ("GLU_SILU", Activation::Silu),
    ("GLU_GELU_TANH", Activation::GeluTanh),
];

/// The kernels' code for a gated product's activation.
pub fn glu_code(act: Activation) -> i32 {
    GLU_ACTS
        .iter()
        .position(|&(_, a)| a == act)
        .expect("every activation has a code") as i32
}

/// What every kernel source is compiled after: `#define`s of the constants and codes
/// above, and the kernels' argument structs ([`crate::args`]).
pub fn prelude() -> String {
    let mut defines: Vec<(String, i64)> = [
        ("Q8K_BYTES", Q8K_BYTES),
        ("Q8K_SUMS", Q8K_SUMS),
        ("Q8K_D", Q8K_D),
        ("HELD_WARPS", HELD_WARPS),
        ("HELD_MAX_ROWS_1", HELD_MAX_ROWS_1),
        ("HELD_MAX_ROWS_8", HELD_MAX_ROWS_8),
        ("MMQ_WARPS", MMQ_WARPS),
        ("CHUNK", CHUNK),
        ("MAX_HEAD_DIM", MAX_HEAD_DIM),
    ]
    .iter()
    .map(|&(n, v)| (n.to_owned(), v as i64))
    .collect();
    defines.extend(
        WEIGHT_TYPES
            .iter()
            .map(|&(n, t)| (n.to_owned(), type_code(t) as i64)),
    );
    defines.extend(
        QUANT_KINDS
            .iter()
            .map(|&(n, a)| (n.to_owned(), quant_kind(a).unwrap() as i64)),
    );
    defines.extend(
        GLU_ACTS
            .iter()
            .map(|&(n, a)| (n.to_owned(), glu_code(a) as i64)),
    );
    let mut out = String::from("// Generated from astra-cuda's src/shared.rs and src/args.rs.\n");
    for (name, value) in defines {
        out.push_str(&format!("#define {name} {value}\n"));
    }
    out.push_str(&crate::args::c_declarations());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes are the ones the kernels were written against, and every name is
    /// defined once.
    #[test]
    fn the_prelude_defines_each_name_once() {
        let p = prelude();
        for line in [
            "#define T_Q4_K 12\n",
            "#define QUANT_Q8_K 2\n",
            "#define CHUNK 64\n",
        ] {
            assert!(p.contains(line), "{line:?} in {p}");
        }
        let mut names: Vec<&str> = p.lines().filter_map(|l| l.split(' ').nth(1)).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "{p}");
        assert_eq!(quant_kind(ActType::F32), None);
    }
}
