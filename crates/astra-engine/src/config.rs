//! Model hyperparameters from GGUF metadata, with the facts llama.cpp hard-codes per
//! architecture (Gemma 3's sliding-window pattern, local RoPE base, attention scale).

use astra_gguf::Metadata;

use crate::EngineError;

/// The architectures this engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama family (SmolLM2, Llama 2/3, Mistral): SwiGLU, RoPE on adjacent pairs.
    Llama,
    /// Gemma 3: GeGLU, NeoX RoPE, QK-norm, pre and post norms, scaled embeddings,
    /// sliding-window layers with their own RoPE base.
    Gemma3,
}

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
    /// RoPE base of global layers, and of sliding-window layers.
    pub rope_base: f32,
    pub rope_base_local: f32,
    /// Dimensions rotated per head (the first `rope_dim` of `head_dim`).
    pub rope_dim: usize,
    /// NeoX-style RoPE (rotate the two halves) rather than adjacent pairs.
    pub rope_neox: bool,
    /// Keys a sliding-window layer attends to (the query's own position included).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer.
    pub layer_local: Vec<bool>,
    /// Factor on the input embeddings (Gemma: √n_embd).
    pub embed_scale: Option<f32>,
    /// Factor on q·k.
    pub attn_scale: f32,
}

impl Config {
    pub fn from_metadata(md: &Metadata) -> Result<Config, EngineError> {
        let arch_name = md.str("general.architecture")?;
        let arch = match arch_name {
            "llama" => Arch::Llama,
            "gemma3" => Arch::Gemma3,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "architecture {other:?} (supported: llama, gemma3)"
                )))
            }
        };
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
        let mut cfg = Config {
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
            rope_base_local: rope_base,
            rope_dim: rope_dim.min(head_dim),
            rope_neox: false,
            sliding_window: None,
            layer_local: vec![false; n_layer],
            embed_scale: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
        };
        if arch == Arch::Gemma3 {
            // llama.cpp: sliding window from the file, every sixth layer global, local
            // layers with RoPE base 10000, embeddings scaled by √n_embd, q scaled by
            // 1/√head_dim (query_pre_attn_scalar = head_dim for these sizes).
            let window = md.u64(&key("attention.sliding_window"))? as usize;
            cfg.sliding_window = Some(window);
            cfg.layer_local = (0..n_layer).map(|il| il % 6 < 5).collect();
            cfg.rope_base_local = 10000.0;
            cfg.rope_neox = true;
            cfg.embed_scale = Some((n_embd as f32).sqrt());
        }
        Ok(cfg)
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
}
