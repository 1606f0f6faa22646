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
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use astra_quant::matmul::Parallel;

use crate::config::Config;
use crate::ggml_ops::SwaCells;
use crate::model::MAX_BATCH;
use crate::ops::{attend_rows, axpy, expf, KvElem};
use crate::EngineError;

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

/// How a CPU backend's caches hold their positions. `ASTRA_ATTN` picks it (`1`
/// contiguous, `2` paged): attention reads a chunk's keys and values from either
/// through the same kernels, so the two give the same bits, and the contiguous layout
/// stays as the baseline the paged one is compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvStorage {
    /// Each layer's keys and values in one buffer `(kv_head, slot, head_dim)`, made
    /// whole for the context when the cache is (a ring for a sliding-window layer).
    /// No sharing, no page limit.
    Contiguous,
    /// Pages of [`CHUNK`] positions, made as positions are written and shared between
    /// sequences holding the same prefix.
    #[default]
    Paged,
}

impl KvStorage {
    pub fn name(self) -> &'static str {
        match self {
            KvStorage::Contiguous => "contiguous",
            KvStorage::Paged => "paged",
        }
    }

    /// `ASTRA_ATTN` where set (an unknown value is reported once and ignored), else
    /// paged. Decided once.
    pub fn selected() -> KvStorage {
        static SELECTED: std::sync::OnceLock<KvStorage> = std::sync::OnceLock::new();
        *SELECTED.get_or_init(|| match std::env::var("ASTRA_ATTN").as_deref() {
            Ok("1") => KvStorage::Contiguous,
            Ok("2") | Err(_) => KvStorage::Paged,
            Ok(other) => {
                eprintln!(
                    "warning: ASTRA_ATTN={other} is not 1 (contiguous) or 2 (paged); using paged"
                );
                KvStorage::Paged
            }
        })
    }
}

/// Keys (or values) of a page, `(layer of its group, kv_head, position in the chunk,
/// head_dim)`, or of a contiguous cache's layer, `(kv_head, slot, head_dim)`, in the
/// cache's type.
#[derive(Clone)]
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

/// Layers whose pages are kept for the whole context, and sliding-window layers, whose
/// pages are released once they leave the window: each group has pages of its own.
const GLOBAL: usize = 0;
const LOCAL: usize = 1;

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
/// attended to; a ring of whole chunks never splits a chunk across its end). A paged
/// cache holds the same positions in pages of [`CHUNK`].
#[derive(Clone, Debug)]
pub struct KvLayout {
    pub layers: Vec<LayerSlots>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub elem: KvType,
    /// Positions a sequence may hold.
    pub ctx: usize,
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
            ctx,
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

    /// Bytes the whole cache (keys and values) can take: its slots, or, paged, the
    /// pages that hold them (a sliding window's ring and the page its oldest position
    /// shares with the one before).
    pub fn bytes(&self) -> usize {
        let row = self.n_head_kv * self.head_dim * self.elem.bytes();
        self.layers
            .iter()
            .map(|l| {
                let whole = l.slots.next_multiple_of(CHUNK);
                2 * row
                    * if l.window.is_some() {
                        whole + CHUNK
                    } else {
                        whole
                    }
            })
            .sum()
    }

    /// How far below the highest position written a sequence may be cut back and
    /// continued: a ring keeps the positions a query needs only while fewer than
    /// `slots - window` later positions have overwritten them (a ring as long as the
    /// context is never overwritten).
    pub fn rewind_limit(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| l.slots < self.ctx)
            .filter_map(|l| l.window.map(|w| l.slots.saturating_sub(w)))
            .min()
            .unwrap_or(usize::MAX)
    }

    /// The group of each layer (global or sliding-window) and its index in the group.
    fn groups(&self) -> (Vec<(usize, usize)>, [usize; 2]) {
        let mut count = [0usize; 2];
        let places = self
            .layers
            .iter()
            .map(|l| {
                let group = if l.window.is_some() { LOCAL } else { GLOBAL };
                count[group] += 1;
                (group, count[group] - 1)
            })
            .collect();
        (places, count)
    }
}

