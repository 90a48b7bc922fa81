//! `tessera up` and `tessera generate --url` without the other binaries: the launcher's
//! preparation (written topology, check, certificates, command lines) with `--dry-run`, its
//! clear failures, and the client side of `--url` against a small fake server. The runs of
//! real clusters are in `crates/tests`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(rel: &str) -> PathBuf {
    repo_root().join("fixtures/models").join(rel)
}

fn tessera(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .current_dir(cwd)
        .env_remove("TESSERA_TOPOLOGY")
        .env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_URL")
        .env_remove("TESSERA_BIN_DIR")
        .env_remove("TESSERA_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("tessera runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks a clean failure (exit 1, one `error:` line, no panic) and returns stderr.
fn fails(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(stderr.contains("error: "), "stderr: {stderr}");
    stderr
}

#[test]
fn a_missing_model_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = tessera(
        &["up", "--model", "DOES_NOT_EXIST", "--run-dir", "run"],
        dir.path(),
    );
    let stderr = fails(&out);
    assert!(
        stderr.contains("--model DOES_NOT_EXIST: no such file or directory"),
        "{stderr}"
    );
    assert!(!dir.path().join("run/certs").exists(), "nothing is made");
}

#[test]
fn the_demo_without_its_model_says_how_to_fetch_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let stderr = fails(&tessera(&["up", "--dry-run"], dir.path()));
    assert!(stderr.contains("scripts/get-demo-model.sh"), "{stderr}");
    assert!(
        stderr.contains("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "{stderr}"
    );
}

#[test]
fn tp_needs_a_model() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = tessera(&["up", "--tp", "2"], dir.path());
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(
        text(&out.stderr).contains("--model"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_model_and_tp_make_a_topology_that_check_accepts() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = fixture("llama-gqa/f32");
    let model = model.to_str().expect("utf-8 path");
    let args = [
        "up",
        "--model",
        model,
        "--tp",
        "2",
        "--run-dir",
        "run",
        "--http",
        "127.0.0.1:18000",
        "--dry-run",
    ];
    let out = tessera(&args, dir.path());
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let topology = dir.path().join("run/topology.toml");
    assert!(
        stderr.contains(&format!("wrote {}", topology.display())),
        "{stderr}"
    );
    // The plan, as `topology check` prints it, and the three command lines.
    assert!(
        stderr.contains("group cpu-tp2: model f32, tp 2, collective shm"),
        "{stderr}"
    );
    for name in ["coordinator-1", "cpu-tp2/0", "cpu-tp2/1"] {
        assert!(stderr.contains(&format!("  {name} ")), "{name}: {stderr}");
    }
    assert!(
        stderr.contains(&format!(
            "--topology {} --group cpu-tp2 --rank 1",
            topology.display()
        )),
        "{stderr}"
    );
    let certs = dir.path().join("run/certs");
    for file in [
        "ca.pem",
        "coordinator-1.pem",
        "shard-cpu-tp2-0.pem",
        "shard-cpu-tp2-1.key",
    ] {
        assert!(certs.join(file).exists(), "{file} made");
    }

    let check = tessera(
        &["topology", "check", topology.to_str().expect("utf-8")],
        dir.path(),
    );
    assert!(check.status.success(), "{}", text(&check.stderr));
    let plan = text(&check.stdout);
    assert!(
        plan.contains("ok — 1 coordinator peer, 1 host, 1 model, 1 group"),
        "{plan}"
    );
    assert!(plan.contains("127.0.0.1:18000"), "{plan}");

    // A second run reuses the certificates.
    let again = tessera(&args, dir.path());
    let stderr = text(&again.stderr);
    assert!(again.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("using the certificates in {}", certs.display())),
        "{stderr}"
    );

    // Another --tp makes other shards: the launcher's own certificates are replaced.
    let tp1 = args.map(|a| if a == "2" { "1" } else { a });
    let other = tessera(&tp1, dir.path());
    let stderr = text(&other.stderr);
    assert!(other.status.success(), "{stderr}");
    assert!(
        stderr.contains("made for another topology: replacing them"),
        "{stderr}"
    );
    assert!(certs.join("shard-cpu-tp1-0.pem").exists());
}

#[test]
fn missing_binaries_are_named_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tmp");
    let empty = tempfile::tempdir().expect("tmp");
    let model = fixture("llama-gqa/f32");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "up",
            "--run-dir",
            "run",
            "--http",
            "127.0.0.1:18001",
            "--model",
        ])
        .arg(&model)
        .env("TESSERA_BIN_DIR", empty.path())
        .current_dir(dir.path())
        .output()
        .expect("tessera runs");
    let stderr = fails(&out);
    assert!(stderr.contains("tessera-coordinator not found"), "{stderr}");
    assert!(stderr.contains("TESSERA_BIN_DIR"), "{stderr}");
}

