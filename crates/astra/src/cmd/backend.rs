//! `--backend cpu|cuda`, `--deterministic`, `--kv-type` and `--arithmetic`: which
//! engine backend a command runs on, and how.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use astra_cuda::{CudaBackend, Mode};
use astra_engine::{Arithmetic, Backend, CpuBackend, KvType, Model};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// SIMD kernels on the CPU's cores.
    #[default]
    Cpu,
    /// An NVIDIA GPU (kernels compiled at start-up by NVRTC).
    Cuda,
}

/// The options that choose a command's backend.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct BackendArgs {
    /// Which engine runs the model.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// CUDA: every matrix product by astra's per-token kernels, so that logits are
    /// bitwise the same however prompts are batched and whether a prefix came from the
    /// cache (the CPU engine always is); batches of 64+ tokens run slower.
    #[arg(long)]
    pub deterministic: bool,
    /// What the KV cache stores: f16 (half the memory) or f32 (the CPU backend only).
    #[arg(long, value_enum, default_value = "f16")]
    pub kv_type: KvTypeArg,
    /// CPU: astra's own arithmetic (the same logits whatever the batching, the cache
    /// state and the thread count), or llama.cpp's (its AVX2 build's logits bit for
    /// bit, for its batching and thread count; Q4_1, Q5_0, Q8_0, Q4_K and Q6_K
    /// weights, f16 KV cache; slower).
    #[arg(long, value_enum, default_value = "astra")]
    pub arithmetic: ArithmeticArg,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ArithmeticArg {
    #[default]
    Astra,
    Ggml,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTypeArg {
    #[default]
    F16,
    F32,
}

impl From<KvTypeArg> for KvType {
    fn from(a: KvTypeArg) -> KvType {
        match a {
            KvTypeArg::F16 => KvType::F16,
            KvTypeArg::F32 => KvType::F32,
        }
    }
}

impl BackendArgs {
    /// The CPU backend as chosen, on `threads` threads.
    pub fn cpu(&self, threads: usize) -> Result<CpuBackend, String> {
        self.check()?;
        let arithmetic = match self.arithmetic {
            ArithmeticArg::Astra => Arithmetic::Astra,
            ArithmeticArg::Ggml => Arithmetic::Ggml,
        };
        CpuBackend::with_kv_type(threads, self.kv_type.into())
            .with_arithmetic(arithmetic)
            .map_err(|e| e.to_string())
    }

    /// Whether the options go together (the CUDA backend's cache is f16 only;
    /// llama.cpp's arithmetic is a CPU one, over an f16 cache).
    pub fn check(&self) -> Result<(), String> {
        if self.backend == BackendKind::Cuda && self.kv_type != KvTypeArg::F16 {
            return Err(
                "--kv-type f32 is for the CPU backend: the CUDA backend keeps its KV cache in f16"
                    .into(),
            );
        }
        if self.arithmetic == ArithmeticArg::Ggml {
            if self.backend == BackendKind::Cuda {
                return Err("--arithmetic ggml is for the CPU backend".into());
            }
            if self.kv_type != KvTypeArg::F16 {
                return Err("--arithmetic ggml keeps the KV cache in f16, as llama.cpp does: drop --kv-type f32".into());
            }
        }
        Ok(())
    }

    /// The CUDA backend as chosen, on GPU 0.
    pub fn cuda(&self) -> Result<CudaBackend, String> {
        self.check()?;
        let mode = if self.deterministic {
            Mode::Deterministic
        } else {
            Mode::Fast
        };
        CudaBackend::new(0, mode).map_err(|e| e.to_string())
    }
}

/// A command body that runs on any backend.
pub trait OnModel {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()>;
}

/// Loads the model at `path` on the chosen backend and runs `body` on it.
pub fn with_model(
    choice: BackendArgs,
    path: &Path,
    threads: usize,
    body: impl OnModel,
) -> Result<()> {
    match choice.backend {
        BackendKind::Cpu => body.run(Model::load_on(
            choice.cpu(threads).map_err(|e| anyhow!(e))?,
            path,
        )?),
        BackendKind::Cuda => {
            let backend = choice.cuda().map_err(|e| anyhow!(e))?;
            body.run(Model::load_on(backend, path)?)
        }
    }
}
