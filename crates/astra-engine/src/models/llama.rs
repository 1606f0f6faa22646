//! Llama (SmolLM2, Llama 2 and 3, Mistral), as llama.cpp's `llama` architecture: pre-norm
//! layers of attention and a SwiGLU feed-forward, RoPE on adjacent pairs, scores scaled
//! by 1/√head_dim. It reads nothing beyond the keys every architecture has.

use crate::backend::{Activation, Backend, Rope};
use crate::config::Config;

use super::blocks::{AttentionParams, Block, Norms};
use super::{Pass, Stage};

pub(crate) type Layer<B> = Block<B>;

/// A layer's optional tensors: none.
pub(crate) const NORMS: Norms = Norms {
    qk: false,
    post: false,
};

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    p: Pass<'_, '_, B>,
) {
    forward_with_rope(be, cfg, token_embd, layers, p, false)
}

/// Llama's forward pass with RoPE on adjacent pairs or, `neox`, on the two halves of
/// each head (what Qwen3 changes, with its layers' QK-norm).
pub(crate) fn forward_with_rope<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    mut p: Pass<'_, '_, B>,
    neox: bool,
) {
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
        layer.forward(be, cfg, at, Activation::Silu, &mut p);
    }
}
