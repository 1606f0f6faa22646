//! The CUDA backend on a GPU (each test says SKIPPED and passes where there is none):
//! determinism of its logits across batching and caching in the deterministic mode, and
//! the default mode's batched products against it, on random-weight models of the real
//! models' shapes and of a Llama 3 1B shape (rows in whole 256-blocks, as large Llama
//! models have them).

use std::sync::Arc;

use astra_cuda::{unavailable_reason, CudaBackend, Mode};
use astra_engine::{Logits, Model, Step};

fn gpu_model(
    like: &str,
    ty: astra_gguf::GgmlType,
    mode: Mode,
) -> Option<(tempfile::TempDir, Arc<Model<CudaBackend>>)> {
    gpu_model_with(like, ty, mode, |b| b)
}

/// As [`gpu_model`], the backend first passed through `setup`.
fn gpu_model_with(
    like: &str,
    ty: astra_gguf::GgmlType,
    mode: Mode,
    setup: impl FnOnce(CudaBackend) -> CudaBackend,
) -> Option<(tempfile::TempDir, Arc<Model<CudaBackend>>)> {
    if let Some(why) = unavailable_reason() {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{like}.gguf"));
    astra_synth::write(astra_synth::shape(like).unwrap(), ty, 7, &path).unwrap();
    let model = Model::load_on(setup(CudaBackend::new(0, mode).unwrap()), &path).unwrap();
    Some((dir, model))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits of a prompt fed as one batch, token by token (decode steps replayed from a
/// recorded graph, recorded again midway when a larger batch of another sequence has
/// replaced the buffers it read; past 64 positions a decode row's attention spreads its
/// chunks over CTAs), and in chunks over the cached prefix; and of 1, 4 and 16 sequences
/// sharing batches: all bitwise the same. Decode attention runs three ways, a CTA per
/// query head, a CTA per KV head's group of them (a head and chunk a CTA at these
/// depths), and with two CTAs a head, so that the grouped kernel takes whole groups a
/// chunk a CTA past the second chunk; it equals the batch's every way.
fn deterministic(like: &str, ty: astra_gguf::GgmlType) {
    for (grouped, split) in [(false, None), (true, None), (true, Some(2))] {
        let setup = |b: CudaBackend| {
            let b = b.with_grouped_attention(grouped);
            match split {
                Some(ctas) => b.with_split_ctas(ctas),
                None => b,
            }
        };
        let Some((_dir, model)) = gpu_model_with(like, ty, Mode::Deterministic, setup) else {
            return;
        };
        let how = format!("grouped attention {grouped}, split {split:?}");
        deterministic_on(&model, &format!("{like} ({how})"));
    }
}

fn deterministic_on(model: &Model<CudaBackend>, like: &str) {
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7919) % 20000 + 300).collect();
    let n = prompt.len();
    let whole = {
        let mut s = model.session(1024).unwrap();
        bits(&model.forward(&mut s, &prompt, 0).unwrap())
    };
    let one_by_one = {
        let replays = model.backend.graph_replays();
        let mut s = model.session(1024).unwrap();
        let mut out: Vec<f32> = prompt[..75]
            .iter()
            .flat_map(|&t| model.forward(&mut s, &[t], 0).unwrap())
            .collect();
        let mut other = model.session(1024).unwrap();
        let long: Vec<u32> = (0..512u32).map(|i| (i * 104_729) % 20000 + 300).collect();
        model.forward(&mut other, &long, 511).unwrap();
        out.extend(
            prompt[75..]
                .iter()
                .flat_map(|&t| model.forward(&mut s, &[t], 0).unwrap()),
        );
        // Every step but the two recordings (first, and after the scratch grew) replayed.
        if std::env::var("ASTRA_CUDA_GRAPHS").map_or(true, |v| v != "0") {
            let replayed = model.backend.graph_replays() - replays;
            assert!(
                replayed as usize >= n - 10,
                "{like}: {replayed} of {n} decode steps replayed a graph"
            );
        }
        bits(&out)
    };
    let chunked = {
        let mut s = model.session(1024).unwrap();
        let mut out = Vec::new();
        for part in [&prompt[..7], &prompt[7..70], &prompt[70..71], &prompt[71..]] {
            out.extend(model.forward(&mut s, part, 0).unwrap());
        }
        bits(&out)
    };
    assert!(whole == one_by_one, "{like}: batch vs token by token");
    assert!(
        whole == chunked,
        "{like}: batch vs chunks over the cached prefix"
    );
    // The last 20 tokens decoded with 0, 3 and 15 other sequences in the same batches.
    let alone = &whole[whole.len() - 20 * model.cfg.n_vocab..];
    for others in [0usize, 3, 15] {
        let mut sessions: Vec<_> = (0..=others).map(|_| model.session(1024).unwrap()).collect();
        let prompts: Vec<Vec<u32>> = (0..=others)
            .map(|i| {
                if i == 0 {
                    prompt.clone()
                } else {
                    prompt.iter().map(|t| t + i as u32).collect()
                }
            })
            .collect();
        for (s, p) in sessions.iter_mut().zip(&prompts) {
            model.forward(s, &p[..n - 20], 0).unwrap();
        }
        let mut got = Vec::new();
        for i in n - 20..n {
            let mut steps: Vec<Step<CudaBackend>> = sessions
                .iter_mut()
                .zip(&prompts)
                .map(|(session, p)| Step {
                    session,
                    tokens: &p[i..i + 1],
                    logits_from: 0,
                })
                .collect();
            let mut logits = Logits::default();
            model.forward_many(&mut steps, &mut logits).unwrap();
            got.extend_from_slice(logits.get(0));
        }
        assert!(
            bits(&got) == alone,
            "{like}: decoding beside {others} other sequences"
        );
    }
}

#[test]
fn smollm2_shape_is_deterministic_on_the_gpu() {
    deterministic("smollm2-135m", astra_gguf::GgmlType::Q4_1);
}

#[test]
fn gemma3_shape_is_deterministic_on_the_gpu() {
    deterministic("gemma3-270m", astra_gguf::GgmlType::Q4_K);
}

/// K-quant matrices all through (every activation quantized to Q8_K; the 8B shape's
/// kernels, on a smaller model), in Q4_K and in Q6_K.
#[test]
fn llama3_1b_shape_is_deterministic_on_the_gpu() {
    deterministic("llama3-1b", astra_gguf::GgmlType::Q4_K);
    deterministic("llama3-1b", astra_gguf::GgmlType::Q6_K);
}

/// The default mode: a prompt's products go through cuBLAS (TF32, activations not
/// quantized), and each position's logits stay close to the deterministic mode's, whose
/// products quantize activations to 8-bit blocks as the CPU engine does: relative L2
/// within `median` at the median position and `worst` at every one, and the same top
/// token at nine positions in ten or more. (Full-f32 GEMM, `ASTRA_CUDA_GEMM=f32`, gives
/// the same distances: they are the 8-bit rounding's, which the random gemma3-shaped
/// model amplifies at a few positions.)
fn batched_products_stay_close(like: &str, ty: astra_gguf::GgmlType, median: f64, worst: f64) {
    let Some((dir, fast)) = gpu_model(like, ty, Mode::Fast) else {
        return;
    };
    let exact = Model::load_on(
        CudaBackend::new(0, Mode::Deterministic).unwrap(),
        &dir.path().join(format!("{like}.gguf")),
    )
    .unwrap();
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 7919) % 20000 + 300).collect();
    let logits = |m: &Model<CudaBackend>| {
        let mut s = m.session(1024).unwrap();
        m.forward(&mut s, &prompt, 0).unwrap()
    };
    let before = fast.backend.gemm_products();
    let (got, want) = (logits(&fast), logits(&exact));
    assert!(
        fast.backend.gemm_products() > before,
        "{like}: the prompt's products did not go through cuBLAS"
    );
    let n = fast.cfg.n_vocab;
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
    };
    let mut same_top = 0;
    let mut apart: Vec<(f64, usize)> = Vec::new();
    for (i, (g, w)) in got.chunks_exact(n).zip(want.chunks_exact(n)).enumerate() {
        let d: f64 = g
            .iter()
            .zip(w)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum();
        let r: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum();
        apart.push(((d / r).sqrt(), i));
        same_top += usize::from(argmax(g) == argmax(w));
    }
    apart.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mid = apart[apart.len() / 2].0;
    eprintln!(
        "{like}: relative L2 of a position's logits: median {mid:.3e}, largest (distance, position) {:?}; same top token at {same_top} of {} positions",
        &apart[..3],
        prompt.len()
    );
    assert!(
        mid < median,
        "{like}: median position's logits {mid:.3e} apart (relative L2)"
    );
    assert!(
        apart[0].0 < worst,
        "{like}: position {}'s logits {:.3e} apart (relative L2)",
        apart[0].1,
        apart[0].0
    );
    assert!(
        same_top * 10 >= prompt.len() * 9,
        "{like}: the top token differs at {} of {} positions",
        prompt.len() - same_top,
        prompt.len()
    );
}

