//! Every CUDA kernel family compiles through NVRTC for sm_80 and sm_90 and its PTX holds
//! each entry point — on a machine without a GPU. NVRTC comes from the CUDA toolkit or the
//! `nvidia-cuda-nvrtc-cu12` wheel (`.ci/run` installs it and puts its lib directory in
//! `LD_LIBRARY_PATH`). Without it the test says so and passes, unless
//! `TESSERA_REQUIRE_NVRTC=1` (CI), where it fails.

use tessera_kernels::cuda::compile::{nvrtc_present, ptx_entries};
use tessera_kernels::cuda::{CudaDevice, CudaError, FAMILIES, PtxCache, compile_family};

const ARCHS: [&str; 2] = ["compute_80", "compute_90"];

fn nvrtc() -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var("TESSERA_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "libnvrtc is required (TESSERA_REQUIRE_NVRTC=1) but was not found: {}",
        CudaError::NoNvrtc
    );
    eprintln!("SKIPPED: {}", CudaError::NoNvrtc);
    false
}

#[test]
fn every_family_compiles_for_sm80_and_sm90_with_its_entry_points() {
    if !nvrtc() {
        return;
    }
    for family in FAMILIES {
        for arch in ARCHS {
            let ptx = compile_family(family, arch).unwrap_or_else(|e| panic!("{e}"));
            let target = arch.replace("compute_", "sm_");
            assert!(
                ptx.contains(&format!(".target {target}")),
                "{}",
                family.file
            );
            let entries = ptx_entries(&ptx);
            for entry in family.entries {
                assert!(
                    entries.contains(entry),
                    "{} {arch}: {entries:?}",
                    family.file
                );
            }
        }
    }
}

#[test]
fn the_ptx_cache_compiles_once_and_recovers_from_a_damaged_file() {
    if !nvrtc() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = PtxCache::new(dir.path());
    let family = &FAMILIES[0];
    let first = cache.get_or_compile(family, "compute_90").unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(files.len(), 1);
    let path = files[0].as_ref().unwrap().path();
    // Served from the file: a marker written into it comes back.
    let marked = format!("{first}\n// cached\n");
    std::fs::write(&path, &marked).unwrap();
    assert_eq!(cache.get_or_compile(family, "compute_90").unwrap(), marked);
    // A file without the entry points is compiled again and replaced.
    std::fs::write(&path, "garbage").unwrap();
    assert_eq!(cache.get_or_compile(family, "compute_90").unwrap(), first);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), first);
}

#[test]
fn opening_a_device_without_a_driver_is_a_clear_error() {
    if tessera_kernels::cuda::device::driver_present() {
        eprintln!("SKIPPED: this machine has a CUDA driver");
        return;
    }
    let cache = PtxCache::new(std::env::temp_dir().join("tessera-no-driver"));
    let err = CudaDevice::open(0, &cache).unwrap_err();
    assert!(matches!(err, CudaError::NoDriver), "{err}");
    assert!(err.to_string().contains("libcuda.so"), "{err}");
}
