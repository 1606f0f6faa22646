//! GGUF files: parse, validate, and write them.
//!
//! The parser works over a byte slice (a memory map of the file, in practice) and
//! trusts nothing it reads: every length and count is checked against the bytes that
//! remain before anything is allocated from it, every tensor must lie inside the data
//! section without overlapping another, and every failure names the byte offset and
//! what was expected there. Tensor data is never copied: [`GgufFile::tensor_data`]
//! hands out slices of the map.

mod error;
mod file;
mod reader;
mod types;
mod value;
mod writer;

pub use error::{GgufError, MetadataError, ParseError, ParseErrorKind};
pub use file::GgufFile;
pub use reader::{Gguf, TensorInfo, DEFAULT_ALIGNMENT, MAX_DIMS};
pub use types::GgmlType;
pub use value::{Array, Metadata, Value, ValueType};
pub use writer::{GgufWriter, TensorSource};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
