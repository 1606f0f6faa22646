//! The device-neutral interface the model is written against: buffers on a device and
//! the operations of a transformer over them. The CPU backend ([`crate::cpu`])
//! implements it in this crate; a GPU backend implements it in its own, and the model
//! ([`crate::model`]) runs unchanged on either.
//!
//! Tensors are row-major `rows × width` f32 activations, one row per token of the
//! batch. A batch may hold tokens of several sequences: [`SeqRows`] says which rows
//! belong to which KV cache and at which positions. Every operation computes a row
//! from that row's inputs alone (attention: from its own sequence's cache), which is
//! what makes a sequence's results independent of what else is in the batch.

use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;

use astra_gguf::GgufFile;

use crate::attention::{KvLayout, KvType};
use crate::weights::MatRef;
use crate::EngineError;

/// The gated feed-forward's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

/// Rotary position embedding of each head's first `dims` values.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub dims: usize,
    pub base: f32,
    /// Rotate the two halves (NeoX) rather than adjacent pairs.
    pub neox: bool,
}

/// The rows a matrix product takes, made by the steps before it that a backend may
/// fuse into the product ([`Backend::product`]).
pub enum Input<'a, B: Backend> {
    /// The rows of a tensor.
    Rows(&'a B::Tensor),
    /// `rms_norm(x) · w`, which a backend may write to `normed` or not at all.
    Normed {
        x: &'a B::Tensor,
        w: &'a B::Vector,
        eps: f32,
        normed: &'a mut B::Tensor,
    },
    /// `act(gate) · up`, which a backend may write over `gate` or not at all.
    Glu {
        gate: &'a mut B::Tensor,
        up: &'a B::Tensor,
        act: Activation,
    },
}

impl<'a, B: Backend> Input<'a, B> {
    /// The rows, made by `be`'s plain ops: normed into `normed`, or gated over `gate`.
    pub fn make(self, be: &B) -> &'a B::Tensor {
        match self {
            Input::Rows(x) => x,
            Input::Normed { x, w, eps, normed } => {
                be.rms_norm(x, w, eps, normed);
                normed
            }
            Input::Glu { gate, up, act } => {
                be.glu(gate, up, act);
                gate
            }
        }
    }
}

/// How a layer's query and key heads are made ready for attention
/// ([`Backend::prepare_attention`]).
pub struct Heads<'a, V> {
    pub head_dim: usize,
    /// Per-head RMSNorm weights of queries and keys (Gemma's QK-norm), with `eps`.
    pub q_norm: Option<&'a V>,
    pub k_norm: Option<&'a V>,
    pub eps: f32,
    pub rope: Rope,
    /// A factor applied to the queries (Gemma scales queries rather than scores).
    pub q_scale: Option<f32>,
}

/// A gated feed-forward block ([`Backend::feed_forward`]): `x`'s rows RMS-normed by
/// `norm`, times `gate` and `up`, `act(gate) · up` times `down`, that (normed by
/// `post_norm` where given, Gemma's) added to `x`. `normed`, `gate_rows`, `up_rows` and
/// `out` are scratch of the right shapes.
pub struct FeedForward<'a, B: Backend> {
    pub x: &'a mut B::Tensor,
    pub norm: &'a B::Vector,
    pub eps: f32,
    pub gate: &'a B::Matrix,
    pub up: &'a B::Matrix,
    pub down: &'a B::Matrix,
    pub act: Activation,
    pub post_norm: Option<&'a B::Vector>,
    pub normed: &'a mut B::Tensor,
    pub gate_rows: &'a mut B::Tensor,
    pub up_rows: &'a mut B::Tensor,
    pub out: &'a mut B::Tensor,
}

/// [`Backend::feed_forward`] composed from [`Backend::product`] and
/// [`Backend::norm_add`].
pub fn compose_feed_forward<B: Backend>(be: &B, f: FeedForward<'_, B>) {
    let FeedForward {
        x,
        norm,
        eps,
        gate,
        up,
        down,
        act,
        post_norm,
        normed,
        gate_rows,
        up_rows,
        out,
    } = f;
    be.product(
        Input::Normed {
            x,
            w: norm,
            eps,
            normed,
        },
        &mut [(gate, gate_rows), (up, up_rows)],
        None,
    );
    let gated = Input::Glu {
        gate: gate_rows,
        up: up_rows,
        act,
    };
    add_to_residual(be, post_norm, eps, out, x, |out, add_to| {
        be.product(gated, &mut [(down, out)], add_to)
    });
}

