//! The KV cache and split attention.
//!
//! Keys and values are stored in f16 (or f32: [`KvType`]), per layer as `(kv_head,
//! slot, head_dim)`; a sliding-window layer keeps a ring of `window + max_batch` slots
//! (rounded up to whole chunks: the window, plus room for a batch written before it is
//! attended to), a global layer one slot per context position.
//!
//! Attention of one query head over positions `lo..=p` is split at absolute positions
//! that are multiples of [`CHUNK`]: each chunk gives a partial (max score, Σ exp,
//! Σ exp·v), and the partials are merged in chunk order. The chunks are fixed by
//! position, never by thread count or batch, and every partial is computed by the same
//! function from the chunk's keys and values as stored, so a query gets the same bits
//! however the work is scheduled: decoded alone (chunks in parallel), in a prefill
//! batch (queries sharing each chunk while it is in cache), or after its prefix came
//! from the cache.

use half::f16;
use std::sync::Mutex;

use astra_quant::matmul::Parallel;

use crate::config::Config;
use crate::ggml_ops::SwaCells;
use crate::model::MAX_BATCH;
use crate::ops::{attend_rows, axpy, KvElem};

/// KV positions per partial. A constant: changing it changes results (in the last
/// bits), never how they depend on threads or batching. At 64 a chunk's f16 keys and
/// values take 16 KiB (head_dim 64) to 64 KiB (head_dim 256), within L2; the value has
/// not been tuned by measurement.
pub const CHUNK: usize = 64;

/// Queries per prefill task: they share each chunk's keys and values while these are
/// in cache.
const QUERY_BLOCK: usize = 16;

/// What the KV cache stores keys and values as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// Half the memory; keys and values rounded to f16 as they are stored.
    #[default]
    F16,
    /// Keys and values as computed.
    F32,
}

impl KvType {
    pub fn bytes(self) -> usize {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }
}

/// One layer's keys (or values), `(kv_head, slot, head_dim)`, in the cache's type.
enum KvRows {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl KvRows {
    fn new(ty: KvType, n: usize) -> KvRows {
        match ty {
            KvType::F16 => KvRows::F16(vec![f16::ZERO; n]),
            KvType::F32 => KvRows::F32(vec![0.0; n]),
        }
    }

    fn store(&mut self, at: usize, row: &[f32]) {
        match self {
            KvRows::F16(x) => KvElem::store(&mut x[at..at + row.len()], row),
            KvRows::F32(x) => KvElem::store(&mut x[at..at + row.len()], row),
        }
    }
}

struct LayerCache {
    k: KvRows,
    v: KvRows,
    slots: usize,
    /// Positions attended back (the sliding window), or unlimited.
    window: Option<usize>,
}

/// One layer's place in a KV cache: its slots, and the window it attends back (none
/// for a global layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSlots {
    pub slots: usize,
    pub window: Option<usize>,
}

/// The shape of one sequence's KV cache, the same on every backend: per layer
/// `(kv_head, slot, head_dim)` keys and values in `elem`; a global layer has a slot per
/// context position, a sliding-window layer a ring of `window + max_batch` slots
/// rounded up to whole chunks (the window, plus room for a batch written before it is
/// attended to; a ring of whole chunks never splits a chunk across its end).
#[derive(Clone, Debug)]
pub struct KvLayout {
    pub layers: Vec<LayerSlots>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub elem: KvType,
}

impl KvLayout {
    /// The layout for `ctx` positions written by batches of at most `max_batch`
    /// tokens of the sequence.
    pub fn new(cfg: &Config, ctx: usize, max_batch: usize) -> KvLayout {
        let layers = (0..cfg.n_layer)
            .map(|l| {
                let window = if cfg.layer_local[l] {
                    cfg.sliding_window
                } else {
                    None
                };
                let slots =
                    window.map_or(ctx, |w| ctx.min((w + max_batch).next_multiple_of(CHUNK)));
                LayerSlots { slots, window }
            })
            .collect();
        KvLayout {
            layers,
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            elem: KvType::F16,
        }
    }

