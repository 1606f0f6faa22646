//! Qwen2 (and Qwen2.5), as llama.cpp's `qwen2` architecture: Llama's layers with biases
//! on the query, key and value projections, RoPE on the two halves of each head (NeoX),
//! scores scaled by 1/√head_dim: Llama's forward pass over its own layers. It reads
//! nothing beyond the keys every architecture has.

use crate::backend::Backend;
use crate::config::Config;
use crate::EngineError;

use super::blocks::{Block, Extras};
use super::Pass;

pub(crate) type Layer<B> = Block<B>;

/// A layer's optional tensors: the projections' biases.
pub(crate) const EXTRAS: Extras = Extras {
    qk: false,
    post: false,
    qkv_bias: true,
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
