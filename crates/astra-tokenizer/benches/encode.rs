//! Encoding throughput on a 35 KB English document (the GPL v3), for each real model's
//! tokenizer, in bytes of text per second. Needs the models in the cache.
//!
//! Run: `cargo bench -p astra-tokenizer --bench encode`

use astra_gguf::GgufFile;
use astra_tokenizer::{EncodeOptions, Tokenizer};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn encode(c: &mut Criterion) {
    let text = include_str!("../tests/data/GPL-3");
    let mut g = c.benchmark_group("encode_gpl3");
    g.throughput(Throughput::Bytes(text.len() as u64))
        .sample_size(20);
    for model in ["smollm2-135m", "gemma3-270m"] {
        let Some(path) = astra_models::model_for_test(model) else {
            continue;
        };
        let tok = Tokenizer::from_metadata(GgufFile::open(path).expect("model").metadata())
            .expect("tokenizer");
        let opts = EncodeOptions {
            add_special: true,
            parse_special: true,
        };
        g.bench_function(model, |b| {
            b.iter(|| tok.encode(std::hint::black_box(text), opts))
        });
    }
    g.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
