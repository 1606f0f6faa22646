//! `--backend cpu|cuda`: which engine backend a command runs on.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use astra_cuda::CudaBackend;
use astra_engine::{Backend, Model};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// SIMD kernels on the CPU's cores.
    #[default]
    Cpu,
    /// An NVIDIA GPU (kernels compiled at start-up by NVRTC).
    Cuda,
}

/// A command body that runs on any backend.
pub trait OnModel {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()>;
}

/// Loads the model at `path` on the chosen backend and runs `body` on it.
pub fn with_model(kind: BackendKind, path: &Path, threads: usize, body: impl OnModel) -> Result<()> {
    match kind {
        BackendKind::Cpu => body.run(Model::load(path, threads)?),
        BackendKind::Cuda => {
            let backend = CudaBackend::new(0).map_err(|e| anyhow!("{e}"))?;
            body.run(Model::load_on(backend, path)?)
        }
    }
}
