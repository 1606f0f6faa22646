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

use std::ops::Range;
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
    /// The whole tensor, on the host, once every launch before it has run: the point
    /// where a failure of those launches is reported ([`Backend::check`]).
    fn read(&self, t: &Self::Tensor) -> Result<Vec<f32>, EngineError>;
    /// The whole tensor, on the host, the tensor no longer needed: where it is in host
    /// memory already, handed over rather than copied.
    fn read_owned(&self, t: Self::Tensor) -> Result<Vec<f32>, EngineError> {
        self.read(&t)
    }

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
