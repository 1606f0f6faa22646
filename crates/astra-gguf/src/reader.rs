//! The GGUF parser: header, metadata, tensor table and data-section bounds.
//!
//! Layout (little-endian): magic, u32 version, u64 tensor count, u64 metadata count,
//! the metadata entries (string key, u32 value type, value), the tensor infos (string
//! name, u32 dimension count, u64 dimensions, u32 ggml type, u64 offset), padding to
//! the alignment, then the data section. Offsets in the tensor infos are relative to
//! the start of the data section.
//!
//! Invariant: nothing is allocated from a count before the count has been checked
//! against the bytes that remain, so a hostile file cannot ask for more memory than
//! its own size (times a small constant).

use std::collections::HashSet;

use crate::error::{ParseError, ParseErrorKind};
use crate::types::GgmlType;
use crate::value::{Array, Metadata, Value, ValueType};

/// Alignment of the data section and of every tensor when `general.alignment` is unset.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor can have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays accepted; real files use one level, and the bound keeps
/// a hostile file from exhausting the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost first (ggml's `ne`): a weight of shape `[rows, cols]` in
    /// row-major terms is stored as `dims = [cols, rows]`.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data, from the type's block size and the dimensions.
    pub size: u64,
}

impl TensorInfo {
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF header: everything but the tensor data itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Gguf {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section in the file.
    pub data_offset: u64,
}

impl Gguf {
    /// Parses and validates a whole GGUF file held in `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Gguf, ParseError> {
        Self::parse_header(bytes, bytes.len() as u64)
    }

