//! astra's CUDA backend: the engine's [`astra_engine::Backend`] on an NVIDIA GPU, with
//! kernels compiled at run time by NVRTC for the device present.

mod args;
mod backend;
pub mod gemm;
mod launch;
pub mod nvrtc;
mod shared;

pub use backend::{unavailable_reason, CudaBackend, GpuKv, GpuMatrix, GpuTensor, Mode};