    /// The same layout storing `elem`.
    pub fn of(self, elem: KvType) -> KvLayout {
        KvLayout { elem, ..self }
    }

    /// Elements of one layer's keys (or values).
    pub fn layer_elems(&self, layer: usize) -> usize {
        self.n_head_kv * self.layers[layer].slots * self.head_dim
    }

    /// Bytes of the whole cache (keys and values).
    pub fn bytes(&self) -> usize {
        (0..self.layers.len())
            .map(|l| 2 * self.layer_elems(l) * self.elem.bytes())
            .sum()
    }

    /// How far below the highest position written a sequence may be cut back and
    /// continued: a ring keeps the positions a query needs only while fewer than
    /// `slots - window` later positions have overwritten them.
    pub fn rewind_limit(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.window.map(|w| l.slots.saturating_sub(w)))
            .min()
            .unwrap_or(usize::MAX)
    }
}

pub struct KvCache {
    layers: Vec<LayerCache>,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    /// Where llama.cpp's cache would hold each position of the sliding-window layers
    /// (for llama.cpp's arithmetic, whose attention visits them in that order).
    swa: Option<SwaCells>,
}

impl KvCache {
    pub fn new(layout: &KvLayout) -> KvCache {
        let layers = layout
            .layers
            .iter()
            .enumerate()
            .map(|(l, &LayerSlots { slots, window })| {
                let n = layout.layer_elems(l);
                LayerCache {
                    k: KvRows::new(layout.elem, n),
                    v: KvRows::new(layout.elem, n),
                    slots,
                    window,
                }
            })
            .collect();
        // llama.cpp sizes a sliding-window cache for the window and a micro-batch, in
        // multiples of 256 cells.
        let swa = layout.layers.iter().find_map(|l| {
            let w = l.window?;
            Some(SwaCells::new(
                (w + MAX_BATCH)
                    .next_multiple_of(256)
                    .min(l.slots.next_multiple_of(256)),
                w,
            ))
        });
        KvCache {
            layers,
            swa,
            n_head: layout.n_head,
            n_head_kv: layout.n_head_kv,
            head_dim: layout.head_dim,
        }
    }

    /// Notes that a micro-batch at `positions` is being stored (every layer's store
    /// says so; the first places it in [`SwaCells`]).
    pub fn place(&mut self, positions: std::ops::Range<usize>) {
        if let Some(swa) = &mut self.swa {
            swa.place(positions);
        }
    }

    /// Stores the key and value rows (all KV heads) of position `pos` in `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (c, hd) = (&mut self.layers[layer], self.head_dim);
        for g in 0..self.n_head_kv {
            let at = (g * c.slots + pos % c.slots) * hd;
            c.k.store(at, &k[g * hd..(g + 1) * hd]);
            c.v.store(at, &v[g * hd..(g + 1) * hd]);
        }
    }

    /// Layer `layer` for attention with scores scaled by `scale`.
    pub fn layer(&self, layer: usize, scale: f32) -> AttnLayer<'_> {
        AttnLayer {
            cache: &self.layers[layer],
            swa: self.swa.as_ref(),
            head_dim: self.head_dim,
            n_head: self.n_head,
            group: self.n_head / self.n_head_kv,
            n_head_kv: self.n_head_kv,
            scale,
        }
    }
}

/// Attention outputs of one prefill task: (token, head, values).
type HeadRows = Vec<(usize, usize, Vec<f32>)>;

/// One chunk's partial result for one query head.
struct Partial {
    max: f32,
    sum: f32,
    acc: Vec<f32>, // (head_dim)
}

#[derive(Clone, Copy)]
pub struct AttnLayer<'a> {
    cache: &'a LayerCache,
    swa: Option<&'a SwaCells>,
    head_dim: usize,
    n_head: usize,
    group: usize, // query heads per KV head
    n_head_kv: usize,
    scale: f32,
}

