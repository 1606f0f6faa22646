//! [`CudaBackend`]: the engine's ops as launches of the run-time compiled kernels on
//! one stream. Weights are uploaded as stored (quantized blocks); activations are
//! quantized on the device by the CPU engine's arithmetic, and a matrix product is a
//! per-block integer dot product as on the CPU — except, unless the backend is
//! deterministic ([`Mode`]), a batch's, which goes through cuBLAS ([`crate::gemm`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use astra_engine::attention::{KvLayout, KvType, LayerSlots};
use astra_engine::backend::{
    add_to_residual, compose_feed_forward, Activation, Attend, Backend, FeedForward, Heads,
    HostBuf, Input, Rope, SeqRows,
};
use astra_engine::weights::MatRef;
use astra_engine::EngineError;
use astra_gguf::{GgmlType, GgufFile};
use astra_quant::ActType;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, LaunchConfig, PinnedHostSlice,
};
use rayon::prelude::*;

use crate::args::*;
use crate::gemm::{self, Gemm};
use crate::launch;
use crate::nvrtc;
use crate::shared::{
    glu_code, quant_kind, type_code, CHUNK, HELD_MAX_ROWS_1, HELD_MAX_ROWS_8, HELD_WARPS,
    MAX_HEAD_DIM, MMQ_WARPS, Q8K_BYTES,
};

fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> EngineError + '_ {
    move |e| EngineError::Backend(format!("CUDA: {what}: {e}"))
}

/// The kernels of the library.
struct Kernels {
    quantize_q8_32: CudaFunction,
    quantize_q8_k: CudaFunction,
    matvec: CudaFunction,
    /// The warp-cooperative matrix kernels.
    matvec_q4_k: MatvecKernels,
    /// Q4_K and Q8_0 products with the activations held in registers (rows of up to
    /// [`HeldKernels::max_blocks`] blocks).
    matvec_q4_k_held: HeldKernels,
    matvec_q8_0_held: HeldKernels,
    /// The tiled products of batches.
    mmq_q4_k: MmqKernels,
    mmq_q8_0: MmqKernels,
    mmq_q4_1: MmqKernels,
    matvec_q4_1: MatvecKernels,
    matvec_q5_0: MatvecKernels,
    matvec_q8_0: MatvecKernels,
    matvec_q6_k: MatvecKernels,
    embed: CudaFunction,
    dequantize: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_inplace: CudaFunction,
    rms_norm_add: CudaFunction,
    /// Norm and quantization of a row: one CTA of 256 threads, and for rows over 2,048
    /// values a CTA per 256 of them.
    rms_norm_quantize: (CudaFunction, CudaFunction),
    qk_rope: CudaFunction,
    rope: CudaFunction,
    scale: CudaFunction,
    add: CudaFunction,
    glu: CudaFunction,
    gather: CudaFunction,
    scatter: CudaFunction,
    scale_rows: CudaFunction,
    add_bias: CudaFunction,
    mul: CudaFunction,
    tanh: CudaFunction,
    kv_store: CudaFunction,
    /// The cache stores of several sequences' rows in one launch.
    kv_store_batch: CudaFunction,
    /// Attention of a decode row with its chunks spread over CTAs, and of four query
    /// rows per CTA (prefill).
    attention: (CudaFunction, CudaFunction),
    /// Attention of several sequences' decode rows in one launch.
    attention_batch: CudaFunction,
    /// The chunk parts of `attention.0` and `attention_batch` for the 2, 3 or 4 query
    /// heads of a KV head together (astra.cu, `group_parts`): the same bits, the cache
    /// read once a group at depth.
    attention_group: [(CudaFunction, CudaFunction); 3],
    /// The grouped kernels' parts merged, each head's row written (single row, batch).
    attention_merge: (CudaFunction, CudaFunction),
    _module: Arc<CudaModule>,
}

impl Kernels {
    /// Compiles `source` for `arch` (or takes it from the disk cache), loads it, and
    /// writes the IQ2_S codebook into its table.
    fn load(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        name: &str,
        source: &str,
        arch: &str,
        driver: i32,
    ) -> Result<Kernels, EngineError> {
        let cubin = nvrtc::cubin_cached(name, source, arch, driver).map_err(EngineError::Load)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(gpu_err("loading kernels"))?;
        let f = |n: &str| module.load_function(n).map_err(gpu_err("kernel lookup"));
        // A type's one- and three-matrix launches with a name suffix, where it has them.
        let launches = |has: bool,
                        n: &str,
                        suffix: &str|
         -> Result<Option<(CudaFunction, CudaFunction)>, EngineError> {
            has.then(|| Ok((f(&format!("{n}{suffix}"))?, f(&format!("{n}_3{suffix}"))?)))
                .transpose()
        };
        let mv = |n: &str, batch: bool, glu: bool| -> Result<MatvecKernels, EngineError> {
            let (one, three) = launches(true, n, "")?.expect("always built");
            let batch = launches(batch, n, "_8")?;
            let glu = glu.then(|| f(&format!("{n}_glu"))).transpose()?;
            Ok(MatvecKernels {
                one,
                three,
                batch,
                glu,
            })
        };
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(gpu_err("counting SMs"))?
            .max(1) as usize;
        let many_tokens = std::env::var("ASTRA_CUDA_MMQ_MANY").map_or(true, |v| v != "0");
        let max_row_tiles = std::env::var("ASTRA_CUDA_MMQ_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4);
        let mmq = |n: &str, wide: bool| -> Result<MmqKernels, EngineError> {
            let tiles = |nt: usize, rt: usize| f(&format!("{n}_{nt}_{rt}"));
            let wide_tiles = |kind: &str| -> Result<Option<[CudaFunction; 2]>, EngineError> {
                Ok(match wide && many_tokens {
                    true => Some([
                        f(&format!("{n}_{kind}_4_2"))?,
                        f(&format!("{n}_{kind}_8_2"))?,
                    ]),
                    false => None,
                })
            };
            let tall = match wide {
                true => Some([[tiles(1, 2)?, tiles(1, 4)?], [tiles(2, 2)?, tiles(2, 4)?]]),
                false => None,
            };
            Ok(MmqKernels {
                by_tiles: [tiles(1, 1)?, tiles(2, 1)?, tiles(4, 1)?, tiles(8, 1)?],
                tall,
                many: wide_tiles("many")?,
                pair: wide_tiles("pair")?,
                sms,
                max_row_tiles,
            })
        };
        let k = Kernels {
            quantize_q8_32: f("quantize_q8_32")?,
            quantize_q8_k: f("quantize_q8_k")?,
            matvec: f("matvec")?,
            matvec_q4_k: mv("matvec_q4_k", true, false)?,
            matvec_q4_k_held: HeldKernels::load(
                &f("matvec_q4_k_held")?,
                &f("matvec_q4_k_held_8")?,
                ctx,
                Q4K_HELD_BLOCKS,
            )?,
            matvec_q8_0_held: HeldKernels::load(
                &f("matvec_q8_0_held")?,
                &f("matvec_q8_0_held_8")?,
                ctx,
                Q8_0_HELD_BLOCKS,
            )?,
            mmq_q4_k: mmq("mmq_q4_k", true)?,
            mmq_q8_0: mmq("mmq_q8_0", false)?,
            mmq_q4_1: mmq("mmq_q4_1", false)?,
            matvec_q4_1: mv("matvec_q4_1", false, true)?,
            matvec_q5_0: mv("matvec_q5_0", true, false)?,
            matvec_q8_0: mv("matvec_q8_0", true, false)?,
            matvec_q6_k: mv("matvec_q6_k", true, false)?,
            embed: f("embed")?,
            dequantize: f("dequantize")?,
            rms_norm: f("rms_norm")?,
            rms_norm_inplace: f("rms_norm_inplace")?,
            rms_norm_add: f("rms_norm_add")?,
            rms_norm_quantize: (f("rms_norm_quantize")?, f("rms_norm_quantize_split")?),
            qk_rope: f("qk_rope")?,
            rope: f("rope")?,
            scale: f("scale")?,
            add: f("add")?,
            glu: f("glu")?,
            gather: f("gather")?,
            scatter: f("scatter")?,
            scale_rows: f("scale_rows")?,
            add_bias: f("add_bias")?,
            mul: f("mul")?,
            tanh: f("tanh_inplace")?,
            kv_store: f("kv_store")?,
            kv_store_batch: f("kv_store_batch")?,
            attention: (f("attention_split")?, f("attention_4")?),
            attention_batch: f("attention_split_batch")?,
            attention_group: [
                (f("attention_group_2")?, f("attention_group_batch_2")?),
                (f("attention_group_3")?, f("attention_group_batch_3")?),
                (f("attention_group_4")?, f("attention_group_batch_4")?),
            ],
            attention_merge: (f("attention_merge")?, f("attention_merge_batch")?),
            _module: Arc::clone(&module),
        };
        // The IQ2_S codebook, from the one table the CPU kernels use.
        let mut grid = module
            .get_global("iq2s_grid", stream)
            .map_err(gpu_err("finding the IQ2_S table"))?;
        // SAFETY: `iq2s_grid` is declared in astra.cu as 1024 u64s.
        let mut grid = unsafe { grid.transmute_mut::<u64>(astra_quant::IQ2S_GRID.len()) }
            .ok_or_else(|| {
                EngineError::Backend("the kernels' IQ2_S table has the wrong size".into())
            })?;
        stream
            .memcpy_htod(&astra_quant::IQ2S_GRID[..], &mut grid)
            .map_err(gpu_err("uploading the IQ2_S table"))?;
        Ok(k)
    }
}

/// A warp-cooperative matrix kernel's launches: one matrix, or up to three in one
/// launch; one token per warp, or eight.
struct MatvecKernels {
    one: CudaFunction,
    three: CudaFunction,
    /// The same with eight tokens per warp, for batches; none for Q4_1, whose
    /// eight-token kernel was tried and measured slower (commit 6f4ffab).
    batch: Option<(CudaFunction, CudaFunction)>,
    /// A decode row's gate and up products, gated and quantized for the down product;
    /// Q4_1 only (astra.cu says why).
    glu: Option<CudaFunction>,
}

/// The matrix kernels that hold a token's activations in registers (astra.cu,
/// `matvec_q4_k_held`, `matvec_q8_0_held`): one token per CTA and eight, and for each,
/// how many CTAs of 1..=[`HELD_WARPS`] warps an SM runs at once.
struct HeldKernels {
    one: CudaFunction,
    eight: CudaFunction,
    /// Blocks of a row a warp takes (as the kernel's lane type in astra.cu says).
    blocks_per_warp: usize,
    ctas_per_sm: [[u32; HELD_WARPS]; 2],
    sms: u32,
}

/// The most rows a held-activations CTA takes with one token and with eight.
const HELD_MAX_ROWS: [usize; 2] = [HELD_MAX_ROWS_1, HELD_MAX_ROWS_8];
/// `matvec_q4_k_held`'s blocks a warp (astra.cu, `Q4KHeldLanes`): eight 256-blocks, a
/// lane per quarter block.
const Q4K_HELD_BLOCKS: usize = 8;
/// `matvec_q8_0_held`'s blocks a warp (astra.cu, `Q8_0HeldLanes`): sixteen 32-blocks, a
/// lane per half block.
const Q8_0_HELD_BLOCKS: usize = 16;

impl HeldKernels {
    fn load(
        one: &CudaFunction,
        eight: &CudaFunction,
        ctx: &Arc<CudaContext>,
        blocks_per_warp: usize,
    ) -> Result<HeldKernels, EngineError> {
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(gpu_err("counting SMs"))?;
        let mut ctas_per_sm = [[1; HELD_WARPS]; 2];
        for (f, per) in [one, eight].into_iter().zip(&mut ctas_per_sm) {
            for (w, n) in per.iter_mut().enumerate() {
                *n = f
                    .occupancy_max_active_blocks_per_multiprocessor(32 * (w as u32 + 1), 0, None)
                    .map_err(gpu_err("kernel occupancy"))?
                    .max(1);
            }
        }
        Ok(HeldKernels {
            one: one.clone(),
            eight: eight.clone(),
            blocks_per_warp,
            ctas_per_sm,
            sms: sms.max(1) as u32,
        })
    }

