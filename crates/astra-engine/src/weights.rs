//! The model's tensors, located in the memory-mapped GGUF file, checked against the
//! shapes the configuration implies, and handed to a backend: matrices by where they
//! lie in the file (a backend reads them in place or uploads them), norm vectors
//! dequantized to f32.

use std::cell::Cell;
use std::sync::Arc;

use astra_gguf::{GgmlType, GgufFile, TensorInfo};
use astra_quant::QuantMatrix;

use crate::backend::{Backend, Experts};
use crate::config::Config;
use crate::EngineError;

/// A weight matrix in the file: `rows × cols` of `ty` at a byte range of the whole
/// mapped file (absolute, so a view needs only the file). Device-neutral: which kernels
/// read it is the backend's choice.
#[derive(Clone, Debug)]
pub struct MatRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    len: usize,
}

impl MatRef {
    /// The 2-D tensor `name` of `file` as a matrix (rows = its second dimension).
    pub fn locate(file: &GgufFile, name: &str) -> Result<MatRef, EngineError> {
        let t = tensor(file, name)?;
        let [cols, rows] = t.dims[..] else {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected two",
                t.dims
            )));
        };
        MatRef::of(file, name, rows as usize, cols as usize)
    }

    /// The tensor `name` of `file`, which must be `rows × cols`.
    fn of(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<MatRef, EngineError> {
        let t = tensor(file, name)?;
        if t.dims != [cols as u64, rows as u64] {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected [{cols}, {rows}]",
                t.dims
            )));
        }
        let start = (file.header().data_offset + t.offset) as usize;
        MatRef::checked(file, name, t.ty, rows, cols, start, t.size as usize)
    }

    /// The 3-D tensor `name` of `file` (dims `[cols, rows, experts]`, as llama.cpp
    /// stores a layer's experts) as one `rows × cols` matrix per expert.
    pub fn experts(file: &GgufFile, name: &str) -> Result<Vec<MatRef>, EngineError> {
        let t = tensor(file, name)?;
        let [cols, rows, n] = t.dims[..] else {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected three",
                t.dims
            )));
        };
        // Empty experts would make their count unbounded by the file's size.
        if cols == 0 || rows == 0 || n == 0 || t.size % n != 0 {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?} hold no experts",
                t.dims
            )));
        }
        let start = (file.header().data_offset + t.offset) as usize;
        let len = (t.size / n) as usize;
        (0..n as usize)
            .map(|e| {
                let at = start + e * len;
                MatRef::checked(file, name, t.ty, rows as usize, cols as usize, at, len)
            })
            .collect()
    }

    fn checked(
        file: &GgufFile,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        start: usize,
        len: usize,
    ) -> Result<MatRef, EngineError> {
        let m = MatRef {
            ty,
            rows,
            cols,
            start,
            len,
        };
        // The reader checked the size against the type; a type with no block layout
        // here is refused now rather than at the first product.
        QuantMatrix::new(m.ty, rows, cols, m.bytes_in(file))
            .map_err(|e| EngineError::Invalid(format!("tensor {name}: {e}")))?;
        Ok(m)
    }

    /// The matrix in `file` (the file it was located in).
    pub fn view<'a>(&self, file: &'a GgufFile) -> QuantMatrix<'a> {
        QuantMatrix::new(self.ty, self.rows, self.cols, self.bytes_in(file))
            .expect("shape checked when located")
    }

    fn bytes_in<'a>(&self, file: &'a GgufFile) -> &'a [u8] {
        &file.raw()[self.start..self.start + self.len]
    }

    pub fn bytes(&self) -> usize {
        self.len
    }

    /// Where the matrix lies in its file, in bytes.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// The experts of the 3-D tensor `name` ([`MatRef::experts`]) on `be`.
pub fn load_experts<B: Backend>(
    be: &B,
    file: &Arc<GgufFile>,
    name: &str,
) -> Result<Experts<B::Matrix>, EngineError> {
    let refs = MatRef::experts(file, name)?;
    let (rows, cols) = (refs[0].rows, refs[0].cols);
    let matrices = refs
        .iter()
        .map(|m| be.matrix(file, m))
        .collect::<Result<_, _>>()
        .map_err(|e| match e {
            EngineError::Invalid(why) => EngineError::Invalid(format!("tensor {name}: {why}")),
            other => other,
        })?;
    Ok(Experts {
        rows,
        cols,
        matrices,
    })
}

