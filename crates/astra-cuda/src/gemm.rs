//! Batched matrix products through cuBLAS, the CUDA backend's default for batches of
//! [`MIN_TOKENS`] or more (off with `--deterministic`): the weight matrix is dequantized
//! to f32 rows (by the kernel library's `dequantize`, in slices of bounded size) and
//! multiplied with the f32 activations in one GEMM per slice, TF32 inputs with f32
//! accumulation by default. Its sums are associated differently from the per-token
//! kernels', so a batch's logits are close to, not bitwise equal to, token-by-token ones.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

/// Batches with fewer tokens than this take the per-token kernels, which read each
/// weight once for up to eight tokens: cheaper than dequantizing the whole matrix to
/// f32 for small batches. The crossover was measured on an H200 (prefill of three shapes,
/// kernels against cuBLAS, commit fddf9ab); to retune, compare `astra bench -p N --backend cuda` with
/// `ASTRA_CUDA_GEMM=0` and without it.
pub const MIN_TOKENS: usize = 64;

/// Most bytes of dequantized weights held at once: larger matrices (a vocabulary's
/// output projection) are multiplied in slices of rows.
pub const SLICE_BYTES: usize = 256 << 20;

/// The arithmetic of the GEMM (`ASTRA_CUDA_GEMM`: `tf32`, the default; `f32`; `0` for
/// none, every product by the per-token kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Inputs rounded to TF32 (10-bit mantissa) on the tensor cores, f32 sums.
    Tf32,
    /// f32 throughout (no tensor cores).
    F32,
}

impl Precision {
    /// From `ASTRA_CUDA_GEMM`; `None` where products should not use cuBLAS.
    pub fn from_env() -> Result<Option<Precision>, String> {
        match std::env::var("ASTRA_CUDA_GEMM").as_deref() {
            Err(_) | Ok("tf32") => Ok(Some(Precision::Tf32)),
            Ok("f32") => Ok(Some(Precision::F32)),
            Ok("0") => Ok(None),
            Ok(other) => Err(format!("ASTRA_CUDA_GEMM={other}: expected tf32, f32 or 0")),
        }
    }

    fn compute_type(self) -> cublasComputeType_t {
        match self {
            Precision::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            Precision::F32 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
        }
    }
}

/// Whether cuBLAS can be loaded, loading it (and cuBLASLt, which it needs) by full path
/// from the CUDA toolkit's folders first where they are there.
pub fn available() -> bool {
    static PRELOAD: std::sync::Once = std::sync::Once::new();
    PRELOAD.call_once(|| crate::nvrtc::preload(&["libcublasLt.so.13", "libcublas.so.13"]));
    // SAFETY: only probes for the library.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// A cuBLAS handle on the backend's stream.
pub struct Gemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    precision: Precision,
}

impl Gemm {
    pub fn new(stream: &Arc<CudaStream>, precision: Precision) -> Result<Gemm, String> {
        let blas = CudaBlas::new(Arc::clone(stream))
            .map_err(|e| format!("creating a cuBLAS handle: {e:?}"))?;
        Ok(Gemm {
            blas,
            stream: Arc::clone(stream),
            precision,
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// `out[t][row0 + r] (+)= Σ_c x[t][c] · w[r][c]` for the `rows` rows of `w`
    /// (row-major, `cols` wide), the `tokens` rows of `x`, and `out` rows `stride`
    /// wide; added to what `out` holds where `accumulate`.
    #[allow(clippy::too_many_arguments)]
    pub fn product(
        &self,
        w: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        tokens: usize,
        out: &mut CudaSlice<f32>,
        row0: usize,
        stride: usize,
        accumulate: bool,
    ) -> Result<(), String> {
        assert!(
            w.len() >= rows * cols
                && x.len() >= tokens * cols
                && out.len() >= (tokens - 1) * stride + row0 + rows
        );
        let stream = &self.stream;
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (wp, _w) = w.device_ptr(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let c = op + (row0 * std::mem::size_of::<f32>()) as u64;
        let dim = |n: usize| i32::try_from(n).map_err(|_| format!("a GEMM dimension of {n}"));
        // Column-major: out (rows × tokens, leading dimension stride) = wᵀ · x, with w read
        // as a cols × rows matrix and x as cols × tokens.
        // SAFETY: the pointers are live device buffers of at least the sizes asserted above,
        // on the handle's stream; alpha and beta are host values (the default pointer mode).
        unsafe {
            cudarc::cublas::sys::cublasGemmEx(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                dim(rows)?,
                dim(tokens)?,
                dim(cols)?,
                (&alpha as *const f32).cast::<c_void>(),
                wp as *const c_void,
                cudaDataType::CUDA_R_32F,
                dim(cols)?,
                xp as *const c_void,
                cudaDataType::CUDA_R_32F,
                dim(cols)?,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                dim(stride)?,
                self.precision.compute_type(),
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|e| format!("cublasGemmEx: {e:?}"))
        }
    }
}
