//! The `astra` binary, run as a user runs it: exit codes, output shapes, and results
//! on the real models.

use std::process::{Command, Output};

use serde_json::Value;

fn astra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_astra"))
        .args(args)
        .output()
        .expect("run astra")
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "astra failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn model(name: &str) -> Option<String> {
    astra_models::model_for_test(name).map(|p| p.to_string_lossy().into_owned())
}

#[test]
fn inspect_reports_the_real_models() {
    for (name, arch, blocks, tensors) in [
        ("smollm2-135m", "llama", 30, 272),
        ("gemma3-270m", "gemma3", 18, 236),
    ] {
        let Some(path) = model(name) else { continue };
        let v = json(&astra(&["inspect", &path, "--json"]));
        assert_eq!(v["architecture"], arch);
        assert_eq!(v["block_count"], blocks);
        assert_eq!(v["tensor_count"], tensors);
        let text = String::from_utf8(astra(&["inspect", &path]).stdout).unwrap();
        assert!(
            text.contains(&format!("architecture:  {arch}"))
                && text.contains(&format!("{tensors} tensors")),
            "{text}"
        );
    }
}

#[test]
fn bad_input_is_one_clear_line_and_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00").unwrap();
    let out = astra(&["inspect", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.starts_with("error: ") && err.contains("bad.gguf") && err.contains("at byte 8"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let out = astra(&["inspect", "no-such-model"]);
    assert!(!out.status.success());
    assert!(String::from_utf8(out.stderr)
        .unwrap()
        .contains("known: smollm2-135m"));
    let out = astra(&["parity", "kernels", "--type", "q9_9"]);
    assert!(!out.status.success());
}

/// `parity moe`: every routed feed-forward case within its bound of the f64 reference
/// on the CPU, the table naming each expert type.
#[test]
fn parity_moe_is_within_bounds() {
    let out = astra(&["parity", "moe"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("24 cases, 0 failed"), "{stdout}");
    for ty in ["F16", "IQ2_S", "Q2_0", "IQ2_XS", "Q2_K", "Q4_K", "Q8_0"] {
        assert!(stdout.contains(&format!("| {ty} ")), "{ty}: {stdout}");
    }
}

/// `parity kernels --save DIR` then `--bitwise DIR`: the same build matches its own
/// baseline bit for bit, and a changed baseline fails with what differs.
#[test]
fn parity_baselines_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let base = ["parity", "kernels", "--type", "q4_0", "--isa", "scalar"];
    let save = astra(&[&base[..], &["--save", d]].concat());
    assert!(
        save.status.success(),
        "{}",
        String::from_utf8_lossy(&save.stderr)
    );
    let same = astra(&[&base[..], &["--bitwise", d]].concat());
    assert!(
        same.status.success(),
        "{}",
        String::from_utf8_lossy(&same.stdout)
    );
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let changed = astra(&[&base[..], &["--bitwise", d]].concat());
    assert!(!changed.status.success());
    assert!(String::from_utf8(changed.stdout)
        .unwrap()
        .contains("outputs differ in some bit"));
}

/// `parity kernels --type attention`: the attention cases within their bound, and the
/// paged caches' outputs (`ASTRA_ATTN=2`) bit for bit those of the contiguous ones
/// saved under `ASTRA_ATTN=1`.
#[test]
fn paged_attention_equals_the_contiguous_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let run = |attn: &str, how: &str| {
        Command::new(env!("CARGO_BIN_EXE_astra"))
            .args(["parity", "kernels", "--type", "attention", how, d])
            .env("ASTRA_ATTN", attn)
            .output()
            .expect("run astra")
    };
    let save = run("1", "--save");
    let stdout = String::from_utf8_lossy(&save.stdout);
    assert!(save.status.success(), "{stdout}");
    assert!(stdout.contains("contiguous f16 KV cache"), "{stdout}");
    assert_eq!(
        stdout.matches("54 attention cases, 0 failed").count(),
        2,
        "{stdout}"
    );
    assert!(!stdout.contains("| Q4_0"), "no dot kernels: {stdout}");
    let same = run("2", "--bitwise");
    let stdout = String::from_utf8_lossy(&same.stdout);
    assert!(same.status.success(), "{stdout}");
    assert!(!stdout.contains("contiguous"), "{stdout}");
    assert_eq!(
        stdout.matches("54 attention cases, 0 failed").count(),
        2,
        "{stdout}"
    );
}

/// `bench --depth`: both tests run after that many tokens are in the cache, and a depth
/// past the model's context is one clear line.
#[test]
fn bench_runs_at_a_depth() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let v = json(&astra(&[
        "bench", "-m", &path, "-p", "8", "-n", "2", "-d", "70", "-r", "1", "--json",
    ]));
    assert_eq!(v["depth"], 70);
    assert!(
        v["pp_tokens_per_s"].as_f64().unwrap() > 0.0
            && v["tg_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    let text = String::from_utf8(
        astra(&[
            "bench", "-m", &path, "-p", "8", "-n", "2", "-d", "70", "-r", "1",
        ])
        .stdout,
    )
    .unwrap();
    assert!(
        text.contains("| pp8 @ d70 |") && text.contains("| tg2 @ d70 |"),
        "{text}"
    );
    let out = astra(&["bench", "-m", &path, "-p", "8", "-n", "2", "-d", "8190"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.starts_with("error: ") && err.contains("context of 8192"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // Several sequences decoded together, at a depth, counted in all.
    let v = json(&astra(&[
        "bench", "-m", &path, "-p", "0", "-n", "3", "-d", "20", "-s", "3", "-r", "1", "--json",
    ]));
    assert_eq!(v["sequences"], 3);
    assert!(v["tg_tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    let text = String::from_utf8(
        astra(&[
            "bench", "-m", &path, "-p", "0", "-n", "2", "-s", "2", "-r", "1",
        ])
        .stdout,
    )
    .unwrap();
    assert!(text.contains("| tg2 × 2 |"), "{text}");
    for bad in ["0", "513"] {
        let out = astra(&["bench", "-m", &path, "-s", bad]);
        assert!(
            !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--sequences"),
            "-s {bad}"
        );
    }
}

/// `--backend cuda` (with and without `--deterministic`) where there is no GPU: every
/// command that takes it fails with one clear line, the server before opening its port.
/// Where a GPU is present, tests/gpu.rs and scripts/gpu-check run the backend instead.
#[test]
fn cuda_without_a_gpu_is_one_clear_line() {
    let Some(why) = astra_cuda::unavailable_reason() else {
        eprintln!("SKIPPED: a GPU is present; tests/gpu.rs and scripts/gpu-check cover --backend cuda there");
        return;
    };
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "a short text to score\n").unwrap();
    let text = text.to_str().unwrap();
    let commands: [&[&str]; 4] = [
        &["run", "-m", &path, "-p", "hi", "-n", "1"],
        &["bench", "-m", &path, "-p", "8", "-n", "1", "-r", "1"],
        &["perplexity", "-m", &path, "-f", text],
        &["serve", "-m", &path, "--port", "0"],
    ];
    for command in commands {
        for mode in [&[][..], &["--deterministic"][..]] {
            let args: Vec<&str> = command
                .iter()
                .chain(&["--backend", "cuda"])
                .chain(mode)
                .copied()
                .collect();
            let out = astra(&args);
            assert!(!out.status.success(), "{args:?} succeeded without a GPU");
            let err = String::from_utf8(out.stderr).unwrap();
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(
                err.starts_with("error: ") && err.contains(&why),
                "{args:?}: {err}"
            );
        }
    }
}

/// `parity layers` on the real SmolLM2: the CPU's scalar kernels against its default
/// set, stage by stage. The same arithmetic associated differently: the embeddings
/// equal, every later distance small (a wrong kernel gives distances near 1), the
/// first block at float rounding's size unless an 8-bit activation block rounds
/// one value the other way, and the same first token.
#[test]
fn parity_layers_traces_every_block() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    if astra_quant::Isa::selected() == astra_quant::Isa::Scalar {
        eprintln!("SKIPPED: this CPU runs the scalar kernels already; there is no second instruction set to compare");
        return;
    }
    let out = astra(&[
        "parity",
        "layers",
        "-m",
        &path,
        "-p",
        "The capital of France is",
        "-n",
        "8",
        "-t",
        "2",
        "--isa",
        "scalar",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    // Rows "| stage | rel L2 | max abs |" (and, with a GPU, two more pairs), the scalar
    // kernels' first.
    let rows: Vec<(&str, f64)> = text
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            Some((cells.get(1)?.to_owned(), cells.get(2)?.parse().ok()?))
        })
        .collect();
    let stages: Vec<&str> = rows.iter().map(|r| r.0).collect();
    assert_eq!(stages.len(), 1 + 2 * 30 + 1, "{text}");
    assert_eq!(
        &stages[..3],
        ["embedding", "layer 0 attention", "layer 0"],
        "{text}"
    );
    assert_eq!(stages[stages.len() - 1], "logits", "{text}");
    assert_eq!(rows[0].1, 0.0, "the same embedding rows: {text}");
    assert!(rows[1].1 < 1e-3, "layer 0's attention: {text}");
    assert!(rows.iter().all(|r| r.1 < 0.1), "{text}");
    // "  NAME: PIECE LOGPROB, ..." (the piece quoted, perhaps with spaces).
    let top = |name: &str| {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("  {name}: ")))
            .unwrap_or_else(|| panic!("no top 5 of {name}: {text}"));
        line.split(", ")
            .next()
            .unwrap()
            .rsplit_once(' ')
            .unwrap()
            .0
            .to_owned()
    };
    assert_eq!(top("cpu"), "\" Paris\"", "{text}");
    assert_eq!(top("cpu scalar"), top("cpu"), "{text}");
    assert!(text.contains("greedy, 8 tokens:"), "{text}");
}

#[test]
fn tokenize_prints_llama_cpp_ids() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    // llama.cpp's ids for "Hello world" on SmolLM2 (tokenizer test data).
    assert_eq!(
        json(&astra(&["tokenize", "-m", &path, "Hello world"])),
        serde_json::json!([19556, 905])
    );
    let v = json(&astra(&[
        "tokenize",
        "-m",
        &path,
        "--pieces",
        "--no-special",
        "<|im_end|>",
    ]));
    assert!(
        v.as_array().unwrap().len() > 1,
        "special text must not become the special token: {v}"
    );
}

