//! The run-time compiled kernel library: the `.cu` sources embedded in the binary,
//! compiled by NVRTC to a cubin for the exact architecture of the device present
//! (a driver cannot JIT PTX made by a newer NVRTC), and cached on disk under a key of
//! source hash, architecture, NVRTC version and driver version.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};

/// The kernel sources as written: (name, text).
const FILES: [(&str, &str); 1] = [("astra.cu", include_str!("../kernels/astra.cu"))];

/// The kernel sources as compiled: (name, the constants' prelude then the text, its
/// lines numbered as in the file).
pub fn sources() -> Vec<(&'static str, String)> {
    let prelude = crate::shared::prelude();
    FILES
        .iter()
        .map(|&(name, text)| (name, format!("{prelude}#line 1 \"{name}\"\n{text}")))
        .collect()
}

/// A kernel source's variant whose kernels open with the programmatic-dependent-launch
/// wait (astra.cu's `PDL_START`), for launches recorded in graphs.
pub fn with_dependent_launch(source: &str) -> String {
    format!("#define ASTRA_PDL 1\n{source}")
}

/// Folders that may hold NVRTC and cuBLAS: the CUDA toolkit's (from `CUDA_HOME`,
/// `CUDA_PATH`, the `nvcc` on `PATH`, `/usr/local/cuda`), and the `nvidia-cuda-nvrtc`
/// Python package that scripts/test installs into the cache.
pub(crate) fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        roots.extend(
            std::env::split_paths(&path)
                .filter(|d| d.join("nvcc").is_file())
                .filter_map(|d| d.parent().map(PathBuf::from)),
        );
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut dirs: Vec<PathBuf> = roots
        .iter()
        .flat_map(|r| {
            [
                r.join("lib64"),
                r.join("targets/x86_64-linux/lib"),
                r.join("lib"),
            ]
        })
        .collect();
    dirs.push(cache_home().join("python/nvrtc/nvidia/cu13/lib"));
    dirs
}

/// Loads `libs` by full path from the first toolkit folder that has them all, in the
/// order given, so that the names NVRTC and cudarc later open resolve to them without
/// the folder being on the loader path (which is read only at process start).
pub(crate) fn preload(libs: &[&str]) {
    for dir in toolkit_dirs() {
        if libs.iter().all(|l| dir.join(l).is_file()) {
            for lib in libs {
                // SAFETY: NVIDIA's libraries, loaded for the life of the process.
                if let Ok(l) = unsafe { libloading::Library::new(dir.join(lib)) } {
                    std::mem::forget(l);
                }
            }
            return;
        }
    }
}

/// Whether NVRTC can be loaded (it runs without a GPU).
pub fn available() -> bool {
    static PRELOAD: std::sync::Once = std::sync::Once::new();
    PRELOAD.call_once(|| preload(&["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"]));
    // SAFETY: only probes for the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// Compiles `source` to a cubin for `arch` (e.g. `sm_90`).
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| format!("{name}: a NUL byte in the source"))?;
    let cname = CString::new(name).expect("no NUL in a file name");
    let prog = result::create_program(&src, Some(&cname))
        .map_err(|e| format!("{name}: nvrtcCreateProgram: {e:?}"))?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    // SAFETY: a program just created; the options outlive the call.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let out = match compiled {
        Ok(()) => cubin(prog),
        Err(e) => {
            // SAFETY: the program's log after a failed compile.
            let log = unsafe { result::get_program_log(prog) }
                .map(|raw| {
                    unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            Err(format!("{name}: NVRTC failed for {arch} ({e:?}):\n{log}"))
        }
    };
    // SAFETY: destroyed once, after use.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: a compiled program; the buffer has the size NVRTC reports.
    unsafe {
        sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
        let mut buf = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
            .result()
            .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
        Ok(buf)
    }
}

/// `$ASTRA_HOME`, default `~/.cache/astra`.
fn cache_home() -> PathBuf {
    std::env::var_os("ASTRA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/astra")))
        .unwrap_or_else(|| PathBuf::from(".astra-cache"))
}

fn cache_dir() -> PathBuf {
    cache_home().join("kernels")
}

/// The cubin of `source` for `arch`, from the disk cache or compiled (and cached).
/// `driver` is the driver's version, part of the key.
pub fn cubin_cached(name: &str, source: &str, arch: &str, driver: i32) -> Result<Vec<u8>, String> {
    let (major, minor) = version()?;
    let mut h = Sha256::new();
    for part in [
        source,
        arch,
        &format!("nvrtc {major}.{minor}"),
        &format!("driver {driver}"),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let key: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let path = cache_dir().join(format!(
        "{}-{arch}-{}.cubin",
        name.trim_end_matches(".cu"),
        &key[..16]
    ));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let bytes = compile(name, source, arch)?;
    // A cache that cannot be written only costs a compile next time.
    if std::fs::create_dir_all(path.parent().expect("in a folder")).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether NVRTC is there to compile with; without it (and not required by
    /// `ASTRA_REQUIRE_NVRTC=1`), a test says why it skips.
    fn loadable() -> bool {
        if available() {
            return true;
        }
        let why = "NVRTC (libnvrtc.so.13) is not loadable; scripts/test installs it";
        assert!(
            std::env::var("ASTRA_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "{why}"
        );
        eprintln!("SKIPPED: {why}");
        false
    }

    /// Every kernel source compiles for sm_90 (the H200), with NVRTC alone: no GPU needed.
    /// Without NVRTC the test says so, and fails when ASTRA_REQUIRE_NVRTC=1.
    #[test]
    fn every_kernel_compiles_for_sm_90() {
        if !loadable() {
            return;
        }
        for (name, source) in sources() {
            for source in [source.clone(), with_dependent_launch(&source)] {
                let cubin = compile(name, &source, "sm_90").unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(&cubin[..4], b"\x7fELF", "{name}: a cubin is an ELF image");
            }
        }
    }

    /// The kernels of scripts/decode-ceiling.cu (a program built with nvcc on a GPU
    /// machine) compile too.
    #[test]
    fn the_decode_ceiling_kernels_compile_for_sm_90() {
        if !loadable() {
            return;
        }
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/decode-ceiling.cu"
        );
        let source = std::fs::read_to_string(path).expect("scripts/decode-ceiling.cu");
        let cubin =
            compile("decode-ceiling.cu", &source, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "a cubin is an ELF image");
    }
}
