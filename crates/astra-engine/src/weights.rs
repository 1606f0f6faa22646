//! The model's tensors, located in the memory-mapped GGUF file and checked against the
//! configuration. Matrices stay in the map; only the small norm vectors are copied.

use std::sync::Arc;

use astra_gguf::{GgmlType, GgufFile, TensorInfo};
use astra_quant::{Kernels, QuantMatrix};

use crate::backend::Backend;
use crate::config::{Arch, Config};
use crate::EngineError;

/// A weight matrix in the file: `rows × cols` of `ty` at a byte range of the whole
/// mapped file (absolute, so a view needs only the file).
#[derive(Clone, Debug)]
pub struct MatRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    len: usize,
    pub kernels: Kernels,
}

impl MatRef {
    /// The 2-D tensor `name` of `file` as a matrix (rows = its second dimension).
    pub fn locate(file: &GgufFile, name: &str) -> Result<MatRef, EngineError> {
        let t = file
            .tensor(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_owned()))?;
        let [cols, rows] = t.dims[..] else {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected two",
                t.dims
            )));
        };
        Loader { file }.matrix(name, rows as usize, cols as usize)
    }

    /// The matrix in `file` (the file it was located in).
    pub fn view<'a>(&self, file: &'a GgufFile) -> QuantMatrix<'a> {
        let bytes = &file.raw()[self.start..self.start + self.len];
        QuantMatrix::new(self.ty, self.rows, self.cols, bytes).expect("shape checked at load")
    }

    pub fn bytes(&self) -> usize {
        self.len
    }

    /// Where the matrix lies in its file, in bytes.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// One block's weights: matrices of type `M`, norm vectors of type `V` (in the file,
/// [`MatRef`] and host vectors; on a backend, its own types).
pub struct Layer<M = MatRef, V = Vec<f32>> {
    pub attn_norm: V,              // (n_embd)
    pub wq: M,                     // (n_head·head_dim, n_embd)
    pub wk: M,                     // (n_head_kv·head_dim, n_embd)
    pub wv: M,                     // (n_head_kv·head_dim, n_embd)
    pub wo: M,                     // (n_embd, n_head·head_dim)
    pub q_norm: Option<V>,         // (head_dim), Gemma 3
    pub k_norm: Option<V>,         // (head_dim), Gemma 3
    pub post_attn_norm: Option<V>, // (n_embd), Gemma 3
    pub ffn_norm: V,               // (n_embd)
    pub w_gate: M,                 // (n_ff, n_embd)
    pub w_up: M,                   // (n_ff, n_embd)
    pub w_down: M,                 // (n_embd, n_ff)
    pub post_ffn_norm: Option<V>,  // (n_embd), Gemma 3
}

pub struct Weights<M = MatRef, V = Vec<f32>> {
    pub token_embd: M,  // (n_vocab, n_embd)
    pub output_norm: V, // (n_embd)
    /// (n_vocab, n_embd); `None` when tied to the embedding matrix.
    pub output: Option<M>,
    pub layers: Vec<Layer<M, V>>,
}

impl<M, V> Weights<M, V> {
    /// The output projection (the embedding matrix when tied).
    pub fn output(&self) -> &M {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

struct Loader<'a> {
    file: &'a GgufFile,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.file
            .tensor(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_owned()))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<MatRef, EngineError> {
        let t = self.info(name)?;
        if t.dims != [cols as u64, rows as u64] {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected [{cols}, {rows}]",
                t.dims
            )));
        }
        let kernels =
            Kernels::best(t.ty).map_err(|e| EngineError::Invalid(format!("tensor {name}: {e}")))?;
        Ok(MatRef {
            ty: t.ty,
            rows,
            cols,
            start: (self.file.header().data_offset + t.offset) as usize,
            len: t.size as usize,
            kernels,
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.info(name)?;
        if t.dims != [len as u64] {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected [{len}]",
                t.dims
            )));
        }
        let mut out = vec![0.0f32; len];
        astra_quant::dequantize(t.ty, self.file.tensor_data(t), &mut out)
            .map_err(|e| EngineError::Invalid(format!("tensor {name}: {e}")))?;
        Ok(out)
    }

    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, EngineError> {
        if self.file.tensor(name).is_some() {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Weights {
    pub fn load(file: &GgufFile, cfg: &Config) -> Result<Weights, EngineError> {
        let l = Loader { file };
        let (e, ff, hd) = (cfg.n_embd, cfg.n_ff, cfg.head_dim);
        let token_embd = l.matrix("token_embd.weight", cfg.n_vocab, e)?;
        let output = match file.tensor("output.weight") {
            Some(_) => Some(l.matrix("output.weight", cfg.n_vocab, e)?),
            None => None,
        };
        let gemma = cfg.arch == Arch::Gemma3;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let required = |s: &str, len| {
                if gemma {
                    l.vector(&n(s), len).map(Some)
                } else {
                    l.optional_vector(&n(s), len)
                }
            };
            layers.push(Layer {
                attn_norm: l.vector(&n("attn_norm"), e)?,
                wq: l.matrix(&n("attn_q"), cfg.q_dim(), e)?,
                wk: l.matrix(&n("attn_k"), cfg.kv_dim(), e)?,
                wv: l.matrix(&n("attn_v"), cfg.kv_dim(), e)?,
                wo: l.matrix(&n("attn_output"), e, cfg.q_dim())?,
                q_norm: required("attn_q_norm", hd)?,
                k_norm: required("attn_k_norm", hd)?,
                post_attn_norm: required("post_attention_norm", e)?,
                ffn_norm: l.vector(&n("ffn_norm"), e)?,
                w_gate: l.matrix(&n("ffn_gate"), ff, e)?,
                w_up: l.matrix(&n("ffn_up"), ff, e)?,
                w_down: l.matrix(&n("ffn_down"), e, ff)?,
                post_ffn_norm: required("post_ffw_norm", e)?,
            });
        }
        Ok(Weights {
            token_embd,
            output_norm: l.vector("output_norm.weight", e)?,
            output,
            layers,
        })
    }

    /// Bytes of weights read to decode one token: every matrix once, plus one
    /// embedding row.
    pub fn bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|m| m.bytes())
                    .sum::<usize>()
            })
            .sum();
        per_layer + self.output().bytes() + self.token_embd.bytes() / self.token_embd.rows
    }

    /// The same weights on `backend`.
    pub fn upload<B: Backend>(
        &self,
        backend: &B,
        file: &Arc<GgufFile>,
    ) -> Result<Weights<B::Matrix, B::Vector>, EngineError> {
        let m = |m: &MatRef| backend.matrix(file, m);
        let v = |v: &Vec<f32>| backend.vector(v);
        let ov = |o: &Option<Vec<f32>>| o.as_ref().map(|x| backend.vector(x)).transpose();
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: v(&l.attn_norm)?,
                    wq: m(&l.wq)?,
                    wk: m(&l.wk)?,
                    wv: m(&l.wv)?,
                    wo: m(&l.wo)?,
                    q_norm: ov(&l.q_norm)?,
                    k_norm: ov(&l.k_norm)?,
                    post_attn_norm: ov(&l.post_attn_norm)?,
                    ffn_norm: v(&l.ffn_norm)?,
                    w_gate: m(&l.w_gate)?,
                    w_up: m(&l.w_up)?,
                    w_down: m(&l.w_down)?,
                    post_ffn_norm: ov(&l.post_ffn_norm)?,
                })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(Weights {
            token_embd: m(&self.token_embd)?,
            output_norm: v(&self.output_norm)?,
            output: self.output.as_ref().map(m).transpose()?,
            layers,
        })
    }
}
