//! Every kernel's arguments as one `#[repr(C)]` struct, declared once: the macro below
//! makes the Rust struct a launcher fills by field name, and the C declaration (with a
//! macro unpacking it into locals named as its fields) that the kernel source is
//! compiled with ([`c_declarations`], part of the prelude). A launcher and its kernel
//! therefore read the same fields at the same offsets; the order of fields is the order
//! of the kernel's former parameter list, so the parameter space is laid out as before.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// A C type a kernel argument has.
pub(crate) trait CType {
    const C: &'static str;
}

impl CType for i32 {
    const C: &'static str = "int";
}
impl CType for i64 {
    const C: &'static str = "long";
}
impl CType for f32 {
    const C: &'static str = "float";
}

/// Device memory a kernel reads: a `const T*`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct In<T>(u64, PhantomData<*const T>);

/// Device memory a kernel writes: a `T*`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct Out<T>(u64, PhantomData<*mut T>);

impl<T> In<T> {
    pub fn of(buf: &CudaSlice<T>, stream: &Arc<CudaStream>) -> In<T> {
        // One stream without event tracking: nothing to record on drop.
        In(buf.device_ptr(stream).0, PhantomData)
    }

    /// A device address (of a `T`), or 0 for none.
    pub fn addr(addr: u64) -> In<T> {
        In(addr, PhantomData)
    }
}

impl<T> Out<T> {
    /// Borrowed mutably for the launch, as a reminder that the kernel writes it.
    pub fn of(buf: &mut CudaSlice<T>, stream: &Arc<CudaStream>) -> Out<T> {
        Out(buf.device_ptr(stream).0, PhantomData)
    }

    /// A device address (of a `T`).
    pub fn addr(addr: u64) -> Out<T> {
        Out(addr, PhantomData)
    }
}

/// The C name of a device element type.
pub(crate) trait Elem {
    const C: &'static str;
}
impl Elem for f32 {
    const C: &'static str = "float";
}
impl Elem for u8 {
    const C: &'static str = "unsigned char";
}
impl Elem for u16 {
    const C: &'static str = "unsigned short";
}
impl Elem for u32 {
    const C: &'static str = "unsigned int";
}

/// `In<T>` and `Out<T>` as C spells them.
pub(crate) trait PtrC {
    fn c() -> String;
}
impl<T: Elem> PtrC for In<T> {
    fn c() -> String {
        format!("const {}*", T::C)
    }
}
impl<T: Elem> PtrC for Out<T> {
    fn c() -> String {
        format!("{}*", T::C)
    }
}
impl<T: CType> PtrC for T {
    fn c() -> String {
        T::C.to_owned()
    }
}

/// A kernel's argument struct.
///
/// # Safety
/// Implemented only by the macro below, for `#[repr(C)]` structs of `In`, `Out`, `i32`,
/// `i64` and `f32` fields, which the kernel source declares the same way.
pub(crate) unsafe trait KernelArgs: Copy {}

