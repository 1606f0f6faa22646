//! The KV cache and split attention.
//!
//! Keys and values are stored in f16, per layer as `(slot, kv_head, head_dim)`; a
//! sliding-window layer keeps a ring of `window + max_batch` slots (the window, plus
//! room for a batch written before it is attended to), a global layer one slot per
//! context position.
//!
//! Attention of one query head over positions `lo..=p` is split at absolute positions
//! that are multiples of [`CHUNK`]: each chunk gives a partial (max score, Σ exp, Σ
//! exp·v), and the partials are merged in chunk order. Because the chunks are fixed by
//! position (not by thread count or batch), a query gets the same bits however the
//! chunks are scheduled, whether it is decoded alone or in a prefill batch, and
//! whether its prefix was computed now or earlier.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::config::Config;
use crate::ops::{axpy, dot};

/// KV positions per partial. A constant: changing it changes results (in the last
/// bits), never how they depend on threads or batching. 64 keeps a chunk's keys
/// (64 × head_dim f16) in L1.
pub const CHUNK: usize = 64;

struct LayerCache {
    k: Vec<f16>, // (slot, kv_head, head_dim)
    v: Vec<f16>, // (slot, kv_head, head_dim)
    slots: usize,
    /// Positions attended back (the sliding window), or unlimited.
    window: Option<usize>,
}

pub struct KvCache {
    layers: Vec<LayerCache>,
    kv_dim: usize,
    pub ctx: usize,
}

impl KvCache {
    pub fn new(cfg: &Config, ctx: usize, max_batch: usize) -> KvCache {
        let kv_dim = cfg.kv_dim();
        let layers = (0..cfg.n_layer)
            .map(|l| {
                let window = if cfg.layer_local[l] { cfg.sliding_window } else { None };
                let slots = window.map_or(ctx, |w| ctx.min(w + max_batch));
                LayerCache { k: vec![f16::ZERO; slots * kv_dim], v: vec![f16::ZERO; slots * kv_dim], slots, window }
            })
            .collect();
        KvCache { layers, kv_dim, ctx }
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| 2 * l.k.len() * 2).sum()
    }

    /// Stores the key and value rows of position `pos` in layer `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let c = &mut self.layers[layer];
        let at = (pos % c.slots) * self.kv_dim;
        c.k[at..at + self.kv_dim].convert_from_f32_slice(k);
        c.v[at..at + self.kv_dim].convert_from_f32_slice(v);
    }
}

/// One chunk's partial result for one head.
struct Partial {
    max: f32,
    sum: f32,
    acc: Vec<f32>, // (head_dim)
}

/// What one attention call needs to know about its layer.
pub struct AttnLayer<'a> {
    cache: &'a LayerCache,
    kv_dim: usize,
    head_dim: usize,
    group: usize, // query heads per KV head
    scale: f32,
}

impl KvCache {
    pub fn layer(&self, layer: usize, cfg: &Config, scale: f32) -> AttnLayer<'_> {
        AttnLayer {
            cache: &self.layers[layer],
            kv_dim: self.kv_dim,
            head_dim: cfg.head_dim,
            group: cfg.n_head / cfg.n_head_kv,
            scale,
        }
    }
}

impl AttnLayer<'_> {
    /// The first position a query at `pos` attends to.
    fn first(&self, pos: usize) -> usize {
        self.cache.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    fn partial(&self, q: &[f32], head: usize, lo: usize, hi: usize) -> Partial {
        let (hd, c) = (self.head_dim, self.cache);
        let off = (head / self.group) * hd;
        let mut row = vec![0.0f32; hd];
        let mut scores = Vec::with_capacity(hi + 1 - lo);
        for pos in lo..=hi {
            let at = (pos % c.slots) * self.kv_dim + off;
            c.k[at..at + hd].convert_to_f32_slice(&mut row);
            scores.push(dot(q, &row) * self.scale);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        let mut acc = vec![0.0f32; hd];
        for (pos, s) in (lo..=hi).zip(&scores) {
            let w = (s - max).exp();
            sum += w;
            let at = (pos % c.slots) * self.kv_dim + off;
            c.v[at..at + hd].convert_to_f32_slice(&mut row);
            axpy(&mut acc, w, &row);
        }
        Partial { max, sum, acc }
    }

    /// Attention output of query head `head` (values `q`) at position `pos` into `out`.
    /// `parallel` spreads the chunks over the pool (same result either way).
    pub fn attend(&self, q: &[f32], head: usize, pos: usize, out: &mut [f32], parallel: bool) {
        let lo = self.first(pos);
        let chunks: Vec<(usize, usize)> = (lo / CHUNK..=pos / CHUNK)
            .map(|c| ((c * CHUNK).max(lo), (c * CHUNK + CHUNK - 1).min(pos)))
            .collect();
        let partials: Vec<Partial> = if parallel && chunks.len() > 4 {
            chunks.par_iter().map(|&(a, b)| self.partial(q, head, a, b)).collect()
        } else {
            chunks.iter().map(|&(a, b)| self.partial(q, head, a, b)).collect()
        };
        // Merge in chunk order.
        let max = partials.iter().map(|p| p.max).fold(f32::NEG_INFINITY, f32::max);
        out.fill(0.0);
        let mut sum = 0.0f32;
        for p in &partials {
            let w = (p.max - max).exp();
            sum += p.sum * w;
            axpy(out, w, &p.acc);
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|v| *v *= inv);
    }
}
