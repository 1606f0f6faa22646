//! Qwen3 (dense), as llama.cpp's `qwen3` architecture: Llama's layers with each head's
//! queries and keys RMS-normed before RoPE (QK-norm), RoPE on the two halves of a head
//! (NeoX), heads whose size is their own (`attention.key_length`), scores scaled by
//! 1/√head_dim: Llama's forward pass over its own layers. It reads nothing beyond the
//! keys every architecture has.

use crate::backend::Backend;
use crate::config::Config;
use crate::EngineError;

use super::blocks::{Block, Extras};
use super::Pass;

pub(crate) type Layer<B> = Block<B>;

/// A layer's optional tensors: the QK-norm.
pub(crate) const EXTRAS: Extras = Extras {
    qk: true,
    post: false,
    qkv_bias: false,
};

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    p: Pass<'_, '_, B>,
) -> Result<(), EngineError> {
    super::llama::forward_with_rope(be, cfg, token_embd, layers, p, true)
}
