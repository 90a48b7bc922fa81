//! Every CUDA kernel family compiles through NVRTC for sm_80 and sm_90 and its PTX holds
//! each entry point, and ptxas assembles it with each kernel's registers and shared memory
//! fitting the block it is launched with — on a machine without a GPU. NVRTC and ptxas
//! come from the CUDA toolkit or the `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12`
//! wheels (`.ci/run` installs them; `scripts/test.sh` finds them). Without them the tests
//! say so and pass, unless `TESSERA_REQUIRE_NVRTC=1` (CI), where they fail.

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

/// ptxas, to assemble PTX without a GPU: `TESSERA_PTXAS`, else `ptxas` on the path.
/// `scripts/test.sh` points `TESSERA_PTXAS` at the `nvidia-cuda-nvcc-cu12` wheel's copy.
fn ptxas() -> Option<std::path::PathBuf> {
    let candidates = std::env::var_os("TESSERA_PTXAS")
        .map(std::path::PathBuf::from)
        .into_iter()
        .chain(std::env::var_os("PATH").into_iter().flat_map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("ptxas"))
                .collect::<Vec<_>>()
        }));
    for candidate in candidates {
        if candidate.is_file() {
            return Some(candidate);
        }
    }
    assert!(
        std::env::var("TESSERA_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "ptxas is required (TESSERA_REQUIRE_NVRTC=1) but was not found: set TESSERA_PTXAS \
         (the nvidia-cuda-nvcc-cu12 wheel has one)"
    );
    eprintln!("SKIPPED: no ptxas (TESSERA_PTXAS, or ptxas on the path)");
    None
}

/// The kernels (by prefix) whose registers must hold without spilling: those of the fused
/// decode layer (issue 16), where a spill to local memory costs bandwidth on every step,
/// the prefill attention, and the small-batch GEMV, which must run at the weights' read bandwidth.
const MUST_NOT_SPILL: &[&str] = &[
    "rmsnorm_residual_bf16",
    "rope_kv_write",
    "silu_mul_bf16",
    "attention_grouped_",
    "attention_flash_",
    "gemv_bf16_",
];

/// What ptxas reports for one kernel.
#[derive(Debug, Default)]
struct Usage {
    registers: u32,
    spill_bytes: u32,
    shared_bytes: u32,
}

/// ptxas `-v` output → usage per kernel.
fn usage(log: &str) -> std::collections::HashMap<String, Usage> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find_map(|part| {
                let part = part.trim();
                let mut words = part.split_whitespace();
                let n = words.next()?.parse().ok()?;
                (part.ends_with(unit) || words.next() == Some(unit)).then_some(n)
            })
            .unwrap_or(0)
    };
    let mut all = std::collections::HashMap::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
            continue;
        }
        let Some(name) = &current else { continue };
        let entry: &mut Usage = all.entry(name.clone()).or_default();
        if line.contains("spill stores") {
            entry.spill_bytes += number_before(line, "spill stores");
        }
        if let Some(rest) = line.split("Used ").nth(1) {
            entry.registers = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            entry.shared_bytes = number_before(rest, "smem");
        }
    }
    all
}

#[test]
fn every_kernel_fits_its_launch_on_sm80_and_sm90() {
    if !nvrtc() {
        return;
    }
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for family in FAMILIES {
        for arch in ARCHS {
            let sm = arch.replace("compute_", "sm_");
            let ptx = compile_family(family, arch).unwrap_or_else(|e| panic!("{e}"));
            let path = dir.path().join(format!("{}.{sm}.ptx", family.file));
            std::fs::write(&path, ptx).unwrap();
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={sm}"))
                .arg("-v")
                .arg(&path)
                .arg("-o")
                .arg(path.with_extension("cubin"))
                .output()
                .expect("ptxas runs");
            let log = String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{} {sm}:\n{log}", family.file);
            let usage = usage(&log);
            for entry in family.entries {
                let u = usage
                    .get(*entry)
                    .unwrap_or_else(|| panic!("{entry} {sm}: no usage in\n{log}"));
                let threads = tessera_kernels::cuda::ops::block_threads(entry)
                    .unwrap_or_else(|| panic!("{entry}: no launch size"));
                // Registers are allocated per warp in units of 256; a block must fit the
                // 64K registers of one multiprocessor, and static shared memory 48 KiB.
                let per_warp = (u.registers * 32).div_ceil(256) * 256;
                let block = per_warp * threads.div_ceil(32);
                assert!(
                    block <= 65_536,
                    "{entry} {sm}: {} registers × {threads} threads need {block} of 65536",
                    u.registers
                );
                assert!(u.shared_bytes <= 48 * 1024, "{entry} {sm}: {u:?}");
                assert!(
                    u.spill_bytes == 0 || !MUST_NOT_SPILL.iter().any(|k| entry.starts_with(k)),
                    "{entry} {sm}: {} B spilled (a kernel of a decode layer must not spill)",
                    u.spill_bytes
                );
                eprintln!(
                    "{entry} {sm}: {} registers ({threads} threads: {block} of 65536), \
                     {} B shared, {} B spilled",
                    u.registers, u.shared_bytes, u.spill_bytes
                );
            }
        }
    }
}