#[test]
fn smollm2_shape_batches_stay_close_to_deterministic() {
    batched_products_stay_close("smollm2-135m", astra_gguf::GgmlType::Q4_1, 1e-2, 1e-2);
}

#[test]
fn gemma3_shape_batches_stay_close_to_deterministic() {
    batched_products_stay_close("gemma3-270m", astra_gguf::GgmlType::Q4_K, 5e-2, 1.0);
}

/// Q4_K products of 17–64 tokens give the same bits with a warp a token tile and with
/// a warp a row tile against two token tiles: prompts of 24 and 40 tokens (four and
/// eight token tiles), every position's logits, on the llama3-1b shape.
#[test]
fn paired_q4_k_tiles_equal_a_warp_a_token_tile() {
    let setup = |b: CudaBackend| b.with_paired_tiles(false);
    let Some((dir, single)) =
        gpu_model_with("llama3-1b", astra_gguf::GgmlType::Q4_K, Mode::Fast, setup)
    else {
        return;
    };
    let paired = Model::load_on(
        CudaBackend::new(0, Mode::Fast)
            .unwrap()
            .with_paired_tiles(true),
        &dir.path().join("llama3-1b.gguf"),
    )
    .unwrap();
    for n in [24u32, 40] {
        let prompt: Vec<u32> = (0..n).map(|i| (i * 7919) % 20000 + 300).collect();
        let logits = |m: &Model<CudaBackend>| {
            let mut s = m.session(256).unwrap();
            bits(&m.forward(&mut s, &prompt, 0).unwrap())
        };
        assert!(
            logits(&single) == logits(&paired),
            "{n} tokens: paired tiles differ"
        );
    }
}

/// A device failure is an error, never a panic, and the backend serves the next step:
/// an allocation far beyond the device's memory fails with the driver's error, and a
/// forward pass afterwards gives the same logits as before it.
#[test]
fn a_device_failure_is_an_error_and_the_next_step_runs() {
    use astra_engine::Backend;
    let Some((_dir, model)) = gpu_model("smollm2-135m", astra_gguf::GgmlType::Q4_1, Mode::Fast)
    else {
        return;
    };
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919) % 20000 + 300).collect();
    let run = || {
        let mut s = model.session(256).unwrap();
        bits(&model.forward(&mut s, &prompt, 0).unwrap())
    };
    let before = run();
    // 2^52 bytes of f32: no device has them.
    let err = match model.backend.tensor(1 << 40, 1 << 10) {
        Ok(_) => panic!("a 4 PiB tensor was allocated"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("CUDA"), "{err}");
    assert!(
        model.backend.check().is_ok(),
        "an allocation's error is its own"
    );
    assert_eq!(run(), before);
}
