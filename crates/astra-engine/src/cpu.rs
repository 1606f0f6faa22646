//! The CPU backend: tensors in host memory, weights read in place from the memory-mapped
//! file by the SIMD quantized kernels, work spread over the engine's thread pool. Whose
//! rounding it follows ([`Arithmetic`]) is a table of row operations chosen once.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use astra_gguf::{GgmlType, GgufFile};
use astra_quant::matmul::{matmul_many_on, MatmulJob, Parallel, QuantMatrix, QuantizedActivations};
use astra_quant::{Isa, Kernels};

use crate::attention::{attend_batch, KvCache, KvLayout, KvPages, KvStorage, KvType, SeqQueries};
use crate::backend::{Activation, Attend, Backend, KvUsage, Rope, SeqRows};
use crate::ggml_ops;
use crate::ops::add_inplace;
use crate::pool::Pool;
use crate::weights::MatRef;
use crate::EngineError;

pub struct CpuBackend {
    pool: Pool,
    kv: KvType,
    /// The instruction set of the matrix kernels.
    isa: Isa,
    arithmetic: Arithmetic,
    /// How its KV caches hold positions.
    storage: KvStorage,
    /// The pages of this backend's KV caches, one set per page shape.
    kv_pages: Mutex<Vec<Arc<KvPages>>>,
    /// Bytes the pages of each shape may take.
    kv_limit: AtomicUsize,
}

/// Whose rounding the CPU backend follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Arithmetic {
    /// astra's own: the same bits whatever the batch, the cache state and the thread
    /// count (SPEC's determinism), from the fastest kernels of the machine.
    #[default]
    Astra,
    /// llama.cpp's CPU backend on AVX2 machines, bit for bit ([`crate::ggml_ops`],
    /// `astra_quant::dot::ggml_x86`), on any machine: its logits for its batches and
    /// thread count, which, as llama.cpp's own, depend on both. For Q4_1, Q5_0,
    /// Q8_0, Q4_K and Q6_K matrices and an f16 KV cache; one row at a time, so slower.
    Ggml,
}

/// The operations whose rounding an [`Arithmetic`] decides, one table per arithmetic:
/// the backend reads its table and never asks which arithmetic it follows.
struct RowOps {
    name: &'static str,
    /// The matrix kernels for a weight type on an instruction set.
    kernels: fn(GgmlType, Isa) -> Result<Kernels, EngineError>,
    rms_norm: fn(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]),
    rms_norm_inplace: fn(x: &mut [f32], w: &[f32], eps: f32),
    /// RoPE on every head of one token's row.
    rope: fn(row: &mut [f32], head_dim: usize, pos: usize, dims: usize, base: f32, neox: bool),
    /// `gate = act(gate) · up` over rows of `width`.
    glu: fn(gate: &mut [f32], up: &[f32], width: usize, act: Activation),
    /// Each sequence's queries over a layer of its own cache, into its output.
    attend: fn(&CpuBackend, &[SeqQueries<'_>], &mut [&mut [f32]]),
}

/// astra's arithmetic ([`crate::ops`], [`attend_batch`]).
static ASTRA: RowOps = RowOps {
    name: "astra",
    kernels: |ty, isa| Kernels::new(ty, isa).map_err(|e| EngineError::Invalid(e.to_string())),
    rms_norm: crate::ops::rms_norm,
    rms_norm_inplace: crate::ops::rms_norm_inplace,
    rope: crate::ops::rope,
    glu: |gate, up, _, act| crate::ops::glu(gate, up, act == Activation::GeluTanh),
    attend: |be, seqs, outs| attend_batch(&be.pool, seqs, outs),
};

/// llama.cpp's arithmetic ([`crate::ggml_ops`], [`crate::attention::AttnLayer::attend_ggml`]).
static GGML: RowOps = RowOps {
    name: "ggml",
    kernels: |ty, isa| {
        Kernels::ggml(ty, isa).map_err(|_| {
            EngineError::Invalid(format!(
                "llama.cpp's arithmetic is here for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K \
                 matrices, not {ty:?}"
            ))
        })
    },
    rms_norm: ggml_ops::rms_norm,
    rms_norm_inplace: ggml_ops::rms_norm_inplace,
    rope: ggml_ops::rope,
    // ggml gates a row at a time: its vector loops restart at each row.
    glu: |gate, up, width, act| {
        let f = match act {
            Activation::Silu => ggml_ops::swiglu,
            Activation::GeluTanh => ggml_ops::geglu,
        };
        for (g, u) in gate.chunks_exact_mut(width).zip(up.chunks_exact(width)) {
            f(g, u)
        }
    },
    // ggml attends one sequence's micro-batch at a time.
    attend: |be, seqs, outs| {
        for (s, out) in seqs.iter().zip(outs) {
            s.layer
                .attend_ggml(&be.pool, s.q, s.n_past, out, be.threads(), be.isa)
        }
    },
};

impl Arithmetic {
    fn ops(self) -> &'static RowOps {
        match self {
            Arithmetic::Astra => &ASTRA,
            Arithmetic::Ggml => &GGML,
        }
    }

    pub fn name(self) -> &'static str {
        self.ops().name
    }

    pub fn from_name(name: &str) -> Option<Arithmetic> {
        [Arithmetic::Astra, Arithmetic::Ggml]
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(name))
    }
}