/// A block's output added to the residual `x`: `product` writes it into `out` and adds
/// it to the tensor it is given (`x`) itself, or, with a post-norm (Gemma's), writes it
/// only, and the normed `out` is then added ([`Backend::norm_add`]).
pub fn add_to_residual<B: Backend>(
    be: &B,
    post_norm: Option<&B::Vector>,
    eps: f32,
    out: &mut B::Tensor,
    x: &mut B::Tensor,
    product: impl FnOnce(&mut B::Tensor, Option<&mut B::Tensor>),
) {
    match post_norm {
        Some(n) => {
            product(out, None);
            be.norm_add(out, n, eps, x);
        }
        None => product(out, Some(x)),
    }
}

/// An attention of one layer ([`Backend::attention`]): each sequence's queries (its
/// rows of `q`, heads of the model's head size) over its cached positions of `layer`,
/// causal, within the layer's window, scores scaled by `scale`. `positions` as for
/// [`Backend::kv_store`].
pub struct Attend<'a, 's, B: Backend> {
    pub layer: usize,
    pub seqs: &'a mut [SeqRows<'s, B::KvCache>],
    pub positions: &'a B::Ids,
    pub q: &'a B::Tensor,
    pub scale: f32,
}

/// One sequence's part of a batch: rows `rows` of the batch's tensors are its tokens at
/// positions `pos`, `pos + 1`, …, and `kv` is its cache.
pub struct SeqRows<'a, K> {
    pub kv: &'a mut K,
    pub rows: Range<usize>,
    pub pos: usize,
}

/// Host memory that logits are read into ([`Backend::Host`]), kept from one step to
/// the next so that reading a batch's logits allocates nothing once it has grown to
/// the batch.
pub trait HostBuf: Default + Send + Deref<Target = [f32]> + DerefMut {
    /// Drops every value and keeps the memory.
    fn clear(&mut self);
    /// The values, as a vector of their own.
    fn into_vec(self) -> Vec<f32> {
        self.to_vec()
    }
}

impl HostBuf for Vec<f32> {
    fn clear(&mut self) {
        Vec::clear(self)
    }
    fn into_vec(self) -> Vec<f32> {
        self
    }
}

/// A paged backend's KV memory ([`Backend::kv_usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    pub pages: usize,
    pub bytes: usize,
    /// Bytes the pages may take.
    pub limit: usize,
}

/// How a mixture-of-experts router's scores pick a row's experts and weigh them
/// ([`Backend::route`]): a softmax over the `experts` scores, the `k` most probable
/// experts, their probabilities as weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gating {
    /// Experts a router scores (its rows' width).
    pub experts: usize,
    /// Experts each row uses.
    pub k: usize,
    /// Divide the chosen weights by their sum (llama.cpp's `expert_weights_norm`).
    pub renormalize: bool,
}

/// The smallest sum renormalized weights are divided by (2⁻¹⁴), as llama.cpp clamps it.
const MIN_WEIGHT_SUM: f32 = 1.0 / 16384.0;

