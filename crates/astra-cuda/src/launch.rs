//! Kernel launches through the driver's extended launch: a kernel's one parameter is its
//! argument struct ([`crate::args`]), and programmatic dependent launch is used where it
//! is enabled — a kernel may be scheduled while the one before it finishes, every
//! kernel waiting (`griddepcontrol.wait`, astra.cu's `PDL_START`) before it reads
//! anything.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig};

use crate::args::KernelArgs;

/// Launches `f` on `stream` with `args`; with `dependent`, the kernel may start before
/// the one before it has finished (it waits for it before reading anything).
///
/// # Safety
/// `A` must be the argument struct `f` takes, and the grid must fit the data it
/// touches.
pub unsafe fn launch<A: KernelArgs>(
    f: &CudaFunction,
    stream: &Arc<CudaStream>,
    args: &A,
    cfg: LaunchConfig,
    dependent: bool,
) -> Result<(), DriverError> {
    // The driver copies the struct from this address at the launch.
    let mut params: [*mut c_void; 1] = [args as *const A as *mut c_void];
    // SAFETY: a plain C union of integers; all zero is a valid value.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(dependent),
    };
    stream.context().bind_to_thread()?;
    // SAFETY: `params` points at the struct, which outlives the call; the caller vouches
    // for its meaning.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