const TOPOLOGY: &str = r#"
[[coordinator]]
id = 1
host = "here"
quic = "127.0.0.1:17000"
http = "127.0.0.1:18002"

[[host]]
name = "here"
address = "127.0.0.1"

[[host]]
name = "there"
address = "192.0.2.1"

[[model]]
name = "m"
path = "MODEL"

[[group]]
name = "g"
model = "m"
tp = 2

[[group.shard]]
rank = 0
host = "here"
device = "cpu"
port = 17101
kv_memory = "16MiB"

[[group.shard]]
rank = 1
host = "there"
device = "cpu"
port = 17101
kv_memory = "16MiB"
"#;

fn write_topology(dir: &Path, tp_line: &str) -> PathBuf {
    let model = fixture("llama-gqa/f32");
    let text = TOPOLOGY
        .replace("MODEL", model.to_str().expect("utf-8"))
        .replace("tp = 2", tp_line);
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).expect("write");
    path
}

#[test]
fn a_topology_runs_only_the_processes_of_this_host() {
    let dir = tempfile::tempdir().expect("tmp");
    let topology = write_topology(dir.path(), "tp = 2");
    let file = topology.to_str().expect("utf-8");
    let out = tessera(&["up", "--topology", file, "--dry-run"], dir.path());
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("2 processes on host(s) here"), "{stderr}");
    assert!(
        stderr.contains(&format!("--topology {file} --group g --rank 0")),
        "{stderr}"
    );
    assert!(
        !stderr.contains("--rank 1"),
        "rank 1 runs on the other host: {stderr}"
    );
    assert!(
        stderr.contains("other hosts need these certificates too"),
        "{stderr}"
    );

    let there = tessera(
        &["up", "--topology", file, "--host", "there", "--dry-run"],
        dir.path(),
    );
    let stderr = text(&there.stderr);
    assert!(there.status.success(), "{stderr}");
    assert!(stderr.contains("1 process on host(s) there"), "{stderr}");
    assert!(
        stderr.contains("no coordinator runs on this host"),
        "{stderr}"
    );

    let nowhere = tessera(&["up", "--topology", file, "--host", "nowhere"], dir.path());
    let stderr = fails(&nowhere);
    assert!(stderr.contains("its hosts: here, there"), "{stderr}");
}

#[test]
fn topology_errors_are_printed_and_nothing_starts() {
    let dir = tempfile::tempdir().expect("tmp");
    // llama-gqa has 4 attention heads: tp = 3 does not divide them.
    let topology = write_topology(dir.path(), "tp = 3");
    let out = tessera(
        &["up", "--topology", topology.to_str().expect("utf-8")],
        dir.path(),
    );
    let stderr = fails(&out);
    assert!(stderr.contains("help: "), "the check's advice: {stderr}");
    assert!(stderr.contains("nothing was started"), "{stderr}");
    assert!(
        !dir.path().join("run/certs").exists(),
        "no certificates made"
    );
}