/// A batch's routing, on the host: row `r`'s `j`-th expert is `experts[r·k + j]`, its
/// weight `weights[r·k + j]`, the `k` in descending weight order. Slot `r·k + j` names
/// that pair; the routed products ([`Backend::routed_matmul`]) write a row per slot.
#[derive(Clone, Debug, PartialEq)]
pub struct Routes {
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// Each row of `scores` (`gating.experts` wide) routed as `gating` says: the softmax
    /// as ggml computes it (the maximum subtracted, the exponentials summed in f64, each
    /// scaled by the sum's f32 reciprocal), ties to the lower expert.
    pub fn from_scores(scores: &[f32], gating: Gating) -> Result<Routes, EngineError> {
        let Gating {
            experts: n,
            k,
            renormalize,
        } = gating;
        if k == 0 || k > n || !scores.len().is_multiple_of(n) {
            return Err(EngineError::Invalid(format!(
                "routing {} scores to {k} of {n} experts",
                scores.len()
            )));
        }
        let rows = scores.len() / n;
        let (mut experts, mut weights) =
            (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
        let mut probs = vec![0.0f32; n];
        let mut order: Vec<u32> = Vec::with_capacity(n);
        for row in scores.chunks_exact(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f64;
            for (p, &s) in probs.iter_mut().zip(row) {
                *p = (s - max).exp();
                sum += *p as f64;
            }
            let inv = (1.0 / sum) as f32;
            probs.iter_mut().for_each(|p| *p *= inv);
            order.clear();
            order.extend(0..n as u32);
            // Stable: equal probabilities keep the lower expert first.
            order.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
            let chosen = &order[..k];
            let scale = if renormalize {
                let s = chosen
                    .iter()
                    .map(|&e| probs[e as usize] as f64)
                    .sum::<f64>() as f32;
                Some(s.max(MIN_WEIGHT_SUM))
            } else {
                None
            };
            for &e in chosen {
                experts.push(e);
                let w = probs[e as usize];
                weights.push(scale.map_or(w, |s| w / s));
            }
        }
        Ok(Routes {
            k,
            experts,
            weights,
        })
    }

    /// Rows routed.
    pub fn rows(&self) -> usize {
        self.experts.len() / self.k.max(1)
    }

    /// Each expert used, ascending, with its slots, ascending.
    pub fn by_expert(&self) -> Vec<(usize, Vec<usize>)> {
        let mut slots: Vec<(u32, usize)> = self
            .experts
            .iter()
            .enumerate()
            .map(|(s, &e)| (e, s))
            .collect();
        slots.sort_unstable();
        let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
        for (e, s) in slots {
            match out.last_mut() {
                Some((last, v)) if *last == e as usize => v.push(s),
                _ => out.push((e as usize, vec![s])),
            }
        }
        out
    }
}

/// A 3-D weight tensor: `matrices.len()` experts, each `rows × cols`.
pub struct Experts<M> {
    pub rows: usize,
    pub cols: usize,
    pub matrices: Vec<M>,
}

pub trait Backend: Send + Sync + Sized + 'static {
    /// Activations on the device: `rows × width` f32.
    type Tensor: Send;
    /// A quantized weight matrix on the device, as stored in the file.
    type Matrix: Send + Sync;
    /// An f32 vector on the device (norm weights).
    type Vector: Send + Sync;
    /// One sequence's keys and values, every layer.
    type KvCache: Send;
    /// `u32`s on the device: a batch's token ids, or its rows' positions (made once
    /// per batch for every RoPE and attention of it).
    type Ids: Send;
    /// A recorded run of launches that [`Backend::replay`] repeats (a CUDA graph).
    type Graph: Send;
    /// Host memory logits are read into ([`Backend::read_append`]): where the device
    /// copies faster into memory of its own kind (page-locked), that kind.
    type Host: HostBuf;

    /// The backend's short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// What it runs on, for logs and reports.
    fn describe(&self) -> String;
    /// Bytes of device memory in use (by every process), where the backend has a device
    /// of its own; `None` for host memory.
    fn device_memory_in_use(&self) -> Option<u64> {
        None
    }

