//! Qwen3 (dense), as llama.cpp's `qwen3` architecture: Llama's layers with each head's
//! queries and keys RMS-normed before RoPE (QK-norm), RoPE on the two halves of a head
//! (NeoX), heads whose size is their own (`attention.key_length`), scores scaled by
//! 1/√head_dim: Llama's forward pass over its own layers.

use astra_gguf::Metadata;

use crate::backend::Backend;
use crate::config::Config;
use crate::weights::Loader;
use crate::EngineError;

use super::blocks::{Block, Norms};
use super::Pass;

pub(crate) type Layer<B> = Block<B>;

/// Qwen3 reads nothing beyond the keys every architecture has.
pub(crate) fn hparams(_md: &Metadata, _cfg: &mut Config) -> Result<(), EngineError> {
    Ok(())
}

pub(crate) fn load_layer<B: Backend>(
    l: &Loader<'_, B>,
    cfg: &Config,
    i: usize,
) -> Result<Layer<B>, EngineError> {
    Block::load(
        l,
        cfg,
        i,
        Norms {
            qk: true,
            post: false,
        },
    )
}

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    p: Pass<'_, '_, B>,
) {
    super::llama::forward_with_rope(be, cfg, token_embd, layers, p, true)
}
