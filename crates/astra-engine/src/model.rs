//! A loaded model and its forward pass, written once for both architectures: the
//! Gemma 3 differences (scaled embeddings, QK-norm, post norms, GeGLU, local layers)
//! are configuration, not a second copy of the model.

use std::path::Path;
use std::sync::Arc;

use astra_gguf::GgufFile;
use astra_quant::matmul::{matmul_quantized_on, QuantizedActivations};
use astra_quant::ActType;

use crate::attention::KvCache;
use crate::config::{Arch, Config};
use crate::ops::{add_inplace, gelu, rms_norm, rms_norm_inplace, rope, silu};
use crate::pool::Pool;
use crate::weights::{MatRef, Weights};
use crate::EngineError;

/// Tokens per forward batch; longer inputs run as consecutive batches (with the same
/// results, by the determinism of every step).
pub const MAX_BATCH: usize = 512;

pub struct Model {
    pub file: GgufFile,
    pub cfg: Config,
    pub weights: Weights,
    pool: Pool,
}

/// One sequence's state: its KV cache and how many positions it holds.
pub struct Session {
    kv: KvCache,
    pub n_past: usize,
}

impl Session {
    pub fn ctx(&self) -> usize {
        self.kv.ctx
    }

    /// Forgets positions from `n` on (their cache entries are overwritten later).
    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }
}

/// Activations of one batch, token-major.
struct Scratch {
    x: Vec<f32>,    // (T, n_embd) residual stream
    xb: Vec<f32>,   // (T, n_embd) normed input of a block
    q: Vec<f32>,    // (T, n_head·head_dim)
    k: Vec<f32>,    // (T, n_head_kv·head_dim)
    v: Vec<f32>,    // (T, n_head_kv·head_dim)
    att: Vec<f32>,  // (T, n_head·head_dim)
    o: Vec<f32>,    // (T, n_embd)
    gate: Vec<f32>, // (T, n_ff)
    up: Vec<f32>,   // (T, n_ff)
}

impl Scratch {
    fn new(cfg: &Config, t: usize) -> Scratch {
        let z = |n: usize| vec![0.0f32; t * n];
        Scratch {
            x: z(cfg.n_embd),
            xb: z(cfg.n_embd),
            q: z(cfg.q_dim()),
            k: z(cfg.kv_dim()),
            v: z(cfg.kv_dim()),
            att: z(cfg.q_dim()),
            o: z(cfg.n_embd),
            gate: z(cfg.n_ff),
            up: z(cfg.n_ff),
        }
    }
}

impl Model {
    /// Loads a GGUF model to run on `threads` threads.
    pub fn load(path: &Path, threads: usize) -> Result<Arc<Model>, EngineError> {
        let file = GgufFile::open(path).map_err(|e| EngineError::Load(e.to_string()))?;
        let cfg = Config::from_metadata(file.metadata())?;
        let weights = Weights::load(&file, &cfg)?;
        Ok(Arc::new(Model { file, cfg, weights, pool: Pool::new(threads.max(1)) }))
    }

    pub fn threads(&self) -> usize {
        use astra_quant::matmul::Parallel;
        self.pool.threads()
    }

    /// A new sequence with room for `ctx` positions.
    pub fn session(&self, ctx: usize) -> Result<Session, EngineError> {
        if ctx == 0 || ctx > self.cfg.ctx_train.max(1) {
            return Err(EngineError::Invalid(format!(
                "context {ctx} is outside 1..={} (the model's training context)",
                self.cfg.ctx_train
            )));
        }
        Ok(Session { kv: KvCache::new(&self.cfg, ctx, MAX_BATCH), n_past: 0 })
    }

    /// Runs `tokens` at the session's next positions and returns the logits of the
    /// tokens from index `logits_from` on (token-major, `n_vocab` each).
    pub fn forward(&self, s: &mut Session, tokens: &[u32], logits_from: usize) -> Result<Vec<f32>, EngineError> {
        if s.n_past + tokens.len() > s.kv.ctx {
            return Err(EngineError::ContextFull { ctx: s.kv.ctx, needed: s.n_past + tokens.len() });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            return Err(EngineError::Invalid(format!("token id {bad} is outside the vocabulary of {}", self.cfg.n_vocab)));
        }
        let mut logits = Vec::with_capacity(tokens.len().saturating_sub(logits_from) * self.cfg.n_vocab);
        for (b, batch) in tokens.chunks(MAX_BATCH).enumerate() {
            let start = b * MAX_BATCH;
            let from = logits_from.saturating_sub(start).min(batch.len());
            let out = self.forward_batch(s, batch, from);
            logits.extend(out);
        }
        Ok(logits)
    }