    /// Makes the matrix `m` of `file` available to the kernels.
    fn matrix(&self, file: &Arc<GgufFile>, m: &MatRef) -> Result<Self::Matrix, EngineError>;
    fn vector(&self, v: &[f32]) -> Result<Self::Vector, EngineError>;
    /// A zeroed `rows × width` tensor.
    fn tensor(&self, rows: usize, width: usize) -> Result<Self::Tensor, EngineError>;
    /// A tensor of `data.len() / width` rows holding `data`.
    fn tensor_from(&self, data: &[f32], width: usize) -> Result<Self::Tensor, EngineError>;
    /// A zeroed KV cache of `layout`.
    fn kv_cache(&self, layout: &KvLayout) -> Result<Self::KvCache, EngineError>;
    /// What this backend's KV caches store.
    fn kv_type(&self) -> KvType {
        KvType::F16
    }
    /// Makes room in `kv` for `positions`, the next ones its sequence writes (every
    /// later position is dropped): a paged cache holds pages for them, its own, and
    /// lets go of those a sliding window has left. Fails where the backend's KV memory
    /// would pass its limit ([`Backend::set_kv_limit`]).
    fn kv_reserve(
        &self,
        _kv: &mut Self::KvCache,
        _positions: Range<usize>,
    ) -> Result<(), EngineError> {
        Ok(())
    }
    /// A cache holding `kv`'s first `n` positions, sharing its memory until either
    /// writes; `None` where the backend does not share caches.
    fn kv_fork(&self, _kv: &Self::KvCache, _n: usize) -> Option<Self::KvCache> {
        None
    }
    /// Where the backend pages its KV caches: its pages in existence and their bytes.
    fn kv_usage(&self) -> Option<KvUsage> {
        None
    }
    /// The pages `kv` holds, each by an identity that another cache holding the same
    /// page shares (empty where the backend does not page).
    fn kv_page_ids(&self, _kv: &Self::KvCache) -> Vec<usize> {
        Vec::new()
    }
    /// Bytes the KV pages may take from now on, where the backend pages its caches.
    fn set_kv_limit(&self, _bytes: usize) {}
    /// The whole tensor, on the host, once every launch before it has run: the point
    /// where a failure of those launches is reported ([`Backend::check`]).
    fn read(&self, t: &Self::Tensor) -> Result<Vec<f32>, EngineError>;
    /// The whole tensor, on the host, the tensor no longer needed: where it is in host
    /// memory already, handed over rather than copied.
    fn read_owned(&self, t: Self::Tensor) -> Result<Vec<f32>, EngineError> {
        self.read(&t)
    }
    /// The tensor's values appended to `out`, once every launch before has run: a
    /// batch's logits, read where the caller keeps them from step to step.
    fn read_append(&self, t: &Self::Tensor, out: &mut Self::Host) -> Result<(), EngineError>;

    /// The first failure of an operation since the last call, cleared: a device error,
    /// or a worker task that panicked. Operations other than allocations and reads
    /// return nothing; one that fails records its error here (later ones may then skip
    /// their work), and the caller checks once per step and fails that step.
    fn check(&self) -> Result<(), EngineError> {
        Ok(())
    }

    /// `out[i] = dequantize(table row tokens[i]) · scale`.
    fn embed(
        &self,
        table: &Self::Matrix,
        tokens: &Self::Ids,
        scale: Option<f32>,
        out: &mut Self::Tensor,
    );
    /// A tensor of the given rows of `x`, in that order.
    fn gather(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor, EngineError>;
    /// `out = rms_norm(x) · w` for each row.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, out: &mut Self::Tensor);
    /// RMSNorm in place of each group of `w`'s length: whole rows, or each head.
    fn rms_norm_groups(&self, x: &mut Self::Tensor, w: &Self::Vector, eps: f32);
    /// `out = x · wᵀ` for every `(w, out)`; the weights share one conversion of `x`
    /// where their kernels take the same activation format.
    fn matmul(&self, x: &Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]);
    /// `v` on the device.
    fn ids(&self, v: &[u32]) -> Result<Self::Ids, EngineError>;
    /// Overwrites `dst` (of `v`'s length) with `v`, in order with the launches around it.
    fn write_ids(&self, dst: &mut Self::Ids, v: &[u32]);
    /// RoPE of each `head_dim` head of row `i` at position `positions[i]`.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &Self::Ids, rope: Rope);
    fn scale(&self, x: &mut Self::Tensor, s: f32);
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `gate = act(gate) · up`.
    fn glu(&self, gate: &mut Self::Tensor, up: &Self::Tensor, act: Activation);
    /// `x += b` for each row (a projection's bias).
    fn add_bias(&self, x: &mut Self::Tensor, b: &Self::Vector);
    /// `x ⊙= y`, element by element.
    fn mul(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `x = tanh(x)`, element by element.
    fn tanh(&self, x: &mut Self::Tensor);
    /// Row `i` of `x` times `s[i]`.
    fn scale_rows(&self, x: &mut Self::Tensor, s: &[f32]);
    /// Row `rows[i]` of `dst` overwritten by row `i` of `src`: [`Backend::gather`]'s
    /// inverse.
    fn scatter(&self, src: &Self::Tensor, rows: &[usize], dst: &mut Self::Tensor);
    /// Stores each sequence's keys and values of `layer` (rows of `k`, `v`) in its cache.
    /// `positions` holds every row's position (for a sequence's rows `pos`, `pos + 1`,
    /// …): a backend may read them there rather than from [`SeqRows::pos`], so that a
    /// replayed [`Backend::Graph`] follows them.
    fn kv_store(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, Self::KvCache>],
        positions: &Self::Ids,
        k: &Self::Tensor,
        v: &Self::Tensor,
    );
    /// Writes to `out` the attention `a` describes.
    fn attention(&self, a: Attend<'_, '_, Self>, out: &mut Self::Tensor);