#[test]
fn generate_url_says_when_the_server_is_unreachable() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = tessera(
        &["generate", "--url", "http://127.0.0.1:1", "--prompt", "hi"],
        dir.path(),
    );
    let stderr = fails(&out);
    assert!(
        stderr.contains("cannot reach the server at http://127.0.0.1:1"),
        "{stderr}"
    );
}

/// A one-thread HTTP/1.1 server answering `/v1/models`, and every other request with
/// `completion`: a status and a JSON body, or, where the body is an array, a stream of
/// server-sent events with one element each and `[DONE]`. It records each request's line
/// and body.
struct FakeServer {
    url: String,
    requests: Arc<Mutex<Vec<(String, Value)>>>,
    /// Each request's headers, as `name: value` with the name in lower case.
    headers: Arc<Mutex<Vec<Vec<String>>>>,
}

fn fake_server(completion: (u16, Value)) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let headers = Arc::new(Mutex::new(Vec::new()));
    let (seen, seen_headers) = (Arc::clone(&requests), Arc::clone(&headers));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            answer(stream, &completion, &seen, &seen_headers);
        }
    });
    FakeServer {
        url,
        requests,
        headers,
    }
}

fn answer(
    stream: TcpStream,
    completion: &(u16, Value),
    seen: &Mutex<Vec<(String, Value)>>,
    seen_headers: &Mutex<Vec<Vec<String>>>,
) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut request_line = String::new();
    reader.read_line(&mut request_line).expect("request line");
    let mut length = 0;
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).expect("header");
        if header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let name = name.trim().to_ascii_lowercase();
            if name == "content-length" {
                length = value.trim().parse().expect("length");
            }
            headers.push(format!("{name}: {}", value.trim()));
        }
    }
    seen_headers.lock().expect("lock").push(headers);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("body");
    let request_line = request_line.trim().to_owned();
    let (status, answer) = if request_line.starts_with("GET /v1/models") {
        (
            200,
            json!({"object": "list", "data": [{"id": "m", "max_model_len": 100}]}),
        )
    } else {
        completion.clone()
    };
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    seen.lock().expect("lock").push((request_line, body));
    let (content_type, answer) = match answer {
        Value::Array(events) => {
            let mut sse: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
            sse.push_str("data: [DONE]\n\n");
            ("text/event-stream", sse)
        }
        answer => ("application/json", answer.to_string()),
    };
    let mut stream = stream;
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{answer}",
        answer.len()
    );
}

/// A streamed completion of the tokens 7 and 8 (" Paris") after the prompt 1, 2, 3, as
/// vLLM-style servers send it: prompt ids on the first chunk, then a chunk per token, then
/// the usage.
fn completion() -> Value {
    let chunk = |choice: Value| {
        json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
               "choices": [choice]})
    };
    let mut first = chunk(json!({"index": 0, "text": " Par", "logprobs": null,
                                 "finish_reason": null, "token_ids": [7]}));
    first["prompt_token_ids"] = json!([1, 2, 3]);
    json!([
        first,
        chunk(json!({"index": 0, "text": "is", "logprobs": null,
                     "finish_reason": "length", "token_ids": [8]})),
        {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ])
}

/// The chat form of [`completion`]: deltas instead of text.
fn chat_completion() -> Value {
    let chunk = |delta: Value, ids: Value, finish: Value| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
               "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                          "finish_reason": finish, "token_ids": ids}]})
    };
    json!([
        chunk(json!({"role": "assistant", "content": ""}), json!([]), Value::Null),
        chunk(json!({"content": "Hello"}), json!([7]), Value::Null),
        chunk(json!({"content": "!"}), json!([8]), json!("stop")),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [],
         "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}},
    ])
}