impl AttnLayer<'_> {
    /// The first position a query at `pos` attends to.
    fn first(&self, pos: usize) -> usize {
        self.cache.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Chunk indices a query at `pos` visits.
    fn chunks(&self, pos: usize) -> std::ops::RangeInclusive<usize> {
        self.first(pos) / CHUNK..=pos / CHUNK
    }

    /// The partial of query `q` over positions `lo..=hi` (within one chunk) of KV head
    /// `g`, read from the cache as stored (a chunk's slots are contiguous: the ring's
    /// length is a whole number of chunks).
    fn partial(&self, q: &[f32], g: usize, lo: usize, hi: usize) -> Partial {
        let (c, hd) = (self.cache, self.head_dim);
        let rows = (g * c.slots + lo % c.slots) * hd..(g * c.slots + hi % c.slots + 1) * hd;
        let mut weights = [0.0f32; CHUNK];
        let mut acc = vec![0.0f32; hd];
        let w = &mut weights[..hi + 1 - lo];
        let (max, sum) = match (&c.k, &c.v) {
            (KvRows::F16(k), KvRows::F16(v)) => {
                attend_rows(q, &k[rows.clone()], &v[rows], self.scale, w, &mut acc)
            }
            (KvRows::F32(k), KvRows::F32(v)) => {
                attend_rows(q, &k[rows.clone()], &v[rows], self.scale, w, &mut acc)
            }
            _ => unreachable!("keys and values are made in one type"),
        };
        Partial { max, sum, acc }
    }

    /// Merges partials (in chunk order) into `out`.
    fn merge(partials: &[Partial], out: &mut [f32]) {
        let max = partials
            .iter()
            .map(|p| p.max)
            .fold(f32::NEG_INFINITY, f32::max);
        out.fill(0.0);
        let mut sum = 0.0f32;
        for p in partials {
            let w = (p.max - max).exp();
            sum += p.sum * w;
            axpy(out, w, &p.acc);
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|v| *v *= inv);
    }

    /// Attention for a batch of one sequence: `q` holds `(token, head, head_dim)` for
    /// tokens at positions `n_past..`; the result goes to `out`, shaped the same.
    pub fn attend(&self, par: &dyn Parallel, q: &[f32], n_past: usize, out: &mut [f32]) {
        let seq = SeqQueries {
            layer: *self,
            q,
            n_past,
        };
        attend_batch(par, &[seq], &mut [out]);
    }

    /// Queries in `q` (`(token, head, head_dim)`, tokens from `n_past` on).
    fn tokens(&self, q: &[f32]) -> usize {
        q.len() / (self.n_head * self.head_dim)
    }

    /// The tasks attending `q`: for one query, each KV head's chunks (the chunks of a
    /// long context in parallel) where `split` says, else each KV head; for several,
    /// each KV head's blocks of [`QUERY_BLOCK`] queries (the queries of a block sharing
    /// each chunk while it is in cache).
    fn tasks(&self, seq: usize, q: &[f32], n_past: usize, split: bool, tasks: &mut Vec<Task>) {
        let tokens = self.tokens(q);
        for g in 0..self.n_head_kv {
            if tokens == 1 && split {
                tasks.extend(self.chunks(n_past).map(|c| Task::Chunk { seq, g, c }));
            } else if tokens == 1 {
                tasks.push(Task::Head { seq, g });
            } else {
                let blocks = tokens.div_ceil(QUERY_BLOCK);
                tasks.extend((0..blocks).map(|b| Task::Block { seq, g, b }));
            }
        }
    }

    /// The partials of KV head `g`'s query heads over chunk `c`, for the one query in
    /// `q` (at position `pos`).
    fn chunk_partials(&self, q: &[f32], pos: usize, g: usize, c: usize) -> Vec<Partial> {
        let hd = self.head_dim;
        let lo = self.first(pos);
        let (a, b) = ((c * CHUNK).max(lo), (c * CHUNK + CHUNK - 1).min(pos));
        (g * self.group..(g + 1) * self.group)
            .map(|h| self.partial(&q[h * hd..(h + 1) * hd], g, a, b))
            .collect()
    }

    /// The outputs of KV head `g`'s query heads for the one query in `q` (at position
    /// `pos`): its chunks' partials in order, merged.
    fn head_rows(&self, q: &[f32], pos: usize, g: usize) -> HeadRows {
        let mut partials: Vec<Vec<Partial>> = (0..self.group).map(|_| Vec::new()).collect();
        for c in self.chunks(pos) {
            for (j, p) in self.chunk_partials(q, pos, g, c).into_iter().enumerate() {
                partials[j].push(p);
            }
        }
        let hd = self.head_dim;
        (0..self.group)
            .map(|j| {
                let mut o = vec![0.0f32; hd];
                Self::merge(&partials[j], &mut o);
                (0, g * self.group + j, o)
            })
            .collect()
    }

    /// The outputs of KV head `g`'s query heads for block `b` of the queries in `q`
    /// (from position `n_past` on), chunk by chunk.
    fn block_rows(&self, q: &[f32], n_past: usize, g: usize, b: usize) -> HeadRows {
        let hd = self.head_dim;
        let toks = b * QUERY_BLOCK..((b + 1) * QUERY_BLOCK).min(self.tokens(q));
        let heads = g * self.group..(g + 1) * self.group;
        let last = n_past + toks.end - 1;
        let lo = self.first(n_past + toks.start);
        let mut partials: Vec<Vec<Partial>> =
            (0..toks.len() * self.group).map(|_| Vec::new()).collect();
        for c in lo / CHUNK..=last / CHUNK {
            for (i, t) in toks.clone().enumerate() {
                let pos = n_past + t;
                if !self.chunks(pos).contains(&c) {
                    continue;
                }
                let (qa, qb) = (
                    (c * CHUNK).max(self.first(pos)),
                    (c * CHUNK + CHUNK - 1).min(pos),
                );
                for (j, h) in heads.clone().enumerate() {
                    let qh = &q[(t * self.n_head + h) * hd..][..hd];
                    partials[i * self.group + j].push(self.partial(qh, g, qa, qb));
                }
            }
        }
        let mut rows = Vec::with_capacity(partials.len());
        for (i, t) in toks.enumerate() {
            for (j, h) in heads.clone().enumerate() {
                let mut o = vec![0.0f32; hd];
                Self::merge(&partials[i * self.group + j], &mut o);
                rows.push((t, h, o));
            }
        }
        rows
    }
}

