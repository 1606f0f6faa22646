//! Matrix × vector throughput per weight type, in weight bytes per second, beside the
//! machine's streaming read bandwidth measured the same way, so each figure reads as a
//! fraction of what memory can deliver.
//!
//! Groups:
//! - `stream_read/{1,2}t`: summing a 1 GiB buffer of u64 (the bandwidth ceiling).
//! - `matvec_4096/{type}/{1,2}t`: a 4096 × 4096 matrix of every supported type.
//! - `matvec_models/{type}/{cols}x{rows}`: the real models' matrix shapes and types, on
//!   all threads (`BENCH_THREADS` sets how many), packed where the kernels pack rows as
//!   the engine does; `.../stored` beside it, the same rows unpacked.
//! - `matmul_prefill/{type}/{cols}x{rows}`: the models' shapes against a batch of 128
//!   tokens on one thread, in multiply-adds per second (the prefill kernels' compute
//!   rate; weights and activations stay in cache).
//! - `matmul_batch/{type}/{tokens}`: a matrix larger than the caches (packed as the
//!   engine packs it) against a decode batch of 1, 4 or 16 tokens on one thread, in
//!   multiply-adds per second: what a batch of sequences gains over one.
//! - `matmul_step/{tokens}`: every product of one SmolLM2 decode step (30 layers of
//!   Q4_1 matrices, then the Q8_0 output head; random weights, 96 MB) against a batch
//!   of 1, 4 or 16 tokens on two threads, grouped as the engine groups them (Q, K and
//!   V in one parallel step, gate and up in one): the products' part of a step, with
//!   the short runs of rows that split small matrices between threads.
//!
//! Run: `cargo bench -p astra-quant --bench matvec` (on an idle machine).

use std::hint::black_box;
use std::time::Duration;

use astra_quant::matmul::{
    matmul_many_on, matmul_quantized, pack, MatmulJob, QuantMatrix, QuantizedActivations, Rayon,
};
use astra_quant::parity::{random_weights, SplitMix};
use astra_quant::{GgmlType, Kernels, SUPPORTED_TYPES};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

/// Sums the buffer in independent lanes so that loads, not the adds, limit it: with
/// 256-bit loads where AVX2 is present (as the kernels load), else eight u64 lanes.
fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { sum_words_avx2(words) };
    }
    let mut acc = [0u64; 8];
    for chunk in words.chunks_exact(8) {
        for (a, w) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(*w);
        }
    }
    acc.iter().fold(0, |s, a| s.wrapping_add(*a))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for chunk in words.chunks_exact(16) {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_add_epi64(*a, _mm256_loadu_si256(chunk.as_ptr().add(4 * k).cast()));
        }
    }
    let mut lanes = [0u64; 4];
    for a in acc {
        let mut v = [0u64; 4];
        _mm256_storeu_si256(v.as_mut_ptr().cast(), a);
        for (l, x) in lanes.iter_mut().zip(v) {
            *l = l.wrapping_add(x);
        }
    }
    lanes.iter().fold(0, |s, a| s.wrapping_add(*a))
}

fn stream_read(c: &mut Criterion) {
    let words: Vec<u64> = (0..(1u64 << 27)).collect(); // 1 GiB
    let mut g = c.benchmark_group("stream_read");
    g.throughput(Throughput::Bytes(8 << 27))
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    for threads in [1, 2] {
        let p = pool(threads);
        g.bench_function(format!("{threads}t"), |b| {
            b.iter(|| {
                p.install(|| {
                    words
                        .par_chunks(words.len() / threads)
                        .map(sum_words)
                        .reduce(|| 0, |a, b| a.wrapping_add(b))
                })
            })
        });
    }
    g.finish();
}

/// A random `rows × cols` matrix of `ty` with its best kernels, packed as the engine
/// holds it where `pack_rows` and the kernels have a packing.
struct Held {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    packed: bool,
    kernels: Kernels,
}

impl Held {
    fn new(ty: GgmlType, rows: usize, cols: usize, seed: u64, pack_rows: bool) -> Held {
        let stored = random_weights(ty, rows, cols, seed).expect("weights");
        let kernels = Kernels::best(ty).expect("kernels");
        let m = QuantMatrix::new(ty, rows, cols, &stored).expect("matrix");
        let (bytes, packed) = match pack(&m, &kernels).filter(|_| pack_rows) {
            Some(packed) => (packed, true),
            None => (stored, false),
        };
        Held {
            ty,
            rows,
            cols,
            bytes,
            packed,
            kernels,
        }
    }

