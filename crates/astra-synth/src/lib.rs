//! Random-weight GGUF models: the tensors, metadata and a byte-fallback SentencePiece
//! vocabulary of a known architecture's shape, with quantized blocks drawn at random
//! (scales set so weights have the magnitude of trained ones). They load and run like
//! real models; their text is noise. Used for bandwidth benchmarks of large shapes and
//! for backend parity on shapes no real file here has.

use std::path::Path;

use astra_gguf::{Array, GgmlType, GgufWriter, TensorSource, Value};

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown shape {0:?} (known: {1})")]
    UnknownShape(String, String),
    #[error(
        "{0} weights cannot be synthesized (supported: q4_0, q4_1, q5_0, q8_0, q4_k, q6_k, iq2_s, iq3_s)"
    )]
    UnsupportedType(GgmlType),
    #[error("writing {path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// The hyperparameters of a model shape.
#[derive(Clone, Debug)]
pub struct Shape {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub ctx: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Gemma 3's sliding window.
    pub window: Option<usize>,
    /// Per-head RMSNorm weights of queries and keys (QK-norm).
    pub qk_norm: bool,
    /// RMSNorm weights of each block's output (post-norms).
    pub post_norms: bool,
    /// Biases on the query, key and value projections (Qwen2).
    pub qkv_bias: bool,
    /// A mixture of experts in every layer's feed-forward, in place of the dense one.
    pub experts: Option<Experts>,
}

/// A mixture-of-experts feed-forward's shape.
#[derive(Clone, Copy, Debug)]
pub struct Experts {
    /// Experts per layer.
    pub count: usize,
    /// Experts each token uses.
    pub used: usize,
    /// Each expert's feed-forward width.
    pub n_ff: usize,
}

/// Shapes of known models.
pub const SHAPES: [Shape; 8] = [
    Shape {
        name: "llama3-8b",
        arch: "llama",
        n_layer: 32,
        n_embd: 4096,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 14336,
        n_vocab: 128256,
        ctx: 8192,
        rope_base: 500000.0,
        rms_eps: 1e-5,
        window: None,
        qk_norm: false,
        post_norms: false,
        qkv_bias: false,
        experts: None,
    },
    Shape {
        name: "llama3-1b",
        arch: "llama",
        n_layer: 16,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 64,
        n_ff: 8192,
        n_vocab: 128256,
        ctx: 8192,
        rope_base: 500000.0,
        rms_eps: 1e-5,
        window: None,
        qk_norm: false,
        post_norms: false,
        qkv_bias: false,
        experts: None,
    },
    Shape {
        name: "smollm2-135m",
        arch: "llama",
        n_layer: 30,
        n_embd: 576,
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        n_ff: 1536,
        n_vocab: 49152,
        ctx: 8192,
        rope_base: 100000.0,
        rms_eps: 1e-5,
        window: None,
        qk_norm: false,
        post_norms: false,
        qkv_bias: false,
        experts: None,
    },
    Shape {
        name: "gemma3-270m",
        arch: "gemma3",
        n_layer: 18,
        n_embd: 640,
        n_head: 4,
        n_head_kv: 1,
        head_dim: 256,
        n_ff: 2048,
        n_vocab: 262144,
        ctx: 32768,
        rope_base: 1e6,
        rms_eps: 1e-6,
        window: Some(512),
        qk_norm: true,
        post_norms: true,
        qkv_bias: false,
        experts: None,
    },
    Shape {
        name: "qwen3-0.6b",
        arch: "qwen3",
        n_layer: 28,
        n_embd: 1024,
        n_head: 16,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 3072,
        n_vocab: 151936,
        ctx: 40960,
        rope_base: 1e6,
        rms_eps: 1e-6,
        window: None,
        qk_norm: true,
        post_norms: false,
        qkv_bias: false,
        experts: None,
    },
    Shape {
        name: "qwen2.5-0.5b",
        arch: "qwen2",
        n_layer: 24,
        n_embd: 896,
        n_head: 14,
        n_head_kv: 2,
        head_dim: 64,
        n_ff: 4864,
        n_vocab: 151936,
        ctx: 32768,
        rope_base: 1e6,
        rms_eps: 1e-6,
        window: None,
        qk_norm: false,
        post_norms: false,
        qkv_bias: true,
        experts: None,
    },
    Shape {
        name: "qwen3-30b-a3b",
        arch: "qwen3moe",
        n_layer: 48,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_ff: 6144,
        n_vocab: 151936,
        ctx: 40960,
        rope_base: 1e6,
        rms_eps: 1e-6,
        window: None,
        qk_norm: true,
        post_norms: false,
        qkv_bias: false,
        experts: Some(Experts {
            count: 128,
            used: 8,
            n_ff: 768,
        }),
    },
    Shape {
        name: "mixtral-8x7b",
        arch: "llama",
        n_layer: 32,
        n_embd: 4096,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 14336,
        n_vocab: 32000,
        ctx: 32768,
        rope_base: 1e6,
        rms_eps: 1e-5,
        window: None,
        qk_norm: false,
        post_norms: false,
        qkv_bias: false,
        experts: Some(Experts {
            count: 8,
            used: 2,
            n_ff: 14336,
        }),
    },
];