impl CpuBackend {
    /// A backend running on `threads` threads (the caller's and `threads - 1` more),
    /// its KV caches in f16.
    pub fn new(threads: usize) -> CpuBackend {
        Self::with_kv_type(threads, KvType::F16)
    }

    /// As [`CpuBackend::new`], its KV caches storing `kv`.
    pub fn with_kv_type(threads: usize, kv: KvType) -> CpuBackend {
        CpuBackend {
            pool: Pool::new(threads.max(1)),
            kv,
            isa: Isa::selected(),
            arithmetic: Arithmetic::Astra,
            storage: KvStorage::selected(),
            kv_pages: Mutex::new(Vec::new()),
            kv_limit: AtomicUsize::new(usize::MAX),
        }
    }

    /// The same backend rounding as `arithmetic` says; llama.cpp's needs an f16 cache.
    pub fn with_arithmetic(self, arithmetic: Arithmetic) -> Result<CpuBackend, EngineError> {
        if arithmetic == Arithmetic::Ggml && self.kv != KvType::F16 {
            return Err(EngineError::Invalid(
                "llama.cpp's arithmetic keeps the KV cache in f16".into(),
            ));
        }
        Ok(CpuBackend { arithmetic, ..self })
    }

    /// The same backend with the matrix kernels of `isa` (where it has none for a
    /// weight type, the next set down), instead of [`Isa::selected`]: the same
    /// arithmetic with sums associated differently, for measuring what that alone
    /// changes.
    pub fn with_isa(self, isa: Isa) -> CpuBackend {
        CpuBackend { isa, ..self }
    }

    /// The same backend with caches held as `storage` says, instead of
    /// [`KvStorage::selected`].
    pub fn with_storage(self, storage: KvStorage) -> CpuBackend {
        CpuBackend { storage, ..self }
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The worker pool the backend's operations run on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn ops(&self) -> &'static RowOps {
        self.arithmetic.ops()
    }
}

/// `rows × width` f32 activations, row-major.
pub struct CpuTensor {
    data: Vec<f32>,
    width: usize,
}

impl CpuTensor {
    fn rows(&self) -> impl Iterator<Item = &[f32]> {
        self.data.chunks_exact(self.width)
    }