/// One sequence's part of [`attend_batch`]: its queries `(token, head, head_dim)` at
/// positions `n_past..`, attended over `layer` of its own cache.
pub struct SeqQueries<'a> {
    pub layer: AttnLayer<'a>,
    pub q: &'a [f32],
    pub n_past: usize,
}

/// A task of [`attend_batch`].
#[derive(Clone, Copy)]
enum Task {
    /// Sequence `seq`'s one query: KV head `g`'s heads over chunk `c`.
    Chunk { seq: usize, g: usize, c: usize },
    /// Sequence `seq`'s one query: KV head `g`'s heads over every chunk.
    Head { seq: usize, g: usize },
    /// Sequence `seq`'s queries of block `b`: KV head `g`'s heads over every chunk.
    Block { seq: usize, g: usize, b: usize },
}

/// What a task of [`attend_batch`] gives.
enum Done {
    Partials(Vec<Partial>),
    Rows(HeadRows),
}

/// Attention for several sequences in one parallel job: `outs[i]`, shaped like
/// `seqs[i].q`, gets sequence `i`'s result. Each sequence's tasks and merges are those
/// it would have alone (a decode query's chunks in parallel when too few sequences'
/// KV heads would keep the threads busy, else in turn within one task), so its result
/// has the same bits whatever shares the job.
pub fn attend_batch(par: &dyn Parallel, seqs: &[SeqQueries<'_>], outs: &mut [&mut [f32]]) {
    assert_eq!(seqs.len(), outs.len(), "one output per sequence");
    let decode_heads: usize = seqs
        .iter()
        .filter(|s| s.layer.tokens(s.q) == 1)
        .map(|s| s.layer.n_head_kv)
        .sum();
    let split = decode_heads < 4 * par.threads();
    let mut tasks = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        s.layer.tasks(i, s.q, s.n_past, split, &mut tasks);
    }
    let slots: Vec<Mutex<Done>> = tasks
        .iter()
        .map(|_| Mutex::new(Done::Rows(Vec::new())))
        .collect();
    par.run(tasks.len(), &|task| {
        let done = match tasks[task] {
            Task::Chunk { seq, g, c } => {
                let s = &seqs[seq];
                Done::Partials(s.layer.chunk_partials(s.q, s.n_past, g, c))
            }
            Task::Head { seq, g } => {
                let s = &seqs[seq];
                Done::Rows(s.layer.head_rows(s.q, s.n_past, g))
            }
            Task::Block { seq, g, b } => {
                let s = &seqs[seq];
                Done::Rows(s.layer.block_rows(s.q, s.n_past, g, b))
            }
        };
        *slots[task].lock().expect("own slot") = done;
    });
    // Tasks run KV head by KV head, chunks in order: moving each chunk task's partials
    // to their query heads leaves every head's list in chunk order.
    let mut per_head: Vec<Vec<Vec<Partial>>> = seqs
        .iter()
        .map(|s| match s.layer.tokens(s.q) {
            1 if split => (0..s.layer.n_head).map(|_| Vec::new()).collect(),
            _ => Vec::new(),
        })
        .collect();
    for (task, slot) in tasks.iter().zip(slots) {
        match (*task, slot.into_inner().expect("own slot")) {
            (Task::Chunk { seq, g, .. }, Done::Partials(partials)) => {
                let group = seqs[seq].layer.group;
                for (j, p) in partials.into_iter().enumerate() {
                    per_head[seq][g * group + j].push(p);
                }
            }
            (Task::Head { seq, .. } | Task::Block { seq, .. }, Done::Rows(rows)) => {
                let l = &seqs[seq].layer;
                for (t, h, o) in rows {
                    outs[seq][(t * l.n_head + h) * l.head_dim..][..l.head_dim].copy_from_slice(&o);
                }
            }
            _ => unreachable!("each task fills its own kind of slot"),
        }
    }
    for (seq, heads) in per_head.iter().enumerate() {
        let hd = seqs[seq].layer.head_dim;
        for (h, partials) in heads.iter().enumerate() {
            AttnLayer::merge(partials, &mut outs[seq][h * hd..(h + 1) * hd]);
        }
    }
}