    fn view(&self) -> QuantMatrix<'_> {
        let (ty, rows, cols, bytes) = (self.ty, self.rows, self.cols, &self.bytes[..]);
        match self.packed {
            true => QuantMatrix::packed(ty, rows, cols, bytes),
            false => QuantMatrix::new(ty, rows, cols, bytes),
        }
        .expect("matrix")
    }
}

/// `rows × cols` of `ty` times one token on `threads` threads; the rows packed where
/// `packed` and the kernels have a packing.
fn bench_matvec(
    g: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    id: BenchmarkId,
    (ty, cols, rows): (GgmlType, usize, usize),
    threads: usize,
    packed: bool,
) {
    let held = Held::new(ty, rows, cols, 1, packed);
    let (w, kernels) = (held.view(), &held.kernels);
    let mut rng = SplitMix::new(2);
    let x: Vec<f32> = (0..cols).map(|_| rng.activation()).collect();
    let mut out = vec![0.0f32; rows];
    let p = pool(threads);
    g.throughput(Throughput::Bytes(held.bytes.len() as u64));
    g.bench_function(id, |b| {
        b.iter(|| {
            p.install(|| {
                // Quantizing the activations is part of every matvec.
                let acts =
                    QuantizedActivations::new(kernels.act, black_box(&x), cols).expect("acts");
                matmul_quantized(&w, &acts, &mut out, kernels);
            });
            black_box(&out);
        })
    });
}

fn matvec_4096(c: &mut Criterion) {
    let mut g = c.benchmark_group("matvec_4096");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for ty in SUPPORTED_TYPES {
        for threads in [1, 2] {
            bench_matvec(
                &mut g,
                BenchmarkId::new(ty.name(), format!("{threads}t")),
                (ty, 4096, 4096),
                threads,
                true,
            );
        }
    }
    g.finish();
}

fn matvec_models(c: &mut Criterion) {
    let threads: usize = std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // (type, cols, rows) of the real models' matrices: SmolLM2 (Q4_1 blocks, Q8_0
    // embeddings/output) and Gemma 3 (Q5_0, Q4_K, Q6_K, Q8_0 output).
    let shapes = [
        (GgmlType::Q4_1, 576, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q8_0, 576, 49152),
        (GgmlType::Q5_0, 640, 1024),
        (GgmlType::Q5_0, 640, 2048),
        (GgmlType::Q4_K, 2048, 640),
        (GgmlType::Q6_K, 2048, 640),
        (GgmlType::Q8_0, 640, 262144),
    ];
    let mut g = c.benchmark_group("matvec_models");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (ty, cols, rows) in shapes {
        bench_matvec(
            &mut g,
            BenchmarkId::new(ty.name(), format!("{cols}x{rows}")),
            (ty, cols, rows),
            threads,
            true,
        );
        if Kernels::best(ty).is_ok_and(|k| k.packing.is_some()) {
            bench_matvec(
                &mut g,
                BenchmarkId::new(ty.name(), format!("{cols}x{rows}/stored")),
                (ty, cols, rows),
                threads,
                false,
            );
        }
    }
    g.finish();
}

fn matmul_prefill(c: &mut Criterion) {
    const TOKENS: usize = 128;
    let shapes = [
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q5_0, 640, 2048),
        (GgmlType::Q8_0, 640, 1024),
        (GgmlType::Q4_K, 2048, 640),
        (GgmlType::Q6_K, 2048, 640),
    ];
    let mut g = c.benchmark_group("matmul_prefill");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let p = pool(1);
    for (ty, cols, rows) in shapes {
        let weights = random_weights(ty, rows, cols, 1).expect("weights");
        let w = QuantMatrix::new(ty, rows, cols, &weights).expect("matrix");
        let kernels = Kernels::best(ty).expect("kernels");
        let mut rng = SplitMix::new(2);
        let x: Vec<f32> = (0..cols * TOKENS).map(|_| rng.activation()).collect();
        let mut out = vec![0.0f32; rows * TOKENS];
        g.throughput(Throughput::Elements((rows * cols * TOKENS) as u64));
        g.bench_function(BenchmarkId::new(ty.name(), format!("{cols}x{rows}")), |b| {
            b.iter(|| {
                p.install(|| {
                    let acts =
                        QuantizedActivations::new(kernels.act, black_box(&x), cols).expect("acts");
                    matmul_quantized(&w, &acts, &mut out, &kernels);
                });
                black_box(&out);
            })
        });
    }
    g.finish();
}