    /// A matrix product with the steps around it, which a backend may fuse: the rows
    /// `input` makes, times each matrix of `outs`; with `add_to` (one matrix only) the
    /// product is added to that tensor (the residual) and `outs`' tensor is left as
    /// scratch. As composed from the ops above, with the same results.
    fn product(
        &self,
        input: Input<'_, Self>,
        outs: &mut [(&Self::Matrix, &mut Self::Tensor)],
        add_to: Option<&mut Self::Tensor>,
    ) {
        let x = input.make(self);
        self.matmul(x, outs);
        if let Some(residual) = add_to {
            let [(_, out)] = outs else {
                panic!("a residual add takes one matrix")
            };
            self.add(residual, out);
        }
    }

    /// The attention `a` describes (as [`Backend::attention`], into `att`) and the
    /// product of its rows with `w` (as [`Backend::product`]); a backend may hand the
    /// attention's rows to the product without writing `att`.
    fn attention_product(
        &self,
        a: Attend<'_, '_, Self>,
        att: &mut Self::Tensor,
        w: &Self::Matrix,
        out: &mut Self::Tensor,
        add_to: Option<&mut Self::Tensor>,
    ) {
        self.attention(a, att);
        self.product(Input::Rows(att), &mut [(w, out)], add_to);
    }

    /// The feed-forward block `f` describes; a backend may hand the gated rows to the
    /// down product without writing `f.gate_rows` and `f.up_rows`. As composed by
    /// [`compose_feed_forward`], with the same results.
    fn feed_forward(&self, f: FeedForward<'_, Self>) {
        compose_feed_forward(self, f);
    }

    /// `x = cap · tanh(x / cap)` (soft-capping of scores and logits).
    fn softcap(&self, x: &mut Self::Tensor, cap: f32) {
        self.scale(x, 1.0 / cap);
        self.tanh(x);
        self.scale(x, cap);
    }

    /// The routing of each row of a router's `scores` as `gating` says
    /// ([`Routes::from_scores`]).
    fn route(&self, scores: &Self::Tensor, gating: Gating) -> Result<Routes, EngineError> {
        Routes::from_scores(&self.read(scores)?, gating)
    }

    /// The routed product (ggml's `mul_mat_id`): `out`'s row for slot `r·k + j` is the
    /// input row times expert `routes.experts[r·k + j]` of `w`. The input row is `x`'s
    /// row `r`, or, `per_slot`, its row `r·k + j` (the rows of an earlier routed
    /// product). Each expert used is read once, for all its rows.
    fn routed_matmul(
        &self,
        x: &Self::Tensor,
        per_slot: bool,
        w: &Experts<Self::Matrix>,
        routes: &Routes,
        out: &mut Self::Tensor,
    ) -> Result<(), EngineError> {
        for (e, slots) in routes.by_expert() {
            let m = w.matrices.get(e).ok_or_else(|| {
                EngineError::Invalid(format!("expert {e} of {}", w.matrices.len()))
            })?;
            let rows: Vec<usize> = if per_slot {
                slots.clone()
            } else {
                slots.iter().map(|s| s / routes.k).collect()
            };
            let xe = self.gather(x, &rows)?;
            let mut ye = self.tensor(rows.len(), w.rows)?;
            self.matmul(&xe, &mut [(m, &mut ye)]);
            self.scatter(&ye, &slots, out);
        }
        Ok(())
    }