/// The pages of one backend's sequences: how large a page of each group is, how many
/// exist, and how many bytes they may take. Pages are made as sequences write new
/// positions, shared between sequences that hold the same prefix, and freed when the
/// last sequence holding them lets them go.
pub struct KvPages {
    elem: KvType,
    /// Elements of a page's keys (or values) in each group: layers × kv heads ×
    /// [`CHUNK`] × head_dim.
    page_elems: [usize; 2],
    live: [AtomicUsize; 2],
    /// Bytes the pages may take ([`KvPages::reserve`] refuses more).
    limit: AtomicUsize,
}

impl KvPages {
    /// Pages for caches of `layout` (its slot counts aside: a page holds [`CHUNK`]
    /// positions of every layer of its group), with no limit.
    pub fn new(layout: &KvLayout) -> Arc<KvPages> {
        let (_, count) = layout.groups();
        let per_layer = layout.n_head_kv * CHUNK * layout.head_dim;
        Arc::new(KvPages {
            elem: layout.elem,
            page_elems: count.map(|n| n * per_layer),
            live: [AtomicUsize::new(0), AtomicUsize::new(0)],
            limit: AtomicUsize::new(usize::MAX),
        })
    }

    /// Whether caches of `layout` fit these pages.
    pub fn fits(&self, layout: &KvLayout) -> bool {
        let (_, count) = layout.groups();
        let per_layer = layout.n_head_kv * CHUNK * layout.head_dim;
        self.elem == layout.elem && self.page_elems == count.map(|n| n * per_layer)
    }

    fn page_bytes(&self, group: usize) -> usize {
        2 * self.page_elems[group] * self.elem.bytes()
    }

    /// Pages in existence.
    pub fn pages(&self) -> usize {
        self.live.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }

    /// Bytes of the pages in existence.
    pub fn bytes(&self) -> usize {
        (0..2)
            .map(|g| self.live[g].load(Ordering::Relaxed) * self.page_bytes(g))
            .sum()
    }

    /// Bytes the pages may take from now on (existing pages are not taken back).
    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    fn page(self: &Arc<Self>, group: usize) -> Page {
        self.live[group].fetch_add(1, Ordering::Relaxed);
        Page {
            k: KvRows::new(self.elem, self.page_elems[group]),
            v: KvRows::new(self.elem, self.page_elems[group]),
            group,
            pages: Arc::clone(self),
        }
    }
}

/// [`CHUNK`] positions of every layer of a group: keys and values `(layer of the group,
/// kv_head, position in the chunk, head_dim)`. Shared by reference count; a sequence
/// writing to a page another holds writes to its own copy.
struct Page {
    k: KvRows,
    v: KvRows,
    group: usize,
    pages: Arc<KvPages>,
}

