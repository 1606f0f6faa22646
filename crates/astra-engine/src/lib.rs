//! astra's inference engine: a GGUF model's configuration and weights, one forward pass
//! per architecture (`models/`) written against a backend interface, the CPU backend
//! (KV cache with split attention), and sampling.
//!
//! Determinism: every step computes a token's values from that token's inputs alone in
//! a fixed order (quantized matmul per output element, norms per row, attention split at
//! absolute positions), so logits are bitwise identical whatever the thread count,
//! however a prompt is cut into batches, and whether a prefix came from the cache.

pub mod attention;
pub mod attention_parity;
pub mod backend;
pub mod backend_parity;
pub mod config;
pub mod cpu;
pub mod ggml_ops;
pub mod model;
pub mod models;
pub mod moe_parity;
pub mod ops;
pub mod perplexity;
pub mod pool;
pub mod sampler;
pub mod stop;
pub mod weights;

pub use attention::{KvStorage, KvType};
pub use backend::Backend;
pub use config::{Arch, Config};
pub use cpu::{Arithmetic, CpuBackend};
pub use model::{Logits, Model, Session, Step, Trace, MAX_BATCH};
pub use models::Stage;
pub use sampler::{Sampler, SamplerConfig};
pub use stop::{StopMatcher, StopOutcome};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("loading the model: {0}")]
    Load(String),
    #[error(transparent)]
    Metadata(#[from] astra_gguf::MetadataError),
    #[error("unsupported {0}")]
    Unsupported(String),
    #[error("invalid model: {0}")]
    Invalid(String),
    #[error("tensor {0} is missing from the model file")]
    MissingTensor(String),
    /// The backend's device is missing or failed.
    #[error("{0}")]
    Backend(String),
    #[error("the context holds {ctx} positions; {needed} are needed")]
    ContextFull { ctx: usize, needed: usize },
    /// The KV pages would take more memory than they may.
    #[error("the KV cache would take {needed} bytes; {limit} are allowed")]
    KvFull { needed: usize, limit: usize },
}