    /// The routed rows mixed (the end of a mixture-of-experts block): `out`'s row `r` is
    /// `Σ_j weight(r, j) · y`'s row `r·k + j`, each product rounded, summed in slot
    /// order.
    fn mix_experts(
        &self,
        y: &Self::Tensor,
        routes: &Routes,
        out: &mut Self::Tensor,
    ) -> Result<(), EngineError> {
        let (k, rows) = (routes.k, routes.rows());
        for j in 0..k {
            let slots: Vec<usize> = (0..rows).map(|r| r * k + j).collect();
            let mut part = self.gather(y, &slots)?;
            let weights: Vec<f32> = slots.iter().map(|&s| routes.weights[s]).collect();
            self.scale_rows(&mut part, &weights);
            if j == 0 {
                *out = part;
            } else {
                self.add(out, &part);
            }
        }
        Ok(())
    }

    /// `x += rms_norm(o) · w` per row (a post-norm and the residual add); `o` may be
    /// normed in place.
    fn norm_add(&self, o: &mut Self::Tensor, w: &Self::Vector, eps: f32, x: &mut Self::Tensor) {
        self.rms_norm_groups(o, w, eps);
        self.add(x, o);
    }

    /// Queries and keys made ready for attention — each head RMS-normed where `heads`
    /// has norm weights, rotated at its row's position, the queries scaled where it says
    /// — and the keys and values stored in each sequence's cache of `layer`.
    #[allow(clippy::too_many_arguments)]
    fn prepare_attention(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, Self::KvCache>],
        positions: &Self::Ids,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        heads: &Heads<'_, Self::Vector>,
    ) {
        if let Some(n) = heads.q_norm {
            self.rms_norm_groups(q, n, heads.eps);
        }
        self.rope(q, heads.head_dim, positions, heads.rope);
        if let Some(n) = heads.k_norm {
            self.rms_norm_groups(k, n, heads.eps);
        }
        self.rope(k, heads.head_dim, positions, heads.rope);
        if let Some(s) = heads.q_scale {
            self.scale(q, s);
        }
        self.kv_store(layer, seqs, positions, k, v);
    }

    /// How many sequences' decode rows run better as that many recorded steps, one after
    /// another, than as one batch: where steps are recorded ([`Backend::record`]), a
    /// replay costs little of the host's time and a batch step's launches a lot. 1 (a
    /// batch from two sequences) where nothing is recorded.
    fn separate_decode_steps(&self) -> usize {
        1
    }

    /// Whether this backend's bits depend on how a prompt is cut into batches, so that
    /// a prompt must be cut as llama-server cuts it ([`crate::Model::prompt_batch_end`]):
    /// llama.cpp's arithmetic. Otherwise a prompt runs in batches as large as allowed.
    fn batches_as_llama_server(&self) -> bool {
        false
    }

    /// Runs `launches`, recording them as a graph where the backend can replay one: the
    /// work is done either way. `None` where nothing was recorded (the CPU backend, or a
    /// run that could not be captured).
    fn record(&self, launches: &mut dyn FnMut()) -> Option<Self::Graph> {
        launches();
        None
    }

    /// Runs `graph` again: the same launches over the same buffers, reading the values
    /// those buffers hold now. `false`, having done nothing, where the graph has gone
    /// stale (a buffer it reads was replaced); record it again then.
    fn replay(&self, _graph: &Self::Graph) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_parity::{
        add_expert_tensors, Rng, EXPERTS, EXPERTS_USED, EXPERT_FF, EXPERT_TYPES,
    };
    use crate::cpu::CpuBackend;
    use crate::weights::load_experts;
    use astra_gguf::GgmlType;

    const W: usize = 7;

    fn close(want: f64, got: f32, rel: f64) -> bool {
        (want - got as f64).abs() <= rel * want.abs().max(1e-30)
    }

    #[test]
    fn elementwise_ops_against_f64() {
        let be = CpuBackend::new(2);
        let mut rng = Rng(7);
        let (x, y, b) = (rng.vec(3 * W), rng.vec(3 * W), rng.vec(W));
        let read = |t: &CpuTensorOf| be.read(t).unwrap();
        type CpuTensorOf = <CpuBackend as Backend>::Tensor;

        let mut t = be.tensor_from(&x, W).unwrap();
        be.add_bias(&mut t, &be.vector(&b).unwrap());
        be.mul(&mut t, &be.tensor_from(&y, W).unwrap());
        for (i, got) in read(&t).into_iter().enumerate() {
            // One rounding per operation: the f64 result of each, rounded to f32.
            let sum = (x[i] as f64 + b[i % W] as f64) as f32;
            assert_eq!(
                got,
                (sum as f64 * y[i] as f64) as f32,
                "add_bias, mul at {i}"
            );
        }

        let mut t = be.tensor_from(&x, W).unwrap();
        be.softcap(&mut t, 0.3);
        for (i, got) in read(&t).into_iter().enumerate() {
            let want = 0.3 * (x[i] as f64 / 0.3).tanh();
            assert!(
                close(want, got, 1e-6),
                "softcap at {i}: {got} against {want}"
            );
        }

        let mut t = be.tensor_from(&x, W).unwrap();
        be.scale_rows(&mut t, &[2.0, -0.5, 0.0]);
        let mut dst = be.tensor_from(&y, W).unwrap();
        be.scatter(&t, &[2, 0, 1], &mut dst);
        let got = read(&dst);
        let scales = [2.0f32, -0.5, 0.0];
        for (i, &to) in [2usize, 0, 1].iter().enumerate() {
            for c in 0..W {
                assert_eq!(got[to * W + c], x[i * W + c] * scales[i], "row {i} to {to}");
            }
        }
    }

    /// The f64 reference of a routing: softmax, the k most probable, renormalized.
    fn reference_routes(scores: &[f64], k: usize, renormalize: bool) -> Vec<(usize, f64)> {
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut p: Vec<(usize, f64)> = e.iter().map(|v| v / sum).enumerate().collect();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        p.truncate(k);
        if renormalize {
            let s: f64 = p.iter().map(|x| x.1).sum();
            p.iter_mut().for_each(|x| x.1 /= s);
        }
        p
    }

    #[test]
    fn routes_against_f64() {
        let be = CpuBackend::new(1);
        let mut rng = Rng(11);
        let (n, rows) = (8, 6);
        let scores: Vec<f32> = rng.vec(rows * n).iter().map(|v| v * 4.0).collect();
        for (k, renormalize) in [(1, false), (2, true), (3, false), (8, true)] {
            let gating = Gating {
                experts: n,
                k,
                renormalize,
            };
            let r = be
                .route(&be.tensor_from(&scores, n).unwrap(), gating)
                .unwrap();
            assert_eq!((r.k, r.rows()), (k, rows));
            for row in 0..rows {
                let s: Vec<f64> = scores[row * n..][..n].iter().map(|&v| v as f64).collect();
                for (j, (e, w)) in reference_routes(&s, k, renormalize).into_iter().enumerate() {
                    assert_eq!(
                        r.experts[row * k + j] as usize,
                        e,
                        "k {k} row {row} slot {j}"
                    );
                    let got = r.weights[row * k + j];
                    assert!(close(w, got, 1e-6), "k {k} row {row}: {got} against {w}");
                }
            }
        }
        // Equal scores: the lower expert first.
        let r = Routes::from_scores(
            &[0.5, 1.0, 1.0, 1.0],
            Gating {
                experts: 4,
                k: 2,
                renormalize: true,
            },
        )
        .unwrap();
        assert_eq!((r.experts, r.weights), (vec![1, 2], vec![0.5, 0.5]));
        for (k, len) in [(0, 4), (5, 4), (2, 6)] {
            let g = Gating {
                experts: 4,
                k,
                renormalize: false,
            };
            assert!(
                Routes::from_scores(&vec![0.0; len], g).is_err(),
                "k {k}, {len} scores"
            );
        }
    }

    /// The routed product, row by row: each slot's row is the plain product of its input
    /// row with its expert, to the bit; the mix is the f64 weighted sum of the slots.
    #[test]
    fn routed_products_equal_the_rows_one_at_a_time() {
        let be = CpuBackend::new(2);
        let dir = std::env::temp_dir().join(format!("astra-routed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("experts.gguf");
        let mut w = astra_gguf::GgufWriter::new();
        add_expert_tensors(&mut w).unwrap();
        w.write_file(&path).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let mut rng = Rng(3);
        let (tokens, cols) = (7, crate::backend_parity::COLS);
        let gating = Gating {
            experts: EXPERTS,
            k: EXPERTS_USED,
            renormalize: false,
        };
        let scores = rng.vec(tokens * EXPERTS);
        let routes = be
            .route(&be.tensor_from(&scores, EXPERTS).unwrap(), gating)
            .unwrap();
        let x = rng.vec(tokens * cols);
        let xt = be.tensor_from(&x, cols).unwrap();
        let slots = tokens * EXPERTS_USED;
        for ty in EXPERT_TYPES {
            let gate = load_experts(&be, &file, &format!("eg.{}", ty.name())).unwrap();
            let down = load_experts(&be, &file, &format!("ed.{}", ty.name())).unwrap();
            assert_eq!(
                (gate.matrices.len(), gate.rows, gate.cols),
                (EXPERTS, EXPERT_FF, cols)
            );
            let mut g = be.tensor(slots, EXPERT_FF).unwrap();
            be.routed_matmul(&xt, false, &gate, &routes, &mut g)
                .unwrap();
            let mut d = be.tensor(slots, cols).unwrap();
            be.routed_matmul(&g, true, &down, &routes, &mut d).unwrap();
            let (g, d) = (be.read(&g).unwrap(), be.read(&d).unwrap());
            for s in 0..slots {
                let e = routes.experts[s] as usize;
                let row = be
                    .tensor_from(&x[s / EXPERTS_USED * cols..][..cols], cols)
                    .unwrap();
                let mut one = be.tensor(1, EXPERT_FF).unwrap();
                be.matmul(&row, &mut [(&gate.matrices[e], &mut one)]);
                let one = be.read(&one).unwrap();
                assert_eq!(one, g[s * EXPERT_FF..][..EXPERT_FF], "{ty:?} gate slot {s}");
                let mut back = be.tensor(1, cols).unwrap();
                let one = be.tensor_from(&one, EXPERT_FF).unwrap();
                be.matmul(&one, &mut [(&down.matrices[e], &mut back)]);
                assert_eq!(
                    be.read(&back).unwrap(),
                    d[s * cols..][..cols],
                    "{ty:?} down {s}"
                );
            }
            let mut mixed = be.tensor(tokens, cols).unwrap();
            be.mix_experts(&be.tensor_from(&d, cols).unwrap(), &routes, &mut mixed)
                .unwrap();
            for (i, got) in be.read(&mixed).unwrap().into_iter().enumerate() {
                let (r, c) = (i / cols, i % cols);
                let want: f64 = (0..EXPERTS_USED)
                    .map(|j| {
                        let s = r * EXPERTS_USED + j;
                        routes.weights[s] as f64 * d[s * cols + c] as f64
                    })
                    .sum();
                assert!(
                    (want - got as f64).abs() <= 1e-6 * (1.0 + want.abs()),
                    "mix at {i}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn experts_need_a_three_dimensional_tensor() {
        let dir = std::env::temp_dir().join(format!("astra-experts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("flat.gguf");
        let mut w = astra_gguf::GgufWriter::new();
        let bytes = astra_quant::parity::random_weights(GgmlType::Q8_0, 4, 64, 1).unwrap();
        w.add_tensor(
            "flat",
            &[64, 4],
            GgmlType::Q8_0,
            astra_gguf::TensorSource::Owned(bytes),
        )
        .unwrap();
        w.write_file(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let err = MatRef::experts(&file, "flat").unwrap_err().to_string();
        assert!(err.contains("expected three"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
