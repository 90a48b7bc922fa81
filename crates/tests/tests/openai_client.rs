//! The official `openai` Python client against a cluster started by `tessera up` (as
//! `faults.rs` starts one) on the demo model: `scripts/openai_client_check.py` runs chat and
//! completions, streaming and not, with an API key, and must pass.
//!
//! Needs `python3` with the `openai` package (`.ci/run` installs it). Without it the test
//! fails when `CI` is set and prints SKIPPED otherwise; without the demo model it follows
//! [`tessera_tests::demo_model`].

use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_tests::up::Up;
use tessera_tests::{GroupSpec, demo_model, repo};

const MODEL: &str = "demo";
const API_KEY: &str = "openai-client-check-key";

/// Whether `python3` can import `openai`; panics under CI when it cannot.
fn openai_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but `python3 -c \"import openai\"` fails: pip install openai"
        );
        eprintln!("SKIPPED: python3 cannot import openai (pip install openai)");
    }
    ok
}

#[test]
fn official_openai_client_passes() {
    if !openai_available() {
        return;
    }
    let Some(model) = demo_model() else {
        return;
    };
    let up = Up::start(
        &[GroupSpec::local("g0", MODEL, &model, 1)],
        &[("TESSERA_API_KEYS", API_KEY)],
    );
    up.wait_ready(Duration::from_secs(120));
    let output = Command::new("python3")
        .arg(repo().join("scripts/openai_client_check.py"))
        .arg(format!("{}/v1", up.http))
        .arg(MODEL)
        .env("OPENAI_API_KEY", API_KEY)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the openai client check failed ({}):\n{stdout}\n{stderr}\n--- cluster log\n{}",
        output.status,
        up.log()
    );
    assert!(stdout.contains("openai client check passed"), "{stdout}");
}