impl AttnLayer<'_> {
    /// Attention as llama.cpp's CPU backend computes it ([`crate::ggml_ops`]), for a
    /// batch of `q` (`(token, head, head_dim)`, tokens at positions `n_past..`) in one
    /// of llama.cpp's micro-batches: ggml's path for that batch and cache, the cache
    /// seen as llama.cpp sizes its view of it (`n_kv`: the cells in use rounded up to
    /// 256, at least 256, at most the cache), `threads` as llama.cpp's thread count.
    /// Needs an f16 cache, as llama.cpp's default. `isa` (available here) picks the
    /// instructions, not the bits.
    pub fn attend_ggml(
        &self,
        par: &dyn Parallel,
        q: &[f32],
        n_past: usize,
        out: &mut [f32],
        threads: usize,
        isa: astra_quant::Isa,
    ) {
        use crate::ggml_ops::{attend_row, FlashShape, KvHead};
        let (KvRows::F16(k), KvRows::F16(v)) = (&self.cache.k, &self.cache.v) else {
            unreachable!("llama.cpp's arithmetic runs over an f16 cache (checked at load)")
        };
        let (hd, slots) = (self.head_dim, self.cache.slots);
        let tokens = q.len() / (self.n_head * hd);
        // A sliding-window layer's cells as llama.cpp placed them; a global layer's
        // cell is its position.
        let swa = self.swa.filter(|_| self.cache.window.is_some());
        let n_kv = match swa {
            Some(swa) => swa.n_kv(),
            None => (n_past + tokens).next_multiple_of(256).max(256).min(slots),
        };
        let heads: Vec<KvHead> = (0..self.n_head_kv)
            .map(|g| {
                let span = g * slots * hd..(g + 1) * slots * hd;
                KvHead {
                    k: &k[span.clone()],
                    v: &v[span],
                    slots,
                    dim: hd,
                    cells: swa.map(SwaCells::cells),
                }
            })
            .collect();
        let rows = tokens * self.n_head;
        let results: Vec<Mutex<Vec<f32>>> = (0..rows).map(|_| Mutex::new(Vec::new())).collect();
        par.run(rows, &|row| {
            let (t, h) = (row / self.n_head, row % self.n_head);
            let pos = n_past + t;
            let (qh, kv) = (&q[row * hd..(row + 1) * hd], &heads[h / self.group]);
            let valid = self.first(pos)..pos + 1;
            let mut o = vec![0.0f32; hd];
            attend_row(
                qh,
                kv,
                &valid,
                self.scale,
                FlashShape {
                    tokens,
                    n_kv,
                    threads,
                },
                isa,
                &mut o,
            );
            *results[row].lock().expect("own slot") = o;
        });
        for (o, r) in out.chunks_exact_mut(hd).zip(results) {
            o.copy_from_slice(&r.into_inner().expect("own slot"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_parity::Rng;
    use crate::config::Arch;
    use crate::pool::Pool;

    fn config(window: usize) -> Config {
        Config {
            arch: Arch::Gemma3,
            n_layer: 2,
            n_embd: 128,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 32,
            n_ff: 256,
            n_vocab: 16,
            ctx_train: 4096,
            rms_eps: 1e-6,
            rope_base: 1e6,
            rope_dim: 32,
            embed_scale: None,
            sliding_window: Some(window),
            layer_local: vec![true, false],
            attn_scale: 1.0,
            moe: None,
        }
    }

    /// Causal attention in f64 over positions `first..=pos` of f16-rounded keys and values.
    fn reference(
        q: &[f32],
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
        first: usize,
        pos: usize,
        cfg: &Config,
        scale: f32,
    ) -> Vec<f64> {
        let (hd, group) = (cfg.head_dim, cfg.n_head / cfg.n_head_kv);
        let r = |x: f32| f16::from_f32(x).to_f64();
        let mut out = vec![0.0f64; cfg.n_head * hd];
        for h in 0..cfg.n_head {
            let g = h / group;
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (first..=pos)
                .map(|p| {
                    (0..hd)
                        .map(|i| qh[i] as f64 * r(keys[p][g * hd + i]))
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            for (p, s) in (first..=pos).zip(&scores) {
                let w = (s - max).exp() / sum;
                for i in 0..hd {
                    out[h * hd + i] += w * r(values[p][g * hd + i]);
                }
            }
        }
        out
    }

    /// A sliding-window layer (whose ring of slots wraps several times) and a global
    /// layer, fed in batches of varied sizes: every query's output matches the f64
    /// reference over exactly its window, and a query decoded alone gets the same bits
    /// as in a batch.
    #[test]
    fn windowed_and_global_attention_match_f64_reference() {
        let window = 100;
        let cfg = config(window);
        let (ctx, max_batch) = (700, 64);
        let mut kv = KvCache::new(&KvLayout::new(&cfg, ctx, max_batch));
        assert!(
            kv.layers[0].slots < ctx,
            "the local layer keeps a ring, not the context"
        );
        assert_eq!(kv.layers[1].slots, ctx);
        let pool = Pool::new(2);
        let mut rng = Rng(7);
        let scale = 0.3;
        let (qd, kd) = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let mut pos = 0;
        for &n in [1usize, 37, 64, 5, 64, 64, 1, 63, 64, 64, 64, 64, 64, 50]
            .iter()
            .cycle()
        {
            if pos + n > ctx {
                break;
            }
            let q = rng.vec(n * qd);
            let (k, v) = (rng.vec(n * kd), rng.vec(n * kd));
            for i in 0..n {
                keys.push(k[i * kd..(i + 1) * kd].to_vec());
                values.push(v[i * kd..(i + 1) * kd].to_vec());
            }
            for layer in 0..2 {
                for i in 0..n {
                    kv.store(
                        layer,
                        pos + i,
                        &k[i * kd..(i + 1) * kd],
                        &v[i * kd..(i + 1) * kd],
                    );
                }
                let mut out = vec![0.0f32; n * qd];
                kv.layer(layer, scale).attend(&pool, &q, pos, &mut out);
                for i in 0..n {
                    let p = pos + i;
                    let first = if layer == 0 {
                        (p + 1).saturating_sub(window)
                    } else {
                        0
                    };
                    let want = reference(
                        &q[i * qd..(i + 1) * qd],
                        &keys,
                        &values,
                        first,
                        p,
                        &cfg,
                        scale,
                    );
                    let got = &out[i * qd..(i + 1) * qd];
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(&a, &b)| (a as f64 - b).abs())
                        .fold(0.0, f64::max);
                    assert!(err < 1e-5, "layer {layer} position {p}: max error {err}");
                    if i == n - 1 {
                        // The last query alone (its keys are already stored).
                        let mut alone = vec![0.0f32; qd];
                        kv.layer(layer, scale)
                            .attend(&pool, &q[i * qd..], p, &mut alone);
                        assert!(
                            alone
                                .iter()
                                .zip(got)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "layer {layer} position {p}: alone vs batch"
                        );
                    }
                }
            }
            pos += n;
        }
        assert!(pos > 6 * window);
    }

    /// Several sequences in one call (decode queries and prompt blocks, short and long
    /// contexts, a sliding-window layer and a global one) each get the bits they get
    /// alone, with a decode query's chunks split across tasks (few sequences) or not
    /// (many).
    #[test]
    fn a_batch_of_sequences_gets_each_ones_bits_alone() {
        let cfg = config(100);
        let layout = KvLayout::new(&cfg, 700, 64);
        let pool = Pool::new(2);
        let mut rng = Rng(11);
        let (qd, kd) = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim);
        // (positions held, queries)
        let shapes = [
            (0, 1),
            (650, 1),
            (70, 20),
            (300, 1),
            (129, 3),
            (5, 1),
            (64, 1),
        ];
        let mut caches = Vec::new();
        let mut queries = Vec::new();
        for &(held, n) in &shapes {
            let mut kv = KvCache::new(&layout);
            for layer in 0..2 {
                for p in 0..held + n {
                    kv.store(layer, p, &rng.vec(kd), &rng.vec(kd));
                }
            }
            caches.push(kv);
            queries.push(rng.vec(n * qd));
        }
        for layer in 0..2 {
            let alone: Vec<Vec<f32>> = caches
                .iter()
                .zip(&queries)
                .zip(&shapes)
                .map(|((kv, q), &(held, _))| {
                    let mut out = vec![0.0f32; q.len()];
                    kv.layer(layer, 0.3).attend(&pool, q, held, &mut out);
                    out
                })
                .collect();
            for count in [2, shapes.len()] {
                let seqs: Vec<SeqQueries<'_>> = (0..count)
                    .map(|i| SeqQueries {
                        layer: caches[i].layer(layer, 0.3),
                        q: &queries[i],
                        n_past: shapes[i].0,
                    })
                    .collect();
                let mut outs: Vec<Vec<f32>> = queries[..count]
                    .iter()
                    .map(|q| vec![0.0; q.len()])
                    .collect();
                let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                attend_batch(&pool, &seqs, &mut views);
                for (i, out) in outs.iter().enumerate() {
                    assert!(
                        out.iter()
                            .zip(&alone[i])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "layer {layer}, {count} sequences: sequence {i} differs from alone"
                    );
                }
            }
        }
    }
}