    fn rows_mut(&mut self) -> impl Iterator<Item = &mut [f32]> {
        self.data.chunks_exact_mut(self.width)
    }
}

/// A weight matrix read in place from the mapped file, or, where the kernels read
/// groups of rows packed ([`astra_quant::dot::Packing`]), from a packed copy made at
/// load (the file's pages then released; its rows still serve embedding lookups).
pub struct CpuMatrix {
    file: Arc<GgufFile>,
    m: MatRef,
    /// The kernels that read it, chosen at load for the backend's arithmetic and ISA.
    kernels: Kernels,
    packed: Option<memmap2::MmapMut>,
}

impl CpuMatrix {
    /// The matrix as the kernels read it.
    fn kernel_view(&self) -> QuantMatrix<'_> {
        match &self.packed {
            Some(bytes) => QuantMatrix::packed(self.m.ty, self.m.rows, self.m.cols, bytes)
                .expect("packed from this shape"),
            None => self.m.view(&self.file),
        }
    }
}

/// `w` packed for `kernels` in memory of its own, where they pack its rows: an
/// anonymous map, huge pages advised.
fn packed_copy(
    par: &dyn Parallel,
    w: &QuantMatrix,
    kernels: &Kernels,
) -> Result<Option<memmap2::MmapMut>, EngineError> {
    if kernels.packing.is_none() || w.bytes().is_empty() {
        return Ok(None);
    }
    let mut map = memmap2::MmapMut::map_anon(w.bytes().len())
        .map_err(|e| EngineError::Load(format!("memory for packed weights: {e}")))?;
    #[cfg(target_os = "linux")]
    // Advice only: without huge pages the copy is the same, made more slowly.
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(astra_quant::matmul::pack_into_on(par, w, kernels, &mut map).then_some(map))
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type KvCache = KvCache;
    type Ids = Vec<u32>;
    type Graph = ();
    type Host = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn describe(&self) -> String {
        let (threads, kv) = (self.threads(), self.kv.name());
        let kv = match self.storage {
            KvStorage::Paged => kv.to_owned(),
            KvStorage::Contiguous => format!("{} {kv}", self.storage.name()),
        };
        match self.arithmetic {
            Arithmetic::Astra => format!(
                "cpu ({threads} threads, {}, {kv} KV cache)",
                self.isa.name()
            ),
            Arithmetic::Ggml => {
                format!("cpu ({threads} threads, llama.cpp's arithmetic, {kv} KV cache)")
            }
        }
    }

    fn batches_as_llama_server(&self) -> bool {
        self.arithmetic == Arithmetic::Ggml
    }

    fn matrix(&self, file: &Arc<GgufFile>, m: &MatRef) -> Result<CpuMatrix, EngineError> {
        let kernels = (self.ops().kernels)(m.ty, self.isa)?;
        let packed = packed_copy(&self.pool, &m.view(file), &kernels)?;
        if packed.is_some() {
            // The file's copy is read again only for embedding rows, a few at a time.
            file.release(m.byte_range());
        }
        Ok(CpuMatrix {
            file: Arc::clone(file),
            m: m.clone(),
            kernels,
            packed,
        })
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f32>, EngineError> {
        Ok(v.to_vec())
    }

    fn tensor(&self, rows: usize, width: usize) -> Result<CpuTensor, EngineError> {
        Ok(CpuTensor {
            data: vec![0.0; rows * width],
            width,
        })
    }

    fn tensor_from(&self, data: &[f32], width: usize) -> Result<CpuTensor, EngineError> {
        Ok(CpuTensor {
            data: data.to_vec(),
            width,
        })
    }

    fn kv_cache(&self, layout: &KvLayout) -> Result<KvCache, EngineError> {
        if self.storage == KvStorage::Contiguous {
            return Ok(KvCache::contiguous(layout));
        }
        let mut sets = self.kv_pages.lock().expect("pages lock");
        let pages = match sets.iter().find(|p| p.fits(layout)) {
            Some(p) => Arc::clone(p),
            None => {
                let p = KvPages::new(layout);
                p.set_limit(self.kv_limit.load(Ordering::Relaxed));
                sets.push(Arc::clone(&p));
                p
            }
        };
        Ok(KvCache::paged(layout, &pages))
    }

    fn kv_reserve(&self, kv: &mut KvCache, positions: Range<usize>) -> Result<(), EngineError> {
        kv.reserve(positions)
    }

    fn kv_fork(&self, kv: &KvCache, n: usize) -> Option<KvCache> {
        // llama.cpp's cells depend on how a cache was filled: a fork's would not be
        // those of the prompt fed whole.
        (self.arithmetic == Arithmetic::Astra && self.storage == KvStorage::Paged)
            .then(|| kv.fork(n))
    }

    fn kv_usage(&self) -> Option<KvUsage> {
        if self.storage == KvStorage::Contiguous {
            return None;
        }
        let sets = self.kv_pages.lock().expect("pages lock");
        Some(KvUsage {
            pages: sets.iter().map(|p| p.pages()).sum(),
            bytes: sets.iter().map(|p| p.bytes()).sum(),
            limit: self.kv_limit.load(Ordering::Relaxed),
        })
    }

    fn kv_page_ids(&self, kv: &KvCache) -> Vec<usize> {
        kv.pages_held().collect()
    }

    fn set_kv_limit(&self, bytes: usize) {
        self.kv_limit.store(bytes, Ordering::Relaxed);
        for p in self.kv_pages.lock().expect("pages lock").iter() {
            p.set_limit(bytes);
        }
    }

    fn kv_type(&self) -> KvType {
        self.kv
    }

    fn read(&self, t: &CpuTensor) -> Result<Vec<f32>, EngineError> {
        Ok(t.data.clone())
    }

    fn read_owned(&self, t: CpuTensor) -> Result<Vec<f32>, EngineError> {
        Ok(t.data)
    }

    fn read_append(&self, t: &CpuTensor, out: &mut Vec<f32>) -> Result<(), EngineError> {
        out.extend_from_slice(&t.data);
        Ok(())
    }

    fn check(&self) -> Result<(), EngineError> {
        match self.pool.take_panic() {
            None => Ok(()),
            Some(message) => Err(EngineError::Backend(format!(
                "a CPU worker task panicked: {message}"
            ))),
        }
    }

    fn embed(&self, table: &CpuMatrix, tokens: &Vec<u32>, scale: Option<f32>, out: &mut CpuTensor) {
        let m = table.m.view(&table.file);
        for (row, &tok) in out.rows_mut().zip(tokens) {
            astra_quant::dequantize(m.ty, m.row(tok as usize), row).expect("embedding row");
            if let Some(scale) = scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
    }

    fn gather(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor, EngineError> {
        let w = x.width;
        Ok(CpuTensor {
            data: rows
                .iter()
                .flat_map(|&r| &x.data[r * w..(r + 1) * w])
                .copied()
                .collect(),
            width: w,
        })
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32, out: &mut CpuTensor) {
        let norm = self.ops().rms_norm;
        for (o, x) in out.rows_mut().zip(x.rows()) {
            norm(x, w, eps, o);
        }
    }

    fn rms_norm_groups(&self, x: &mut CpuTensor, w: &Vec<f32>, eps: f32) {
        let norm = self.ops().rms_norm_inplace;
        for g in x.data.chunks_exact_mut(w.len()) {
            norm(g, w, eps);
        }
    }

    fn matmul(&self, x: &CpuTensor, outs: &mut [(&CpuMatrix, &mut CpuTensor)]) {
        // Each activation type the weights take is quantized once; then every matrix
        // goes in one parallel step.
        let mut acts: Vec<QuantizedActivations> = Vec::new();
        for (w, _) in outs.iter() {
            let act = w.kernels.act;
            if !acts.iter().any(|a| a.act == act) {
                acts.push(
                    QuantizedActivations::new_on(&self.pool, act, &x.data, x.width)
                        .expect("activation shape"),
                );
            }
        }
        let views: Vec<_> = outs.iter().map(|(w, _)| w.kernel_view()).collect();
        let mut jobs: Vec<MatmulJob> = outs
            .iter_mut()
            .zip(&views)
            .map(|((w, out), view)| MatmulJob {
                w: *view,
                acts: acts
                    .iter()
                    .find(|a| a.act == w.kernels.act)
                    .expect("quantized above"),
                out: &mut out.data,
                kernels: &w.kernels,
            })
            .collect();
        matmul_many_on(&self.pool, &mut jobs);
    }

    fn ids(&self, v: &[u32]) -> Result<Vec<u32>, EngineError> {
        Ok(v.to_vec())
    }

    fn write_ids(&self, dst: &mut Vec<u32>, v: &[u32]) {
        dst.copy_from_slice(v);
    }

    fn rope(&self, x: &mut CpuTensor, head_dim: usize, positions: &Vec<u32>, r: Rope) {
        let rope = self.ops().rope;
        for (row, &pos) in x.rows_mut().zip(positions) {
            rope(row, head_dim, pos as usize, r.dims, r.base, r.neox);
        }
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) {
        x.data.iter_mut().for_each(|v| *v *= s);
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        add_inplace(&mut x.data, &y.data);
    }

    fn glu(&self, gate: &mut CpuTensor, up: &CpuTensor, act: Activation) {
        (self.ops().glu)(&mut gate.data, &up.data, gate.width, act);
    }

    fn add_bias(&self, x: &mut CpuTensor, b: &Vec<f32>) {
        for row in x.rows_mut() {
            add_inplace(row, b);
        }
    }

    fn mul(&self, x: &mut CpuTensor, y: &CpuTensor) {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a *= b);
    }

    fn tanh(&self, x: &mut CpuTensor) {
        x.data.iter_mut().for_each(|v| *v = v.tanh());
    }

    fn scale_rows(&self, x: &mut CpuTensor, s: &[f32]) {
        for (row, &s) in x.rows_mut().zip(s) {
            row.iter_mut().for_each(|v| *v *= s);
        }
    }

    fn scatter(&self, src: &CpuTensor, rows: &[usize], dst: &mut CpuTensor) {
        let w = dst.width;
        for (row, &r) in src.rows().zip(rows) {
            dst.data[r * w..(r + 1) * w].copy_from_slice(row);
        }
    }

    fn kv_store(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, KvCache>],
        _positions: &Vec<u32>,
        k: &CpuTensor,
        v: &CpuTensor,
    ) {
        let kw = k.width;
        for s in seqs.iter_mut() {
            s.kv.place(s.pos..s.pos + s.rows.len());
            for (i, r) in s.rows.clone().enumerate() {
                let (k, v) = (&k.data[r * kw..(r + 1) * kw], &v.data[r * kw..(r + 1) * kw]);
                s.kv.store(layer, s.pos + i, k, v);
            }
        }
    }

    fn attention(&self, a: Attend<'_, '_, Self>, out: &mut CpuTensor) {
        let qw = a.q.width;
        let seqs: Vec<SeqQueries<'_>> = a
            .seqs
            .iter()
            .map(|s| SeqQueries {
                layer: s.kv.layer(a.layer, a.scale),
                q: &a.q.data[s.rows.start * qw..s.rows.end * qw],
                n_past: s.pos,
            })
            .collect();
        let mut outs = rows_of(&mut out.data, a.seqs.iter().map(|s| s.rows.clone()), qw);
        (self.ops().attend)(self, &seqs, &mut outs);
    }
}

/// The rows `ranges` (in increasing order, disjoint) of `data`, rows of `width`, as
/// separate slices.
fn rows_of(
    data: &mut [f32],
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
    width: usize,
) -> Vec<&mut [f32]> {
    let mut rest = data;
    let mut taken = 0;
    let mut out = Vec::new();
    for r in ranges {
        assert!(r.start >= taken, "a batch's sequences hold increasing rows");
        let tail = std::mem::take(&mut rest);
        let (part, tail) = tail[(r.start - taken) * width..].split_at_mut(r.len() * width);
        out.push(part);
        rest = tail;
        taken = r.end;
    }
    out
}
