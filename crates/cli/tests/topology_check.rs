//! `tessera topology check` end to end: the real binary on the committed examples and on
//! files written here, with small HuggingFace-style model directories (config.json only).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("topology-check-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("run tessera")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A model directory whose config.json has this shape (Llama architecture).
fn model_dir(root: &Path, name: &str, heads: usize, kv: usize, inter: usize) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).expect("model dir");
    let config = serde_json::json!({
        "model_type": "llama",
        "hidden_size": heads * 64,
        "intermediate_size": inter,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": 1000,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
    });
    fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    dir
}

/// One coordinator, one host, model `m` at `model_path`, group `g0` with `tp` cpu ranks.
fn topology(tp: usize, model_path: &str) -> String {
    let mut s = format!(
        "[[coordinator]]\nid = 1\nhost = \"h\"\nquic = \"127.0.0.1:7000\"\nhttp = \"127.0.0.1:8000\"\n\n\
         [[host]]\nname = \"h\"\naddress = \"127.0.0.1\"\n\n\
         [[model]]\nname = \"m\"\npath = \"{model_path}\"\n\n\
         [[group]]\nname = \"g0\"\nmodel = \"m\"\ntp = {tp}\n"
    );
    for rank in 0..tp {
        s.push_str(&format!(
            "\n[[group.shard]]\nrank = {rank}\nhost = \"h\"\ndevice = \"cpu\"\nport = {}\nkv_memory = \"64MiB\"\n",
            7100 + rank
        ));
    }
    s
}

/// The 1-based line of the first occurrence of `needle`.
fn line_of(contents: &str, needle: &str) -> usize {
    let offset = contents.find(needle).expect("needle in contents");
    contents[..offset].matches('\n').count() + 1
}

fn write(dir: &Path, name: &str, contents: &str) -> String {
    let path = dir.join(name);
    fs::write(&path, contents).expect("write topology");
    path.to_string_lossy().into_owned()
}

