//! Gemma 3, as llama.cpp's `gemma3` architecture: embeddings scaled by √n_embd; QK-norm;
//! a post-norm on each block's output; GeGLU; NeoX RoPE; queries (not scores) scaled;
//! five sliding-window layers to every global one, the local layers with a RoPE base of
//! their own.

use astra_gguf::Metadata;

use crate::backend::{Activation, Backend, Rope};
use crate::config::Config;
use crate::EngineError;

use super::blocks::{AttentionParams, Block, Extras, Layer as _};
use super::{Pass, Stage};

pub(crate) type Layer<B> = Block<B>;

/// Of every `GLOBAL_EVERY` layers, the last is global and the others slide (llama.cpp's
/// `LLAMA_SWA_TYPE_STANDARD` pattern for Gemma 3, not in the file).
const GLOBAL_EVERY: usize = 6;

/// RoPE base of the sliding-window layers (llama.cpp hard-codes it for Gemma 3).
const ROPE_BASE_LOCAL: f32 = 10_000.0;

/// The sliding window from the file; the layer pattern and the embedding scale (√n_embd)
/// llama.cpp hard-codes.
pub(crate) fn hparams(md: &Metadata, cfg: &mut Config) -> Result<(), EngineError> {
    let window = md.u64("gemma3.attention.sliding_window")? as usize;
    cfg.sliding_window = Some(window);
    cfg.layer_local = (0..cfg.n_layer)
        .map(|il| il % GLOBAL_EVERY < GLOBAL_EVERY - 1)
        .collect();
    cfg.embed_scale = Some((cfg.n_embd as f32).sqrt());
    Ok(())
}

/// A layer's optional tensors: the QK-norm and the blocks' post-norms.
pub(crate) const EXTRAS: Extras = Extras {
    qk: true,
    post: true,
    qkv_bias: false,
};

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    mut p: Pass<'_, '_, B>,
) -> Result<(), EngineError> {
    // llama.cpp's facts for Gemma 3: NeoX RoPE with a base of its own on local layers,
    // queries scaled by 1/√head_dim (`query_pre_attn_scalar` = head_dim for the released
    // sizes) rather than the scores.
    be.embed(token_embd, p.tokens, cfg.embed_scale, &mut p.acts.x);
    p.show(Stage::Embedding);
    for (l, layer) in layers.iter().enumerate() {
        let base = if cfg.layer_local[l] {
            ROPE_BASE_LOCAL
        } else {
            cfg.rope_base
        };
        let at = AttentionParams {
            layer: l,
            rope: Rope {
                dims: cfg.rope_dim,
                base,
                neox: true,
            },
            q_scale: Some(cfg.attn_scale),
            score_scale: 1.0,
        };
        layer.forward(be, cfg, at, Activation::GeluTanh, &mut p)?;
    }
    Ok(())
}
