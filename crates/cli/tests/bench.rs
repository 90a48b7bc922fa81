//! `tessera bench` against a fake OpenAI server started in the test: a `TcpListener` thread
//! answering `/v1/models` and `/v1/completions` (streamed or whole) with fixed tokens after
//! small sleeps, and failing every n-th completion with a 500 when asked to.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};

/// Time before each token, so TTFT and ITL are measurably above zero.
const TOKEN_DELAY: Duration = Duration::from_millis(3);

#[derive(Debug, Default)]
struct Behaviour {
    /// Every `fail_every`-th completion (1-based) answers 500; 0 never.
    fail_every: usize,
    /// Leave `usage` out of streams, as some servers do.
    no_stream_usage: bool,
}

#[derive(Debug, Default)]
struct FakeServer {
    behaviour: Behaviour,
    completions: AtomicUsize,
    bodies: Mutex<Vec<Value>>,
}

impl FakeServer {
    /// Starts the server; returns its base URL.
    fn start(self: &Arc<Self>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = Arc::clone(self);
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let server = Arc::clone(&server);
                thread::spawn(move || {
                    // A client that hangs up early is not the test's concern.
                    let _ = server.serve(stream);
                });
            }
        });
        url
    }

    /// Answers one request, then closes the connection.
    fn serve(&self, stream: TcpStream) -> std::io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut request_line = String::new();
        reader.read_line(&mut request_line)?;
        let mut content_length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; content_length];
        reader.read_exact(&mut body)?;
        let mut out = stream;
        if request_line.starts_with("GET /v1/models") {
            let models =
                json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]});
            return respond(&mut out, 200, "application/json", &models.to_string());
        }
        if !request_line.starts_with("POST /v1/completions") {
            return respond(&mut out, 404, "text/plain", "not found");
        }
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        self.bodies.lock().expect("bodies").push(body.clone());
        let n = self.completions.fetch_add(1, Ordering::SeqCst) + 1;
        if self.behaviour.fail_every > 0 && n.is_multiple_of(self.behaviour.fail_every) {
            let error = json!({"error": {"message": "fake overload", "type": "server_error"}});
            return respond(&mut out, 500, "application/json", &error.to_string());
        }
        let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
        let prompt_tokens = body["prompt"]
            .as_str()
            .unwrap_or("")
            .split_whitespace()
            .count();
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                           "total_tokens": prompt_tokens + max_tokens});
        if body["stream"] != json!(true) {
            thread::sleep(TOKEN_DELAY * max_tokens as u32);
            let answer = json!({"choices": [{"index": 0, "text": " tok".repeat(max_tokens),
                                             "finish_reason": "length"}],
                                "usage": usage});
            return respond(&mut out, 200, "application/json", &answer.to_string());
        }
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )?;
        out.flush()?;
        for i in 0..max_tokens {
            thread::sleep(TOKEN_DELAY);
            let finish = if i + 1 == max_tokens {
                json!("length")
            } else {
                Value::Null
            };
            let chunk = json!({"choices": [{"index": 0, "text": " tok", "finish_reason": finish}]});
            write!(out, "data: {chunk}\n\n")?;
            out.flush()?;
        }
        if !self.behaviour.no_stream_usage && body["stream_options"]["include_usage"] == json!(true)
        {
            write!(out, "data: {}\n\n", json!({"choices": [], "usage": usage}))?;
        }
        write!(out, "data: [DONE]\n\n")?;
        out.flush()
    }
}

fn respond(
    out: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    write!(
        out,
        "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()
}

/// Runs `tessera bench` with `args` against `url`; returns whether it succeeded and the
/// JSON report.
fn bench(url: &str, dir: &Path, args: &[&str]) -> (bool, Value) {
    let report = dir.join("report.json");
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["bench", "--url", url, "--json"])
        .arg(&report)
        .args(args)
        .env_remove("TESSERA_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("tessera runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("tessera bench"),
        "the table is printed: {stdout}"
    );
    let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        panic!(
            "no report ({e}); stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (
        output.status.success(),
        serde_json::from_str(&text).expect("the report is JSON"),
    )
}

fn f(value: &Value) -> f64 {
    value
        .as_f64()
        .unwrap_or_else(|| panic!("a number: {value}"))
}

