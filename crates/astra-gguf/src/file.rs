//! A GGUF file on disk: memory-mapped, parsed once, tensor data borrowed from the map.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::GgufError;
use crate::reader::{Gguf, TensorInfo};

/// An open, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    header: Gguf,
}

impl GgufFile {
    /// Maps and parses the file at `path`; errors name the path and the byte offset.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |error| GgufError::Io {
            path: path.clone(),
            error,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; the file must not be truncated by another
        // process while it is open, the same contract every mmap-based loader has.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = Gguf::parse(&map).map_err(|error| GgufError::Parse {
            path: path.clone(),
            error,
        })?;
        Ok(GgufFile { path, map, header })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Gguf {
        &self.header
    }

    pub fn metadata(&self) -> &crate::Metadata {
        &self.header.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// Size of the file in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The whole file, as mapped.
    pub fn raw(&self) -> &[u8] {
        &self.map
    }

    /// Lets the system drop the pages of `range` (bytes of the file) from this
    /// process's memory, for data that has been copied elsewhere (weights packed at
    /// load): they stay in the page cache while the system has room, and a later read
    /// maps them again. Advice only: on failure, or where the system has no such
    /// advice, nothing changes.
    pub fn release(&self, range: std::ops::Range<usize>) {
        let page = 4096;
        let (start, end) = (
            range.start.next_multiple_of(page),
            range.end.min(self.map.len()) / page * page,
        );
        if start >= end {
            return;
        }
        #[cfg(unix)]
        // SAFETY: the map is read-only, so dropping its pages loses nothing: a later read
        // faults them in again from the file, unchanged.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }

    /// The bytes of a tensor of this file (bounds were checked when parsing).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + info.offset) as usize;
        &self.map[start..start + info.size as usize]
    }
}