    /// Parses the header of a file of `file_len` bytes from `head`, a prefix of the
    /// file at least as long as its header; the tensor data need not be present, but
    /// its bounds are checked against `file_len`.
    pub fn parse_header(head: &[u8], file_len: u64) -> Result<Gguf, ParseError> {
        let bytes = &head[..head
            .len()
            .min(usize::try_from(file_len).unwrap_or(usize::MAX))];
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(4, "magic")?;
        if magic != crate::MAGIC {
            return Err(r.error_at(
                0,
                ParseErrorKind::BadMagic {
                    found: magic.to_vec(),
                },
            ));
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(r.error_at(4, ParseErrorKind::BigEndian(v.swap_bytes())))
            }
            v => return Err(r.error_at(4, ParseErrorKind::UnsupportedVersion(v))),
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;
        // A metadata entry takes at least a key length, a type and one byte of value;
        // a tensor info at least a name length, a dimension count, a type and an offset.
        r.check_count(kv_count, 8 + 4 + 1, "metadata entry")?;
        r.check_count(tensor_count, 8 + 4 + 4 + 8, "tensor info")?;

        let metadata = r.metadata(kv_count)?;
        let alignment = alignment_of(&metadata).map_err(|k| r.error_at(r.pos as u64, k))?;
        let tensor_table_start = r.pos as u64;
        let mut tensors = Vec::with_capacity(initial_capacity(tensor_count));
        for i in 0..tensor_count {
            tensors.push(r.tensor_info(i)?);
        }
        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        if data_offset > file_len && !tensors.is_empty() {
            return Err(r.error_at(
                r.pos as u64,
                ParseErrorKind::Truncated {
                    what: "padding before the tensor data".into(),
                    needed: data_offset - r.pos as u64,
                    available: file_len - r.pos as u64,
                },
            ));
        }
        let data_len = file_len.saturating_sub(data_offset);
        check_tensor_layout(&tensors, alignment, data_len)
            .map_err(|k| r.error_at(tensor_table_start, k))?;
        Ok(Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

fn alignment_of(metadata: &Metadata) -> Result<u64, ParseErrorKind> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(other) => Err(ParseErrorKind::BadAlignment(format!("{other:?}"))),
    }
}

/// Checks that every tensor is aligned, inside the data section, and alone in its bytes.
fn check_tensor_layout(
    tensors: &[TensorInfo],
    alignment: u64,
    data_len: u64,
) -> Result<(), ParseErrorKind> {
    let mut names = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(ParseErrorKind::DuplicateTensor(t.name.clone()));
        }
        if t.offset % alignment != 0 {
            return Err(ParseErrorKind::MisalignedTensor {
                name: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|end| end > data_len) {
            return Err(ParseErrorKind::TensorOutOfBounds {
                name: t.name.clone(),
                start: t.offset,
                end: end.unwrap_or(u64::MAX),
                data_len,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(ParseErrorKind::TensorsOverlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

/// Capacity to reserve for `count` items read from the file: the count has passed
/// [`Reader::check_count`], but a corrupt count that merely fits the file can still be
/// large, so vectors start small and grow only with items actually parsed.
fn initial_capacity(count: u64) -> usize {
    count.min(4096) as usize
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn error_at(&self, offset: u64, kind: ParseErrorKind) -> ParseError {
        ParseError { offset, kind }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], ParseError> {
        if n > self.remaining() {
            return Err(self.error_at(
                self.pos as u64,
                ParseErrorKind::Truncated {
                    what: what.to_owned(),
                    needed: n,
                    available: self.remaining(),
                },
            ));
        }
        let n = n as usize;
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ParseError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ParseError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_each` bytes fit in what remains.
    fn check_count(&self, count: u64, min_each: u64, what: &str) -> Result<(), ParseError> {
        if count
            .checked_mul(min_each)
            .is_none_or(|n| n > self.remaining())
        {
            return Err(self.error_at(
                self.pos as u64,
                ParseErrorKind::CountTooLarge {
                    what: what.to_owned(),
                    count,
                    min_each,
                    available: self.remaining(),
                },
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, ParseError> {
        let start = self.pos as u64;
        let len = self.u64(&format!("length of {what}"))?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| {
            self.error_at(
                start,
                ParseErrorKind::InvalidUtf8 {
                    what: what.to_owned(),
                },
            )
        })
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, ParseError> {
        let at = self.pos as u64;
        let type_id = self.u32(&format!("value type of {what}"))?;
        ValueType::from_id(type_id).ok_or_else(|| {
            self.error_at(
                at,
                ParseErrorKind::UnknownValueType {
                    what: what.to_owned(),
                    type_id,
                },
            )
        })
    }

    fn metadata(&mut self, count: u64) -> Result<Metadata, ParseError> {
        let mut metadata = Metadata::new();
        let mut seen = HashSet::new();
        for i in 0..count {
            let at = self.pos as u64;
            let key = self.string(&format!("key of metadata entry {i}"))?;
            if !seen.insert(key.clone()) {
                return Err(self.error_at(at, ParseErrorKind::DuplicateKey(key)));
            }
            let what = format!("metadata value {key:?}");
            let ty = self.value_type(&what)?;
            let value = self.value(ty, &what, 0)?;
            metadata.set(key, value);
        }
        Ok(metadata)
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: usize) -> Result<Value, ParseError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.u8(what)? as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(what, depth)?),
        })
    }

    fn bool(&mut self, what: &str) -> Result<bool, ParseError> {
        let at = self.pos as u64;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.error_at(at, ParseErrorKind::InvalidBool(b))),
        }
    }

    fn array_value(&mut self, what: &str, depth: usize) -> Result<Array, ParseError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.error_at(
                self.pos as u64,
                ParseErrorKind::TooDeep {
                    what: what.to_owned(),
                    max: MAX_ARRAY_DEPTH,
                },
            ));
        }
        let elem = self.value_type(&format!("elements of {what}"))?;
        let count = self.u64(&format!("length of {what}"))?;
        self.check_count(count, elem.min_encoded_len(), &format!("{what} element"))?;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.take(count * std::mem::size_of::<$t>() as u64, what)?;
                Array::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            ValueType::U8 => Array::U8(self.take(count, what)?.to_vec()),
            ValueType::I8 => Array::I8(self.take(count, what)?.iter().map(|&b| b as i8).collect()),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(initial_capacity(count));
                for _ in 0..count {
                    v.push(self.bool(what)?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(initial_capacity(count));
                for i in 0..count {
                    v.push(self.string(&format!("{what}[{i}]"))?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(initial_capacity(count));
                for i in 0..count {
                    v.push(self.array_value(&format!("{what}[{i}]"), depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }

    fn tensor_info(&mut self, index: u64) -> Result<TensorInfo, ParseError> {
        let name = self.string(&format!("name of tensor {index}"))?;
        let at = self.pos as u64;
        let n_dims = self.u32(&format!("dimension count of tensor {name:?}"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(self.error_at(
                at,
                ParseErrorKind::TooManyDims {
                    name,
                    dims: n_dims,
                    max: MAX_DIMS,
                },
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(self.u64(&format!("dimension {d} of tensor {name:?}"))?);
        }
        let type_at = self.pos as u64;
        let type_id = self.u32(&format!("type of tensor {name:?}"))?;
        let offset = self.u64(&format!("data offset of tensor {name:?}"))?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(self.error_at(type_at, ParseErrorKind::UnknownTensorType { name, type_id }));
        };
        // ggml keeps element counts in int64_t: the product must fit there.
        let elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        let Some(elems) = elems else {
            return Err(self.error_at(at, ParseErrorKind::DimsOverflow { name, dims }));
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        let size = match ty.bytes_for(elems) {
            Some(size) if ne0 % ty.block_elems() == 0 => size,
            _ => {
                return Err(self.error_at(
                    at,
                    ParseErrorKind::NotWholeBlocks {
                        name,
                        ne0,
                        ty: ty.name().to_owned(),
                        block: ty.block_elems(),
                    },
                ))
            }
        };
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size,
        })
    }
}