pub fn shape(name: &str) -> Result<&'static Shape, SynthError> {
    SHAPES.iter().find(|s| s.name == name).ok_or_else(|| {
        SynthError::UnknownShape(
            name.to_owned(),
            SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", "),
        )
    })
}

/// xorshift64*: fast, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn f16_bits(x: f32) -> [u8; 2] {
    // Normal f16 for the small positive scales used here.
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let mant = (bits >> 13) & 0x3ff;
    (((exp.clamp(1, 30) as u32) << 10 | mant) as u16).to_le_bytes()
}

/// Offsets of the f16 scale fields in a block of `ty`, and each one's value: chosen
/// so that the weights are of order 0.02, as trained ones.
fn scale_fields(ty: GgmlType) -> Result<&'static [(usize, f32)], SynthError> {
    Ok(match ty {
        GgmlType::Q4_0 => &[(0, 0.005)],
        GgmlType::Q4_1 => &[(0, 0.005), (2, -0.04)],
        GgmlType::Q5_0 => &[(0, 0.002)],
        GgmlType::Q8_0 => &[(0, 0.0002)],
        GgmlType::Q4_K => &[(0, 0.0002), (2, 0.0002)],
        GgmlType::Q6_K => &[(208, 0.0001)],
        // Every bit pattern of the rest is a valid IQ2_S or IQ3_S block.
        GgmlType::IQ2_S => &[(0, 0.0002)],
        GgmlType::IQ3_S => &[(0, 0.0001)],
        other => return Err(SynthError::UnsupportedType(other)),
    })
}

/// `n` f32 values drawn uniformly from ±`scale`, little-endian.
fn random_f32(n: usize, scale: f32, rng: &mut Rng) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
            ((2.0 * u - 1.0) * scale).to_le_bytes()
        })
        .collect()
}

/// A random `rows × cols` matrix of `ty`.
fn random_matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    rng: &mut Rng,
) -> Result<Vec<u8>, SynthError> {
    let fields = scale_fields(ty)?;
    let (elems, bytes) = (ty.block_elems() as usize, ty.block_bytes() as usize);
    let mut data = vec![0u8; rows * cols / elems * bytes];
    rng.fill(&mut data);
    for block in data.chunks_exact_mut(bytes) {
        for &(at, v) in fields {
            let h = f16_bits(v.abs());
            block[at..at + 2].copy_from_slice(&h);
            if v < 0.0 {
                block[at + 1] |= 0x80;
            }
        }
    }
    Ok(data)
}

/// The type a matrix of `cols` columns gets: `ty`, or Q5_0 (as llama.cpp falls back)
/// when its rows are not whole blocks of `ty`.
fn matrix_type(ty: GgmlType, cols: usize) -> GgmlType {
    if cols.is_multiple_of(ty.block_elems() as usize) {
        ty
    } else {
        GgmlType::Q5_0
    }
}

/// A byte-fallback SentencePiece vocabulary of `n` tokens: `<unk>`, `<s>`, `</s>`, the
/// 256 byte tokens, then filler pieces.
fn vocabulary(n: usize) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut i = 0;
    while tokens.len() < n {
        tokens.push(format!("▁t{i}"));
        types.push(1);
        i += 1;
    }
    tokens.truncate(n);
    types.truncate(n);
    let scores = (0..n).map(|i| -(i as f32)).collect();
    (tokens, scores, types)
}

/// Adds `count` random matrices of `rows × cols` in `ty` as the tensor `name` (2-D where
/// `count` is 1, else 3-D, as llama.cpp stores experts).
fn add_matrices(
    w: &mut GgufWriter,
    rng: &mut Rng,
    name: String,
    (rows, cols, count): (usize, usize, usize),
    ty: GgmlType,
) -> Result<(), SynthError> {
    let ty = matrix_type(ty, cols);
    let mut dims = vec![cols as u64, rows as u64];
    let data = if ty == GgmlType::F32 {
        random_f32(rows * cols * count, 0.05, rng)
    } else {
        random_matrix(ty, rows * count, cols, rng)?
    };
    if count > 1 {
        dims.push(count as u64);
    }
    w.add_tensor(name, &dims, ty, TensorSource::Owned(data))
        .expect("consistent shape");
    Ok(())
}

