//! `GET /v1/streams/{id}` on a request that a stop string ended: the journal holds the
//! tokens as generated (which may run past the match), and the resumed response ends
//! where the original did, with `finish_reason: stop`.

use serde_json::{Value, json};
use tessera_tests::{Cluster, GroupSpec, demo_model, post, sse};

/// The text of a stream's chunks and its last finish reason.
fn streamed(events: &[tessera_tests::SseEvent]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for e in events.iter().filter(|e| e.data != "[DONE]") {
        let chunk: Value = serde_json::from_str(&e.data).expect("chunk");
        assert!(chunk.get("error").is_none(), "error event: {chunk}");
        let choice = &chunk["choices"][0];
        text.push_str(choice["text"].as_str().unwrap_or_default());
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (text, finish)
}

#[test]
fn a_request_ended_by_a_stop_string_resumes_to_the_same_text() {
    let Some(path) = demo_model() else { return };
    let cluster = Cluster::start_local(&[GroupSpec::local("g", "smol", &path, 1)])
        .expect("the cluster starts");
    let url = format!("{}/v1/completions", cluster.http);
    let base = json!({
        "model": "smol", "prompt": "The three primary colors are", "max_tokens": 32,
        "temperature": 0, "ignore_eos": true,
    });
    let (status, full) = post(&url, &base).expect("completion");
    assert_eq!(status, 200, "{full}");
    let text = full["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    // A stop string from the middle of the greedy text; it first matches at `cut`.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 20, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 4].iter().collect();
    let cut = text.find(&stop).expect("the stop string is in the text");
    let expected = &text[..cut];

    let mut body = base.clone();
    body["stop"] = json!([stop]);
    body["stream"] = json!(true);
    let (events, done) = sse(&url, Some(&body), None);
    assert!(done, "the stream ended without [DONE]");
    let (got, finish) = streamed(&events);
    assert_eq!(got, expected, "stop {stop:?}");
    assert_eq!(finish.as_deref(), Some("stop"));
    let first: Value = serde_json::from_str(&events[0].data).expect("chunk");
    let id = first["id"].as_str().expect("id");

    // The whole body again, by id, and the stream again from its first token.
    let again = format!("{}/v1/streams/{id}", cluster.http);
    let (status, whole) = tessera_tests::get(&format!("{again}?stream=false")).expect("GET");
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"], expected, "{whole}");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
    let (events, done) = sse(&again, None, None);
    assert!(done, "the resumed stream ended without [DONE]");
    let (resumed, finish) = streamed(&events);
    assert_eq!(resumed, expected);
    assert_eq!(finish.as_deref(), Some("stop"));
}
