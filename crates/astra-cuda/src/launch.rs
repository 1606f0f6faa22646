//! Kernel launches through the driver's extended launch: each argument held in an
//! 8-byte word, and programmatic dependent launch where it is enabled — a kernel may
//! be scheduled while the one before it finishes, every kernel waiting
//! (`griddepcontrol.wait`, astra.cu's `PDL_START`) before it reads anything.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig};

/// The most arguments a kernel of astra.cu takes, with room.
const MAX_ARGS: usize = 24;

/// A value passed to a kernel: its bits in the low bytes of a word (the driver reads
/// each parameter's size from the start of its slot; the target is little-endian).
pub trait Word {
    fn word(&self, stream: &Arc<CudaStream>) -> u64;
}

impl Word for i32 {
    fn word(&self, _: &Arc<CudaStream>) -> u64 {
        *self as u32 as u64
    }
}

impl Word for f32 {
    fn word(&self, _: &Arc<CudaStream>) -> u64 {
        self.to_bits() as u64
    }
}

impl Word for i64 {
    fn word(&self, _: &Arc<CudaStream>) -> u64 {
        *self as u64
    }
}

impl Word for u64 {
    fn word(&self, _: &Arc<CudaStream>) -> u64 {
        *self
    }
}

impl<T> Word for CudaSlice<T> {
    fn word(&self, stream: &Arc<CudaStream>) -> u64 {
        // One stream without event tracking: nothing to record on drop.
        self.device_ptr(stream).0
    }
}

/// A kernel and its arguments, in the order of its signature.
pub struct Args<'a> {
    f: &'a CudaFunction,
    stream: &'a Arc<CudaStream>,
    words: [u64; MAX_ARGS],
    n: usize,
}

impl<'a> Args<'a> {
    pub fn new(f: &'a CudaFunction, stream: &'a Arc<CudaStream>) -> Args<'a> {
        Args {
            f,
            stream,
            words: [0; MAX_ARGS],
            n: 0,
        }
    }

    /// An argument the kernel reads.
    pub fn arg<A: Word + ?Sized>(&mut self, a: &A) -> &mut Self {
        assert!(self.n < MAX_ARGS, "more kernel arguments than MAX_ARGS");
        self.words[self.n] = a.word(self.stream);
        self.n += 1;
        self
    }

    /// A buffer the kernel writes (borrowed mutably for the launch, as a reminder).
    pub fn out<A: Word + ?Sized>(&mut self, a: &mut A) -> &mut Self {
        self.arg(a)
    }

    /// Launches on the stream; with `dependent`, the kernel may start before the one
    /// before it has finished (it waits for it before reading anything).
    ///
    /// # Safety
    /// The arguments must match the kernel's signature, and the grid the data it
    /// touches.
    pub unsafe fn launch(mut self, cfg: LaunchConfig, dependent: bool) -> Result<(), DriverError> {
        let mut params: [*mut c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
        for (p, w) in params.iter_mut().zip(self.words.iter_mut()).take(self.n) {
            *p = w as *mut u64 as *mut c_void;
        }
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
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(dependent),
        };
        self.stream.context().bind_to_thread()?;
        // SAFETY: `params` points at `self.n` words that outlive the call; the caller
        // vouches for their meaning.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
