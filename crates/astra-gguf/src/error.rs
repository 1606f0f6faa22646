//! Errors: where in the file parsing failed and what was expected there.

use std::path::PathBuf;

/// A parse failure at a byte offset of the input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("at byte {offset}: {kind}")]
pub struct ParseError {
    pub offset: u64,
    pub kind: ParseErrorKind,
}

/// What went wrong while parsing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseErrorKind {
    #[error("bad magic {found:02x?}: expected \"GGUF\" (47 47 55 46); not a GGUF file")]
    BadMagic { found: Vec<u8> },
    #[error("GGUF version {0} is big-endian, which is not supported")]
    BigEndian(u32),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("truncated while reading {what}: needs {needed} bytes, {available} remain")]
    Truncated {
        what: String,
        needed: u64,
        available: u64,
    },
    #[error("{what} count {count} cannot fit in the {available} bytes that remain (each takes at least {min_each} bytes)")]
    CountTooLarge {
        what: String,
        count: u64,
        min_each: u64,
        available: u64,
    },
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: String },
    #[error("unknown metadata value type {type_id} for {what}")]
    UnknownValueType { what: String, type_id: u32 },
    #[error("arrays nested deeper than {max} levels in {what}")]
    TooDeep { what: String, max: usize },
    #[error("bool value {0} is neither 0 nor 1")]
    InvalidBool(u8),
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("general.alignment must be a power of two of type u32, got {0}")]
    BadAlignment(String),
    #[error("tensor {name:?}: {dims} dimensions, at most {max} allowed")]
    TooManyDims { name: String, dims: u32, max: usize },
    #[error("tensor {name:?}: unknown ggml type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: dimensions {dims:?} overflow the element count")]
    DimsOverflow { name: String, dims: Vec<u64> },
    #[error(
        "tensor {name:?}: first dimension {ne0} is not a multiple of the {ty} block size {block}"
    )]
    NotWholeBlocks {
        name: String,
        ne0: u64,
        ty: String,
        block: u64,
    },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?}: data [{start}, {end}) lies outside the {data_len}-byte data section"
    )]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        data_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    TensorsOverlap { first: String, second: String },
}

/// A metadata key that is missing or has another type than the caller needs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata key {key:?} is missing")]
    Missing { key: String },
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
}

/// An error opening or parsing a GGUF file: the path and what failed.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    // The inner errors are rendered here rather than exposed as `source`, so that an
    // error chain prints each fact once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {error}")]
    Parse { path: PathBuf, error: ParseError },
}