macro_rules! kernel_args {
    ($($(#[doc = $doc:literal])* $name:ident { $($field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[doc = $doc])*
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub(crate) struct $name {
                $(pub $field: $ty),*
            }
            // SAFETY: a #[repr(C)] struct of the field types the macro's contract names.
            unsafe impl KernelArgs for $name {}
        )*

        /// The C declarations of every argument struct and, for each, a macro
        /// `UNPACK_<name>(p)` declaring its fields as locals.
        pub(crate) fn c_declarations() -> String {
            let mut s = String::new();
            $(
                s.push_str(concat!("struct ", stringify!($name), " {"));
                $(s.push_str(&format!(" {} {};", <$ty as PtrC>::c(), stringify!($field)));)*
                s.push_str(" };\n");
                s.push_str(concat!("#define UNPACK_", stringify!($name), "(p)"));
                $(s.push_str(&format!(
                    " {} {} = p.{};",
                    <$ty as PtrC>::c(),
                    stringify!($field),
                    stringify!($field)
                ));)*
                s.push('\n');
            )*
            s
        }
    };
}

kernel_args! {
    /// `quantize_q8_32`: rows of `x` (gated by `up` with `act` where `up` is not null)
    /// quantized to Q8_0 or, `with_sum`, Q8_1.
    QuantizeQ8_32Args { x: In<f32>, out: Out<u8>, cols: i32, with_sum: i32, up: In<f32>, act: i32 }
    /// `quantize_q8_k`: as `quantize_q8_32`, to Q8_K.
    QuantizeQ8KArgs { x: In<f32>, out: Out<u8>, cols: i32, up: In<f32>, act: i32 }
    /// `matvec`: the generic product, a lane per block of weight type `ty`.
    MatvecArgs {
        ty: i32, w: In<u8>, a: In<u8>, out: Out<f32>, rows: i32, nb: i32, wbytes: i32,
        abytes: i32, acc: i32,
    }
    /// The warp-cooperative products of one matrix (`matvec_<type>`, `…_8`).
    MatvecOneArgs { w: In<u8>, a: In<u8>, out: Out<f32>, rows: i32, nb: i32, acc: i32, tokens: i32 }
    /// The warp-cooperative products of up to three matrices (`matvec_<type>_3`, …).
    MatvecThreeArgs {
        w0: In<u8>, w1: In<u8>, w2: In<u8>, a: In<u8>, o0: Out<f32>, o1: Out<f32>,
        o2: Out<f32>, r0: i32, r1: i32, r2: i32, nb: i32, tokens: i32,
    }
    /// The held-activations products of up to three matrices, and the tiled ones
    /// (`mmq_*`, whose CTAs take 16 rows each: `per_cta`).
    MatvecHeldArgs {
        w0: In<u8>, w1: In<u8>, w2: In<u8>, a: In<u8>, o0: Out<f32>, o1: Out<f32>,
        o2: Out<f32>, r0: i32, r1: i32, r2: i32, nb: i32, per_cta: i32, acc: i32, tokens: i32,
    }
    /// The gate and up products of one row, gated and quantized (`matvec_<type>_glu`).
    MatvecGluArgs { wg: In<u8>, wu: In<u8>, a: In<u8>, out: Out<u8>, nb: i32, kind: i32, act: i32 }
    /// `embed`: rows `tokens` of `table`, dequantized and scaled.
    EmbedArgs {
        ty: i32, table: In<u8>, tokens: In<u32>, out: Out<f32>, cols: i32, row_bytes: i64,
        scale: f32, scaled: i32,
    }
    /// `dequantize`: rows of `w` to f32.
    DequantizeArgs { ty: i32, w: In<u8>, out: Out<f32>, cols: i32, row_bytes: i64 }
    /// `rms_norm`: `out = rms_norm(x) · w` per group of `n`.
    RmsNormArgs { x: In<f32>, w: In<f32>, out: Out<f32>, n: i32, eps: f32 }
    /// `rms_norm_inplace`.
    RmsNormInplaceArgs { x: Out<f32>, w: In<f32>, n: i32, eps: f32 }
    /// `rms_norm_add`: `x += rms_norm(o) · w`.
    RmsNormAddArgs { o: In<f32>, w: In<f32>, x: Out<f32>, n: i32, eps: f32 }
    /// `rms_norm_quantize` and `rms_norm_quantize_split`: the normed row quantized.
    RmsNormQuantizeArgs { x: In<f32>, w: In<f32>, out: Out<u8>, n: i32, eps: f32, kind: i32 }
    /// `rope`.
    RopeArgs {
        x: Out<f32>, positions: In<u32>, width: i32, head_dim: i32, dims: i32,
        theta_scale: f32, neox: i32,
    }
    /// `qk_rope`: QK-norm, RoPE, query scale and the KV store of one layer's rows.
    QkRopeArgs {
        q: Out<f32>, k: Out<f32>, v: In<f32>, q_norm: In<f32>, k_norm: In<f32>,
        positions: In<u32>, n_q: i32, n_k: i32, head_dim: i32, dims: i32, theta_scale: f32,
        neox: i32, eps: f32, q_scale: f32, kc: Out<u16>, vc: Out<u16>, slots: i32,
    }
    /// `scale`.
    ScaleArgs { x: Out<f32>, n: i64, s: f32 }
    /// `add`.
    AddArgs { x: Out<f32>, y: In<f32>, n: i64 }
    /// `glu`.
    GluArgs { gate: Out<f32>, up: In<f32>, n: i64, act: i32 }
    /// `gather`.
    GatherArgs { x: In<f32>, rows: In<u32>, out: Out<f32>, width: i32 }
    /// `scatter`.
    ScatterArgs { x: In<f32>, rows: In<u32>, out: Out<f32>, width: i32 }
    /// `scale_rows`.
    ScaleRowsArgs { x: Out<f32>, s: In<f32>, width: i32 }
    /// `add_bias`.
    AddBiasArgs { x: Out<f32>, b: In<f32>, n: i64, width: i64 }
    /// `mul`.
    MulArgs { x: Out<f32>, y: In<f32>, n: i64 }
    /// `tanh_inplace`.
    TanhArgs { x: Out<f32>, n: i64 }
    /// `kv_store`.
    KvStoreArgs {
        k: In<f32>, v: In<f32>, kc: Out<u16>, vc: Out<u16>, row0: i32, positions: In<u32>,
        slots: i32, kv_dim: i32, head_dim: i32,
    }
    /// Not a kernel's arguments: an entry of the table of sequences that the batched
    /// launches below read (device memory, one entry a sequence): its layer's cache, its
    /// decode attention's scratch, its rows of the batch and the cache's slots.
    SeqKv {
        kc: Out<u16>, vc: Out<u16>, parts: Out<f32>, tickets: Out<u32>, row0: i32, rows: i32,
        slots: i32, max_chunks: i32,
    }
    /// `kv_store_batch`: `kv_store` for the rows of every sequence of `seqs` (SeqKv
    /// entries).
    KvStoreBatchArgs {
        k: In<f32>, v: In<f32>, positions: In<u32>, seqs: In<u8>, kv_dim: i32, head_dim: i32,
    }
    /// `attention_split_batch`: `attention_split` for the decode row of every sequence
    /// of `seqs` (SeqKv entries).
    AttentionBatchArgs {
        q: In<f32>, out: Out<f32>, positions: In<u32>, seqs: In<u8>, window: i32, n_head: i32,
        group: i32, head_dim: i32, scale: f32,
    }
    /// `attention_4`: a batch's rows over their cached positions.
    AttentionArgs {
        q: In<f32>, kc: In<u16>, vc: In<u16>, out: Out<f32>, row0: i32, positions: In<u32>,
        rows: i32, slots: i32, window: i32, n_head: i32, group: i32, head_dim: i32, scale: f32,
    }
    /// `attention_split`: one decode row, its chunks over CTAs and merged.
    AttentionSplitArgs {
        q: In<f32>, kc: In<u16>, vc: In<u16>, out: Out<f32>, row0: i32, positions: In<u32>,
        slots: i32, window: i32, n_head: i32, group: i32, head_dim: i32, scale: f32,
        qout: Out<u8>, qkind: i32, parts: Out<f32>, tickets: Out<u32>, max_chunks: i32,
    }
}
