//! Mixtral, as llama.cpp runs it: a `llama` file whose metadata has `expert_count`, each
//! layer's feed-forward a mixture of experts (the router's softmax, the
//! `expert_used_count` most probable experts with their probabilities renormalized to
//! sum to one, each a SwiGLU of `feed_forward_length`), under Llama's attention: Llama's
//! forward pass over these layers.

use astra_gguf::Metadata;

use crate::backend::Backend;
use crate::config::{Config, Moe};
use crate::EngineError;

use super::blocks::{read_experts, MoeBlock};
use super::Pass;

pub(crate) type Layer<B> = MoeBlock<B>;

/// The experts of a `llama` file, where it has them.
pub(crate) fn experts(md: &Metadata) -> Result<Option<Moe>, EngineError> {
    read_experts(md, "llama", true)
}

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    p: Pass<'_, '_, B>,
) -> Result<(), EngineError> {
    super::llama::forward_with_rope(be, cfg, token_embd, layers, p, false)
}
