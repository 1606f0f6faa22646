//! One query against one attention chunk of cached keys and values ([`attend_rows`]):
//! the scores, their softmax weights and the weighted values of a query head, as
//! decode runs it once per (sequence, head, chunk), in keys per second.
//!
//! Groups: `attend_rows/{f16,f32}/{head_dim}`, 64 keys (a whole chunk), heads of 64
//! (SmolLM2), 128 (Llama 3) and 256 (Gemma 3).
//!
//! Run: `cargo bench -p astra-engine --bench attention` (on an idle machine).

use std::hint::black_box;
use std::time::Duration;

use astra_engine::attention::CHUNK;
use astra_engine::ops::{attend_rows, KvElem};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::f16;

fn case<T: KvElem>(c: &mut Criterion, name: &str, elem: fn(f32) -> T) {
    let mut group = c.benchmark_group(format!("attend_rows/{name}"));
    group
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(CHUNK as u64));
    for hd in [64usize, 128, 256] {
        let q: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.07)
            .collect();
        let k: Vec<T> = (0..CHUNK * hd)
            .map(|i| elem(((i * 53 % 17) as f32 - 8.0) * 0.031))
            .collect();
        let v: Vec<T> = (0..CHUNK * hd)
            .map(|i| elem(((i * 29 % 13) as f32 - 6.0) * 0.053))
            .collect();
        let (mut weights, mut acc) = (vec![0.0f32; CHUNK], vec![0.0f32; hd]);
        group.bench_function(hd.to_string(), |b| {
            b.iter(|| {
                acc.fill(0.0);
                black_box(attend_rows(
                    black_box(&q),
                    &k,
                    &v,
                    0.125,
                    &mut weights,
                    &mut acc,
                ))
            })
        });
    }
    group.finish();
}

fn bench(c: &mut Criterion) {
    case::<f16>(c, "f16", f16::from_f32);
    case::<f32>(c, "f32", |x| x);
}

criterion_group!(benches, bench);
criterion_main!(benches);