#[test]
fn run_greedy_continues_as_llama_cpp_and_is_reproducible() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let args = [
        "run",
        "-m",
        &path,
        "-p",
        "The capital of France is",
        "--temp",
        "0",
        "-n",
        "8",
        "--json",
        "-t",
        "2",
    ];
    let a = json(&astra(&args));
    let b = json(&astra(&args));
    assert_eq!(a["tokens"], b["tokens"]);
    // llama.cpp's greedy continuation begins " Paris.\n\nThe United States".
    assert!(a["text"].as_str().unwrap().starts_with(" Paris."), "{a}");
    assert_eq!(a["timings"]["prompt_tokens"], 5);
    let sampled = [
        "run",
        "-m",
        &path,
        "-p",
        "Once upon a time",
        "--temp",
        "0.9",
        "--seed",
        "7",
        "-n",
        "12",
        "--json",
    ];
    assert_eq!(
        json(&astra(&sampled))["tokens"],
        json(&astra(&sampled))["tokens"],
        "same seed, same tokens"
    );
}

/// `--kv-type f32` runs (the same greedy start as the f16 cache here) and says so in
/// the bench report; with `--backend cuda` it is refused in one line, GPU or not.
#[test]
fn an_f32_kv_cache_is_chosen_by_a_flag() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let run = json(&astra(&[
        "run",
        "-m",
        &path,
        "-p",
        "The capital of France is",
        "--temp",
        "0",
        "-n",
        "4",
        "--json",
        "--kv-type",
        "f32",
    ]));
    assert!(
        run["text"].as_str().unwrap().starts_with(" Paris."),
        "{run}"
    );
    let bench = json(&astra(&[
        "bench",
        "-m",
        &path,
        "-p",
        "8",
        "-n",
        "2",
        "-r",
        "1",
        "--json",
        "--kv-type",
        "f32",
    ]));
    assert!(
        bench["backend"].as_str().unwrap().contains("f32 KV cache"),
        "{bench}"
    );
    let out = astra(&[
        "run",
        "-m",
        &path,
        "-p",
        "hi",
        "--backend",
        "cuda",
        "--kv-type",
        "f32",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--kv-type f32 is for the CPU backend") && err.lines().count() == 1,
        "{err}"
    );
    let out = astra(&["run", "-m", &path, "-p", "hi", "--kv-type", "f8"]);
    assert!(!out.status.success());
}