#[test]
fn committed_examples_are_valid() {
    for example in [
        "demo-cpu.toml",
        "llama70b-2x4gpu.toml",
        "replicas-2x-cpu.toml",
    ] {
        let path = repo_root().join("examples").join(example);
        let out = tessera(&["topology", "check", &path.to_string_lossy()]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{example}:\n{stdout}\n{stderr}");
        assert!(stdout.contains(": ok — "), "{example}: {stdout}");
        assert!(!stderr.contains("error"), "{example}: {stderr}");
    }
}

#[test]
fn a_missing_model_is_a_warning_and_strict_makes_it_an_error() {
    let path = repo_root().join("examples/llama70b-2x4gpu.toml");
    let path = path.to_string_lossy();
    let out = tessera(&["topology", "check", &path]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("llama70b-2x4gpu.toml:47: warning: model llama-3-70b-instruct: "),
        "{stderr}"
    );
    assert!(
        stderr.contains("checks that need its config were skipped"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("group llama70b-tp8: model llama-3-70b-instruct, tp 8, collective nccl")
    );
    assert!(stdout.contains("heads and rows not computed"), "{stdout}");

    let strict = tessera(&["topology", "check", "--strict", &path]);
    assert_eq!(strict.status.code(), Some(1));
    let stderr = text(&strict.stderr);
    assert!(
        stderr.contains(":47: error: model llama-3-70b-instruct"),
        "{stderr}"
    );
    assert!(text(&strict.stdout).is_empty());
}

#[test]
fn the_plan_lists_each_ranks_slices() {
    let dir = scratch("plan");
    model_dir(&dir, "smol", 9, 3, 1536);
    let file = write(&dir, "t.toml", &topology(3, "smol"));
    let out = tessera(&["topology", "check", &file]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("group g0: model m, tp 3, collective shm (auto)"),
        "{stdout}"
    );
    let rank1 = stdout
        .lines()
        .skip_while(|l| !l.starts_with("group g0"))
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_default();
    let cells: Vec<_> = rank1.split_whitespace().collect();
    assert_eq!(
        cells,
        [
            "1",
            "h",
            "cpu",
            "1",
            "7101",
            "64",
            "MiB",
            "3..6",
            "1..2",
            "512..1024",
            "334..667"
        ],
        "{stdout}"
    );
}

#[test]
fn replicated_kv_heads_are_marked() {
    let dir = scratch("replicated");
    model_dir(&dir, "gqa", 8, 2, 512);
    let file = write(&dir, "t.toml", &topology(4, "gqa"));
    let out = tessera(&["topology", "check", &file]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("0..1 (copy)"), "{stdout}");
    assert!(
        stdout.contains("each KV head is held by 2 ranks"),
        "{stdout}"
    );
}

#[test]
fn model_checks_report_the_tp_line_and_what_to_change() {
    let dir = scratch("tp3");
    model_dir(&dir, "llama", 32, 8, 14336);
    let contents = topology(3, "llama");
    let file = write(&dir, "t.toml", &contents);
    let out = tessera(&["topology", "check", &file]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let line = line_of(&contents, "tp = 3");
    assert!(
        stderr.contains(&format!(
            "{file}:{line}: error: group g0 (model m): tp = 3 does not divide num_attention_heads = 32\n  \
             help: use a tp that divides 32 (1, 2, 4, 8, 16, 32)"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("tp = 3 neither divides num_key_value_heads = 8"),
        "{stderr}"
    );
    assert!(
        stderr.contains("tp = 3 does not divide intermediate_size = 14336"),
        "{stderr}"
    );
    assert!(
        stderr.contains("3 errors; the topology cannot be used"),
        "{stderr}"
    );
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn every_error_is_printed_with_its_line() {
    let dir = scratch("errors");
    model_dir(&dir, "smol", 9, 3, 1536);
    let contents = topology(3, "smol")
        .replace("id = 1\n", "id = 1\nbogus = true\n")
        .replace("port = 7101", "port = 8000")
        .replacen("device = \"cpu\"", "device = \"cuda\"", 1);
    let file = write(&dir, "t.toml", &contents);
    let out = tessera(&["topology", "check", &file]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let lines: Vec<_> = stderr.lines().filter(|l| l.contains(": error: ")).collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    let at = |needle| line_of(&contents, needle);
    let expected = [
        format!(
            "{file}:{}: error: coordinator[0]: unknown key `bogus`",
            at("bogus")
        ),
        format!(
            "{file}:{}: error: group g0 rank 0: device = \"cuda\"",
            at("\"cuda\"")
        ),
        format!(
            "{file}:{}: error: host h: port 8000 is used by both coordinator 1 (http) and group \
             g0 rank 1",
            at("port = 8000")
        ),
    ];
    for (line, expected) in lines.iter().zip(&expected) {
        assert!(line.starts_with(expected), "{line}\n{expected}");
    }
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("  help: ")).count(),
        3
    );
}

#[test]
fn json_output_has_the_plan_or_the_issues() {
    let dir = scratch("json");
    model_dir(&dir, "smol", 9, 3, 1536);
    let file = write(&dir, "t.toml", &topology(3, "smol"));
    let out = tessera(&["topology", "check", "--json", &file]);
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(doc["ok"], true);
    assert_eq!(doc["models"][0]["shape"]["num_attention_heads"], 9);
    let shard = &doc["groups"][0]["shards"][2];
    assert_eq!(shard["heads"], serde_json::json!({"start": 6, "end": 9}));
    assert_eq!(shard["kv_replicated"], false);
    assert_eq!(shard["kv_memory_bytes"], 64 << 20);
    assert_eq!(doc["groups"][0]["collective"], "shm");

    let contents = topology(3, "smol").replace("tp = 3", "tp = 2");
    let bad = write(&dir, "bad.toml", &contents);
    let out = tessera(&["topology", "check", "--json", &bad]);
    assert_eq!(out.status.code(), Some(1));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(doc["ok"], false);
    let classes: Vec<_> = doc["issues"]
        .as_array()
        .expect("issues")
        .iter()
        .map(|i| i["class"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(classes, ["shard-count", "rank-range"]);
    assert_eq!(doc["issues"][0]["line"], line_of(&contents, "tp = 2"));
    assert!(doc.get("groups").is_none());
}

#[test]
fn unreadable_model_config_is_an_error() {
    let dir = scratch("noconfig");
    fs::create_dir_all(dir.join("empty-model")).expect("dir");
    let contents = topology(1, "empty-model");
    let file = write(&dir, "t.toml", &contents);
    let out = tessera(&["topology", "check", &file]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let line = line_of(&contents, "path = ");
    assert!(
        stderr.contains(&format!(
            "{file}:{line}: error: model m: cannot read its config"
        )),
        "{stderr}"
    );
}

#[test]
fn a_missing_topology_file_is_a_clear_error() {
    let out = tessera(&["topology", "check", "/nonexistent/topology.toml"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot read topology file /nonexistent/topology.toml"),
        "{stderr}"
    );
}
