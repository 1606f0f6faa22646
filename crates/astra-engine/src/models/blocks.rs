//! The blocks architectures are built from, each with its weights and its part of the
//! forward pass: pre-normed attention (QK-norm, projection biases and a post-norm where
//! a model has them), the gated feed-forward and the mixture of experts, and the layers
//! made of them. A block writes its output into the residual stream.

use astra_gguf::Metadata;

use crate::backend::{
    add_to_residual, Activation, Attend, Backend, Experts, FeedForward, Gating, Heads, Input, Rope,
};
use crate::config::{Config, Moe};
use crate::weights::Loader;
use crate::EngineError;

use super::{Pass, Stage};

/// The name of layer `i`'s tensor `what`.
fn blk(i: usize, what: &str) -> String {
    format!("blk.{i}.{what}.weight")
}

/// The activations of a batch of `t` tokens through the layers.
pub(crate) struct Activations<B: Backend> {
    pub x: B::Tensor,    // (t, n_embd): the residual stream
    pub xb: B::Tensor,   // (t, n_embd): a block's normed input
    pub o: B::Tensor,    // (t, n_embd): a block's output
    pub q: B::Tensor,    // (t, n_head·head_dim)
    pub k: B::Tensor,    // (t, n_head_kv·head_dim)
    pub v: B::Tensor,    // (t, n_head_kv·head_dim)
    pub att: B::Tensor,  // (t, n_head·head_dim): attention's output rows
    pub gate: B::Tensor, // (t, n_ff)
    pub up: B::Tensor,   // (t, n_ff)
    /// The mixture-of-experts block's buffers, where the model has one.
    pub moe: Option<MoeActivations<B>>,
}

/// A mixture-of-experts block's activations: a row per token, or per slot (a token's
/// `j`-th expert is slot `token·k + j`).
pub(crate) struct MoeActivations<B: Backend> {
    pub scores: B::Tensor, // (t, n_expert): the router's
    pub gate: B::Tensor,   // (t·k, n_ff_expert)
    pub up: B::Tensor,     // (t·k, n_ff_expert)
    pub down: B::Tensor,   // (t·k, n_embd)
}