#[test]
fn perplexity_command_reports_llama_cpp_format() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(60),
    )
    .unwrap();
    let out = astra(&[
        "perplexity",
        "-m",
        &path,
        "-f",
        text.to_str().unwrap(),
        "--ctx",
        "128",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let ppl: f64 = stdout
        .split("PPL = ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // A sentence repeated sixty times is nearly certain after the first copies.
    assert!(ppl > 1.0 && ppl < 1.5, "{stdout}");
}

/// `astra synth` writes models of the real ones' shapes that load and generate, with the
/// real files' tensor counts; a quant type whose blocks do not divide a row falls back
/// to q5_0 for that matrix (as llama.cpp's quantizer does); `--ctx` sets the context
/// length.
#[test]
fn synth_writes_loadable_models_of_known_shapes() {
    let dir = tempfile::tempdir().unwrap();
    for (like, ty, tensors) in [
        ("smollm2-135m", "q4_1", 272),
        ("gemma3-270m", "q4_k", 236),
        ("qwen3-0.6b", "q4_0", 310),
    ] {
        let path = dir.path().join(format!("{like}.gguf"));
        let p = path.to_str().unwrap();
        let out = astra(&["synth", "--like", like, "--type", ty, "-o", p]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json(&astra(&["inspect", p, "--json"]));
        assert_eq!(v["tensor_count"], tensors, "{like}");
        if like == "gemma3-270m" {
            let types = &v["tensor_types"];
            assert!(
                types["Q5_0"]["tensors"].as_u64() > Some(0)
                    && types["Q4_K"]["tensors"].as_u64() > Some(0),
                "{types}"
            );
        }
        let run = json(&astra(&[
            "run", "-m", p, "-p", "hello", "-n", "3", "--temp", "0", "--json",
        ]));
        assert_eq!(run["tokens"].as_array().unwrap().len(), 3);
    }
    // --ctx sets the context length the file states.
    let path = dir.path().join("long.gguf");
    let p = path.to_str().unwrap();
    let out = astra(&["synth", "--like", "smollm2-135m", "--ctx", "16384", "-o", p]);
    assert!(out.status.success());
    let v = json(&astra(&["inspect", p, "--json"]));
    assert_eq!(v["hyperparameters"]["context_length"], 16384, "{v}");
    let out = astra(&[
        "synth",
        "--like",
        "gpt-5",
        "-o",
        dir.path().join("x.gguf").to_str().unwrap(),
    ]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unknown shape")
    );
}

/// `bench --greedy`: times per repetition, and each sequence's greedy ids, the same on
/// 1 and 2 threads and whether its sequence is decoded alone or beside another.
#[test]
fn bench_greedy_reports_times_and_ids() {
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let run = |threads: &str, seqs: &str| {
        json(&astra(&[
            "bench", "-m", &path, "-p", "12", "-n", "6", "-s", seqs, "-r", "2", "-t", threads,
            "--greedy",
        ]))
    };
    let two = run("2", "2");
    assert_eq!(two["prefill_s"].as_array().unwrap().len(), 2, "{two}");
    assert!(two["decode_s"][1].as_f64().unwrap() > 0.0, "{two}");
    let ids = two["tokens"].as_array().unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(
        ids[0].as_array().unwrap().len(),
        7,
        "the prefill's token and six more"
    );
    assert_eq!(run("1", "2")["tokens"], two["tokens"], "thread count");
    assert_eq!(run("1", "1")["tokens"][0], ids[0], "decoded alone");
    let out = astra(&["bench", "-m", &path, "-p", "0", "-n", "4", "--greedy"]);
    assert!(!out.status.success());
}

/// `astra ab` on two settings of this build that must agree (astra's arithmetic does
/// not depend on the thread count): the plan names both arms with the binary's
/// sha256, every pair's ratios are its arms' times, the tokens are identical.
#[test]
fn ab_compares_two_settings_in_pairs() {
    use sha2::Digest;
    let Some(path) = model("smollm2-135m") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("ab");
    let out = astra(&[
        "ab",
        "-m",
        &path,
        "-p",
        "8,16",
        "-n",
        "4",
        "-s",
        "2",
        "--pairs",
        "3",
        "--warmup",
        "1",
        "--a-args",
        "-t 1",
        "--b-args",
        "-t 2",
        "--b-env",
        "ASTRA_AB_TEST=1",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("| p16 n4 d0 × 2 | decode |"), "{table}");
    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(out_dir.join(name)).unwrap()).unwrap()
    };
    let plan = read("plan.json");
    let bin = std::fs::read(env!("CARGO_BIN_EXE_astra")).unwrap();
    let sha: String = sha2::Sha256::digest(&bin)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    for arm in ["a", "b"] {
        assert_eq!(plan["arms"][arm]["sha256"], sha.as_str(), "{plan}");
    }
    assert_eq!(plan["arms"]["b"]["args"], serde_json::json!(["-t", "2"]));
    assert_eq!(plan["arms"]["b"]["env"]["ASTRA_AB_TEST"], "1");
    assert_eq!(
        (plan["pairs"].as_u64(), plan["threshold"].as_f64()),
        (Some(3), Some(0.02))
    );
    assert!(plan["machine"]["cores"].as_u64().unwrap() >= 1, "{plan}");
    let result = read("result.json");
    assert_eq!(result["identical_tokens"], true, "{result}");
    let cases = result["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for case in cases {
        let pairs = case["pairs"].as_array().unwrap();
        assert_eq!(pairs.len(), 3);
        assert_eq!(pairs[1]["first"], "B");
        for p in pairs {
            let t = |arm: &str, m: &str| p[arm][m].as_f64().unwrap();
            let ratio = t("b", "prefill_s") / t("a", "prefill_s");
            assert!((p["prefill_ratio"].as_f64().unwrap() - ratio).abs() < 1e-12);
            assert_eq!(p["a"]["tokens"], p["b"]["tokens"]);
        }
        for m in ["prefill", "decode"] {
            let v = case["verdict"][m]["verdict"].as_str().unwrap();
            assert!(["faster", "slower", "inconclusive"].contains(&v), "{case}");
        }
        assert!(case["drift"]["a"]["decode"].as_f64().unwrap() > 0.0);
    }
    let bad = astra(&["ab", "-m", &path, "--pairs", "0"]);
    assert!(!bad.status.success());
    let bad = astra(&["ab", "-m", &path, "--a-env", "NOEQUALS"]);
    assert!(!bad.status.success());
}

/// A small F16 llama-like file, with `extra` tensors added.
fn write_f16_model(path: &std::path::Path, extra: &[(&str, Vec<u64>, astra_gguf::GgmlType)]) {
    use astra_gguf::{GgmlType, GgufWriter, TensorSource, Value};
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("llama.block_count", Value::U32(1));
    w.set("general.file_type", Value::U32(1));
    let mut tensors: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight", vec![64, 100], GgmlType::F16),
        ("blk.0.attn_q.weight", vec![64, 64], GgmlType::F16),
        ("blk.0.attn_norm.weight", vec![64], GgmlType::F32),
    ];
    tensors.extend(extra.iter().cloned());
    for (i, (name, dims, ty)) in tensors.into_iter().enumerate() {
        let n: u64 = dims.iter().product();
        let x: Vec<f32> = (0..n)
            .map(|j| ((j * 7 + i as u64 * 13) % 29) as f32 / 29.0 - 0.5)
            .collect();
        let bytes = astra_quant::quantize(ty, &x).unwrap();
        w.add_tensor(name, &dims, ty, TensorSource::Owned(bytes))
            .unwrap();
    }
    w.write_file(path).unwrap();
}

/// `astra quantize`: the types and metadata of the result; bad input is one clear line
/// and leaves no file behind. (The bytes are llama-quantize's: astra-quant's
/// `quantize_golden` tests.)
#[test]
fn quantize_writes_the_types_and_refuses_bad_input() {
    use astra_gguf::{GgmlType, GgufFile};
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.gguf");
    write_f16_model(&input, &[]);
    let out = dir.path().join("out.gguf");
    let run = |args: &[&str]| astra(&[&["quantize"], args].concat());
    let ok = run(&[input.to_str().unwrap(), out.to_str().unwrap(), "q8_0"]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let f = GgufFile::open(&out).unwrap();
    let ty = |n: &str| f.tensor(n).unwrap().ty;
    // The tied embedding takes the output's Q6_K, whose block does not divide 64: Q8_0.
    assert_eq!(
        (
            ty("token_embd.weight"),
            ty("blk.0.attn_q.weight"),
            ty("blk.0.attn_norm.weight")
        ),
        (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::F32)
    );
    assert_eq!(f.metadata().u32("general.file_type").unwrap(), 7);
    assert_eq!(f.metadata().u32("general.quantization_version").unwrap(), 2);
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    let mut got = vec![0.0f32; 64 * 64];
    astra_quant::dequantize(q.ty, f.tensor_data(q), &mut got).unwrap();
    let orig = GgufFile::open(&input).unwrap();
    let t = orig.tensor("blk.0.attn_q.weight").unwrap();
    let mut want = vec![0.0f32; 64 * 64];
    astra_quant::dequantize(t.ty, orig.tensor_data(t), &mut want).unwrap();
    let err = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(err < 0.5 / 127.0 + 1e-3, "Q8_0 error {err}");

    let left = |name: &str| {
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(name))
            .collect();
        files
    };
    let bad = |args: &[&str], expect: &str, name: &str| {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            !o.status.success() && err.contains(expect),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(left(name).is_empty(), "{args:?} left {:?}", left(name));
    };
    let i = input.to_str().unwrap();
    let o2 = dir.path().join("bad.gguf");
    let o2 = o2.to_str().unwrap();
    bad(&[i, o2, "q3_xyz"], "unknown type", "bad");
    let odd = dir.path().join("odd.gguf");
    write_f16_model(&odd, &[("blk.0.attn_k.weight", vec![40, 8], GgmlType::F16)]);
    bad(
        &[odd.to_str().unwrap(), o2, "q4_0"],
        "not a whole number of Q4_0 blocks",
        "bad",
    );
    let quantized = dir.path().join("quantized.gguf");
    write_f16_model(
        &quantized,
        &[("blk.0.attn_k.weight", vec![64, 8], GgmlType::Q8_0)],
    );
    bad(
        &[quantized.to_str().unwrap(), o2, "q4_0"],
        "already quantized",
        "bad",
    );
    bad(&[i, i, "q8_0"], "overwrite the input", "in.gguf.");
}
