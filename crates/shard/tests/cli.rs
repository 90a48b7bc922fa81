//! `tessera-shard` refuses bad start-up input with a message that says what is wrong,
//! before it connects anywhere. (Building this test also builds the binary that the
//! end-to-end tests in `crates/tests` start.)

use std::path::{Path, PathBuf};
use std::process::Command;

const SHARD: &str = env!("CARGO_BIN_EXE_tessera-shard");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the shard with `args`; it must fail, and its stderr is returned.
fn fails(args: &[&str]) -> String {
    let out = Command::new(SHARD).args(args).output().expect("shard runs");
    assert!(!out.status.success(), "the shard should refuse {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn topology(dir: &Path) -> PathBuf {
    topology_with(dir, 2, "cpu")
}

/// A topology of one group `g` of `tp` ranks on `device` (`cuda:N`: rank r on `cuda:N+r`).
fn topology_with(dir: &Path, tp: usize, device: &str) -> PathBuf {
    let model = repo().join("fixtures/models/llama-gqa/f32");
    let mut text = format!(
        "[[coordinator]]\nid = 1\nhost = \"local\"\nquic = \"127.0.0.1:1\"\nhttp = \"127.0.0.1:2\"\n\n\
         [[host]]\nname = \"local\"\naddress = \"127.0.0.1\"\n\n\
         [[model]]\nname = \"m\"\npath = \"{}\"\n\n\
         [[group]]\nname = \"g\"\nmodel = \"m\"\ntp = {tp}\n\n",
        model.display()
    );
    for rank in 0..tp {
        let device = match device.strip_prefix("cuda:") {
            Some(n) => format!("cuda:{}", n.parse::<usize>().expect("cuda index") + rank),
            None => device.to_string(),
        };
        text.push_str(&format!(
            "[[group.shard]]\nrank = {rank}\nhost = \"local\"\ndevice = \"{device}\"\nport = {}\nkv_memory = \"1MiB\"\n\n",
            7101 + rank
        ));
    }
    let path = dir.join("topology.toml");
    std::fs::write(&path, text).expect("write topology");
    path
}

#[test]
fn missing_topology_names_the_file() {
    let err = fails(&[
        "--topology",
        "/nonexistent/t.toml",
        "--group",
        "g",
        "--rank",
        "0",
        "--certs",
        "/x",
    ]);
    assert!(
        err.contains("cannot read topology file /nonexistent/t.toml"),
        "{err}"
    );
}

#[test]
fn unknown_group_and_rank_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let t = topology(dir.path());
    let t = t.to_str().expect("utf-8 path");
    let err = fails(&[
        "--topology",
        t,
        "--group",
        "nope",
        "--rank",
        "0",
        "--certs",
        "/x",
    ]);
    assert!(err.contains("group `nope` is not in"), "{err}");
    let err = fails(&[
        "--topology",
        t,
        "--group",
        "g",
        "--rank",
        "2",
        "--certs",
        "/x",
    ]);
    assert!(err.contains("there is no rank 2"), "{err}");
}

#[test]
fn missing_certificates_say_how_to_make_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    let t = topology(dir.path());
    let certs = dir.path().join("certs");
    let err = fails(&[
        "--topology",
        t.to_str().expect("utf-8 path"),
        "--group",
        "g",
        "--rank",
        "1",
        "--certs",
        certs.to_str().expect("utf-8 path"),
    ]);
    assert!(err.contains("tessera certs init"), "{err}");
}

/// What a shard of a one-rank group on `cuda:0` prints when it exits at start.
fn cuda_shard_error() -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let t = topology_with(dir.path(), 1, "cuda:0");
    let err = fails(&[
        "--topology",
        t.to_str().expect("utf-8 path"),
        "--group",
        "g",
        "--rank",
        "0",
        "--certs",
        "/x",
    ]);
    assert!(err.contains("cuda:0"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// A shard asked for `cuda:0` where there is no NVIDIA driver says so and exits, before
/// it reads any weights or connects anywhere.
#[cfg(feature = "cuda")]
#[test]
fn a_cuda_device_without_a_driver_is_a_clear_error() {
    if tessera_kernels::cuda::device::driver_present() {
        eprintln!("SKIPPED: this machine has a CUDA driver");
        return;
    }
    let err = cuda_shard_error();
    assert!(
        err.contains("no CUDA driver: libcuda.so was not found"),
        "{err}"
    );
}

/// A shard built without the `cuda` feature, asked for `cuda:0`, says that this build
/// cannot run it and how to get one that can, before it reads any weights.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_cuda_device_in_a_build_without_cuda_is_a_clear_error() {
    let err = cuda_shard_error();
    assert!(err.contains("built without CUDA support"), "{err}");
}

#[test]
fn a_device_sampling_switch_that_is_not_a_boolean_is_refused_at_start() {
    let out = Command::new(SHARD)
        .args(["--topology", "/t.toml", "--group", "g", "--rank", "0"])
        .args(["--certs", "/x"])
        .env("TESSERA_DEVICE_SAMPLING", "maybe")
        .output()
        .expect("shard runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("maybe") && err.contains("--device-sampling"),
        "{err}"
    );
}