impl<B: Backend> Activations<B> {
    pub fn new(be: &B, cfg: &Config, t: usize) -> Result<Activations<B>, EngineError> {
        let (e, qd, kd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        Ok(Activations {
            x: be.tensor(t, e)?,
            xb: be.tensor(t, e)?,
            o: be.tensor(t, e)?,
            q: be.tensor(t, qd)?,
            k: be.tensor(t, kd)?,
            v: be.tensor(t, kd)?,
            att: be.tensor(t, qd)?,
            gate: be.tensor(t, ff)?,
            up: be.tensor(t, ff)?,
            moe: match cfg.moe {
                Some(m) => {
                    let slots = t * m.gating.k;
                    Some(MoeActivations {
                        scores: be.tensor(t, m.gating.experts)?,
                        gate: be.tensor(slots, m.n_ff)?,
                        up: be.tensor(slots, m.n_ff)?,
                        down: be.tensor(slots, e)?,
                    })
                }
                None => None,
            },
        })
    }
}

/// Which of a block's optional tensors an architecture has.
#[derive(Clone, Copy)]
pub(crate) struct Extras {
    /// Per-head RMSNorm of queries and keys (QK-norm).
    pub qk: bool,
    /// RMSNorm of the block's output before it joins the residual.
    pub post: bool,
    /// Biases added to the query, key and value projections.
    pub qkv_bias: bool,
}

/// Self-attention: `x += wo · attend(rope(wq · n), rope(wk · n), wv · n)` where
/// `n = rms_norm(x) · norm`.
pub(crate) struct Attention<B: Backend> {
    pub norm: B::Vector,              // (n_embd)
    pub wq: B::Matrix,                // (n_head·head_dim, n_embd)
    pub wk: B::Matrix,                // (n_head_kv·head_dim, n_embd)
    pub wv: B::Matrix,                // (n_head_kv·head_dim, n_embd)
    pub wo: B::Matrix,                // (n_embd, n_head·head_dim)
    pub q_norm: Option<B::Vector>,    // (head_dim)
    pub k_norm: Option<B::Vector>,    // (head_dim)
    pub post_norm: Option<B::Vector>, // (n_embd)
    /// The projections' biases (q, k, v), where the architecture has them.
    pub qkv_bias: Option<[B::Vector; 3]>,
}

/// How one layer's attention positions and scales its queries.
pub(crate) struct AttentionParams {
    pub layer: usize,
    pub rope: Rope,
    /// A factor on the queries before they meet the keys.
    pub q_scale: Option<f32>,
    /// A factor on the scores q·k.
    pub score_scale: f32,
}

impl<B: Backend> Attention<B> {
    /// Layer `i`'s attention tensors, with the optional ones `extras` names.
    pub fn load(
        l: &Loader<'_, B>,
        cfg: &Config,
        i: usize,
        extras: Extras,
    ) -> Result<Self, EngineError> {
        let (e, hd) = (cfg.n_embd, cfg.head_dim);
        let n = |s: &str| blk(i, s);
        let qk = |s: &str| extras.qk.then(|| l.vector(&n(s), hd)).transpose();
        Ok(Attention {
            norm: l.vector(&n("attn_norm"), e)?,
            wq: l.matrix(&n("attn_q"), cfg.q_dim(), e)?,
            wk: l.matrix(&n("attn_k"), cfg.kv_dim(), e)?,
            wv: l.matrix(&n("attn_v"), cfg.kv_dim(), e)?,
            wo: l.matrix(&n("attn_output"), e, cfg.q_dim())?,
            q_norm: qk("attn_q_norm")?,
            k_norm: qk("attn_k_norm")?,
            post_norm: extras
                .post
                .then(|| l.vector(&n("post_attention_norm"), e))
                .transpose()?,
            qkv_bias: if extras.qkv_bias {
                let bias = |s: &str, len| l.vector(&format!("blk.{i}.{s}.bias"), len);
                Some([
                    bias("attn_q", cfg.q_dim())?,
                    bias("attn_k", cfg.kv_dim())?,
                    bias("attn_v", cfg.kv_dim())?,
                ])
            } else {
                None
            },
        })
    }

    /// The block over the batch `p`, its output added to `p.acts.x`.
    pub fn forward(&self, be: &B, cfg: &Config, at: AttentionParams, p: &mut Pass<'_, '_, B>) {
        let eps = cfg.rms_eps;
        let Activations {
            x,
            xb,
            o,
            q,
            k,
            v,
            att,
            ..
        } = &mut *p.acts;
        let normed = Input::Normed {
            x,
            w: &self.norm,
            eps,
            normed: xb,
        };
        be.product(
            normed,
            &mut [(&self.wq, q), (&self.wk, k), (&self.wv, v)],
            None,
        );
        if let Some([bq, bk, bv]) = &self.qkv_bias {
            be.add_bias(q, bq);
            be.add_bias(k, bk);
            be.add_bias(v, bv);
        }
        let heads = Heads {
            head_dim: cfg.head_dim,
            q_norm: self.q_norm.as_ref(),
            k_norm: self.k_norm.as_ref(),
            eps,
            rope: at.rope,
            q_scale: at.q_scale,
        };
        be.prepare_attention(at.layer, p.seqs, p.positions, q, k, v, &heads);
        let attend = Attend {
            layer: at.layer,
            seqs: &mut *p.seqs,
            positions: p.positions,
            q,
            scale: at.score_scale,
        };
        add_to_residual(be, self.post_norm.as_ref(), eps, o, x, |o, add_to| {
            be.attention_product(attend, att, &self.wo, o, add_to)
        });
    }
}

/// The gated feed-forward: `x += down · (act(gate · n) ⊙ (up · n))` where
/// `n = rms_norm(x) · norm`.
pub(crate) struct GatedFfn<B: Backend> {
    pub norm: B::Vector,              // (n_embd)
    pub gate: B::Matrix,              // (n_ff, n_embd)
    pub up: B::Matrix,                // (n_ff, n_embd)
    pub down: B::Matrix,              // (n_embd, n_ff)
    pub post_norm: Option<B::Vector>, // (n_embd)
}

impl<B: Backend> FeedForwardBlock<B> for GatedFfn<B> {
    /// Layer `i`'s feed-forward tensors, with the post-norm where `extras` has one.
    fn load(
        l: &Loader<'_, B>,
        cfg: &Config,
        i: usize,
        extras: Extras,
    ) -> Result<Self, EngineError> {
        let (e, ff) = (cfg.n_embd, cfg.n_ff);
        let n = |s: &str| blk(i, s);
        Ok(GatedFfn {
            norm: l.vector(&n("ffn_norm"), e)?,
            gate: l.matrix(&n("ffn_gate"), ff, e)?,
            up: l.matrix(&n("ffn_up"), ff, e)?,
            down: l.matrix(&n("ffn_down"), e, ff)?,
            post_norm: extras
                .post
                .then(|| l.vector(&n("post_ffw_norm"), e))
                .transpose()?,
        })
    }