fn matmul_batch(c: &mut Criterion) {
    // 96 times SmolLM2's feed-forward matrix, 53 MB in Q4_1: past the caches, so each
    // call streams the rows from memory as a decode step does.
    let (cols, rows) = (576, 96 * 1536);
    let mut g = c.benchmark_group("matmul_batch");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let p = pool(1);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let held = Held::new(ty, rows, cols, 1, true);
        let (w, kernels) = (held.view(), &held.kernels);
        for tokens in [1, 4, 16] {
            let mut rng = SplitMix::new(2);
            let x: Vec<f32> = (0..cols * tokens).map(|_| rng.activation()).collect();
            let acts = QuantizedActivations::new(kernels.act, &x, cols).expect("acts");
            let mut out = vec![0.0f32; rows * tokens];
            g.throughput(Throughput::Elements((rows * cols * tokens) as u64));
            g.bench_function(BenchmarkId::new(ty.name(), tokens), |b| {
                b.iter(|| {
                    p.install(|| matmul_quantized(&w, black_box(&acts), &mut out, kernels));
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

/// SmolLM2-135M's products: (weight type, rows, columns) of each matrix, in groups that
/// share an input, layer by layer; then the output head.
fn smollm2_products() -> Vec<Vec<(GgmlType, usize, usize)>> {
    let q = GgmlType::Q4_1;
    let layer = [
        vec![(q, 576, 576), (q, 192, 576), (q, 192, 576)],
        vec![(q, 576, 576)],
        vec![(q, 1536, 576), (q, 1536, 576)],
        vec![(q, 576, 1536)],
    ];
    let mut step: Vec<_> = (0..30).flat_map(|_| layer.clone()).collect();
    step.push(vec![(GgmlType::Q8_0, 49152, 576)]);
    step
}

fn matmul_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul_step");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let step: Vec<Vec<Held>> = smollm2_products()
        .iter()
        .enumerate()
        .map(|(i, group)| {
            group
                .iter()
                .map(|&(ty, rows, cols)| Held::new(ty, rows, cols, i as u64, true))
                .collect()
        })
        .collect();
    let macs: usize = step.iter().flatten().map(|h| h.rows * h.cols).sum();
    let p = pool(2);
    for tokens in [1, 4, 16] {
        // Each group's input, quantized once for its matrices (one weight type each).
        let mut rng = SplitMix::new(3);
        let acts: Vec<QuantizedActivations> = step
            .iter()
            .map(|group| {
                let x: Vec<f32> = (0..group[0].cols * tokens)
                    .map(|_| rng.activation())
                    .collect();
                QuantizedActivations::new(group[0].kernels.act, &x, group[0].cols).expect("acts")
            })
            .collect();
        let mut outs: Vec<Vec<Vec<f32>>> = step
            .iter()
            .map(|group| group.iter().map(|h| vec![0.0; h.rows * tokens]).collect())
            .collect();
        g.throughput(Throughput::Elements((macs * tokens) as u64));
        g.bench_function(BenchmarkId::from_parameter(tokens), |b| {
            b.iter(|| {
                p.install(|| {
                    for ((group, acts), outs) in step.iter().zip(&acts).zip(&mut outs) {
                        let mut jobs: Vec<MatmulJob> = group
                            .iter()
                            .zip(outs.iter_mut())
                            .map(|(h, out)| MatmulJob {
                                w: h.view(),
                                acts,
                                out,
                                kernels: &h.kernels,
                            })
                            .collect();
                        matmul_many_on(&Rayon, &mut jobs);
                    }
                });
                black_box(&outs);
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    stream_read,
    matvec_4096,
    matvec_models,
    matmul_prefill,
    matmul_batch,
    matmul_step
);
criterion_main!(benches);
