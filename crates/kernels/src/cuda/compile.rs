//! NVRTC: CUDA C → PTX for one virtual architecture (`compute_90` for an sm_90 device),
//! checked for every entry point of the family, and a cache of the PTX on disk keyed by
//! the source, the architecture and the NVRTC version, so a restarted shard loads instead
//! of compiling.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{CompileError, CompileOptions, compile_ptx_with_opts};

use super::CudaError;
use super::source::KernelFamily;

/// The largest PTX file the cache reads back (the families compile to tens of KiB).
const MAX_PTX_BYTES: u64 = 16 << 20;

/// Whether libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            file: "(nvrtcVersion)",
            arch: String::new(),
            log: format!("{status:?}"),
        });
    }
    Ok((major, minor))
}

/// Compiles `family` for `arch` (`compute_80`, `compute_90`, …) and checks that the PTX
/// defines each of its entry points.
pub fn compile_family(family: &KernelFamily, arch: &str) -> Result<String, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some(family.file.into()),
        ..CompileOptions::default()
    };
    let failed = |log: String| CudaError::Compile {
        file: family.file,
        arch: arch.to_string(),
        log,
    };
    let ptx = compile_ptx_with_opts(family.full_source(), options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => failed(log.to_string_lossy().into_owned()),
        other => failed(format!("{other:?}")),
    })?;
    let ptx = ptx.to_src();
    check_entries(family, arch, &ptx)?;
    Ok(ptx)
}

/// The kernels a PTX module defines (its `.entry` directives).
pub fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|line| line.trim_start().strip_prefix(".visible .entry "))
        .map(|rest| rest.split(['(', ' ']).next().unwrap_or(rest))
        .collect()
}

fn check_entries(family: &KernelFamily, arch: &str, ptx: &str) -> Result<(), CudaError> {
    let defined = ptx_entries(ptx);
    match family.entries.iter().find(|e| !defined.contains(e)) {
        Some(entry) => Err(CudaError::MissingEntry {
            file: family.file,
            arch: arch.to_string(),
            entry,
        }),
        None => Ok(()),
    }
}

/// Compiled PTX on disk, one file per (family, architecture, source and NVRTC version).
#[derive(Clone, Debug)]
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    pub fn new(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache { dir: dir.into() }
    }

    /// `$TESSERA_CACHE_DIR/ptx`, else `$XDG_CACHE_HOME/tessera/ptx`, else
    /// `~/.cache/tessera/ptx`, else a directory under the system's temporary one.
    pub fn default_dir() -> PathBuf {
        let var = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let base = var("TESSERA_CACHE_DIR")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("tessera")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/tessera")))
            .unwrap_or_else(|| std::env::temp_dir().join("tessera-cache"));
        base.join("ptx")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `family`'s PTX for `arch` under NVRTC `version` lives.
    pub fn path(&self, family: &KernelFamily, arch: &str, version: (i32, i32)) -> PathBuf {
        let key = fnv1a(&[
            family.full_source().as_bytes(),
            arch.as_bytes(),
            format!("{}.{}", version.0, version.1).as_bytes(),
        ]);
        let stem = family.file.trim_end_matches(".cu");
        self.dir.join(format!("{stem}-{arch}-{key:016x}.ptx"))
    }

    /// The cached PTX of `family` for `arch`, compiled (and stored) when absent or unusable.
    pub fn get_or_compile(&self, family: &KernelFamily, arch: &str) -> Result<String, CudaError> {
        let path = self.path(family, arch, nvrtc_version()?);
        if let Some(ptx) = read_small(&path)
            && check_entries(family, arch, &ptx).is_ok()
        {
            return Ok(ptx);
        }
        let ptx = compile_family(family, arch)?;
        self.store(&path, &ptx)?;
        Ok(ptx)
    }

    /// Writes through a temporary file and a rename, so a reader never sees half a file.
    fn store(&self, path: &Path, ptx: &str) -> Result<(), CudaError> {
        let failed = |message: String| CudaError::Cache {
            path: path.to_path_buf(),
            message,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| failed(e.to_string()))?;
        // One temporary name per process and call: threads of one process may store the
        // same entry at once.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, ptx).map_err(|e| failed(e.to_string()))?;
        match std::fs::rename(&tmp, path) {
            Ok(()) => Ok(()),
            // Another writer put the same entry there first.
            Err(_) if path.is_file() => {
                let _ = std::fs::remove_file(&tmp);
                Ok(())
            }
            Err(e) => Err(failed(e.to_string())),
        }
    }
}

/// The file's text, when it exists and is at most [`MAX_PTX_BYTES`].
fn read_small(path: &Path) -> Option<String> {
    let len = std::fs::metadata(path).ok()?.len();
    if len > MAX_PTX_BYTES {
        return None;
    }
    std::fs::read_to_string(path).ok()
}

/// FNV-1a over the parts (with a separator): a cache key stable across builds.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_read_from_ptx() {
        let ptx = "\n.visible .entry rope_f32(\n\t.param .u64 a\n)\n.visible .entry other (\n";
        assert_eq!(ptx_entries(ptx), ["rope_f32", "other"]);
    }

    #[test]
    fn the_cache_key_changes_with_source_arch_and_version() {
        let cache = PtxCache::new("/c");
        let f = super::super::FAMILIES[0];
        let mut g = f;
        g.code = "// changed";
        let a = cache.path(&f, "compute_90", (12, 6));
        assert_ne!(a, cache.path(&g, "compute_90", (12, 6)));
        assert_ne!(a, cache.path(&f, "compute_80", (12, 6)));
        assert_ne!(a, cache.path(&f, "compute_90", (12, 8)));
        assert_eq!(a, cache.path(&f, "compute_90", (12, 6)));
        assert!(a.starts_with("/c"));
    }
}
