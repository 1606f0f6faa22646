//! Llama (SmolLM2, Llama 2 and 3, Mistral), as llama.cpp's `llama` architecture: pre-norm
//! layers of attention and a SwiGLU feed-forward, RoPE on adjacent pairs, scores scaled
//! by 1/√head_dim. It reads nothing beyond the keys every architecture has.

use crate::backend::{Activation, Backend, Rope};
use crate::config::Config;
use crate::EngineError;

use super::blocks::{AttentionParams, Block, Extras};
use super::{Pass, Stage};

pub(crate) type Layer<B> = Block<B>;

/// A layer's optional tensors: none.
pub(crate) const EXTRAS: Extras = Extras {
    qk: false,
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
    forward_with_rope(be, cfg, token_embd, layers, p, false)
}

/// Llama's forward pass over `layers` (dense or mixture-of-experts) with RoPE on
/// adjacent pairs or, `neox`, on the two halves of each head (what Qwen changes).
pub(crate) fn forward_with_rope<B: Backend, L: super::blocks::Layer<B>>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[L],
    mut p: Pass<'_, '_, B>,
    neox: bool,
) -> Result<(), EngineError> {
    be.embed(token_embd, p.tokens, None, &mut p.acts.x);
    p.show(Stage::Embedding);
    let rope = Rope {
        dims: cfg.rope_dim,
        base: cfg.rope_base,
        neox,
    };
    for (l, layer) in layers.iter().enumerate() {
        let at = AttentionParams {
            layer: l,
            rope,
            q_scale: None,
            score_scale: cfg.attn_scale,
        };
        layer.forward(be, cfg, at, Activation::Silu, &mut p)?;
    }
    Ok(())
}