    /// The longest rows, in blocks, that the kernels take.
    fn max_blocks(&self) -> usize {
        self.blocks_per_warp * HELD_WARPS
    }

    /// The kernel and launch for matrices of `matrix_rows` rows (each CTA's rows of one
    /// of them) of `nb` blocks and `tokens` tokens, and the rows each CTA runs down: as
    /// many CTAs as the SMs run at once, or whole waves of them. (Rows spread over the
    /// waves rather than a last part-filled one measured faster, commit 3725071.)
    fn launch(
        &self,
        matrix_rows: [usize; 3],
        nb: usize,
        tokens: usize,
    ) -> (&CudaFunction, LaunchConfig, i32) {
        let rows: usize = matrix_rows.iter().sum();
        let warps = nb.div_ceil(self.blocks_per_warp).clamp(1, HELD_WARPS);
        let set = usize::from(tokens > 1);
        let (f, groups) = if tokens > 1 {
            (&self.eight, tokens.div_ceil(8))
        } else {
            (&self.one, 1)
        };
        let (resident, max_rows) = (
            (self.sms * self.ctas_per_sm[set][warps - 1]) as usize,
            HELD_MAX_ROWS[set],
        );
        let waves = rows.div_ceil(resident * max_rows).max(1);
        let per = rows.div_ceil(resident * waves).clamp(1, max_rows);
        let ctas: usize = matrix_rows.iter().map(|r| r.div_ceil(per)).sum();
        let cfg = LaunchConfig {
            grid_dim: (ctas as u32, groups as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        (f, cfg, per as i32)
    }
}

/// How a batch's matrix products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Through cuBLAS for batches of [`gemm::MIN_TOKENS`] tokens or more, where it can
    /// be loaded: logits depend (in their last bits) on how a prompt was batched.
    Fast,
    /// Every product by the per-token kernels: logits bitwise the same whatever the
    /// batching and whether a prefix came from the cache (`--deterministic`).
    Deterministic,
}

pub struct CudaBackend {
    stream: Arc<CudaStream>,
    k: Kernels,
    device: String,
    /// Quantized activations, reused by every matrix product (the stream orders the
    /// reuse).
    acts: Mutex<Scratch>,
    /// The down product's quantized activations where the gate and up kernel makes them
    /// (taken after `acts` where both are held).
    gated_acts: Mutex<Scratch>,
    /// How many times the activation scratches have been replaced (a graph recorded over
    /// older ones is stale).
    scratch_generation: AtomicU64,
    /// Whether decode steps are recorded as graphs (`ASTRA_CUDA_GRAPHS=0` turns it off).
    graphs: bool,
    /// Whether Q4_K products of 17–64 tokens take a warp a row tile against two token
    /// tiles (the default) rather than a warp a token tile (`ASTRA_CUDA_MMQ_MANY=1`).
    paired_tiles: bool,
    /// Whether decode attention takes a CTA per KV head's group of query heads (the
    /// default) rather than one per query head (`ASTRA_CUDA_GQA=0`).
    grouped_attention: bool,
    /// The most CTAs a query head's decode attention spreads its chunks over
    /// ([`SPLIT_CTAS`] unless a test asks for fewer).
    split_ctas: usize,
    /// The kernels compiled to be launched as programmatic dependents of the one
    /// before, used while a decode step is recorded; `None` where that is off.
    k_graph: Option<Kernels>,
    /// A capture is under way: launches are recorded, not run.
    capturing: AtomicBool,
    /// Something during the capture could not be recorded; the capture is dropped.
    capture_failed: AtomicBool,
    /// The first failed operation since the last [`Backend::check`] (sticky, as the
    /// device's own errors are): the step it happened in fails, not the process.
    failure: Mutex<Option<String>>,
    /// Decode steps run by replaying a recorded graph.
    replays: AtomicU64,
    /// Batched products through cuBLAS; `None` when deterministic, or without cuBLAS.
    gemm: Option<Gemm>,
    /// Weights dequantized for `gemm` (the stream orders the reuse).
    dequantized: Mutex<Option<CudaSlice<f32>>>,
    /// Products run through `gemm`.
    gemm_products: AtomicU64,
    /// Batches of this many tokens or more take the tiled products where their weight
    /// type has them; 0 where none do (`--deterministic`, devices before compute
    /// capability 8.0, `ASTRA_CUDA_MMQ=0`).
    mmq_min_tokens: usize,
    /// Up to how many sequences' decode rows run as their own recorded steps rather
    /// than one batch (`ASTRA_CUDA_SEPARATE_DECODE`; [`SEPARATE_DECODE_STEPS`] unless set).
    separate_steps: usize,
    /// Each layer's table of the sequences of the last batch launched over it (astra.cu's
    /// `SeqKv`), kept on the device and uploaded again only when it changes.
    seq_tables: Mutex<Vec<Option<SeqTable>>>,
    /// Page-locked host memory that [`Backend::read`] downloads through, grown as
    /// needed.
    staging: Mutex<Option<PinnedHostSlice<f32>>>,
}

/// A device buffer that grows as needed (each replacement counted in
/// `CudaBackend::scratch_generation`, so that a graph recorded over the old one is known
/// to be stale).
struct Scratch {
    buf: Option<CudaSlice<u8>>,
}

/// A layer's table of sequences on the device, and the entries it holds.
struct SeqTable {
    entries: Vec<u8>,
    buf: CudaSlice<u8>,
}

/// What the sequences of a batched launch share: their heads and the layer's window.
#[derive(Clone, Copy, PartialEq, Eq)]
struct BatchShape {
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    window: Option<usize>,
}

/// A recorded decode step ([`Backend::record`]).
pub struct StepGraph {
    graph: CudaGraph,
    /// The activation scratches' generation it was recorded over.
    generation: u64,
}

// SAFETY: a graph is used through `&mut` of the session owning it, so by one thread at
// a time, which is what the driver requires of graph objects.
unsafe impl Send for StepGraph {}

/// Page-locked host memory logits are read into ([`Backend::Host`]): the device copies
/// into it directly, at the link's speed, and the host reads it as any memory.
pub struct PinnedLogits {
    mem: Option<PinnedHostSlice<f32>>,
    /// `mem`'s first value (dangling while there is none).
    ptr: *mut f32,
    len: usize,
}

// SAFETY: `ptr` points into `mem`, which the value owns; it is not shared.
unsafe impl Send for PinnedLogits {}

impl Default for PinnedLogits {
    fn default() -> PinnedLogits {
        PinnedLogits {
            mem: None,
            ptr: std::ptr::NonNull::dangling().as_ptr(),
            len: 0,
        }
    }
}

impl PinnedLogits {
    /// Room for `n` more values, the allocation grown (by at least half) where too
    /// small: at most once per larger batch. Returns where they go.
    fn reserve(&mut self, ctx: &Arc<CudaContext>, n: usize) -> Result<*mut f32, EngineError> {
        let need = self
            .len
            .checked_add(n)
            .ok_or_else(|| EngineError::Invalid(format!("{n} more logits")))?;
        let cap = self.mem.as_ref().map_or(0, |m| m.len());
        if need > cap {
            let cap = need.max(cap + cap / 2).max(1 << 16);
            // Plain page-locked memory (not write-combined: the host reads it).
            // SAFETY: only the first `len` values are read, each written before.
            let mut mem = unsafe { ctx.alloc_pinned_with_flags::<f32>(cap, 0) }
                .map_err(gpu_err("page-locked allocation"))?;
            let ptr = mem.as_mut_ptr().map_err(gpu_err("page-locked memory"))?;
            // SAFETY: both hold at least `len` values and are distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr, ptr, self.len) };
            self.mem = Some(mem);
            self.ptr = ptr;
        }
        // SAFETY: `len` is within the allocation.
        Ok(unsafe { self.ptr.add(self.len) })
    }
}

impl std::ops::Deref for PinnedLogits {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the first `len` values were written by completed copies
        // (`read_append` synchronizes before it counts them).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedLogits {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl HostBuf for PinnedLogits {
    fn clear(&mut self) {
        self.len = 0;
    }
}

/// Activations on the device: `rows × width` f32.
pub struct GpuTensor {
    buf: CudaSlice<f32>,
    rows: usize,
    width: usize,
}

/// A weight matrix on the device, its blocks as stored.
pub struct GpuMatrix {
    data: CudaSlice<u8>,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    act: ActType,
}

struct LayerKv {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    slots: usize,
    window: Option<usize>,
}

/// One sequence's KV cache, laid out as the engine's [`KvLayout`] says, and the scratch
/// of its decode attention (astra.cu's `attention_split` and `attention_group_*`): each
/// head's chunk parts, and the tickets that find the CTA of `attention_split` merging
/// them.
pub struct GpuKv {
    layers: Vec<LayerKv>,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    parts: CudaSlice<f32>,
    tickets: CudaSlice<u32>,
    /// The most chunks a query row of any layer spans.
    max_chunks: usize,
}

/// Up to how many sequences' decode rows run as their own recorded steps, one after
/// another, rather than as one batch (whose launches are not recorded): the most at which
/// separate steps measured faster on every shape (commit dc69ed3). To retune,
/// compare `astra bench -s N` with `ASTRA_CUDA_SEPARATE_DECODE` set around it.
const SEPARATE_DECODE_STEPS: usize = 2;

/// The fewest tokens of a batch whose products take the tiled kernels (`mmq_*`) rather
/// than the per-token ones, where the weight type has them.
const MMQ_MIN_TOKENS: usize = 2;

/// The most tokens of a batch whose products take the tiled kernels rather than cuBLAS,
/// where every matrix has them (and cuBLAS would take the batch): 64 sequences' decode
/// of the 8B shape measured faster tiled, a 512-token prompt faster through cuBLAS
/// (docs/performance.md). Between the two is not measured.
const MMQ_MAX_TOKENS: usize = 64;

/// The most CTAs a query head's decode attention spreads its chunks over: the fastest of
/// the values tried (commit 57aea41); to retune, time decode deep in a conversation
/// (`astra bench -d N`) with other values. A KV head's group of query heads spreads
/// over as many for each head of the group, so that a layer has as many CTAs either
/// way.
const SPLIT_CTAS: usize = 32;

/// Threads per attention CTA for heads of `head_dim`: 1, 2 or 4 per key of a chunk,
/// the fewest that give a thread per element of the head (astra.cu, `key_lanes`).
fn attention_threads(head_dim: usize) -> u32 {
    (head_dim.div_ceil(CHUNK).next_power_of_two().min(4) * CHUNK) as u32
}

/// The grid of astra.cu's `attention_merge` for `seqs` sequences' decode rows: a CTA a
/// head and sequence, a thread for each element of the head and one for the sum of its
/// weights (in whole warps).
fn merge_grid(n_head: usize, head_dim: usize, seqs: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_head as u32, 1, seqs as u32),
        block_dim: ((head_dim + 1).next_multiple_of(32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per CTA for element-wise kernels.
const THREADS: u32 = 256;

fn grid_for(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A thread per value of `rows` rows of `width`: blocks along the row, a grid row per
/// row.
fn rows_grid(width: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((width as u32).div_ceil(THREADS), rows as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Why CUDA cannot be used here, in one line; `None` when the driver is present.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: probes for the library only.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("no CUDA driver (libcuda.so) on this machine: --backend cuda needs an NVIDIA GPU and its driver".into());
    }
    if !nvrtc::available() {
        return Some("NVRTC (libnvrtc.so.13) is not on the library path: install the CUDA 13 toolkit or its nvrtc package".into());
    }
    None
}

impl CudaBackend {
    /// The backend with decode attention taking a CTA per KV head's group of query
    /// heads (`on`) or one per query head, whatever `ASTRA_CUDA_GQA` says: the same bits
    /// either way.
    pub fn with_grouped_attention(mut self, on: bool) -> CudaBackend {
        self.grouped_attention = on;
        self
    }

    /// The backend with a decode row's attention spread over at most `ctas` CTAs a query
    /// head (at least one): the same bits for any number. With few, shallow rows take
    /// the grouped kernel's deep form (a CTA a chunk for all the heads of a group).
    pub fn with_split_ctas(mut self, ctas: usize) -> CudaBackend {
        self.split_ctas = ctas.max(1);
        self
    }

    /// The backend with Q4_K products of 17–64 tokens taking a warp a row tile against
    /// two token tiles (`on`) or a warp a token tile, whatever `ASTRA_CUDA_MMQ_MANY`
    /// says: the same bits either way.
    pub fn with_paired_tiles(mut self, on: bool) -> CudaBackend {
        self.paired_tiles = on;
        self
    }

    /// The backend on GPU `ordinal`, with the kernels compiled (or taken from the disk
    /// cache) for its architecture.
    pub fn new(ordinal: usize, mode: Mode) -> Result<CudaBackend, EngineError> {
        if let Some(why) = unavailable_reason() {
            return Err(EngineError::Backend(why));
        }
        let count = CudaContext::device_count().map_err(gpu_err("counting devices"))?;
        if ordinal as i32 >= count {
            return Err(EngineError::Backend(format!(
                "CUDA device {ordinal} requested; {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(gpu_err("creating a context"))?;
        // One stream, in order: the per-buffer event tracking is not needed.
        // SAFETY: every launch goes to the one stream below.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(gpu_err("compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let mut driver = 0;
        // SAFETY: an out-parameter.
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        // A stream of its own: the legacy default stream cannot be captured.
        let stream = ctx.new_stream().map_err(gpu_err("creating a stream"))?;
        let (name, source) = nvrtc::sources().swap_remove(0);
        let k = Kernels::load(&ctx, &stream, name, &source, &arch, driver)?;
        // Recorded decode steps launch each kernel as a programmatic dependent of the
        // one before (compute capability 9.0 and up; ASTRA_CUDA_PDL=0 turns it off).
        let graphs = std::env::var("ASTRA_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let k_graph =
            if graphs && major >= 9 && std::env::var("ASTRA_CUDA_PDL").map_or(true, |v| v != "0") {
                Some(Kernels::load(
                    &ctx,
                    &stream,
                    name,
                    &nvrtc::with_dependent_launch(&source),
                    &arch,
                    driver,
                )?)
            } else {
                None
            };
        let gemm = match mode {
            Mode::Fast => match gemm::Precision::from_env().map_err(EngineError::Backend)? {
                Some(precision) if gemm::available() => {
                    Some(Gemm::new(&stream, precision).map_err(EngineError::Backend)?)
                }
                _ => None,
            },
            Mode::Deterministic => None,
        };
        let products = match &gemm {
            Some(g) => format!(
                "batches of {}+ tokens through cuBLAS, {:?}",
                gemm::MIN_TOKENS,
                g.precision()
            ),
            None if mode == Mode::Deterministic => "deterministic".into(),
            None => "every product by astra's kernels".into(),
        };
        let device = format!(
            "{} ({arch}, driver {driver}; {products})",
            ctx.name().unwrap_or_else(|_| "GPU".into())
        );
        Ok(CudaBackend {
            stream,
            k,
            device,
            acts: Mutex::new(Scratch { buf: None }),
            gated_acts: Mutex::new(Scratch { buf: None }),
            scratch_generation: AtomicU64::new(0),
            graphs,
            grouped_attention: std::env::var("ASTRA_CUDA_GQA").map_or(true, |v| v != "0"),
            split_ctas: SPLIT_CTAS,
            paired_tiles: std::env::var("ASTRA_CUDA_MMQ_MANY").map_or(true, |v| v != "1"),
            k_graph,
            capturing: AtomicBool::new(false),
            capture_failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            replays: AtomicU64::new(0),
            gemm,
            mmq_min_tokens: match mode {
                Mode::Fast if major >= 8 => std::env::var("ASTRA_CUDA_MMQ")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(MMQ_MIN_TOKENS),
                _ => 0,
            },
            dequantized: Mutex::new(None),
            gemm_products: AtomicU64::new(0),
            separate_steps: std::env::var("ASTRA_CUDA_SEPARATE_DECODE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(SEPARATE_DECODE_STEPS)
                .max(1),
            seq_tables: Mutex::new(Vec::new()),
            staging: Mutex::new(None),
        })
    }

    fn upload<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>, EngineError> {
        self.stream.clone_htod(v).map_err(gpu_err("upload"))
    }

    /// Records the failure of an operation that returns nothing: the first one is kept
    /// for [`Backend::check`].
    fn fail(&self, what: &str, e: impl std::fmt::Display) {
        let mut first = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert_with(|| format!("CUDA: {what}: {e}"));
    }

    /// `scratch` with room for `rows` rows of `width` values quantized for `act`, grown
    /// if too small; `None` where it would have to grow during a capture (which is then
    /// dropped).
    fn reserve<'s>(
        &self,
        scratch: &'s mut Scratch,
        act: ActType,
        rows: usize,
        width: usize,
    ) -> Option<&'s mut CudaSlice<u8>> {
        let need = device_row_bytes(act, width) * rows;
        if scratch.buf.as_ref().is_none_or(|b| b.len() < need) {
            if self.capturing.load(Ordering::Relaxed) {
                self.capture_failed.store(true, Ordering::Relaxed);
                return None;
            }
            // SAFETY: every byte read is first written by a quantization kernel.
            match unsafe { self.stream.alloc::<u8>(need.max(1 << 16)) } {
                Ok(buf) => scratch.buf = Some(buf),
                Err(e) => {
                    self.fail("allocating activation scratch", e);
                    return None;
                }
            }
            self.scratch_generation.fetch_add(1, Ordering::Relaxed);
        }
        scratch.buf.as_mut()
    }

    /// Makes `input`'s rows, quantized for the activation type `act`, in `scratch`
    /// (grown if too small); `false` (nothing launched) where it would have to grow
    /// during a capture. Norm and gated product are computed inside the quantization.
    fn quantize(&self, input: &Input<'_, Self>, act: ActType, scratch: &mut Scratch) -> bool {
        let x = input_rows(input);
        let Some(out) = self.reserve(scratch, act, x.rows, x.width) else {
            return false;
        };
        let (cols, rows) = (x.width as i32, x.rows as u32);
        if let Input::Normed { w, eps, .. } = input {
            let kind = quant_kind(act).expect("float weights are not uploaded to this backend");
            // Rows longer than 2,048 values take a CTA per 256 of them.
            let (f, split) = if x.width > 2048 {
                (
                    &self.k().rms_norm_quantize.1,
                    (x.width as u32).div_ceil(THREADS),
                )
            } else {
                (&self.k().rms_norm_quantize.0, 1)
            };
            let cfg = LaunchConfig {
                grid_dim: (rows, split, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = RmsNormQuantizeArgs {
                x: In::of(&x.buf, &self.stream),
                w: In::of(w, &self.stream),
                out: Out::of(out, &self.stream),
                n: cols,
                eps: *eps,
                kind,
            };
            self.launch(f, &args, cfg);
            return true;
        }
        // The gated product's second operand and activation, or none.
        let (up, glu) = match input {
            Input::Glu { up, act, .. } => {
                let (ptr, _sync) = up.buf.device_ptr(&self.stream);
                (ptr, glu_code(*act))
            }
            _ => (0u64, 0i32),
        };
        match act {
            ActType::Q8_0 | ActType::Q8_1 => {
                let with_sum = i32::from(act == ActType::Q8_1);
                let cfg = LaunchConfig {
                    grid_dim: (x.width as u32 / 32, rows, 1),
                    block_dim: (32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let args = QuantizeQ8_32Args {
                    x: In::of(&x.buf, &self.stream),
                    out: Out::of(out, &self.stream),
                    cols,
                    with_sum,
                    up: In::addr(up),
                    act: glu,
                };
                self.launch(&self.k().quantize_q8_32, &args, cfg);
            }
            ActType::Q8K => {
                let cfg = LaunchConfig {
                    grid_dim: (x.width as u32 / 256, rows, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let args = QuantizeQ8KArgs {
                    x: In::of(&x.buf, &self.stream),
                    out: Out::of(out, &self.stream),
                    cols,
                    up: In::addr(up),
                    act: glu,
                };
                self.launch(&self.k().quantize_q8_k, &args, cfg);
            }
            ActType::F32 => unreachable!("float weights are not uploaded to this backend"),
        }
        true
    }

    /// The matrix kernels' launches for `outs`, each activation format made once by
    /// `prepare` (into the scratch) before the first matrix that takes it; with
    /// `add_to`, the one product is added to it. Stops, launching nothing more, where
    /// `prepare` cannot (a capture that would need to allocate).
    fn matvecs(
        &self,
        source: &Mutex<Scratch>,
        tokens: usize,
        outs: &mut [(&GpuMatrix, &mut GpuTensor)],
        mut add_to: Option<&mut GpuTensor>,
        prepare: &mut dyn FnMut(ActType, &mut Scratch) -> bool,
    ) {
        assert!(
            add_to.is_none() || outs.len() == 1,
            "a residual add takes one matrix"
        );
        let mut scratch = source.lock().expect("scratch lock");
        let mut quantized: Option<ActType> = None;
        let mut i = 0;
        while i < outs.len() {
            let w = outs[i].0;
            let nb = (w.cols / w.ty.block_elems() as usize) as i32;
            // With a residual, the product is added to it in place.
            let acc = i32::from(add_to.is_some());
            // The following matrices of the same type and width (Q, K, V; gate, up) go
            // in the same launch, up to three.
            let n = outs[i..]
                .iter()
                .take(3)
                .take_while(|(m, _)| m.ty == w.ty && m.cols == w.cols)
                .count();
            if quantized != Some(w.act) {
                if !prepare(w.act, &mut scratch) {
                    return;
                }
                quantized = Some(w.act);
            }
            let acts = scratch.buf.as_ref().expect("quantized above");
            // Tiled products for a batch where the type has them; else, held activations
            // where the rows are short enough. Both take up to three matrices a launch.
            let held = self
                .held_kernels(w.ty)
                .filter(|h| nb as usize <= h.max_blocks());
            let grouped = self.mmq_kernel(w.ty, tokens).map(Ok).or(held.map(Err));
            if let Some(kind) = grouped {
                let (rows, weights, outs_ptr) =
                    self.group_args(&mut outs[i..i + n], add_to.as_deref_mut());
                let (f, cfg, per_cta) = match kind {
                    Ok(mmq) => {
                        let (f, cfg) = mmq.launch(rows, tokens, self.paired_tiles);
                        (f, cfg, 16)
                    }
                    Err(held) => held.launch(rows.map(|r| r as usize), nb as usize, tokens),
                };
                let args = MatvecHeldArgs {
                    w0: In::of(weights[0], &self.stream),
                    w1: In::of(weights[1], &self.stream),
                    w2: In::of(weights[2], &self.stream),
                    a: In::of(acts, &self.stream),
                    o0: Out::addr(outs_ptr[0]),
                    o1: Out::addr(outs_ptr[1]),
                    o2: Out::addr(outs_ptr[2]),
                    r0: rows[0],
                    r1: rows[1],
                    r2: rows[2],
                    nb,
                    per_cta,
                    acc,
                    tokens: tokens as i32,
                };
                self.launch(f, &args, cfg);
                i += n;
                continue;
            }
            // Warp-cooperative kernels where there is one; a lane per block otherwise.
            let Some(kernels) = self.matvec_kernels(w.ty) else {
                let (wbytes, abytes) =
                    (w.ty.block_bytes() as i32, device_block_bytes(w.act) as i32);
                let (ty, rows) = (type_code(w.ty), w.rows as i32);
                let cfg = matvec_grid(w.rows, tokens);
                let out = match add_to.as_deref_mut() {
                    Some(r) => &mut r.buf,
                    None => &mut outs[i].1.buf,
                };
                let args = MatvecArgs {
                    ty,
                    w: In::of(&w.data, &self.stream),
                    a: In::of(acts, &self.stream),
                    out: Out::of(out, &self.stream),
                    rows,
                    nb,
                    wbytes,
                    abytes,
                    acc,
                };
                self.launch(&self.k().matvec, &args, cfg);
                i += 1;
                continue;
            };
            // Eight tokens per warp for a batch where the type has those kernels (a row's
            // sums are the same either way).
            let (one, three, per_warp) = match &kernels.batch {
                Some((one_8, three_8)) if tokens > 1 => (one_8, three_8, 8),
                _ => (&kernels.one, &kernels.three, 1),
            };
            let toks = tokens as i32;
            if n == 1 {
                let rows = w.rows as i32;
                let cfg = matvec_grid(w.rows, tokens.div_ceil(per_warp));
                let out = match add_to.as_deref_mut() {
                    Some(r) => &mut r.buf,
                    None => &mut outs[i].1.buf,
                };
                let args = MatvecOneArgs {
                    w: In::of(&w.data, &self.stream),
                    a: In::of(acts, &self.stream),
                    out: Out::of(out, &self.stream),
                    rows,
                    nb,
                    acc,
                    tokens: toks,
                };
                self.launch(one, &args, cfg);
                i += 1;
                continue;
            }
            let (rows, weights, outs_ptr) = self.group_args(&mut outs[i..i + n], None);
            let cfg = matvec_grid(
                rows.iter().map(|&r| r as usize).sum::<usize>(),
                tokens.div_ceil(per_warp),
            );
            let args = MatvecThreeArgs {
                w0: In::of(weights[0], &self.stream),
                w1: In::of(weights[1], &self.stream),
                w2: In::of(weights[2], &self.stream),
                a: In::of(acts, &self.stream),
                o0: Out::addr(outs_ptr[0]),
                o1: Out::addr(outs_ptr[1]),
                o2: Out::addr(outs_ptr[2]),
                r0: rows[0],
                r1: rows[1],
                r2: rows[2],
                nb,
                tokens: toks,
            };
            self.launch(three, &args, cfg);
            i += n;
        }
    }

    /// A three-matrix launch's arguments for `group` (up to three matrices): their rows,
    /// weights and outputs (`add_to`, where given, for a group of one). With fewer than
    /// three, the last slots repeat the last matrix's pointers with no rows, so they are
    /// never used.
    fn group_args<'m>(
        &self,
        group: &mut [(&'m GpuMatrix, &mut GpuTensor)],
        mut add_to: Option<&mut GpuTensor>,
    ) -> ([i32; 3], [&'m CudaSlice<u8>; 3], [u64; 3]) {
        let last = group.len() - 1;
        let rows = std::array::from_fn(|j| group.get(j).map_or(0, |(m, _)| m.rows as i32));
        let weights = std::array::from_fn(|j| {
            let m: &'m GpuMatrix = group[j.min(last)].0;
            &m.data
        });
        let mut outs = [0u64; 3];
        for (j, p) in outs.iter_mut().enumerate() {
            let buf = match add_to.as_deref_mut() {
                Some(r) => &mut r.buf,
                None => &mut group[j.min(last)].1.buf,
            };
            *p = buf.device_ptr_mut(&self.stream).0;
        }
        (rows, weights, outs)
    }

    /// The tiled-product kernels of weight type `ty`, where it has them and a batch of
    /// `tokens` is large enough for them.
    fn mmq_kernel(&self, ty: GgmlType, tokens: usize) -> Option<&MmqKernels> {
        if self.mmq_min_tokens == 0 || tokens < self.mmq_min_tokens {
            return None;
        }
        match ty {
            GgmlType::Q4_K => Some(&self.k().mmq_q4_k),
            GgmlType::Q8_0 => Some(&self.k().mmq_q8_0),
            GgmlType::Q4_1 => Some(&self.k().mmq_q4_1),
            _ => None,
        }
    }

    /// `t` downloaded into the page-locked staging buffer (grown where too small), and
    /// `f` of its values there once every launch before has run.
    fn with_download<R>(
        &self,
        t: &GpuTensor,
        f: impl FnOnce(&[f32]) -> R,
    ) -> Result<R, EngineError> {
        let n = t.rows * t.width;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if staging.as_ref().is_none_or(|p| p.len() < n) {
            // Plain page-locked memory (not write-combined: the host reads it).
            // SAFETY: only the first `n` values are read, after the copy into them.
            let p = unsafe {
                self.stream
                    .context()
                    .alloc_pinned_with_flags::<f32>(n.max(1 << 16), 0)
            };
            *staging = Some(p.map_err(gpu_err("page-locked allocation"))?);
        }
        let p = staging
            .as_mut()
            .expect("allocated above")
            .as_mut_ptr()
            .map_err(gpu_err("page-locked memory"))?;
        // SAFETY: the allocation holds at least `n` values, and nothing else uses it
        // while the lock is held. (A copy takes its length from the host slice, so it is
        // cut to the tensor's.)
        let host = unsafe { std::slice::from_raw_parts_mut(p, n) };
        self.stream
            .memcpy_dtoh(&t.buf.slice(0..n), host)
            .map_err(gpu_err("download"))?;
        self.stream.synchronize().map_err(gpu_err("synchronize"))?;
        Ok(f(host))
    }

    /// For a batch of several sequences (not while recording), the device address of
    /// `layer`'s table of them, uploaded where it changed, and the shape the sequences
    /// share; `None` where a launch per sequence is needed.
    fn batch_of(&self, layer: usize, seqs: &mut [SeqRows<'_, GpuKv>]) -> Option<(u64, BatchShape)> {
        if seqs.len() < 2 || self.capturing.load(Ordering::Relaxed) {
            return None;
        }
        let shape = |kv: &GpuKv| BatchShape {
            n_head: kv.n_head,
            n_head_kv: kv.n_head_kv,
            head_dim: kv.head_dim,
            window: kv.layers[layer].window,
        };
        let first = shape(seqs[0].kv);
        if seqs.iter().any(|s| shape(s.kv) != first) {
            return None;
        }
        let mut entries = Vec::with_capacity(seqs.len() * std::mem::size_of::<SeqKv>());
        for s in seqs.iter_mut() {
            let kv = &mut *s.kv;
            let l = &mut kv.layers[layer];
            let e = SeqKv {
                kc: Out::of(&mut l.k, &self.stream),
                vc: Out::of(&mut l.v, &self.stream),
                parts: Out::of(&mut kv.parts, &self.stream),
                tickets: Out::of(&mut kv.tickets, &self.stream),
                row0: s.rows.start as i32,
                rows: s.rows.len() as i32,
                slots: l.slots as i32,
                max_chunks: kv.max_chunks as i32,
            };
            // SAFETY: SeqKv is #[repr(C)] of 8-byte addresses and i32s, with no padding.
            entries.extend_from_slice(unsafe {
                std::slice::from_raw_parts(
                    (&e as *const SeqKv).cast::<u8>(),
                    std::mem::size_of::<SeqKv>(),
                )
            });
        }
        let mut tables = self.seq_tables.lock().expect("table lock");
        if tables.len() <= layer {
            tables.resize_with(layer + 1, || None);
        }
        let slot = &mut tables[layer];
        if slot.as_ref().is_none_or(|t| t.entries != entries) {
            // The stream orders this upload after every launch that read the table.
            let upload = match slot.take() {
                Some(mut t) if t.buf.len() >= entries.len() => self
                    .stream
                    .memcpy_htod(&entries[..], &mut t.buf)
                    .map(|()| t.buf),
                _ => self.stream.clone_htod(&entries[..]),
            };
            match upload {
                Ok(buf) => *slot = Some(SeqTable { entries, buf }),
                Err(e) => {
                    self.fail("uploading a batch's sequences", e);
                    return None;
                }
            }
        }
        let table = slot.as_ref().expect("uploaded above");
        let addr = table.buf.device_ptr(&self.stream).0;
        Some((addr, first))
    }

    /// The grouped decode attention kernels (single row, batch) for `group` query heads
    /// a KV head, where they are on and exist for it.
    fn group_attention(&self, group: usize) -> Option<&(CudaFunction, CudaFunction)> {
        match group {
            2..=4 if self.grouped_attention => Some(&self.k().attention_group[group - 2]),
            _ => None,
        }
    }

    /// The held-activations matrix kernels of weight type `ty`, where it has them.
    fn held_kernels(&self, ty: GgmlType) -> Option<&HeldKernels> {
        match ty {
            GgmlType::Q4_K => Some(&self.k().matvec_q4_k_held),
            GgmlType::Q8_0 => Some(&self.k().matvec_q8_0_held),
            _ => None,
        }
    }

    /// The warp-cooperative matrix kernels of weight type `ty`, where it has them.
    fn matvec_kernels(&self, ty: GgmlType) -> Option<&MatvecKernels> {
        match ty {
            GgmlType::Q4_K => Some(&self.k().matvec_q4_k),
            GgmlType::Q4_1 => Some(&self.k().matvec_q4_1),
            GgmlType::Q5_0 => Some(&self.k().matvec_q5_0),
            GgmlType::Q8_0 => Some(&self.k().matvec_q8_0),
            GgmlType::Q6_K => Some(&self.k().matvec_q6_k),
            _ => None,
        }
    }

    /// Attention of sequence `seq` of `a` (kernels as `attend` in astra.cu): into
    /// `out`, or, with `quantized` (one decode row), as the quantized row of a matrix
    /// product's activations (its quantization kind, as [`quant_kind`]).
    fn launch_attention(
        &self,
        a: &mut Attend<'_, '_, Self>,
        seq: usize,
        out: &mut GpuTensor,
        quantized: Option<(&mut CudaSlice<u8>, i32)>,
    ) {
        let (q, positions, scale) = (a.q, a.positions, a.scale);
        let s = &mut a.seqs[seq];
        let kv = &mut *s.kv;
        let (n_head, group, hd) = (kv.n_head, kv.n_head / kv.n_head_kv, kv.head_dim);
        let l = &kv.layers[a.layer];
        let (row0, slots) = (s.rows.start as i32, l.slots as i32);
        let n = s.rows.len() as u32;
        let window = l.window.map_or(0, |w| w as i32);
        let (nh, grp, hdi) = (n_head as i32, group as i32, hd as i32);
        let (qout, qkind) = quantized.map_or((0u64, -1i32), |(buf, kind)| {
            (buf.device_ptr_mut(&self.stream).0, kind)
        });
        // A row's result is the same whichever kernel runs it (astra.cu, `attend`).
        let block_dim = (attention_threads(hd), 1, 1);
        if n == 1 {
            // The chunk's value rows in dynamic shared memory, each padded by 16 bytes
            // (astra.cu, chunk_part and SV_STRIDE).
            let shared = (CHUNK * (hd + 8) * 2) as u32;
            let grouped = self.group_attention(group);
            // The grouped kernel takes at least a CTA a head of its group (astra.cu,
            // `group_parts`).
            let (ctas, split) = if grouped.is_some() {
                (kv.n_head_kv, group * kv.max_chunks.min(self.split_ctas))
            } else {
                (n_head, kv.max_chunks.min(self.split_ctas))
            };
            let cfg = LaunchConfig {
                grid_dim: (ctas as u32, split as u32, 1),
                block_dim,
                shared_mem_bytes: shared,
            };
            let max_chunks = kv.max_chunks as i32;
            let args = AttentionSplitArgs {
                q: In::of(&q.buf, &self.stream),
                kc: In::of(&l.k, &self.stream),
                vc: In::of(&l.v, &self.stream),
                out: Out::of(&mut out.buf, &self.stream),
                row0,
                positions: In::of(positions, &self.stream),
                slots,
                window,
                n_head: nh,
                group: grp,
                head_dim: hdi,
                scale,
                qout: Out::addr(qout),
                qkind,
                parts: Out::of(&mut kv.parts, &self.stream),
                tickets: Out::of(&mut kv.tickets, &self.stream),
                max_chunks,
            };
            let Some(grouped) = grouped else {
                return self.launch(&self.k().attention.0, &args, cfg);
            };
            self.launch(&grouped.0, &args, cfg);
            self.launch(
                &self.k().attention_merge.0,
                &args,
                merge_grid(n_head, hd, 1),
            );
            return;
        }
        let cfg = LaunchConfig {
            grid_dim: (n_head as u32, n.div_ceil(4), 1),
            block_dim,
            shared_mem_bytes: 0,
        };
        let rows = n as i32;
        let args = AttentionArgs {
            q: In::of(&q.buf, &self.stream),
            kc: In::of(&l.k, &self.stream),
            vc: In::of(&l.v, &self.stream),
            out: Out::of(&mut out.buf, &self.stream),
            row0,
            positions: In::of(positions, &self.stream),
            rows,
            slots,
            window,
            n_head: nh,
            group: grp,
            head_dim: hdi,
            scale,
        };
        self.launch(&self.k().attention.1, &args, cfg);
    }

    /// The products of `outs` for a batch of `tokens` through cuBLAS, where they go
    /// there: from [`gemm::MIN_TOKENS`] tokens, and past [`MMQ_MAX_TOKENS`] where every
    /// matrix has tiled kernels.
    fn batched(&self, tokens: usize, outs: &[(&GpuMatrix, &mut GpuTensor)]) -> Option<&Gemm> {
        let tiled = tokens <= MMQ_MAX_TOKENS
            && outs
                .iter()
                .all(|(w, _)| self.mmq_kernel(w.ty, tokens).is_some());
        self.gemm.as_ref().filter(|_| {
            tokens >= gemm::MIN_TOKENS && !tiled && !self.capturing.load(Ordering::Relaxed)
        })
    }

    /// `input`'s rows (made in f32: normed into `normed`, gated over `gate`) times each
    /// matrix of `outs` through `gemm`, dequantized a slice of rows at a time; with
    /// `add_to`, the one product is added to it.
    fn products_through(
        &self,
        gemm: &Gemm,
        input: Input<'_, Self>,
        outs: &mut [(&GpuMatrix, &mut GpuTensor)],
        mut add_to: Option<&mut GpuTensor>,
    ) {
        assert!(
            add_to.is_none() || outs.len() == 1,
            "a residual add takes one matrix"
        );
        let x = input.make(self);
        let mut scratch = self.dequantized.lock().expect("scratch lock");
        for (w, out) in outs.iter_mut() {
            let row_bytes = astra_quant::row_bytes(w.ty, w.cols).expect("checked at load");
            let slice = (gemm::SLICE_BYTES / (4 * w.cols)).clamp(1, w.rows);
            if scratch.as_ref().is_none_or(|b| b.len() < slice * w.cols) {
                // SAFETY: every value read is first written by `dequantize`.
                match unsafe { self.stream.alloc::<f32>(slice * w.cols) } {
                    Ok(buf) => *scratch = Some(buf),
                    Err(e) => return self.fail("allocating dequantized weights", e),
                }
            }
            let dq = scratch.as_mut().expect("allocated above");
            let accumulate = add_to.is_some();
            let dst = match add_to.as_deref_mut() {
                Some(r) => r,
                None => &mut **out,
            };
            let base = w.data.device_ptr(&self.stream).0;
            let (ty, cols, rb) = (type_code(w.ty), w.cols as i32, row_bytes as i64);
            for row0 in (0..w.rows).step_by(slice) {
                let n = slice.min(w.rows - row0);
                let src = base + (row0 * row_bytes) as u64;
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, (w.cols as u32).div_ceil(THREADS), 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let args = DequantizeArgs {
                    ty,
                    w: In::addr(src),
                    out: Out::of(dq, &self.stream),
                    cols,
                    row_bytes: rb,
                };
                self.launch(&self.k().dequantize, &args, cfg);
                let done = gemm.product(
                    dq,
                    n,
                    w.cols,
                    &x.buf,
                    x.rows,
                    &mut dst.buf,
                    row0,
                    w.rows,
                    accumulate,
                );
                if let Err(e) = done {
                    return self.fail("cuBLAS product", e);
                }
            }
            self.gemm_products.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many matrix products have gone through cuBLAS.
    pub fn gemm_products(&self) -> u64 {
        self.gemm_products.load(Ordering::Relaxed)
    }

    /// The feed-forward of one decode row in three launches — norm + quantize; gate and
    /// up products gated and quantized for the down product by one kernel; the down
    /// product with the residual add (or, with a post-norm, the product, then the norm
    /// and add) — where its shapes and types allow: the down matrix taking 32-blocks,
    /// gate and up of one type with rows in whole 32s. `false` (nothing launched) where
    /// not, or where a capture would need to allocate.
    fn fused_feed_forward(&self, f: &mut FeedForward<'_, Self>) -> bool {
        let (g, u, d) = (f.gate, f.up, f.down);
        let Some(glu) = self.matvec_kernels(g.ty).and_then(|k| k.glu.as_ref()) else {
            return false;
        };
        let Some(kind) = quant_kind(d.act).filter(|&k| k < 2) else {
            return false;
        };
        if f.x.rows != 1
            || u.ty != g.ty
            || u.rows != g.rows
            || u.cols != g.cols
            || g.rows % 32 != 0
            || d.cols != g.rows
        {
            return false;
        }
        let mut acts = self.acts.lock().expect("scratch lock");
        let mut gated = self.gated_acts.lock().expect("scratch lock");
        // Reserve first: nothing is launched unless everything fits.
        if self.reserve(&mut acts, g.act, 1, g.cols).is_none()
            || self.reserve(&mut gated, d.act, 1, g.rows).is_none()
        {
            return false;
        }
        let normed_input = Input::Normed {
            x: &*f.x,
            w: f.norm,
            eps: f.eps,
            normed: &mut *f.normed,
        };
        assert!(
            self.quantize(&normed_input, g.act, &mut acts),
            "reserved above"
        );
        let (nb, act) = (
            (g.cols / g.ty.block_elems() as usize) as i32,
            glu_code(f.act),
        );
        let cfg = LaunchConfig {
            grid_dim: ((g.rows / 32) as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = MatvecGluArgs {
            wg: In::of(&g.data, &self.stream),
            wu: In::of(&u.data, &self.stream),
            a: In::of(acts.buf.as_ref().expect("reserved"), &self.stream),
            out: Out::of(gated.buf.as_mut().expect("reserved"), &self.stream),
            nb,
            kind,
            act,
        };
        self.launch(glu, &args, cfg);
        drop(acts);
        drop(gated);
        let down = |out: &mut GpuTensor, add_to: Option<&mut GpuTensor>| {
            self.matvecs(&self.gated_acts, 1, &mut [(d, out)], add_to, &mut |_, _| {
                true
            })
        };
        add_to_residual(self, f.post_norm, f.eps, f.out, f.x, down);
        true
    }

    /// How many decode steps have run as replays of a recorded graph.
    pub fn graph_replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// The kernels to launch now: the dependent-launch set while recording.
    fn k(&self) -> &Kernels {
        match &self.k_graph {
            Some(k) if self.capturing.load(Ordering::Relaxed) => k,
            _ => &self.k,
        }
    }

    /// Launches `f` with `args` (the argument struct its kernel takes) over `cfg`.
    fn launch<A: KernelArgs>(&self, f: &CudaFunction, args: &A, cfg: LaunchConfig) {
        // SAFETY: `A` is the argument struct `f` takes (astra.cu declares each kernel
        // with its struct from the prelude), and the grid covers exactly the elements
        // it writes.
        let dependent = self.k_graph.is_some() && self.capturing.load(Ordering::Relaxed);
        let result = unsafe { launch::launch(f, &self.stream, args, cfg, dependent) };
        if let Err(e) = result {
            if !self.capturing.load(Ordering::Relaxed) {
                return self.fail("kernel launch", e);
            }
            self.capture_failed.store(true, Ordering::Relaxed);
        }
    }
}

/// The tensor an [`Input`] makes its rows from (their count and width).
fn input_rows<'a>(input: &'a Input<'_, CudaBackend>) -> &'a GpuTensor {
    match input {
        Input::Rows(x) | Input::Normed { x, .. } => x,
        Input::Glu { gate, .. } => gate,
    }
}

/// Bytes of a block of activations quantized for `act` as the kernels keep it: the
/// stored format's, but for Q8_K, whose blocks the kernels pad to 304 bytes (astra.cu,
/// `Q8K_BYTES`: the same values, reordered for aligned loads).
fn device_block_bytes(act: ActType) -> usize {
    match act {
        ActType::Q8K => Q8K_BYTES,
        _ => act.ggml_type().block_bytes() as usize,
    }
}

/// Bytes of a row of `n` activations quantized for `act` as the kernels keep it.
fn device_row_bytes(act: ActType, n: usize) -> usize {
    n / act.ggml_type().block_elems() as usize * device_block_bytes(act)
}

/// Q8_0 weights in the kernels' layout (astra.cu, `q8_0_scale`): each row of `nb`
/// blocks as its quants, block by block, then its f16 scales — the same bytes per row,
/// so a row keeps its place, with block b's 32 quants at 32·b within it. Rows are
/// rearranged on every core, at least 256 to a task.
fn q8_0_rows_to_device(bytes: &[u8], nb: usize) -> Vec<u8> {
    let row_bytes = (34 * nb).max(1);
    let mut out = vec![0u8; bytes.len()];
    out.par_chunks_exact_mut(row_bytes)
        .zip(bytes.par_chunks_exact(row_bytes))
        .with_min_len(256)
        .for_each(|(dst, row)| {
            let (quants, scales) = dst.split_at_mut(32 * nb);
            for ((block, q), d) in row
                .chunks_exact(34)
                .zip(quants.chunks_exact_mut(32))
                .zip(scales.chunks_exact_mut(2))
            {
                d.copy_from_slice(&block[..2]);
                q.copy_from_slice(&block[2..]);
            }
        });
    out
}

/// A stored Q8_K block (d, quants, sums) in the kernels' order (quants, sums, d; the
/// padding zero).
#[cfg(test)]
fn q8k_to_device(block: &[u8]) -> [u8; Q8K_BYTES] {
    let mut out = [0u8; Q8K_BYTES];
    out[..256].copy_from_slice(&block[4..260]);
    out[256..288].copy_from_slice(&block[260..292]);
    out[288..292].copy_from_slice(&block[..4]);
    out
}

/// A weight type's tiled products (astra.cu, `mmq_*`): by token tiles of 8 a CTA (1, 2,
/// 4 and 8) with a CTA for every 16 rows; where the type has them, for 1 and 2 token
/// tiles with a CTA for every 32 and 64 rows (which share the activations' loads among
/// more rows), and for 4 and 8 token tiles a CTA of a warp a token tile for every 32
/// rows.
struct MmqKernels {
    by_tiles: [CudaFunction; 4],
    /// `tall[tiles - 1][0]` takes 32 rows a CTA, `[1]` 64.
    tall: Option<[[CudaFunction; 2]; 2]>,
    /// For 4 and 8 token tiles, 32 rows a CTA (`ASTRA_CUDA_MMQ_MANY=0`: `by_tiles`).
    many: Option<[CudaFunction; 2]>,
    /// The same tiles with a warp a row tile against two token tiles (the same bits),
    /// where the backend asks for them.
    pair: Option<[CudaFunction; 2]>,
    sms: usize,
    /// The most row tiles of 16 a CTA takes (`ASTRA_CUDA_MMQ_ROWS`, 4 unless set).
    max_row_tiles: usize,
}

impl MmqKernels {
    /// The kernel and launch for matrices of `rows` and a batch of `tokens`: for one or
    /// two token tiles, the most rows a CTA that still leave two CTAs or more for each
    /// SM.
    fn launch(&self, rows: [i32; 3], tokens: usize, pair: bool) -> (&CudaFunction, LaunchConfig) {
        let tiles = mmq_tiles(tokens);
        let ctas = |per: usize| -> usize {
            rows.iter()
                .map(|&r| (r as usize).div_ceil(16).div_ceil(per))
                .sum()
        };
        let plain = (
            &self.by_tiles[tiles.trailing_zeros() as usize],
            1,
            MMQ_WARPS,
        );
        let (f, per, warps) = match (&self.tall, &self.many) {
            (Some(tall), _) if tiles <= 2 => [(4, 1), (2, 0)]
                .into_iter()
                .find(|&(per, _)| per <= self.max_row_tiles && ctas(per) >= 2 * self.sms)
                .map_or(plain, |(per, i)| (&tall[tiles - 1][i], per, MMQ_WARPS)),
            (_, Some(many)) if tiles >= 4 => {
                let kernels = self.pair.as_ref().filter(|_| pair).unwrap_or(many);
                (&kernels[tiles / 8], 2, tiles)
            }
            _ => plain,
        };
        let cfg = LaunchConfig {
            grid_dim: (ctas(per) as u32, tokens.div_ceil(8 * tiles) as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        (f, cfg)
    }
}

/// The token tiles of 8 a tiled-product CTA takes for a batch of `tokens`: 1, 2, 4 or 8.
fn mmq_tiles(tokens: usize) -> usize {
    tokens.div_ceil(8).next_power_of_two().min(8)
}

/// The matrix kernels' launch: a warp per output row (four warps per block of 128
/// threads), a grid row per token, or per group of tokens a warp takes.
fn matvec_grid(rows: usize, tokens: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(4), tokens as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Weight types the matvec kernel reads.
fn supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::Q4_K
            | GgmlType::Q6_K
            | GgmlType::IQ2_S
    )
}

impl Backend for CudaBackend {
    type Tensor = GpuTensor;
    type Matrix = GpuMatrix;
    type Vector = CudaSlice<f32>;
    type KvCache = GpuKv;
    type Ids = CudaSlice<u32>;
    type Graph = StepGraph;
    type Host = PinnedLogits;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        format!("cuda ({})", self.device)
    }

    fn device_memory_in_use(&self) -> Option<u64> {
        let (free, total) = self.stream.context().mem_get_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }

    fn matrix(&self, file: &Arc<GgufFile>, m: &MatRef) -> Result<GpuMatrix, EngineError> {
        if !supported(m.ty) {
            return Err(EngineError::Unsupported(format!(
                "{} weights on the CUDA backend",
                m.ty
            )));
        }
        let bytes = m.view(file).bytes();
        let data = match m.ty {
            GgmlType::Q8_0 => self.stream.clone_htod(&q8_0_rows_to_device(
                bytes,
                m.cols / m.ty.block_elems() as usize,
            )),
            _ => self.stream.clone_htod(bytes),
        };
        let data = data.map_err(gpu_err("uploading weights"))?;
        Ok(GpuMatrix {
            data,
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            act: ActType::for_weights(m.ty).map_err(|e| EngineError::Invalid(e.to_string()))?,
        })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaSlice<f32>, EngineError> {
        self.stream
            .clone_htod(v)
            .map_err(gpu_err("uploading a vector"))
    }

    fn tensor(&self, rows: usize, width: usize) -> Result<GpuTensor, EngineError> {
        debug_assert!(
            !self.capturing.load(Ordering::Relaxed),
            "no allocation while recording"
        );
        let n = rows
            .checked_mul(width)
            .ok_or_else(|| EngineError::Invalid(format!("a tensor of {rows} × {width}")))?;
        let buf = self
            .stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(gpu_err("allocating a tensor"))?;
        Ok(GpuTensor { buf, rows, width })
    }

    fn tensor_from(&self, data: &[f32], width: usize) -> Result<GpuTensor, EngineError> {
        Ok(GpuTensor {
            buf: self.upload(data)?,
            rows: data.len() / width.max(1),
            width,
        })
    }

    fn check(&self) -> Result<(), EngineError> {
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        failure.map_or(Ok(()), |f| Err(EngineError::Backend(f)))
    }

    fn kv_cache(&self, layout: &KvLayout) -> Result<GpuKv, EngineError> {
        if layout.elem != KvType::F16 {
            return Err(EngineError::Invalid(format!(
                "the CUDA backend keeps its KV cache in f16, not {}",
                layout.elem.name()
            )));
        }
        // astra.cu's attention: a thread per element of a head, up to MAX_HEAD_DIM.
        if layout.head_dim > MAX_HEAD_DIM {
            return Err(EngineError::Invalid(format!(
                "the CUDA attention takes heads of up to {} elements, not {}",
                MAX_HEAD_DIM, layout.head_dim
            )));
        }
        let layers = layout
            .layers
            .iter()
            .enumerate()
            .map(|(l, &LayerSlots { slots, window })| {
                let n = layout.layer_elems(l);
                let k = self
                    .stream
                    .alloc_zeros::<u16>(n)
                    .map_err(gpu_err("allocating the KV cache"))?;
                let v = self
                    .stream
                    .alloc_zeros::<u16>(n)
                    .map_err(gpu_err("allocating the KV cache"))?;
                Ok(LayerKv {
                    k,
                    v,
                    slots,
                    window,
                })
            })
            .collect::<Result<_, EngineError>>()?;
        // A row at position p of a layer sees at most its slots' positions, from
        // wherever a chunk starts.
        let max_chunks = layout
            .layers
            .iter()
            .map(|l| l.slots.div_ceil(CHUNK) + 1)
            .max()
            .unwrap_or(1);
        let parts = self
            .stream
            .alloc_zeros::<f32>(layout.n_head * max_chunks * (layout.head_dim + 2))
            .map_err(gpu_err("allocating the KV cache"))?;
        let tickets = self
            .stream
            .alloc_zeros::<u32>(layout.n_head)
            .map_err(gpu_err("allocating the KV cache"))?;
        Ok(GpuKv {
            layers,
            n_head: layout.n_head,
            n_head_kv: layout.n_head_kv,
            head_dim: layout.head_dim,
            parts,
            tickets,
            max_chunks,
        })
    }

    fn read(&self, t: &GpuTensor) -> Result<Vec<f32>, EngineError> {
        self.with_download(t, |host| host.to_vec())
    }

    fn read_append(&self, t: &GpuTensor, out: &mut PinnedLogits) -> Result<(), EngineError> {
        let n = t.rows * t.width;
        let at = out.reserve(self.stream.context(), n)?;
        // SAFETY: `reserve` made room for `n` values at `at`, which nothing else uses
        // while `out` is borrowed. (A copy takes its length from the host slice, so it
        // is cut to the tensor's.)
        let host = unsafe { std::slice::from_raw_parts_mut(at, n) };
        self.stream
            .memcpy_dtoh(&t.buf.slice(0..n), host)
            .map_err(gpu_err("download"))?;
        self.stream.synchronize().map_err(gpu_err("synchronize"))?;
        out.len += n;
        Ok(())
    }

    fn embed(
        &self,
        table: &GpuMatrix,
        ids: &CudaSlice<u32>,
        scale: Option<f32>,
        out: &mut GpuTensor,
    ) {
        let row_bytes =
            astra_quant::row_bytes(table.ty, table.cols).expect("checked at load") as i64;
        let (ty, cols, s, scaled) = (
            type_code(table.ty),
            table.cols as i32,
            scale.unwrap_or(1.0),
            i32::from(scale.is_some()),
        );
        let cfg = LaunchConfig {
            grid_dim: ((table.cols as u32).div_ceil(THREADS), ids.len() as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = EmbedArgs {
            ty,
            table: In::of(&table.data, &self.stream),
            tokens: In::of(ids, &self.stream),
            out: Out::of(&mut out.buf, &self.stream),
            cols,
            row_bytes,
            scale: s,
            scaled,
        };
        self.launch(&self.k().embed, &args, cfg);
    }

    fn gather(&self, x: &GpuTensor, rows: &[usize]) -> Result<GpuTensor, EngineError> {
        let mut out = self.tensor(rows.len(), x.width)?;
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.upload(&idx)?;
        let width = x.width as i32;
        let cfg = rows_grid(x.width, rows.len());
        let args = GatherArgs {
            x: In::of(&x.buf, &self.stream),
            rows: In::of(&idx, &self.stream),
            out: Out::of(&mut out.buf, &self.stream),
            width,
        };
        self.launch(&self.k().gather, &args, cfg);
        Ok(out)
    }

    fn rms_norm(&self, x: &GpuTensor, w: &CudaSlice<f32>, eps: f32, out: &mut GpuTensor) {
        let n = w.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: ((x.rows * x.width / w.len()) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = RmsNormArgs {
            x: In::of(&x.buf, &self.stream),
            w: In::of(w, &self.stream),
            out: Out::of(&mut out.buf, &self.stream),
            n,
            eps,
        };
        self.launch(&self.k().rms_norm, &args, cfg);
    }

    fn rms_norm_groups(&self, x: &mut GpuTensor, w: &CudaSlice<f32>, eps: f32) {
        let n = w.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: ((x.rows * x.width / w.len()) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = RmsNormInplaceArgs {
            x: Out::of(&mut x.buf, &self.stream),
            w: In::of(w, &self.stream),
            n,
            eps,
        };
        self.launch(&self.k().rms_norm_inplace, &args, cfg);
    }

    fn matmul(&self, x: &GpuTensor, outs: &mut [(&GpuMatrix, &mut GpuTensor)]) {
        self.product(Input::Rows(x), outs, None);
    }

    fn product(
        &self,
        input: Input<'_, Self>,
        outs: &mut [(&GpuMatrix, &mut GpuTensor)],
        add_to: Option<&mut GpuTensor>,
    ) {
        let tokens = input_rows(&input).rows;
        if let Some(gemm) = self.batched(tokens, outs) {
            self.products_through(gemm, input, outs, add_to);
            return;
        }
        self.matvecs(&self.acts, tokens, outs, add_to, &mut |act, scratch| {
            self.quantize(&input, act, scratch)
        });
    }

    fn attention_product(
        &self,
        mut a: Attend<'_, '_, Self>,
        att: &mut GpuTensor,
        w: &GpuMatrix,
        out: &mut GpuTensor,
        add_to: Option<&mut GpuTensor>,
    ) {
        // One decode row of one sequence, for a matrix taking 32-blocks: each warp of the
        // attention kernel quantizes the 32 outputs it holds, the f32 row never stored.
        let kind = quant_kind(w.act).filter(|&k| k < 2);
        let fused = match (&*a.seqs, kind) {
            ([s], Some(_)) => a.q.rows == 1 && s.rows == (0..1) && s.kv.head_dim % 32 == 0,
            _ => false,
        };
        let Some(kind) = kind.filter(|_| fused) else {
            self.attention(a, att);
            self.product(Input::Rows(att), &mut [(w, out)], add_to);
            return;
        };
        self.matvecs(
            &self.acts,
            1,
            &mut [(w, out)],
            add_to,
            &mut |act, scratch| {
                let Some(qout) = self.reserve(scratch, act, a.q.rows, a.q.width) else {
                    return false;
                };
                self.launch_attention(&mut a, 0, att, Some((qout, kind)));
                true
            },
        );
    }

    fn feed_forward(&self, mut f: FeedForward<'_, Self>) {
        if !self.fused_feed_forward(&mut f) {
            compose_feed_forward(self, f);
        }
    }

    fn norm_add(&self, o: &mut GpuTensor, w: &CudaSlice<f32>, eps: f32, x: &mut GpuTensor) {
        if w.len() != o.width {
            // Per-head groups: as composed.
            self.rms_norm_groups(o, w, eps);
            self.add(x, o);
            return;
        }
        let n = o.width as i32;
        let cfg = LaunchConfig {
            grid_dim: (o.rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = RmsNormAddArgs {
            o: In::of(&o.buf, &self.stream),
            w: In::of(w, &self.stream),
            x: Out::of(&mut x.buf, &self.stream),
            n,
            eps,
        };
        self.launch(&self.k().rms_norm_add, &args, cfg);
    }

    fn prepare_attention(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, GpuKv>],
        positions: &CudaSlice<u32>,
        q: &mut GpuTensor,
        k: &mut GpuTensor,
        v: &GpuTensor,
        heads: &Heads<'_, CudaSlice<f32>>,
    ) {
        let ptr = |v: Option<&CudaSlice<f32>>| v.map_or(0u64, |v| v.device_ptr(&self.stream).0);
        let (qn, kn) = (ptr(heads.q_norm), ptr(heads.k_norm));
        let r = heads.rope;
        let theta_scale = r.base.powf(-2.0 / r.dims as f32);
        let hd = heads.head_dim;
        let (n_q, n_k) = ((q.width / hd) as i32, (k.width / hd) as i32);
        let (hdi, dims, neox, qs, eps) = (
            hd as i32,
            r.dims as i32,
            i32::from(r.neox),
            heads.q_scale.unwrap_or(0.0),
            heads.eps,
        );
        // One sequence: its keys and values are stored by the same launch.
        let store = match seqs {
            [s] if s.rows == (0..q.rows) => {
                let l = &mut s.kv.layers[layer];
                Some((
                    l.k.device_ptr_mut(&self.stream).0,
                    l.v.device_ptr_mut(&self.stream).0,
                    l.slots as i32,
                ))
            }
            _ => None,
        };
        let (kc, vc, slots) = store.unwrap_or((0, 0, 0));
        let ctas = n_q + n_k + if store.is_some() { n_k } else { 0 };
        let threads = (hd as u32).div_ceil(32) * 32;
        let cfg = LaunchConfig {
            grid_dim: (ctas as u32, q.rows as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = QkRopeArgs {
            q: Out::of(&mut q.buf, &self.stream),
            k: Out::of(&mut k.buf, &self.stream),
            v: In::of(&v.buf, &self.stream),
            q_norm: In::addr(qn),
            k_norm: In::addr(kn),
            positions: In::of(positions, &self.stream),
            n_q,
            n_k,
            head_dim: hdi,
            dims,
            theta_scale,
            neox,
            eps,
            q_scale: qs,
            kc: Out::addr(kc),
            vc: Out::addr(vc),
            slots,
        };
        self.launch(&self.k().qk_rope, &args, cfg);
        if store.is_none() {
            self.kv_store(layer, seqs, positions, k, v);
        }
    }

    fn ids(&self, v: &[u32]) -> Result<CudaSlice<u32>, EngineError> {
        self.upload(v)
    }

    fn write_ids(&self, dst: &mut CudaSlice<u32>, v: &[u32]) {
        if let Err(e) = self.stream.memcpy_htod(v, dst) {
            self.fail("writing token ids", e);
        }
    }

    fn rope(&self, x: &mut GpuTensor, head_dim: usize, pos: &CudaSlice<u32>, r: Rope) {
        // The angle step exactly as the CPU engine computes it.
        let theta_scale = r.base.powf(-2.0 / r.dims as f32);
        let (width, hd, dims, neox) = (
            x.width as i32,
            head_dim as i32,
            r.dims as i32,
            i32::from(r.neox),
        );
        let cfg = LaunchConfig {
            grid_dim: ((x.width / head_dim) as u32, x.rows as u32, 1),
            block_dim: ((r.dims / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = RopeArgs {
            x: Out::of(&mut x.buf, &self.stream),
            positions: In::of(pos, &self.stream),
            width,
            head_dim: hd,
            dims,
            theta_scale,
            neox,
        };
        self.launch(&self.k().rope, &args, cfg);
    }

    fn scale(&self, x: &mut GpuTensor, s: f32) {
        let n = (x.rows * x.width) as i64;
        let args = ScaleArgs {
            x: Out::of(&mut x.buf, &self.stream),
            n,
            s,
        };
        self.launch(&self.k().scale, &args, grid_for(n as usize));
    }

    fn add(&self, x: &mut GpuTensor, y: &GpuTensor) {
        let n = (x.rows * x.width) as i64;
        let args = AddArgs {
            x: Out::of(&mut x.buf, &self.stream),
            y: In::of(&y.buf, &self.stream),
            n,
        };
        self.launch(&self.k().add, &args, grid_for(n as usize));
    }

    fn glu(&self, gate: &mut GpuTensor, up: &GpuTensor, act: Activation) {
        let n = (gate.rows * gate.width) as i64;
        let a = glu_code(act);
        let args = GluArgs {
            gate: Out::of(&mut gate.buf, &self.stream),
            up: In::of(&up.buf, &self.stream),
            n,
            act: a,
        };
        self.launch(&self.k().glu, &args, grid_for(n as usize));
    }

    fn add_bias(&self, x: &mut GpuTensor, b: &CudaSlice<f32>) {
        let n = (x.rows * x.width) as i64;
        let args = AddBiasArgs {
            x: Out::of(&mut x.buf, &self.stream),
            b: In::of(b, &self.stream),
            n,
            width: x.width as i64,
        };
        self.launch(&self.k().add_bias, &args, grid_for(n as usize));
    }

    fn mul(&self, x: &mut GpuTensor, y: &GpuTensor) {
        let n = (x.rows * x.width) as i64;
        let args = MulArgs {
            x: Out::of(&mut x.buf, &self.stream),
            y: In::of(&y.buf, &self.stream),
            n,
        };
        self.launch(&self.k().mul, &args, grid_for(n as usize));
    }

    fn tanh(&self, x: &mut GpuTensor) {
        let n = (x.rows * x.width) as i64;
        let args = TanhArgs {
            x: Out::of(&mut x.buf, &self.stream),
            n,
        };
        self.launch(&self.k().tanh, &args, grid_for(n as usize));
    }

    fn scale_rows(&self, x: &mut GpuTensor, s: &[f32]) {
        if x.rows == 0 {
            return;
        }
        let s = match self.upload(s) {
            Ok(s) => s,
            Err(e) => return self.fail("row scales", e),
        };
        let args = ScaleRowsArgs {
            x: Out::of(&mut x.buf, &self.stream),
            s: In::of(&s, &self.stream),
            width: x.width as i32,
        };
        self.launch(&self.k().scale_rows, &args, rows_grid(x.width, x.rows));
    }

    fn scatter(&self, src: &GpuTensor, rows: &[usize], dst: &mut GpuTensor) {
        if rows.is_empty() {
            return;
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = match self.upload(&idx) {
            Ok(i) => i,
            Err(e) => return self.fail("scatter rows", e),
        };
        let args = ScatterArgs {
            x: In::of(&src.buf, &self.stream),
            rows: In::of(&idx, &self.stream),
            out: Out::of(&mut dst.buf, &self.stream),
            width: dst.width as i32,
        };
        self.launch(&self.k().scatter, &args, rows_grid(dst.width, rows.len()));
    }

    fn kv_store(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, GpuKv>],
        positions: &CudaSlice<u32>,
        k: &GpuTensor,
        v: &GpuTensor,
    ) {
        if let Some((table, kv)) = self.batch_of(layer, seqs) {
            let rows = seqs.iter().map(|s| s.rows.len()).max().unwrap_or(0);
            let cfg = LaunchConfig {
                grid_dim: (kv.n_head_kv as u32, rows as u32, seqs.len() as u32),
                block_dim: (kv.head_dim as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = KvStoreBatchArgs {
                k: In::of(&k.buf, &self.stream),
                v: In::of(&v.buf, &self.stream),
                positions: In::of(positions, &self.stream),
                seqs: In::addr(table),
                kv_dim: (kv.n_head_kv * kv.head_dim) as i32,
                head_dim: kv.head_dim as i32,
            };
            return self.launch(&self.k().kv_store_batch, &args, cfg);
        }
        for s in seqs.iter_mut() {
            let kv = &mut *s.kv;
            let (hd, kv_dim) = (kv.head_dim, kv.n_head_kv * kv.head_dim);
            let l = &mut kv.layers[layer];
            // Positions are read on the device, so a replayed graph follows them.
            let (row0, slots) = (s.rows.start as i32, l.slots as i32);
            let cfg = LaunchConfig {
                grid_dim: (kv.n_head_kv as u32, s.rows.len() as u32, 1),
                block_dim: (hd as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let (kd, hdi) = (kv_dim as i32, hd as i32);
            let args = KvStoreArgs {
                k: In::of(&k.buf, &self.stream),
                v: In::of(&v.buf, &self.stream),
                kc: Out::of(&mut l.k, &self.stream),
                vc: Out::of(&mut l.v, &self.stream),
                row0,
                positions: In::of(positions, &self.stream),
                slots,
                kv_dim: kd,
                head_dim: hdi,
            };
            self.launch(&self.k().kv_store, &args, cfg);
        }
    }

    fn attention(&self, mut a: Attend<'_, '_, Self>, out: &mut GpuTensor) {
        let decode_rows = a.seqs.iter().all(|s| s.rows.len() == 1);
        if let Some((table, kv)) = self.batch_of(a.layer, a.seqs).filter(|_| decode_rows) {
            // As many CTAs a head as the longest row spans chunks (this launch is not
            // recorded, so the positions are known); a row's bits do not depend on how
            // many (astra.cu, `attention_split`).
            let group = kv.n_head / kv.n_head_kv;
            let grouped = self.group_attention(group);
            let (ctas, per_head) = if grouped.is_some() {
                (kv.n_head_kv, group)
            } else {
                (kv.n_head, 1)
            };
            let split = per_head
                * a.seqs
                    .iter()
                    .map(|s| (s.pos + 1).div_ceil(CHUNK).min(self.split_ctas))
                    .max()
                    .unwrap_or(1);
            let cfg = LaunchConfig {
                grid_dim: (ctas as u32, split as u32, a.seqs.len() as u32),
                block_dim: (attention_threads(kv.head_dim), 1, 1),
                shared_mem_bytes: (CHUNK * (kv.head_dim + 8) * 2) as u32,
            };
            let args = AttentionBatchArgs {
                q: In::of(&a.q.buf, &self.stream),
                out: Out::of(&mut out.buf, &self.stream),
                positions: In::of(a.positions, &self.stream),
                seqs: In::addr(table),
                window: kv.window.map_or(0, |w| w as i32),
                n_head: kv.n_head as i32,
                group: (kv.n_head / kv.n_head_kv) as i32,
                head_dim: kv.head_dim as i32,
                scale: a.scale,
            };
            let Some(grouped) = grouped else {
                return self.launch(&self.k().attention_batch, &args, cfg);
            };
            self.launch(&grouped.1, &args, cfg);
            let merge = merge_grid(kv.n_head, kv.head_dim, a.seqs.len());
            return self.launch(&self.k().attention_merge.1, &args, merge);
        }
        for seq in 0..a.seqs.len() {
            self.launch_attention(&mut a, seq, out, None);
        }
    }

    fn record(&self, launches: &mut dyn FnMut()) -> Option<StepGraph> {
        if !self.graphs {
            launches();
            return None;
        }
        let generation = self.scratch_generation.load(Ordering::Relaxed);
        // Thread-local: other threads' calls (memory queries) stay legal meanwhile.
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if let Err(e) = self.stream.begin_capture(mode) {
            self.fail("beginning a capture", e);
            launches();
            return None;
        }
        self.capturing.store(true, Ordering::Relaxed);
        launches();
        self.capturing.store(false, Ordering::Relaxed);
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        let failed = self.capture_failed.swap(false, Ordering::Relaxed);
        match graph {
            Ok(Some(graph)) if !failed => match graph.launch() {
                Ok(()) => Some(StepGraph { graph, generation }),
                Err(e) => {
                    self.fail("launching a recorded step", e);
                    None
                }
            },
            // Nothing ran: run it as plain launches.
            _ => {
                launches();
                None
            }
        }
    }

    fn separate_decode_steps(&self) -> usize {
        if self.graphs {
            self.separate_steps
        } else {
            1
        }
    }

    fn replay(&self, g: &StepGraph) -> bool {
        if self.scratch_generation.load(Ordering::Relaxed) != g.generation {
            return false;
        }
        if let Err(e) = g.graph.launch() {
            self.fail("replaying a recorded step", e);
        }
        self.replays.fetch_add(1, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device's Q8_0 rows hold each stored block's scale and quants where the
    /// kernels read them (scale b at 32·nb + 2b, quants at 32·b): rebuilt from there,
    /// every row dequantizes to the stored row's values. Rows of an odd block count
    /// too, whose rows begin 2-byte aligned.
    #[test]
    fn q8_0_device_rows_hold_the_stored_blocks() {
        for nb in [1, 18, 45, 128] {
            let rows = 3;
            let stored =
                astra_quant::parity::random_weights(GgmlType::Q8_0, rows, 32 * nb, nb as u64)
                    .unwrap();
            let device = q8_0_rows_to_device(&stored, nb);
            assert_eq!(device.len(), stored.len());
            for (r, row) in device.chunks_exact(34 * nb).enumerate() {
                let rebuilt: Vec<u8> = (0..nb)
                    .flat_map(|b| {
                        [
                            &row[32 * nb + 2 * b..32 * nb + 2 * b + 2],
                            &row[32 * b..32 * b + 32],
                        ]
                        .concat()
                    })
                    .collect();
                let (mut want, mut got) = (vec![0f32; 32 * nb], vec![0f32; 32 * nb]);
                astra_quant::dequantize(
                    GgmlType::Q8_0,
                    &stored[r * 34 * nb..(r + 1) * 34 * nb],
                    &mut want,
                )
                .unwrap();
                astra_quant::dequantize(GgmlType::Q8_0, &rebuilt, &mut got).unwrap();
                assert_eq!(got, want, "{nb} blocks, row {r}");
                assert!(want.iter().any(|&v| v != 0.0));
            }
        }
    }

    /// Activation quantization on the GPU gives the CPU engine's bytes. Needs a GPU;
    /// without one it says so (scripts/gpu-check runs it on a GPU machine).
    #[test]
    fn quantization_matches_the_cpu_bytes() {
        if let Some(why) = unavailable_reason() {
            eprintln!("SKIPPED: {why}");
            return;
        }
        let gpu = CudaBackend::new(0, Mode::Deterministic).unwrap();
        let cols = 512;
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        let t = gpu.tensor_from(&x, cols).unwrap();
        for act in [ActType::Q8_0, ActType::Q8_1, ActType::Q8K] {
            let mut scratch = Scratch { buf: None };
            assert!(gpu.quantize(&Input::Rows(&t), act, &mut scratch));
            let rb = act.row_bytes(cols).unwrap();
            let mut got = gpu
                .stream
                .clone_dtoh(scratch.buf.as_ref().unwrap())
                .unwrap();
            got.truncate(3 * device_row_bytes(act, cols));
            let mut want = vec![0u8; 3 * rb];
            for (row, out) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rb)) {
                act.quantize(row, out);
            }
            let mut block = act.ggml_type().block_bytes() as usize;
            if act == ActType::Q8K {
                // The kernels' order of the same values; their padding is never written.
                want = want.chunks_exact(block).flat_map(q8k_to_device).collect();
                block = Q8K_BYTES;
                for (g, w) in got.chunks_exact_mut(block).zip(want.chunks_exact(block)) {
                    g[292..].copy_from_slice(&w[292..]);
                }
            }
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            let diffs: Vec<(usize, u8, u8)> = got
                .iter()
                .zip(&want)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| (i % block, *a, *b))
                .take(24)
                .collect();
            eprintln!(
                "{act:?}: {} differing bytes; (offset in block, gpu, cpu): {diffs:?}",
                got.iter().zip(&want).filter(|(a, b)| a != b).count()
            );
            assert_eq!(
                first,
                None,
                "{act:?}: first differing byte (of {}); gpu {:?} cpu {:?}",
                want.len(),
                first.map(|i| &got[i.saturating_sub(4)..(i + 8).min(got.len())]),
                first.map(|i| &want[i.saturating_sub(4)..(i + 8).min(want.len())])
            );
        }
    }
}
