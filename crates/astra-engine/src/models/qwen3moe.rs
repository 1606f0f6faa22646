//! Qwen3-MoE, as llama.cpp's `qwen3moe` architecture: Qwen3's attention (QK-norm, NeoX
//! RoPE, heads of their own size) with a mixture-of-experts feed-forward in every layer:
//! the router's softmax over `expert_count` experts, the `expert_used_count` most
//! probable taken with their probabilities renormalized to sum to one, each token's
//! SwiGLU through its experts mixed by those weights.

use astra_gguf::Metadata;

use crate::backend::Backend;
use crate::config::Config;
use crate::EngineError;

use super::blocks::{read_experts, MoeBlock};
use super::Pass;

pub(crate) type Layer<B> = MoeBlock<B>;

/// The experts, which this architecture must have. llama.cpp renormalizes the chosen
/// weights for it whatever the file says.
pub(crate) fn hparams(md: &Metadata, cfg: &mut Config) -> Result<(), EngineError> {
    cfg.moe = Some(
        read_experts(md, "qwen3moe", true)?
            .ok_or_else(|| EngineError::Invalid("qwen3moe without experts".into()))?,
    );
    Ok(())
}

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    p: Pass<'_, '_, B>,
) -> Result<(), EngineError> {
    super::llama::forward_with_rope(be, cfg, token_embd, layers, p, true)
}