/// Writes a random-weight model of `shape` with matrices of `ty` (the embedding in
/// Q8_0, tied to the output, as the small real models have it) to `path`.
pub fn write(shape: &Shape, ty: GgmlType, seed: u64, path: &Path) -> Result<(), SynthError> {
    let s = shape;
    let a = s.arch;
    let mut w = GgufWriter::new();
    let (tokens, scores, types) = vocabulary(s.n_vocab);
    w.set("general.architecture", Value::String(a.into()))
        .set(
            "general.name",
            Value::String(format!("synthetic {} ({})", s.name, ty.name())),
        )
        .set(format!("{a}.block_count"), Value::U32(s.n_layer as u32))
        .set(format!("{a}.embedding_length"), Value::U32(s.n_embd as u32))
        .set(
            format!("{a}.feed_forward_length"),
            Value::U32(s.n_ff as u32),
        )
        .set(
            format!("{a}.attention.head_count"),
            Value::U32(s.n_head as u32),
        )
        .set(
            format!("{a}.attention.head_count_kv"),
            Value::U32(s.n_head_kv as u32),
        )
        .set(
            format!("{a}.attention.key_length"),
            Value::U32(s.head_dim as u32),
        )
        .set(
            format!("{a}.attention.value_length"),
            Value::U32(s.head_dim as u32),
        )
        .set(format!("{a}.context_length"), Value::U32(s.ctx as u32))
        .set(format!("{a}.rope.freq_base"), Value::F32(s.rope_base))
        .set(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(s.rms_eps),
        )
        .set("tokenizer.ggml.model", Value::String("llama".into()))
        .set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .set("tokenizer.ggml.scores", Value::Array(Array::F32(scores)))
        .set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))
        .set("tokenizer.ggml.bos_token_id", Value::U32(1))
        .set("tokenizer.ggml.eos_token_id", Value::U32(2))
        .set("tokenizer.ggml.add_bos_token", Value::Bool(true));
    if let Some(x) = s.experts {
        w.set(format!("{a}.expert_count"), Value::U32(x.count as u32))
            .set(format!("{a}.expert_used_count"), Value::U32(x.used as u32));
        if x.n_ff != s.n_ff {
            w.set(
                format!("{a}.expert_feed_forward_length"),
                Value::U32(x.n_ff as u32),
            );
        }
    }
    if let Some(window) = s.window {
        w.set(
            format!("{a}.attention.sliding_window"),
            Value::U32(window as u32),
        );
    }
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let (e, q, kv) = (s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
    let ones = |n: usize| TensorSource::Owned((0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect());
    add_matrices(
        &mut w,
        &mut rng,
        "token_embd.weight".into(),
        (s.n_vocab, e, 1),
        GgmlType::Q8_0,
    )?;
    for l in 0..s.n_layer {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        add_matrices(&mut w, &mut rng, n("attn_q"), (q, e, 1), ty)?;
        add_matrices(&mut w, &mut rng, n("attn_k"), (kv, e, 1), ty)?;
        add_matrices(&mut w, &mut rng, n("attn_v"), (kv, e, 1), ty)?;
        add_matrices(&mut w, &mut rng, n("attn_output"), (e, q, 1), ty)?;
        if s.qkv_bias {
            for (t, len) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                let b = random_f32(len, 0.5, &mut rng);
                w.add_tensor(
                    format!("blk.{l}.{t}.bias"),
                    &[len as u64],
                    GgmlType::F32,
                    TensorSource::Owned(b),
                )
                .expect("consistent shape");
            }
        }
        match s.experts {
            // The router in F32, as llama-quantize leaves it; the experts in `ty`.
            Some(x) => {
                add_matrices(
                    &mut w,
                    &mut rng,
                    n("ffn_gate_inp"),
                    (x.count, e, 1),
                    GgmlType::F32,
                )?;
                add_matrices(
                    &mut w,
                    &mut rng,
                    n("ffn_gate_exps"),
                    (x.n_ff, e, x.count),
                    ty,
                )?;
                add_matrices(&mut w, &mut rng, n("ffn_up_exps"), (x.n_ff, e, x.count), ty)?;
                add_matrices(
                    &mut w,
                    &mut rng,
                    n("ffn_down_exps"),
                    (e, x.n_ff, x.count),
                    ty,
                )?;
            }
            None => {
                add_matrices(&mut w, &mut rng, n("ffn_gate"), (s.n_ff, e, 1), ty)?;
                add_matrices(&mut w, &mut rng, n("ffn_up"), (s.n_ff, e, 1), ty)?;
                add_matrices(&mut w, &mut rng, n("ffn_down"), (e, s.n_ff, 1), ty)?;
            }
        }
        let mut norms = vec![("attn_norm", e), ("ffn_norm", e)];
        if s.qk_norm {
            norms.extend([("attn_q_norm", s.head_dim), ("attn_k_norm", s.head_dim)]);
        }
        if s.post_norms {
            norms.extend([("post_attention_norm", e), ("post_ffw_norm", e)]);
        }
        for (t, len) in norms {
            w.add_tensor(n(t), &[len as u64], GgmlType::F32, ones(len))
                .expect("consistent shape");
        }
    }
    w.add_tensor("output_norm.weight", &[e as u64], GgmlType::F32, ones(e))
        .expect("consistent shape");
    w.write_file(path).map_err(|err| SynthError::Io {
        path: path.display().to_string(),
        err,
    })
}