#[test]
fn a_streamed_run_reports_tokens_and_latencies() {
    let server = Arc::new(FakeServer::default());
    let url = server.start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, r) = bench(
        &url,
        dir.path(),
        &[
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--warmup",
            "2",
            "--prompt-tokens",
            "7",
            "--output-tokens",
            "5",
            "--label",
            "fake",
        ],
    );
    assert!(ok, "{r:#}");
    assert_eq!(r["label"], "fake");
    assert_eq!(r["model"], "fake-model", "the first listed model");
    assert_eq!(r["load"], json!({"mode": "closed", "concurrency": 3}));
    assert_eq!(
        (
            r["requests"].as_u64(),
            r["completed"].as_u64(),
            r["failed"].as_u64()
        ),
        (Some(12), Some(12), Some(0))
    );
    assert_eq!(r["usage_reported"], 12);
    assert_eq!(r["prompt_tokens_total"], 12 * 7);
    assert_eq!(r["completion_tokens_total"], 12 * 5);
    assert_eq!(r["ttft"]["count"], 12);
    assert_eq!(
        r["itl"]["count"],
        12 * 4,
        "four gaps after each first token"
    );
    assert_eq!(r["tpot"]["count"], 12);
    let (ttft, e2e) = (f(&r["ttft"]["mean_ms"]), f(&r["e2e"]["mean_ms"]));
    assert!(ttft >= 3.0 && ttft < e2e, "ttft {ttft} ms, e2e {e2e} ms");
    assert!(f(&r["itl"]["p50_ms"]) >= 2.0, "{}", r["itl"]);
    assert!(f(&r["ttft"]["p50_ms"]) <= f(&r["ttft"]["p99_ms"]));
    assert!(f(&r["output_token_throughput_per_s"]) > 0.0);
    let total = f(&r["total_token_throughput_per_s"]);
    assert!((total / f(&r["output_token_throughput_per_s"]) - 12.0 / 5.0).abs() < 1e-6);

    // The warmup went to the server too; every request streamed, with ignore_eos.
    let bodies = server.bodies.lock().expect("bodies");
    assert_eq!(bodies.len(), 14);
    assert!(bodies.iter().all(|b| b["stream"] == true
        && b["ignore_eos"] == true
        && b["stream_options"]["include_usage"] == true
        && b["model"] == "fake-model"
        && b["max_tokens"] == 5
        && b["min_tokens"] == 5
        && b["temperature"] == 0.0));
    assert_eq!(
        bodies[0]["prompt"].as_str().map(|p| p.split(' ').count()),
        Some(7)
    );
}

#[test]
fn server_errors_are_counted_not_fatal() {
    let server = Arc::new(FakeServer {
        behaviour: Behaviour {
            fail_every: 3,
            ..Behaviour::default()
        },
        ..FakeServer::default()
    });
    let url = server.start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, r) = bench(
        &url,
        dir.path(),
        &[
            "--requests",
            "9",
            "--concurrency",
            "2",
            "--output-tokens",
            "3",
        ],
    );
    assert!(ok, "{r:#}");
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(6), Some(3))
    );
    assert_eq!(
        r["errors"],
        json!([{"message": "HTTP 500: fake overload", "count": 3}])
    );
    assert_eq!(
        r["completion_tokens_total"],
        6 * 3,
        "failed requests add no tokens"
    );
    assert_eq!(r["e2e"]["count"], 6);

    // When every request fails, the report is still written and the command fails.
    let server = Arc::new(FakeServer {
        behaviour: Behaviour {
            fail_every: 1,
            ..Behaviour::default()
        },
        ..FakeServer::default()
    });
    let url = server.start();
    let (ok, r) = bench(&url, dir.path(), &["--requests", "2", "--model", "m"]);
    assert!(!ok);
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(0), Some(2))
    );
    assert_eq!(r["ttft"], Value::Null);
}

#[test]
fn whole_answers_and_streams_without_usage() {
    let server = Arc::new(FakeServer {
        behaviour: Behaviour {
            no_stream_usage: true,
            ..Behaviour::default()
        },
        ..FakeServer::default()
    });
    let url = server.start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, r) = bench(
        &url,
        dir.path(),
        &[
            "--requests",
            "4",
            "--no-stream",
            "--output-tokens",
            "4",
            "--prompt-tokens",
            "5",
        ],
    );
    assert!(ok, "{r:#}");
    assert_eq!(r["stream"], false);
    assert_eq!(r["completion_tokens_total"], 16, "from usage");
    assert_eq!(r["prompt_tokens_total"], 20);
    assert_eq!(
        (&r["ttft"], &r["itl"], &r["tpot"]),
        (&Value::Null, &Value::Null, &Value::Null)
    );
    assert!(f(&r["e2e"]["p50_ms"]) >= 12.0);

    // A stream without usage: tokens are the content chunks; the prompt is the word count.
    let (ok, r) = bench(
        &url,
        dir.path(),
        &[
            "--requests",
            "3",
            "--rate",
            "50",
            "--seed",
            "9",
            "--output-tokens",
            "6",
            "--prompt-tokens",
            "5",
        ],
    );
    assert!(ok, "{r:#}");
    assert_eq!(
        r["load"],
        json!({"mode": "open", "rate_per_s": 50.0, "max_concurrency": 256})
    );
    assert_eq!(r["usage_reported"], 0);
    assert_eq!(r["completion_tokens_total"], 18);
    assert_eq!(r["prompt_tokens_total"], 15);
    assert_eq!(r["itl"]["count"], 15);
}
