//! Qwen3-MoE, as llama.cpp's `qwen3moe` architecture: Qwen3's attention (QK-norm, NeoX
//! RoPE, heads of their own size) with a mixture-of-experts feed-forward in every layer:
//! the router's softmax over `expert_count` experts, the `expert_used_count` most
//! probable taken with their probabilities renormalized to sum to one, each token's
//! SwiGLU through its experts mixed by those weights.

use astra_gguf::Metadata;

use crate::backend::{Activation, Backend, Gating, Rope};
use crate::config::{Config, Moe};
use crate::weights::Loader;
use crate::EngineError;

use super::blocks::{Attention, AttentionParams, MoeFfn};
use super::{Pass, Stage};

pub(crate) struct Layer<B: Backend> {
    attn: Attention<B>,
    moe: MoeFfn<B>,
}

/// The experts: how many, how many a token uses, their width. llama.cpp renormalizes
/// the chosen weights for this architecture whatever the file says.
pub(crate) fn hparams(md: &Metadata, cfg: &mut Config) -> Result<(), EngineError> {
    let key = |k: &str| format!("qwen3moe.{k}");
    let experts = md.u64(&key("expert_count"))? as usize;
    let k = md.u64(&key("expert_used_count"))? as usize;
    let n_ff = md.u64(&key("expert_feed_forward_length"))? as usize;
    if k == 0 || k > experts || n_ff == 0 {
        return Err(EngineError::Invalid(format!(
            "experts: {k} used of {experts}, each {n_ff} wide"
        )));
    }
    cfg.moe = Some(Moe {
        gating: Gating {
            experts,
            k,
            renormalize: true,
        },
        n_ff,
    });
    Ok(())
}

pub(crate) fn load_layer<B: Backend>(
    l: &Loader<'_, B>,
    cfg: &Config,
    i: usize,
) -> Result<Layer<B>, EngineError> {
    let moe = cfg
        .moe
        .ok_or_else(|| EngineError::Invalid("qwen3moe without experts".into()))?;
    Ok(Layer {
        attn: Attention::load(l, cfg, i, super::qwen3::NORMS)?,
        moe: MoeFfn::load(l, cfg, i, moe)?,
    })
}

pub(crate) fn forward<B: Backend>(
    be: &B,
    cfg: &Config,
    token_embd: &B::Matrix,
    layers: &[Layer<B>],
    mut p: Pass<'_, '_, B>,
) -> Result<(), EngineError> {
    let moe = cfg
        .moe
        .ok_or_else(|| EngineError::Invalid("qwen3moe without experts".into()))?;
    be.embed(token_embd, p.tokens, None, &mut p.acts.x);
    p.show(Stage::Embedding);
    let rope = Rope {
        dims: cfg.rope_dim,
        base: cfg.rope_base,
        neox: true,
    };
    for (l, layer) in layers.iter().enumerate() {
        let at = AttentionParams {
            layer: l,
            rope,
            q_scale: None,
            score_scale: cfg.attn_scale,
        };
        layer.attn.forward(be, cfg, at, &mut p);
        p.show(Stage::Attention(l));
        layer.moe.forward(be, cfg, moe, Activation::Silu, &mut p)?;
        p.show(Stage::Layer(l));
    }
    Ok(())
}
