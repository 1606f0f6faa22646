//! Writing GGUF files: metadata and tensors laid out with the file's alignment.
//!
//! Used by tests, `astra quantize` and `astra synth`. The writer produces exactly what
//! the reader accepts: a round trip gives back the same metadata and tensor bytes.

use std::io::{self, Write};

use crate::reader::{DEFAULT_ALIGNMENT, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::{Array, Metadata, Value};

/// A tensor's bytes made when the file is written: one tensor in memory at a time.
pub type MakeBytes<'a> = Box<dyn Fn() -> io::Result<Vec<u8>> + 'a>;

/// Where a tensor's bytes come from when the file is written.
pub enum TensorSource<'a> {
    Bytes(&'a [u8]),
    Owned(Vec<u8>),
    /// `len` bytes that `make` returns when the tensor is written.
    Made {
        len: usize,
        make: MakeBytes<'a>,
    },
}

impl TensorSource<'_> {
    fn len(&self) -> usize {
        match self {
            TensorSource::Bytes(b) => b.len(),
            TensorSource::Owned(v) => v.len(),
            TensorSource::Made { len, .. } => *len,
        }
    }

    fn write(&self, name: &str, out: &mut impl Write) -> io::Result<()> {
        match self {
            TensorSource::Bytes(b) => out.write_all(b),
            TensorSource::Owned(v) => out.write_all(v),
            TensorSource::Made { len, make } => {
                let bytes = make()?;
                if bytes.len() != *len {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "tensor {name:?}: made {} bytes, {len} announced",
                            bytes.len()
                        ),
                    ));
                }
                out.write_all(&bytes)
            }
        }
    }
}

struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: TensorSource<'a>,
}

/// Collects metadata and tensors, then writes a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter<'a> {
    metadata: Metadata,
    tensors: Vec<PendingTensor<'a>>,
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.set(key, value);
        self
    }

    /// Adds a tensor; its byte length must match its type and dimensions.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: TensorSource<'a>,
    ) -> io::Result<&mut Self> {
        let name = name.into();
        let invalid = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        if dims.len() > MAX_DIMS {
            return Err(invalid(format!(
                "tensor {name:?}: more than {MAX_DIMS} dimensions"
            )));
        }
        let elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let expected = elems.and_then(|n| ty.bytes_for(n));
        if expected != Some(data.len() as u64) {
            return Err(invalid(format!(
                "tensor {name:?}: {} bytes given, {ty} {dims:?} needs {expected:?}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    fn alignment(&self) -> io::Result<u64> {
        match self.metadata.get("general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
            Some(other) => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("general.alignment must be a power-of-two u32, got {other:?}"),
            )),
        }
    }

    /// Writes the file to `out`.
    pub fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        let alignment = self.alignment()?;
        let mut head = Vec::new();
        head.extend_from_slice(&crate::MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in self.metadata.iter() {
            put_str(&mut head, key);
            head.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut head, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        pad_to(&mut head, alignment);
        out.write_all(&head)?;
        let mut written = 0u64;
        for t in &self.tensors {
            t.data.write(&t.name, out)?;
            written += t.data.len() as u64;
            let padded = written.next_multiple_of(alignment);
            out.write_all(&vec![0u8; (padded - written) as usize])?;
            written = padded;
        }
        Ok(())
    }

    /// Writes the file to a byte vector.
    pub fn to_bytes(&self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    /// Writes the file at `path` through a temporary file and a rename, so that a
    /// reader never sees half a file; on failure nothing is left behind.
    pub fn write_file(&self, path: &std::path::Path) -> io::Result<()> {
        // Unique to this process: two writers of one path never share a temporary.
        let tmp = path.with_extension(format!("gguf.partial-{}", std::process::id()));
        let written = (|| {
            let mut f = io::BufWriter::new(std::fs::File::create(&tmp)?);
            self.write_to(&mut f)?;
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }
}

fn pad_to(buf: &mut Vec<u8>, alignment: u64) {
    let len = (buf.len() as u64).next_multiple_of(alignment) as usize;
    buf.resize(len, 0);
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => buf.push(*v),
        Value::I8(v) => buf.push(*v as u8),
        Value::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => buf.push(u8::from(*v)),
        Value::String(s) => put_str(buf, s),
        Value::Array(a) => put_array(buf, a),
        Value::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
    }
}

fn put_array(buf: &mut Vec<u8>, a: &Array) {
    buf.extend_from_slice(&(a.element_type() as u32).to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each_le {
        ($v:expr) => {
            for x in $v {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => buf.extend(v.iter().map(|&x| x as u8)),
        Array::Bool(v) => buf.extend(v.iter().map(|&x| u8::from(x))),
        Array::U16(v) => each_le!(v),
        Array::I16(v) => each_le!(v),
        Array::U32(v) => each_le!(v),
        Array::I32(v) => each_le!(v),
        Array::F32(v) => each_le!(v),
        Array::U64(v) => each_le!(v),
        Array::I64(v) => each_le!(v),
        Array::F64(v) => each_le!(v),
        Array::String(v) => v.iter().for_each(|s| put_str(buf, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(buf, inner)),
    }
}