    fn forward(
        &self,
        be: &B,
        cfg: &Config,
        act: Activation,
        p: &mut Pass<'_, '_, B>,
    ) -> Result<(), EngineError> {
        let Activations {
            x, xb, o, gate, up, ..
        } = &mut *p.acts;
        be.feed_forward(FeedForward {
            x,
            norm: &self.norm,
            eps: cfg.rms_eps,
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
            act,
            post_norm: self.post_norm.as_ref(),
            normed: xb,
            gate_rows: gate,
            up_rows: up,
            out: o,
        });
        Ok(())
    }
}

/// The mixture-of-experts feed-forward: each token's `n = rms_norm(x) · norm` scored by
/// the router, the `k` experts the gating picks run as gated feed-forwards on it, and
/// `x += Σ_j weight_j · down_j(act(gate_j · n) ⊙ (up_j · n))`.
pub(crate) struct MoeFfn<B: Backend> {
    pub moe: Moe,
    pub norm: B::Vector,          // (n_embd)
    pub router: B::Matrix,        // (n_expert, n_embd)
    pub gate: Experts<B::Matrix>, // each (n_ff_expert, n_embd)
    pub up: Experts<B::Matrix>,   // each (n_ff_expert, n_embd)
    pub down: Experts<B::Matrix>, // each (n_embd, n_ff_expert)
}

impl<B: Backend> FeedForwardBlock<B> for MoeFfn<B> {
    /// Layer `i`'s router and experts (`ffn_{gate,up,down}_exps`), as `cfg.moe` says.
    fn load(l: &Loader<'_, B>, cfg: &Config, i: usize, _: Extras) -> Result<Self, EngineError> {
        let moe = cfg.moe.ok_or_else(|| {
            EngineError::Invalid("a mixture-of-experts layer without experts".into())
        })?;
        let (e, ff, n, k) = (cfg.n_embd, moe.n_ff, moe.gating.experts, moe.gating.k);
        let name = |s: &str| blk(i, s);
        let experts = |s: &str, rows, cols| -> Result<Experts<B::Matrix>, EngineError> {
            let x = l.experts(&name(s), rows, cols, k)?;
            if x.matrices.len() != n {
                return Err(EngineError::Invalid(format!(
                    "tensor {}: {} experts, the metadata says {n}",
                    name(s),
                    x.matrices.len()
                )));
            }
            Ok(x)
        };
        Ok(MoeFfn {
            moe,
            norm: l.vector(&name("ffn_norm"), e)?,
            router: l.matrix(&name("ffn_gate_inp"), n, e)?,
            gate: experts("ffn_gate_exps", ff, e)?,
            up: experts("ffn_up_exps", ff, e)?,
            down: experts("ffn_down_exps", e, ff)?,
        })
    }