impl Clone for Page {
    fn clone(&self) -> Page {
        self.pages.live[self.group].fetch_add(1, Ordering::Relaxed);
        Page {
            k: self.k.clone(),
            v: self.v.clone(),
            group: self.group,
            pages: Arc::clone(&self.pages),
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.pages.live[self.group].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a cache's positions are.
#[derive(Clone)]
enum Held {
    /// For each group, the page of each chunk of positions (`None`: not written yet,
    /// or released after leaving a sliding window), from `pages`.
    Pages {
        pages: Arc<KvPages>,
        tables: [Vec<Option<Arc<Page>>>; 2],
    },
    /// For each layer, its keys and values `(kv_head, slot, head_dim)`.
    Slots(Vec<(KvRows, KvRows)>),
}

/// A layer's place in a cache.
#[derive(Clone, Copy)]
struct LayerPlace {
    group: usize,
    /// The layer's index among its group's.
    index: usize,
    slots: usize,
    window: Option<usize>,
}

/// One sequence's keys and values.
pub struct KvCache {
    layers: Vec<LayerPlace>,
    held: Held,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    /// Where llama.cpp's cache would hold each position of the sliding-window layers
    /// (for llama.cpp's arithmetic, whose attention visits them in that order).
    swa: Option<SwaCells>,
}

impl KvCache {
    /// A cache of `layout` over pages of its own.
    pub fn new(layout: &KvLayout) -> KvCache {
        KvCache::paged(layout, &KvPages::new(layout))
    }

    /// A cache of `layout` over `pages` (which [`KvPages::fits`] the layout).
    pub fn paged(layout: &KvLayout, pages: &Arc<KvPages>) -> KvCache {
        KvCache::holding(
            layout,
            Held::Pages {
                pages: Arc::clone(pages),
                tables: [Vec::new(), Vec::new()],
            },
        )
    }

    /// A cache of `layout` in one buffer per layer, made whole now
    /// ([`KvStorage::Contiguous`]).
    pub fn contiguous(layout: &KvLayout) -> KvCache {
        let slots = (0..layout.layers.len())
            .map(|l| {
                let n = layout.layer_elems(l);
                (KvRows::new(layout.elem, n), KvRows::new(layout.elem, n))
            })
            .collect();
        KvCache::holding(layout, Held::Slots(slots))
    }

    fn holding(layout: &KvLayout, held: Held) -> KvCache {
        let (places, _) = layout.groups();
        let layers = layout
            .layers
            .iter()
            .zip(places)
            .map(|(l, (group, index))| LayerPlace {
                group,
                index,
                slots: l.slots,
                window: l.window,
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
            held,
            swa,
            n_head: layout.n_head,
            n_head_kv: layout.n_head_kv,
            head_dim: layout.head_dim,
        }
    }

    /// The chunks a sliding-window layer no longer needs once positions up to `end`
    /// are written: those wholly before its last `slots` positions (the ring it would
    /// keep, which [`KvLayout::rewind_limit`] assumes).
    fn local_keep_from(&self, end: usize) -> usize {
        self.layers
            .iter()
            .filter(|l| l.group == LOCAL)
            .map(|l| end.saturating_sub(l.slots) / CHUNK)
            .min()
            .unwrap_or(0)
    }

    /// Makes room for positions `positions` to be written: every page they fall in made
    /// and held by this sequence alone (a shared page copied), and a sliding window's
    /// pages that fall out of it released. Fails, changing nothing, where the pages
    /// would take more than the limit. A contiguous cache has its room already.
    pub fn reserve(&mut self, positions: Range<usize>) -> Result<(), EngineError> {
        if positions.is_empty() {
            return Ok(());
        }
        let chunks = positions.start / CHUNK..positions.end.div_ceil(CHUNK);
        let keep_from = self.local_keep_from(positions.end);
        let Held::Pages { pages, tables } = &mut self.held else {
            return Ok(());
        };
        let pages = &*pages;
        let mut new_bytes = 0;
        for group in [GLOBAL, LOCAL] {
            if pages.page_elems[group] == 0 {
                continue;
            }
            let table = &tables[group];
            let owned = |c: usize| {
                table
                    .get(c)
                    .and_then(|p| p.as_ref())
                    .is_some_and(|p| Arc::strong_count(p) == 1)
            };
            let first = if group == LOCAL {
                chunks.start.max(keep_from)
            } else {
                chunks.start
            };
            new_bytes +=
                (first..chunks.end).filter(|&c| !owned(c)).count() * pages.page_bytes(group);
        }
        let (now, limit) = (pages.bytes(), pages.limit());
        if new_bytes > 0 && now + new_bytes > limit {
            return Err(EngineError::KvFull {
                needed: now + new_bytes,
                limit,
            });
        }
        for group in [GLOBAL, LOCAL] {
            if pages.page_elems[group] == 0 {
                continue;
            }
            let table = &mut tables[group];
            // Positions past these are no longer held (a rewind left them behind).
            table.resize(chunks.end, None);
            if group == LOCAL {
                table[..keep_from.min(chunks.end)].fill(None);
            }
            for slot in &mut table[chunks.clone()] {
                match slot {
                    Some(p) => {
                        Arc::make_mut(p);
                    }
                    None => *slot = Some(Arc::new(pages.page(group))),
                }
            }
        }
        Ok(())
    }

    /// A cache holding this one's first `n` positions, sharing its pages (the last,
    /// partly filled one too, until one of them writes to it); a contiguous cache is
    /// copied whole.
    pub fn fork(&self, n: usize) -> KvCache {
        let chunks = n.div_ceil(CHUNK);
        let held = match &self.held {
            Held::Pages { pages, tables } => Held::Pages {
                pages: Arc::clone(pages),
                tables: [GLOBAL, LOCAL].map(|g| {
                    let t = &tables[g];
                    t[..chunks.min(t.len())].to_vec()
                }),
            },
            Held::Slots(slots) => Held::Slots(slots.clone()),
        };
        KvCache {
            layers: self.layers.clone(),
            held,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            swa: self.swa.clone(),
        }
    }

    /// Pages this cache holds (a shared page counted by each holder), and which: the
    /// pages' addresses, for counting pages shared between caches.
    pub fn pages_held(&self) -> impl Iterator<Item = usize> + '_ {
        let tables: &[Vec<Option<Arc<Page>>>] = match &self.held {
            Held::Pages { tables, .. } => tables,
            Held::Slots(_) => &[],
        };
        tables
            .iter()
            .flatten()
            .flatten()
            .map(|p| Arc::as_ptr(p) as usize)
    }

    /// The pages this cache's pages come from (none for a contiguous cache).
    pub fn pages(&self) -> Option<&Arc<KvPages>> {
        match &self.held {
            Held::Pages { pages, .. } => Some(pages),
            Held::Slots(_) => None,
        }
    }

    /// Notes that a micro-batch at `positions` is being stored (every layer's store
    /// says so; the first places it in [`SwaCells`]).
    pub fn place(&mut self, positions: std::ops::Range<usize>) {
        if let Some(swa) = &mut self.swa {
            swa.place(positions);
        }
    }

    /// Stores the key and value rows (all KV heads) of position `pos` in `layer`,
    /// making its page where [`KvCache::reserve`] did not.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (l, hd) = (self.layers[layer], self.head_dim);
        let (pages, tables) = match &mut self.held {
            Held::Pages { pages, tables } => (&*pages, tables),
            Held::Slots(slots) => {
                let (keys, values) = &mut slots[layer];
                for g in 0..self.n_head_kv {
                    let at = (g * l.slots + pos % l.slots) * hd;
                    keys.store(at, &k[g * hd..(g + 1) * hd]);
                    values.store(at, &v[g * hd..(g + 1) * hd]);
                }
                return;
            }
        };
        let table = &mut tables[l.group];
        let c = pos / CHUNK;
        if table.len() <= c {
            table.resize(c + 1, None);
        }
        let page = Arc::make_mut(table[c].get_or_insert_with(|| Arc::new(pages.page(l.group))));
        for g in 0..self.n_head_kv {
            let at = ((l.index * self.n_head_kv + g) * CHUNK + pos % CHUNK) * hd;
            page.k.store(at, &k[g * hd..(g + 1) * hd]);
            page.v.store(at, &v[g * hd..(g + 1) * hd]);
        }
    }

    /// Layer `layer` for attention with scores scaled by `scale`.
    pub fn layer(&self, layer: usize, scale: f32) -> AttnLayer<'_> {
        let l = self.layers[layer];
        AttnLayer {
            held: match &self.held {
                Held::Pages { tables, .. } => LayerRows::Pages {
                    table: &tables[l.group],
                    index: l.index,
                },
                Held::Slots(slots) => LayerRows::Slots {
                    k: &slots[layer].0,
                    v: &slots[layer].1,
                },
            },
            slots: l.slots,
            window: l.window,
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

/// Where an [`AttnLayer`]'s keys and values are.
#[derive(Clone, Copy)]
enum LayerRows<'a> {
    Pages {
        /// The pages of the layer's group, by chunk.
        table: &'a [Option<Arc<Page>>],
        /// The layer's index in its pages.
        index: usize,
    },
    /// The layer's keys and values, `(kv_head, slot, head_dim)`.
    Slots { k: &'a KvRows, v: &'a KvRows },
}

#[derive(Clone, Copy)]
pub struct AttnLayer<'a> {
    held: LayerRows<'a>,
    slots: usize,
    /// Positions attended back (the sliding window), or unlimited.
    window: Option<usize>,
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
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Chunk indices a query at `pos` visits.
    fn chunks(&self, pos: usize) -> std::ops::RangeInclusive<usize> {
        self.first(pos) / CHUNK..=pos / CHUNK
    }

    /// KV head `g`'s keys and values of chunk `c`, `(position in the chunk,
    /// head_dim)`: the rows that hold them and the range of elements the chunk's
    /// positions take (`None` where a paged cache holds no page for it).
    fn chunk(&self, g: usize, c: usize) -> Option<(&KvRows, &KvRows, Range<usize>)> {
        let hd = self.head_dim;
        match self.held {
            LayerRows::Pages { table, index } => {
                let page = table.get(c)?.as_ref()?;
                let at = (index * self.n_head_kv + g) * CHUNK * hd;
                Some((&page.k, &page.v, at..at + CHUNK * hd))
            }
            LayerRows::Slots { k, v } => {
                // A ring of whole chunks, or slots for every position: a chunk's
                // positions are consecutive slots either way.
                let slot = (c * CHUNK) % self.slots;
                let at = (g * self.slots + slot) * hd;
                Some((k, v, at..at + CHUNK.min(self.slots - slot) * hd))
            }
        }
    }

    /// The key and value rows (every KV head) stored at `pos`, as f32.
    #[cfg(test)]
    fn row(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let hd = self.head_dim;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for g in 0..self.n_head_kv {
            let (kr, vr, span) = self.chunk(g, pos / CHUNK).expect("a stored position");
            let at = span.start + (pos % CHUNK) * hd;
            for (rows, out) in [(kr, &mut k), (vr, &mut v)] {
                match rows {
                    KvRows::F16(x) => out.extend(x[at..at + hd].iter().map(|e| e.to_f32())),
                    KvRows::F32(x) => out.extend_from_slice(&x[at..at + hd]),
                }
            }
        }
        (k, v)
    }

    /// The partial of query `q` over positions `lo..=hi` (within one chunk) of KV head
    /// `g`, read from the cache as stored (a chunk's positions are contiguous in its
    /// page).
    fn partial(&self, q: &[f32], g: usize, lo: usize, hi: usize) -> Partial {
        let hd = self.head_dim;
        let (k, v, span) = self
            .chunk(g, lo / CHUNK)
            .expect("attended positions are stored");
        let rows = span.start + (lo % CHUNK) * hd..span.start + (hi % CHUNK + 1) * hd;
        let mut weights = [0.0f32; CHUNK];
        let mut acc = vec![0.0f32; hd];
        let w = &mut weights[..hi + 1 - lo];
        let (max, sum) = match (k, v) {
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
            let w = expf(p.max - max);
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
        let (hd, slots) = (self.head_dim, self.slots);
        let tokens = q.len() / (self.n_head * hd);
        // A sliding-window layer's cells as llama.cpp placed them; a global layer's
        // cell is its position.
        let swa = self.swa.filter(|_| self.window.is_some());
        let n_kv = match swa {
            Some(swa) => swa.n_kv(),
            None => (n_past + tokens).next_multiple_of(256).max(256).min(slots),
        };
        let heads: Vec<KvHead> = (0..self.n_head_kv)
            .map(|g| {
                let chunks = (0..(n_past + tokens).div_ceil(CHUNK))
                    .map(|c| match self.chunk(g, c) {
                        Some((KvRows::F16(k), KvRows::F16(v), span)) => {
                            (&k[span.clone()], &v[span])
                        }
                        Some(_) => unreachable!(
                            "llama.cpp's arithmetic runs over an f16 cache (checked at load)"
                        ),
                        None => (&[][..], &[][..]),
                    })
                    .collect();
                KvHead {
                    chunks,
                    chunk: CHUNK,
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

    /// A sliding-window layer (whose ring of slots wraps several times) and a global
    /// layer, fed in batches of varied sizes: every query's output matches the f64
    /// reference over exactly its window, and a query decoded alone gets the same bits
    /// as in a batch.
    #[test]
    fn windowed_and_global_attention_match_f64_reference() {
        let window = 100;
        let cfg = config(window);
        let (ctx, max_batch) = (700, 64);
        let layout = KvLayout::new(&cfg, ctx, max_batch);
        let ring = layout.layers[0].slots;
        assert!(ring < ctx, "the local layer keeps a ring, not the context");
        let mut kv = KvCache::new(&layout);
        let pool = Pool::new(2);
        let mut rng = Rng(7);
        let scale = 0.3;
        let (qd, kd) = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim);
        // Keys and values `(position, kv_head, head_dim)` as the f16 cache holds them.
        let mut held = (Vec::new(), Vec::new());
        let f16_rounded = |x: &[f32]| {
            x.iter()
                .map(|&e| f16::from_f32(e).to_f64())
                .collect::<Vec<_>>()
        };
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
            held.0.extend(f16_rounded(&k));
            held.1.extend(f16_rounded(&v));
            kv.reserve(pos..pos + n).unwrap();
            // The local layer holds the pages of its ring's positions, no more.
            let Held::Pages { tables, .. } = &kv.held else {
                unreachable!("a new cache is paged")
            };
            let local = tables[LOCAL].iter().flatten().count();
            assert!(local <= ring / CHUNK + 1, "{local} local pages at {pos}");
            assert_eq!(tables[GLOBAL].len(), (pos + n).div_ceil(CHUNK));
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
                    let want = crate::attention_parity::reference(
                        &cfg,
                        &q[i * qd..(i + 1) * qd],
                        &held,
                        first..p + 1,
                        scale,
                    );
                    let got = &out[i * qd..(i + 1) * qd];
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(&a, &b)| (a as f64 - b as f64).abs())
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

    /// A fork shares its source's pages, writes to copies of its own, and sees the
    /// source's positions as the source saw them; the limit refuses new pages and
    /// changes nothing when it does.
    #[test]
    fn forks_share_pages_until_they_write() {
        let cfg = config(100);
        let layout = KvLayout::new(&cfg, 700, 64);
        let pool = Pool::new(2);
        let mut rng = Rng(5);
        let (qd, kd) = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim);
        let mut a = KvCache::new(&layout);
        let pages = Arc::clone(a.pages().expect("a new cache is paged"));
        let held = 150;
        a.reserve(0..held).unwrap();
        for layer in 0..2 {
            for p in 0..held {
                a.store(layer, p, &rng.vec(kd), &rng.vec(kd));
            }
        }
        // Three global pages and three local ones (the window keeps all 150).
        assert_eq!(pages.pages(), 6);
        let q = rng.vec(qd);
        let attend = |kv: &KvCache, layer: usize, n_past: usize| {
            let mut out = vec![0.0f32; qd];
            kv.layer(layer, 0.3).attend(&pool, &q, n_past, &mut out);
            out
        };
        let (k, v) = (rng.vec(kd), rng.vec(kd));
        let mut b = a.fork(100);
        assert_eq!(pages.pages(), 6, "a fork makes no page");
        // b continues from 100 with its own position 100; a keeps its own.
        b.reserve(100..101).unwrap();
        for layer in 0..2 {
            b.store(layer, 100, &k, &v);
        }
        assert_eq!(
            pages.pages(),
            8,
            "b copied the page it wrote to, in each group"
        );
        let mut c = KvCache::new(&layout);
        c.reserve(0..101).unwrap();
        for layer in 0..2 {
            for p in 0..100 {
                let (ka, va) = a.layer(layer, 1.0).row(p);
                c.store(layer, p, &ka, &va);
            }
            c.store(layer, 100, &k, &v);
        }
        for layer in 0..2 {
            let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(attend(&b, layer, 100)), bits(attend(&c, layer, 100)));
            assert_ne!(bits(attend(&a, layer, 100)), bits(attend(&b, layer, 100)));
        }
        drop(c);
        drop(b);
        assert_eq!(pages.pages(), 6);
        // Room for one more page only: a's next chunk needs two (one a group).
        pages.set_limit(pages.bytes() + pages.page_bytes(GLOBAL));
        let err = a.reserve(held..200).unwrap_err();
        assert!(matches!(err, EngineError::KvFull { .. }), "{err}");
        assert_eq!(pages.pages(), 6);
        pages.set_limit(usize::MAX);
        a.reserve(held..200).unwrap();
        assert_eq!(pages.pages(), 8);
        // Cut back to 10 and continued: the pages past the first chunk are let go of.
        a.reserve(10..20).unwrap();
        assert_eq!(pages.pages(), 2);
        drop(a);
        assert_eq!(pages.pages(), 0);
    }
}
