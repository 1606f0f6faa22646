//! Model hyperparameters: the GGUF metadata keys every architecture has (under its own
//! prefix), and the fields an architecture sets for itself in its file of
//! [`crate::models`] (its sliding-window layers, its embedding scale).

use astra_gguf::Metadata;

use crate::backend::Gating;
pub use crate::models::Arch;
use crate::EngineError;

#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub ctx_train: usize,
    pub rms_eps: f32,
    /// RoPE base (of the global layers, where an architecture has others).
    pub rope_base: f32,
    /// Dimensions rotated per head (the first `rope_dim` of `head_dim`).
    pub rope_dim: usize,
    /// Factor on the input embeddings (Gemma: √n_embd).
    pub embed_scale: Option<f32>,
    /// Keys a sliding-window layer attends to (the query's own position included).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer.
    pub layer_local: Vec<bool>,
    /// Factor on q·k.
    pub attn_scale: f32,
    /// The mixture-of-experts feed-forward, where the layers have one.
    pub moe: Option<Moe>,
}

/// A mixture-of-experts feed-forward's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    /// The router's choice: experts, how many each token uses, renormalized or not.
    pub gating: Gating,
    /// Each expert's feed-forward width.
    pub n_ff: usize,
}

impl Config {
    /// The hyperparameters of the model `md` describes.
    pub fn from_metadata(md: &Metadata) -> Result<Config, EngineError> {
        crate::models::config(md)
    }

    /// The keys every architecture has, read under `arch`'s prefix; the fields only
    /// some architectures set left as a plain global-attention model has them.
    pub(crate) fn common(md: &Metadata, arch: Arch) -> Result<Config, EngineError> {
        let arch_name = arch.name();
        let key = |k: &str| format!("{arch_name}.{k}");
        let n_embd = md.u64(&key("embedding_length"))? as usize;
        let n_head = md.u64(&key("attention.head_count"))? as usize;
        let n_head_kv = md
            .optional(&key("attention.head_count_kv"), Metadata::u64)?
            .map_or(n_head, |v| v as usize);
        let n_layer = md.u64(&key("block_count"))? as usize;
        let head_dim = match md.optional(&key("attention.key_length"), Metadata::u64)? {
            Some(d) => d as usize,
            None if n_head > 0 => n_embd / n_head,
            None => 0,
        };
        if n_head == 0
            || n_head_kv == 0
            || !n_head.is_multiple_of(n_head_kv)
            || head_dim == 0
            || head_dim % 2 != 0
        {
            return Err(EngineError::Invalid(format!(
                "attention shape: {n_head} heads, {n_head_kv} KV heads, head dim {head_dim}"
            )));
        }
        let rope_dim = md
            .optional(&key("rope.dimension_count"), Metadata::u64)?
            .map_or(head_dim, |v| v as usize);
        let rope_base = md
            .optional(&key("rope.freq_base"), Metadata::f32)?
            .unwrap_or(10000.0);
        let n_vocab = match md.optional(&key("vocab_size"), Metadata::u64)? {
            Some(v) => v as usize,
            None => md.array("tokenizer.ggml.tokens")?.len(),
        };
        Ok(Config {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: md.u64(&key("feed_forward_length"))? as usize,
            n_vocab,
            ctx_train: md.u64(&key("context_length"))? as usize,
            rms_eps: md.f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_base,
            rope_dim: rope_dim.min(head_dim),
            embed_scale: None,
            sliding_window: None,
            layer_local: vec![false; n_layer],
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            moe: None,
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
}