#[test]
fn generate_url_sends_the_request_and_prints_like_the_local_path() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = fake_server((200, completion()));
    let out = tessera(
        &[
            "generate",
            "--url",
            &server.url,
            "--prompt-tokens",
            "1,2,3",
            "--seed",
            "7",
            "--ignore-eos",
            "--json",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(printed["model"], "m", "the first listed model");
    assert_eq!(printed["prompt_tokens"], 3);
    assert_eq!(printed["prompt_token_ids"], json!([1, 2, 3]));
    assert_eq!(printed["tokens"], json!([7, 8]));
    assert_eq!(printed["text"], " Paris");
    assert_eq!(printed["finish_reason"], "length");
    assert!(printed["elapsed_s"].as_f64().is_some(), "{printed}");

    let requests = server.requests.lock().expect("lock").clone();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert!(requests[0].0.starts_with("GET /v1/models "), "{requests:?}");
    assert!(
        requests[1].0.starts_with("POST /v1/completions "),
        "{requests:?}"
    );
    let body = &requests[1].1;
    assert_eq!(body["model"], "m");
    assert_eq!(body["prompt"], json!([1, 2, 3]));
    // 256 at most, and what the 100-token context leaves after the prompt.
    assert_eq!(body["max_tokens"], 97);
    assert_eq!(body["temperature"], 0.0);
    assert_eq!(body["seed"], 7);
    assert_eq!(body["ignore_eos"], true);
    assert_eq!(body["return_token_ids"], true);
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert!(body.get("top_k").is_none(), "top-k 0 is not sent: {body}");

    let plain = tessera(
        &[
            "generate",
            "--url",
            &server.url,
            "--model",
            "m",
            "--prompt",
            "The capital is",
            "--max-tokens",
            "2",
            "--top-k",
            "5",
        ],
        dir.path(),
    );
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert_eq!(text(&plain.stdout), " Paris\n");
    assert!(text(&plain.stderr).contains("3 prompt tokens, 2 generated (length)"));
    let requests = server.requests.lock().expect("lock").clone();
    let body = &requests.last().expect("a request").1;
    assert_eq!(body["prompt"], "The capital is");
    assert_eq!(body["max_tokens"], 2);
    assert_eq!(body["top_k"], 5);
}

#[test]
fn generate_url_with_chat_asks_the_chat_endpoint() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = fake_server((200, chat_completion()));
    let out = tessera(
        &["generate", "--url", &server.url, "--chat", "Say hello"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "Hello!\n");
    assert!(
        text(&out.stderr).contains("12 prompt tokens, 2 generated (stop)"),
        "{}",
        text(&out.stderr)
    );
    let requests = server.requests.lock().expect("lock").clone();
    let (line, body) = requests.last().expect("a request");
    assert!(line.starts_with("POST /v1/chat/completions "), "{line}");
    assert_eq!(
        body["messages"],
        json!([{"role": "user", "content": "Say hello"}])
    );
    assert!(body.get("prompt").is_none(), "{body}");
}

#[test]
fn generate_url_sends_the_api_key() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = fake_server((200, completion()));
    let out = tessera(
        &[
            "generate",
            "--url",
            &server.url,
            "--prompt-tokens",
            "1",
            "--api-key",
            "k-1",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let headers = server.headers.lock().expect("lock").clone();
    assert!(
        headers
            .iter()
            .all(|h| h.contains(&"authorization: Bearer k-1".to_owned())),
        "{headers:?}"
    );
}

#[test]
fn generate_url_prints_the_servers_error_message() {
    let dir = tempfile::tempdir().expect("tmp");
    let envelope = json!({"error": {"message": "the model `m` does not exist",
                                    "type": "invalid_request_error", "param": "model",
                                    "code": "model_not_found"}});
    let server = fake_server((404, envelope));
    let out = tessera(
        &["generate", "--url", &server.url, "--prompt-tokens", "1"],
        dir.path(),
    );
    let stderr = fails(&out);
    assert!(
        stderr.contains("the server answered 404: the model `m` does not exist"),
        "{stderr}"
    );
}