    fn forward(
        &self,
        be: &B,
        cfg: &Config,
        act: Activation,
        p: &mut Pass<'_, '_, B>,
    ) -> Result<(), EngineError> {
        let Activations {
            x,
            xb,
            o,
            moe: acts,
            ..
        } = &mut *p.acts;
        let acts = acts
            .as_mut()
            .ok_or_else(|| EngineError::Invalid("no mixture-of-experts buffers".into()))?;
        be.rms_norm(x, &self.norm, cfg.rms_eps, xb);
        be.matmul(xb, &mut [(&self.router, &mut acts.scores)]);
        let routes = be.route(&acts.scores, self.moe.gating)?;
        be.routed_matmul(xb, false, &self.gate, &routes, &mut acts.gate)?;
        be.routed_matmul(xb, false, &self.up, &routes, &mut acts.up)?;
        be.glu(&mut acts.gate, &acts.up, act);
        be.routed_matmul(&acts.gate, true, &self.down, &routes, &mut acts.down)?;
        be.mix_experts(&acts.down, &routes, o)?;
        be.add(x, o);
        Ok(())
    }
}

/// A layer's feed-forward block: the dense gated one or a mixture of experts.
pub(crate) trait FeedForwardBlock<B: Backend>: Sized {
    /// Layer `i`'s tensors, with the optional ones `extras` names.
    fn load(l: &Loader<'_, B>, cfg: &Config, i: usize, extras: Extras)
        -> Result<Self, EngineError>;
    /// The block over the batch `p`, its output added to `p.acts.x`.
    fn forward(
        &self,
        be: &B,
        cfg: &Config,
        act: Activation,
        p: &mut Pass<'_, '_, B>,
    ) -> Result<(), EngineError>;
}

/// A pre-norm transformer layer: attention, then a feed-forward block (the gated one
/// unless named).
pub(crate) struct Block<B: Backend, F = GatedFfn<B>> {
    pub attn: Attention<B>,
    pub ffn: F,
}

/// A layer whose feed-forward is a mixture of experts.
pub(crate) type MoeBlock<B> = Block<B, MoeFfn<B>>;

impl<B: Backend, F: FeedForwardBlock<B>> Block<B, F> {
    /// Layer `i`, with the optional tensors `extras` names.
    pub fn load(
        l: &Loader<'_, B>,
        cfg: &Config,
        i: usize,
        extras: Extras,
    ) -> Result<Self, EngineError> {
        Ok(Block {
            attn: Attention::load(l, cfg, i, extras)?,
            ffn: F::load(l, cfg, i, extras)?,
        })
    }
}

/// A layer of a Llama-like stack: attention as `at` says, then a feed-forward with
/// `act`, the residual stream shown to the probe after each.
pub(crate) trait Layer<B: Backend> {
    fn forward(
        &self,
        be: &B,
        cfg: &Config,
        at: AttentionParams,
        act: Activation,
        p: &mut Pass<'_, '_, B>,
    ) -> Result<(), EngineError>;
}

impl<B: Backend, F: FeedForwardBlock<B>> Layer<B> for Block<B, F> {
    fn forward(
        &self,
        be: &B,
        cfg: &Config,
        at: AttentionParams,
        act: Activation,
        p: &mut Pass<'_, '_, B>,
    ) -> Result<(), EngineError> {
        let layer = at.layer;
        self.attn.forward(be, cfg, at, p);
        p.show(Stage::Attention(layer));
        self.ffn.forward(be, cfg, act, p)?;
        p.show(Stage::Layer(layer));
        Ok(())
    }
}

/// The experts of an `arch` file, where its metadata has them (`expert_count` > 0): how
/// many, how many a token uses, their width (`expert_feed_forward_length`, else the
/// dense `feed_forward_length`), the chosen weights renormalized or not.
pub(crate) fn read_experts(
    md: &Metadata,
    arch: &str,
    renormalize: bool,
) -> Result<Option<Moe>, EngineError> {
    let key = |k: &str| format!("{arch}.{k}");
    let experts = match md.optional(&key("expert_count"), Metadata::u64)? {
        None | Some(0) => return Ok(None),
        Some(n) => n as usize,
    };
    let k = md.u64(&key("expert_used_count"))? as usize;
    let n_ff = match md.optional(&key("expert_feed_forward_length"), Metadata::u64)? {
        Some(n) => n,
        None => md.u64(&key("feed_forward_length"))?,
    } as usize;
    if k == 0 || k > experts || n_ff == 0 {
        return Err(EngineError::Invalid(format!(
            "experts: {k} used of {experts}, each {n_ff} wide"
        )));
    }
    Ok(Some(Moe {
        gating: Gating {
            experts,
            k,
            renormalize,
        },
        n_ff,
    }))
}