    fn forward_batch(&self, s: &mut Session, tokens: &[u32], logits_from: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let t = tokens.len();
        let e = cfg.n_embd;
        let mut sc = Scratch::new(cfg, t);
        self.embed(tokens, &mut sc.x);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            self.attention_block(s, l, &mut sc);
            add_inplace(&mut sc.x, &sc.o);
            for (xb, x) in sc.xb.chunks_exact_mut(e).zip(sc.x.chunks_exact(e)) {
                rms_norm(x, &layer.ffn_norm, cfg.rms_eps, xb);
            }
            self.ffn_block(l, &mut sc);
            add_inplace(&mut sc.x, &sc.o);
        }
        s.n_past += t;
        let rows = t - logits_from;
        if rows == 0 {
            return Vec::new();
        }
        let mut normed = vec![0.0f32; rows * e];
        for (o, x) in normed.chunks_exact_mut(e).zip(sc.x[logits_from * e..].chunks_exact(e)) {
            rms_norm(x, &self.weights.output_norm, cfg.rms_eps, o);
        }
        let mut logits = vec![0.0f32; rows * cfg.n_vocab];
        self.matmul(&self.weights.output, &normed, &mut logits);
        logits
    }

    fn embed(&self, tokens: &[u32], x: &mut [f32]) {
        let m = self.weights.token_embd.view(&self.file);
        for (row, &tok) in x.chunks_exact_mut(self.cfg.n_embd).zip(tokens) {
            astra_quant::dequantize(m.ty, m.row(tok as usize), row).expect("embedding row");
            if let Some(scale) = self.cfg.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
    }

    fn matmul(&self, w: &MatRef, x: &[f32], out: &mut [f32]) {
        let acts = QuantizedActivations::new(w.kernels.act, x, w.cols).expect("activation shape");
        matmul_quantized_on(&self.pool, &w.view(&self.file), &acts, out, &w.kernels);
    }

    /// `sc.o = attention(norm(sc.x))` for layer `l`, storing the batch's keys and values.
    fn attention_block(&self, s: &mut Session, l: usize, sc: &mut Scratch) {
        let cfg = &self.cfg;
        let layer = &self.weights.layers[l];
        let (e, hd) = (cfg.n_embd, cfg.head_dim);
        for (xb, x) in sc.xb.chunks_exact_mut(e).zip(sc.x.chunks_exact(e)) {
            rms_norm(x, &layer.attn_norm, cfg.rms_eps, xb);
        }
        // Q, K and V share one quantization of the input when their types pair with
        // the same activation type.
        let mut shared: Option<(ActType, QuantizedActivations)> = None;
        for (w, out) in [(&layer.wq, &mut sc.q), (&layer.wk, &mut sc.k), (&layer.wv, &mut sc.v)] {
            if shared.as_ref().is_none_or(|(a, _)| *a != w.kernels.act) {
                let acts = QuantizedActivations::new(w.kernels.act, &sc.xb, e).expect("activation shape");
                shared = Some((w.kernels.act, acts));
            }
            let (_, acts) = shared.as_ref().expect("just set");
            matmul_quantized_on(&self.pool, &w.view(&self.file), acts, out, &w.kernels);
        }
        let local = cfg.layer_local[l];
        let base = if local { cfg.rope_base_local } else { cfg.rope_base };
        let gemma = cfg.arch == Arch::Gemma3;
        let n_past = s.n_past;
        for (i, (q, k)) in sc.q.chunks_exact_mut(cfg.q_dim()).zip(sc.k.chunks_exact_mut(cfg.kv_dim())).enumerate() {
            let pos = n_past + i;
            for head in q.chunks_exact_mut(hd) {
                if let Some(w) = &layer.q_norm {
                    rms_norm_inplace(head, w, cfg.rms_eps);
                }
                rope(head, pos, cfg.rope_dim, base, cfg.rope_neox);
                if gemma {
                    head.iter_mut().for_each(|v| *v *= cfg.attn_scale);
                }
            }
            for head in k.chunks_exact_mut(hd) {
                if let Some(w) = &layer.k_norm {
                    rms_norm_inplace(head, w, cfg.rms_eps);
                }
                rope(head, pos, cfg.rope_dim, base, cfg.rope_neox);
            }
        }
        for (i, (k, v)) in sc.k.chunks_exact(cfg.kv_dim()).zip(sc.v.chunks_exact(cfg.kv_dim())).enumerate() {
            s.kv.store(l, n_past + i, k, v);
        }
        let scale = if gemma { 1.0 } else { cfg.attn_scale };
        s.kv.layer(l, cfg, scale).attend(&self.pool, &sc.q, n_past, &mut sc.att);
        self.matmul(&layer.wo, &sc.att, &mut sc.o);
        if let Some(w) = &layer.post_attn_norm {
            for o in sc.o.chunks_exact_mut(e) {
                rms_norm_inplace(o, w, cfg.rms_eps);
            }
        }
    }

    /// `sc.o = ffn(sc.xb)` for layer `l`.
    fn ffn_block(&self, l: usize, sc: &mut Scratch) {
        let cfg = &self.cfg;
        let layer = &self.weights.layers[l];
        let acts = QuantizedActivations::new(layer.w_gate.kernels.act, &sc.xb, cfg.n_embd).expect("activation shape");
        matmul_quantized_on(&self.pool, &layer.w_gate.view(&self.file), &acts, &mut sc.gate, &layer.w_gate.kernels);
        if layer.w_up.kernels.act == layer.w_gate.kernels.act {
            matmul_quantized_on(&self.pool, &layer.w_up.view(&self.file), &acts, &mut sc.up, &layer.w_up.kernels);
        } else {
            self.matmul(&layer.w_up, &sc.xb, &mut sc.up);
        }
        let act: fn(f32) -> f32 = if cfg.arch == Arch::Gemma3 { gelu } else { silu };
        for (g, &u) in sc.gate.iter_mut().zip(&sc.up) {
            *g = act(*g) * u;
        }
        self.matmul(&layer.w_down, &sc.gate, &mut sc.o);
        if let Some(w) = &layer.post_ffn_norm {
            for o in sc.o.chunks_exact_mut(cfg.n_embd) {
                rms_norm_inplace(o, w, cfg.rms_eps);
            }
        }
    }
}
