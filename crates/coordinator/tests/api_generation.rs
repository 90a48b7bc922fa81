//! Generation through the API over a mock engine: streaming (SSE framing, event ids,
//! usage), chat completions and templates, `n` choices, stop strings, logprobs, and
//! admission.

mod common;

use axum::http::header;
use common::*;
use serde_json::{Value, json};
use tessera_comm::proto::{ErrorClass, FinishReason, WireError};

/// The ids of `text` without BOS, for scripted replies.
fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap()
}

/// The token offsets of the events' ids (`{response_id}:{tokens sent}`).
fn offsets(events: &[SseEvent], response_id: &str) -> Vec<usize> {
    events
        .iter()
        .enumerate()
        .map(|(k, event)| {
            let id = event
                .id
                .as_deref()
                .unwrap_or_else(|| panic!("event {k} has no id"));
            id.strip_prefix(response_id)
                .and_then(|rest| rest.strip_prefix(':'))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("event {k}: id {id} is not {response_id}:<tokens>"))
        })
        .collect()
}

/// Every streamed chunk before `[DONE]`, checking ids and the terminator.
fn chunks(events: &[SseEvent], response_id: &str) -> Vec<Value> {
    let offsets = offsets(events, response_id);
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]),
        "token offsets go back: {offsets:?}"
    );
    assert_eq!(events.last().unwrap().data, "[DONE]");
    events[..events.len() - 1]
        .iter()
        .map(SseEvent::json)
        .collect()
}

fn streamed_text(chunks: &[Value], field: &str) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter_map(|choice| {
            let value = if field == "text" {
                &choice["text"]
            } else {
                &choice["delta"]["content"]
            };
            value.as_str().map(str::to_string)
        })
        .collect()
}

#[tokio::test]
async fn completion_streams_with_event_ids_and_usage() {
    let tokens = ids("Hello world, the end");
    let engine = MockEngine::new(Reply::Script(tokens.clone(), Some(FinishReason::Stop)));
    let body = json!({"model": TEXT_MODEL, "prompt": "Hi", "stream": true,
                      "stream_options": {"include_usage": true}, "max_tokens": 20});
    let (_, events) = stream(app(engine.clone()), "/v1/completions", body.clone()).await;
    let first = events[0].json();
    let id = first["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("cmpl-"), "{id}");
    let chunks = chunks(&events, &id);
    assert_eq!(offsets(&events, &id).last(), Some(&tokens.len()));
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["id"], id);
    }
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let prompt_tokens = tokenizer().encode("Hi", true).unwrap().len();
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": tokens.len(),
               "total_tokens": prompt_tokens + tokens.len()})
    );
    let content = &chunks[..chunks.len() - 1];
    assert!(content.iter().all(|c| c["usage"].is_null()));
    let finishes: Vec<&Value> = content
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .collect();
    assert_eq!(finishes.last().unwrap().as_str(), Some("stop"));
    assert!(finishes[..finishes.len() - 1].iter().all(|f| f.is_null()));

    // The streamed text is the non-streamed text.
    let whole = complete(
        app(engine),
        json!({"model": TEXT_MODEL, "prompt": "Hi",
                                              "max_tokens": 20}),
    )
    .await;
    assert_eq!(
        streamed_text(content, "text"),
        whole.body["choices"][0]["text"].as_str().unwrap()
    );
    assert_eq!(whole.body["choices"][0]["text"], "Hello world, the end");
}

#[tokio::test]
async fn stream_without_usage_has_no_usage_field() {
    let engine = MockEngine::new(Reply::EchoPrompt(3));
    let body = json!({"model": IDS_MODEL, "prompt": [5, 6, 7], "stream": true,
                      "return_token_ids": true});
    let (_, events) = stream(app(engine), "/v1/completions", body).await;
    let id = events[0].json()["id"].as_str().unwrap().to_string();
    let chunks = chunks(&events, &id);
    // Without a tokenizer there is no text, but every token is sent with its id.
    assert_eq!(chunks.len(), 3);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(chunks[0]["prompt_token_ids"], json!([5, 6, 7]));
    let streamed: Vec<Value> = chunks
        .iter()
        .map(|c| c["choices"][0]["token_ids"][0].clone())
        .collect();
    assert_eq!(streamed, vec![json!(5), json!(6), json!(7)]);
}

#[tokio::test]
async fn engine_error_mid_stream_is_an_error_event() {
    let error = WireError {
        class: ErrorClass::Unavailable,
        message: "group g0: rank 1 lost".into(),
        rank: None,
    };
    let engine = MockEngine::new(Reply::FailAfter(ids("Hello"), error));
    let body = json!({"model": TEXT_MODEL, "prompt": "Hi", "stream": true});
    let (_, events) = stream(app(engine), "/v1/completions", body).await;
    let n = events.len();
    assert_eq!(events[n - 1].data, "[DONE]");
    let error = events[n - 2].json();
    assert_eq!(error["error"]["type"], "service_unavailable_error");
    assert_eq!(error["error"]["message"], "group g0: rank 1 lost");
}