fn tensor<'f>(file: &'f GgufFile, name: &str) -> Result<&'f TensorInfo, EngineError> {
    file.tensor(name)
        .ok_or_else(|| EngineError::MissingTensor(name.to_owned()))
}

/// Loads a model's tensors from `file` onto a backend, counting the bytes of weights a
/// decoded token reads.
pub(crate) struct Loader<'a, B: Backend> {
    be: &'a B,
    file: &'a Arc<GgufFile>,
    /// Bytes of the matrices loaded so far (the embedding table apart).
    matrix_bytes: Cell<usize>,
    /// Bytes of the embedding table, and of one of its rows.
    embedding_bytes: Cell<(usize, usize)>,
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(be: &'a B, file: &'a Arc<GgufFile>) -> Self {
        Loader {
            be,
            file,
            matrix_bytes: Cell::new(0),
            embedding_bytes: Cell::new((0, 0)),
        }
    }

    fn upload(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(B::Matrix, usize), EngineError> {
        let m = MatRef::of(self.file, name, rows, cols)?;
        let on_backend = self.be.matrix(self.file, &m).map_err(|e| match e {
            EngineError::Invalid(why) => EngineError::Invalid(format!("tensor {name}: {why}")),
            other => other,
        })?;
        Ok((on_backend, m.bytes()))
    }

    /// The `rows × cols` matrix `name`, read once per decoded token.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix, EngineError> {
        let (m, bytes) = self.upload(name, rows, cols)?;
        self.matrix_bytes.set(self.matrix_bytes.get() + bytes);
        Ok(m)
    }

    /// The embedding table `name`, `n_vocab × n_embd`: a decoded token reads one row.
    pub fn embedding(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<B::Matrix, EngineError> {
        let (m, bytes) = self.upload(name, rows, cols)?;
        self.embedding_bytes.set((bytes, bytes / rows.max(1)));
        Ok(m)
    }

    /// The experts of the 3-D tensor `name`, each `rows × cols`; a decoded token reads
    /// `used` of them.
    pub fn experts(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        used: usize,
    ) -> Result<Experts<B::Matrix>, EngineError> {
        let e = load_experts(self.be, self.file, name)?;
        if (e.rows, e.cols) != (rows, cols) {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: experts of {} × {}, expected {rows} × {cols}",
                e.rows, e.cols
            )));
        }
        let each = MatRef::experts(self.file, name)?[0].bytes();
        self.matrix_bytes
            .set(self.matrix_bytes.get() + each * used.min(e.matrices.len()));
        Ok(e)
    }

    /// The vector `name` of `len` values, as f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<B::Vector, EngineError> {
        let t = tensor(self.file, name)?;
        if t.dims != [len as u64] {
            return Err(EngineError::Invalid(format!(
                "tensor {name}: dims {:?}, expected [{len}]",
                t.dims
            )));
        }
        let mut out = vec![0.0f32; len];
        astra_quant::dequantize(t.ty, self.file.tensor_data(t), &mut out)
            .map_err(|e| EngineError::Invalid(format!("tensor {name}: {e}")))?;
        self.be.vector(&out)
    }

    /// Every layer of `cfg`, each loaded by `layer`.
    pub fn layers<L>(
        &self,
        cfg: &Config,
        layer: impl Fn(&Self, &Config, usize) -> Result<L, EngineError>,
    ) -> Result<Vec<L>, EngineError> {
        (0..cfg.n_layer).map(|i| layer(self, cfg, i)).collect()
    }

    /// Bytes of weights read to decode one token: every matrix once and one embedding
    /// row, or, where the output matrix is the embedding table (`tied`), all of it.
    pub fn bytes_per_token(&self, tied: bool) -> usize {
        let (table, row) = self.embedding_bytes.get();
        self.matrix_bytes.get() + if tied { table + row } else { row }
    }
}