#[tokio::test]
async fn stop_string_cuts_the_text_and_cancels_the_sequence() {
    // The script never finishes: only the stop string can end it.
    let engine = MockEngine::new(Reply::Script(ids("Hello world, the end"), None));
    let reply = complete(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "prompt": "Hi", "stop": ["ld, t", "zzz"]}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choice = &reply.body["choices"][0];
    assert_eq!(choice["text"], "Hello wor");
    assert_eq!(choice["finish_reason"], "stop");
    engine.wait_cancelled(1).await;

    // Streaming: the same text, and the stream ends.
    let body = json!({"model": TEXT_MODEL, "prompt": "Hi", "stop": "ld, t", "stream": true});
    let (_, events) = stream(app(engine.clone()), "/v1/completions", body).await;
    let id = events[0].json()["id"].as_str().unwrap().to_string();
    let chunks = chunks(&events, &id);
    assert_eq!(streamed_text(&chunks, "text"), "Hello wor");
    engine.wait_cancelled(2).await;
}

#[tokio::test]
async fn n_choices_have_their_own_seeds() {
    let engine = MockEngine::new(Reply::EchoPrompt(2));
    let reply = complete(
        app(engine.clone()),
        json!({"model": IDS_MODEL, "prompt": [5, 6, 7], "n": 3, "seed": 10}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choices = reply.body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "length");
    }
    let seeds: Vec<u64> = engine.requests().iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![10, 11, 12]);
    assert_eq!(reply.body["usage"]["completion_tokens"], 6);
    assert_eq!(reply.body["usage"]["prompt_tokens"], 3);

    // Streaming: every choice index shows up and finishes.
    let body = json!({"model": IDS_MODEL, "prompt": [5, 6], "n": 2, "stream": true,
                      "return_token_ids": true});
    let (_, events) = stream(app(engine), "/v1/completions", body).await;
    let id = events[0].json()["id"].as_str().unwrap().to_string();
    let finished: Vec<u64> = chunks(&events, &id)
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect();
    let mut finished = finished;
    finished.sort_unstable();
    assert_eq!(finished, vec![0, 1]);
}

#[tokio::test]
async fn priority_and_logprobs_reach_the_engine() {
    let engine = MockEngine::new(Reply::Script(ids("Hello"), Some(FinishReason::Length)));
    let reply = complete(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "prompt": "Hi", "priority": -3, "logprobs": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let request = engine.last();
    assert_eq!(request.priority, -3);
    assert_eq!(request.sampling.logprobs, Some(2));
    let logprobs = &reply.body["choices"][0]["logprobs"];
    let count = ids("Hello").len();
    assert_eq!(logprobs["tokens"].as_array().unwrap().len(), count);
    assert_eq!(logprobs["token_logprobs"][0], -0.25);
    assert_eq!(logprobs["text_offset"][0], 0);
    // Two alternatives plus the sampled token.
    assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 3);
}

#[tokio::test]
async fn chat_uses_the_template_and_answers_openai_style() {
    let engine = MockEngine::new(Reply::Script(ids("Hello"), Some(FinishReason::Stop)));
    let reply = chat(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "max_completion_tokens": 8,
               "messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = &reply.body;
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    let choice = &body["choices"][0];
    assert_eq!(
        choice["message"],
        json!({"role": "assistant", "content": "Hello"})
    );
    assert_eq!(choice["finish_reason"], "stop");
    let expected = tokenizer()
        .encode(
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]",
            false,
        )
        .unwrap();
    let request = engine.last();
    assert_eq!(request.prompt, expected);
    assert_eq!(request.max_tokens, 8);
    assert_eq!(body["usage"]["prompt_tokens"], expected.len());

    // Without a limit, the rest of the context.
    chat(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    let request = engine.last();
    assert_eq!(
        request.max_tokens as usize,
        CONTEXT_TOKENS - request.prompt.len()
    );
}

#[tokio::test]
async fn chat_streams_role_then_content() {
    let engine = MockEngine::new(Reply::Script(ids("Hello world"), Some(FinishReason::Stop)));
    let body = json!({"model": TEXT_MODEL, "stream": true, "logprobs": true,
                      "top_logprobs": 1, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "Hi"}]});
    let (_, events) = stream(app(engine), "/v1/chat/completions", body).await;
    let id = events[0].json()["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("chatcmpl-"));
    let chunks = chunks(&events, &id);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(streamed_text(&chunks, "content"), "Hello world");
    let content = &chunks[1..chunks.len() - 1];
    let entry = &content[0]["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["logprob"], -0.25);
    assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 1);
    assert!(entry["bytes"].is_array());
    assert_eq!(
        chunks.last().unwrap()["usage"]["completion_tokens"],
        ids("Hello world").len()
    );
}

#[tokio::test]
async fn chat_errors_name_the_parameter() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (
            json!({"model": IDS_MODEL, "messages": user}),
            400,
            Some("model"),
        ),
        (json!({"model": TEXT_MODEL}), 400, Some("messages")),
        (
            json!({"model": TEXT_MODEL, "messages": []}),
            400,
            Some("messages"),
        ),
        (
            json!({"model": TEXT_MODEL, "messages": [{"role": "assistant", "content": "x"}]}),
            400,
            Some("messages"),
        ),
        (
            json!({"model": TEXT_MODEL, "messages": user, "top_logprobs": 2}),
            400,
            Some("top_logprobs"),
        ),
        (
            json!({"model": TEXT_MODEL, "messages": user, "logprobs": true,
                   "top_logprobs": 21}),
            400,
            Some("top_logprobs"),
        ),
        (
            json!({"model": TEXT_MODEL, "messages": user, "max_completion_tokens": 0}),
            400,
            Some("max_completion_tokens"),
        ),
        (
            json!({"model": TEXT_MODEL, "messages": user, "temperature": 3}),
            400,
            Some("temperature"),
        ),
        (
            json!({"model": "nope", "messages": user}),
            404,
            Some("model"),
        ),
    ];
    for (body, status, param) in cases {
        let reply = chat(app(engine.clone()), body.clone()).await;
        assert_error(&reply, status, "invalid_request_error", param);
    }
    assert!(engine.requests().is_empty());
}

#[tokio::test]
async fn full_queue_is_429_before_tokenizing() {
    let engine = std::sync::Arc::new(MockEngine {
        admission: Some(WireError {
            class: ErrorClass::CapacityExhausted,
            message: "every queue of model tiny-spm is full".into(),
            rank: None,
        }),
        ..MockEngine::with(Reply::EchoPrompt(1))
    });
    // A prompt far over the context: admission answers before it is tokenized.
    let long = "word ".repeat(10_000);
    let reply = complete(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "prompt": long}),
    )
    .await;
    assert_error(&reply, 429, "overloaded_error", None);
    assert_eq!(reply.headers.get(header::RETRY_AFTER).unwrap(), "1");
    let reply = chat(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_error(&reply, 429, "overloaded_error", None);
    assert!(engine.requests().is_empty());
}

#[tokio::test]
async fn prompt_over_the_context_is_context_length_exceeded() {
    let reply = complete(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        json!({"model": TEXT_MODEL, "prompt": "word ".repeat(200)}),
    )
    .await;
    assert_error(&reply, 400, "invalid_request_error", Some("prompt"));
    assert_eq!(reply.body["error"]["code"], "context_length_exceeded");
    // Chat blames its own fields: the messages, or the completion length it was given.
    let long = json!([{"role": "user", "content": "word ".repeat(200)}]);
    let reply = chat(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        json!({"model": TEXT_MODEL, "messages": long}),
    )
    .await;
    assert_error(&reply, 400, "invalid_request_error", Some("messages"));
    assert_eq!(reply.body["error"]["code"], "context_length_exceeded");
    let hi = json!([{"role": "user", "content": "Hi"}]);
    for field in ["max_tokens", "max_completion_tokens"] {
        let mut body = json!({"model": TEXT_MODEL, "messages": hi});
        body[field] = json!(CONTEXT_TOKENS - 1);
        let reply = chat(app(MockEngine::new(Reply::EchoPrompt(1))), body).await;
        assert_error(&reply, 400, "invalid_request_error", Some(field));
        assert_eq!(reply.body["error"]["code"], "context_length_exceeded");
    }
}

#[tokio::test]
async fn invalid_utf8_and_lone_surrogates_are_400() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let mut bytes = br#"{"model": "tiny-spm", "prompt": "ab"#.to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(br#""}"#);
    let reply = post_raw(app(engine.clone()), Some("application/json"), bytes).await;
    assert_error(&reply, 400, "invalid_request_error", None);
    let surrogate = r#"{"model": "tiny-spm", "prompt": "a\ud800b"}"#;
    let reply = post_raw(app(engine.clone()), Some("application/json"), surrogate).await;
    assert_error(&reply, 400, "invalid_request_error", None);
    assert!(engine.requests().is_empty());
}

/// The response names its request in `x-request-id`, streamed (before the first event,
/// so a stream that breaks at once can still be resumed) or not.
#[tokio::test]
async fn responses_name_their_request_in_a_header() {
    let engine = || MockEngine::new(Reply::EchoPrompt(2));
    let whole = complete(app(engine()), json!({"model": IDS_MODEL, "prompt": [5, 6]})).await;
    assert_eq!(whole.status, 200);
    let header = whole.headers.get("x-request-id").expect("the header");
    assert_eq!(header.to_str().unwrap(), whole.body["id"].as_str().unwrap());

    let request = axum::http::Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(
            json!({"model": IDS_MODEL, "prompt": [5, 6], "stream": true}).to_string(),
        ))
        .unwrap();
    let (status, headers, text) = send_text(app(engine()), request).await;
    assert_eq!(status, 200);
    let id = headers
        .get("x-request-id")
        .expect("the header")
        .to_str()
        .unwrap();
    assert!(id.starts_with("cmpl-"), "{id}");
    assert!(text.contains(&format!("\"id\":\"{id}\"")), "{text}");
}
