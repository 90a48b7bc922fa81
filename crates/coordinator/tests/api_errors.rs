//! The HTTP API's refusals over a mock engine: invalid parameters (400 naming the field),
//! unknown models, bad and oversized bodies, unknown routes, engine errors by class, and
//! random bodies that never crash the server. The router is called in process.

mod common;

use axum::http::{StatusCode, header};
use common::*;
use serde_json::{Value, json};
use tessera_comm::proto::{ErrorClass, WireError};
use tessera_coordinator::api::MAX_BODY_BYTES;

#[tokio::test]
async fn invalid_requests_are_400_with_param() {
    let long_prompt: Vec<u32> = vec![1; CONTEXT_TOKENS];
    // (body, status, param, words the message must contain)
    let cases: Vec<(Value, u16, Option<&str>, &[&str])> = vec![
        (json!({"prompt": [1]}), 400, Some("model"), &["required"]),
        (json!({"model": 7, "prompt": [1]}), 400, Some("model"), &[]),
        (
            json!({"model": IDS_MODEL}),
            400,
            Some("prompt"),
            &["required"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": []}),
            400,
            Some("prompt"),
            &["empty"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": 3}),
            400,
            Some("prompt"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [[1], [2]]}),
            400,
            Some("prompt"),
            &["one prompt"],
        ),
        (
            json!({"model": TEXT_MODEL, "prompt": ["a", "b"]}),
            400,
            Some("prompt"),
            &["one prompt"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1, IDS_VOCAB]}),
            400,
            Some("prompt"),
            &["100"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [-1]}),
            400,
            Some("prompt"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": "text"}),
            400,
            Some("prompt"),
            &["token ids"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": 0}),
            400,
            Some("max_tokens"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": "5"}),
            400,
            Some("max_tokens"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": -3}),
            400,
            Some("max_tokens"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "temperature": 2.5}),
            400,
            Some("temperature"),
            &["2.5"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "top_p": 0}),
            400,
            Some("top_p"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "top_p": 1.5}),
            400,
            Some("top_p"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "top_k": -2}),
            400,
            Some("top_k"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "seed": -1}),
            400,
            Some("seed"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "n": 17}),
            400,
            Some("n"),
            &["16"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "n": 0}),
            400,
            Some("n"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "temperature": -0.1}),
            400,
            Some("temperature"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "min_p": 1.5}),
            400,
            Some("min_p"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "min_p": -0.5}),
            400,
            Some("min_p"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "presence_penalty": 2.5}),
            400,
            Some("presence_penalty"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "frequency_penalty": -2.1}),
            400,
            Some("frequency_penalty"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "repetition_penalty": 2.5}),
            400,
            Some("repetition_penalty"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "stop": ["a", "b", "c", "d", "e"]}),
            400,
            Some("stop"),
            &["at most 4"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "stop": "x".repeat(257)}),
            400,
            Some("stop"),
            &["256 bytes"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "stop": [1]}),
            400,
            Some("stop"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "priority": "high"}),
            400,
            Some("priority"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "priority": 1u64 << 40}),
            400,
            Some("priority"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": 65}),
            400,
            Some("max_tokens"),
            &["64 tokens"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "ignore_eos": "yes"}),
            400,
            Some("ignore_eos"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "stop_token_ids": [IDS_VOCAB]}),
            400,
            Some("stop_token_ids"),
            &["100"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "stop_token_ids": vec![3; 257]}),
            400,
            Some("stop_token_ids"),
            &["256"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "echo": true}),
            400,
            Some("echo"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "logprobs": 6}),
            400,
            Some("logprobs"),
            &["0 to 5"],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1], "logprobs": -1}),
            400,
            Some("logprobs"),
            &[],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": long_prompt, "max_tokens": 1}),
            400,
            Some("prompt"),
            &[
                "maximum context length is 64 tokens",
                "65 tokens",
                "64 in the prompt",
            ],
        ),
        (
            json!({"model": IDS_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 61}),
            400,
            Some("max_tokens"),
            &["65 tokens (4 in the prompt, 61 for the completion)"],
        ),
    ];
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    for (body, status, param, words) in cases {
        let reply = complete(app(engine.clone()), body.clone()).await;
        let message = assert_error(&reply, status, "invalid_request_error", param);
        for word in words {
            assert!(message.contains(word), "{body}: {message:?} lacks {word:?}");
        }
    }
    assert!(
        engine.requests().is_empty(),
        "no invalid request reaches the engine"
    );

    // Exactly at the limit is fine.
    let fits = json!({"model": IDS_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 60});
    assert_eq!(
        complete(app(engine.clone()), fits).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn unknown_model_is_404_model_not_found() {
    let reply = complete(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        json!({"model": "gpt-4", "prompt": [1]}),
    )
    .await;
    let message = assert_error(&reply, 404, "invalid_request_error", Some("model"));
    assert_eq!(reply.body["error"]["code"], "model_not_found");
    assert!(message.contains("gpt-4"), "{message}");
}

#[tokio::test]
async fn context_overflow_has_openai_code() {
    let reply = complete(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": 1000}),
    )
    .await;
    assert_error(&reply, 400, "invalid_request_error", Some("max_tokens"));
    assert_eq!(reply.body["error"]["code"], "context_length_exceeded");
}

#[tokio::test]
async fn bad_bodies_are_400_in_the_envelope() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let cases: Vec<(Option<&str>, &str)> = vec![
        (Some("application/json"), "{\"model\": "),
        (Some("application/json"), "not json"),
        (Some("application/json"), ""),
        (Some("application/json"), "[1, 2]"),
        (Some("application/json"), "\"a string\""),
        (Some("application/json"), "null"),
        (
            Some("text/plain"),
            "{\"model\": \"ids-only\", \"prompt\": [1]}",
        ),
        (None, "{\"model\": \"ids-only\", \"prompt\": [1]}"),
    ];
    for (content_type, body) in cases {
        let reply = post_raw(app(engine.clone()), content_type, body).await;
        let message = assert_error(&reply, 400, "invalid_request_error", None);
        assert!(!message.is_empty(), "{content_type:?} {body:?}");
    }
    assert!(engine.requests().is_empty());
}

#[tokio::test]
async fn oversized_body_is_413_in_the_envelope() {
    let prompt = "a".repeat(MAX_BODY_BYTES + 1);
    let reply = complete(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        json!({"model": TEXT_MODEL, "prompt": prompt}),
    )
    .await;
    let message = assert_error(&reply, 413, "invalid_request_error", None);
    assert!(message.contains(&MAX_BODY_BYTES.to_string()), "{message}");
}

#[tokio::test]
async fn unknown_route_and_method_are_in_the_envelope() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let reply = get(app(engine.clone()), "/v1/nothing").await;
    assert_error(&reply, 404, "invalid_request_error", None);
    let reply = get(app(engine.clone()), "/v1/completions").await;
    assert_error(&reply, 405, "invalid_request_error", None);
}

#[tokio::test]
async fn engine_errors_map_by_class() {
    let cases = [
        (ErrorClass::InvalidRequest, 400, "invalid_request_error"),
        (ErrorClass::CapacityExhausted, 429, "overloaded_error"),
        (ErrorClass::Cancelled, 499, "cancelled_error"),
        (ErrorClass::Internal, 500, "server_error"),
        (ErrorClass::Unavailable, 503, "service_unavailable_error"),
        (ErrorClass::DeadlineExceeded, 504, "timeout_error"),
    ];
    for (class, status, error_type) in cases {
        let message = format!("group g0: rank 1 failed ({class:?})");
        let engine = MockEngine::new(Reply::Fail(WireError {
            class,
            message: message.clone(),
            rank: None,
        }));
        let reply = complete(app(engine), json!({"model": IDS_MODEL, "prompt": [1]})).await;
        let got = assert_error(&reply, status, error_type, None);
        assert_eq!(got, message, "the engine's message is passed through");
        let retry_after = reply.headers.get(header::RETRY_AFTER);
        if matches!(
            class,
            ErrorClass::CapacityExhausted | ErrorClass::Unavailable
        ) {
            assert_eq!(retry_after.unwrap(), "1", "{class:?}");
        } else {
            assert!(retry_after.is_none(), "{class:?}");
        }
    }
}

/// Random and mutated bodies never crash the server nor produce a 5xx: every answer is a
/// 200 or a 4xx in the envelope.
#[tokio::test]
async fn garbage_bodies_never_panic() {
    let engine = MockEngine::new(Reply::EchoPrompt(2));
    let valid = json!({"model": TEXT_MODEL, "prompt": "Hello [INST] <s></s> ünï 🦀",
                       "max_tokens": 3, "temperature": 0.7, "top_p": 0.9,
                       "stop_token_ids": [2], "return_token_ids": true})
    .to_string()
    .into_bytes();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // xorshift64*: deterministic, so a failure reproduces.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    for round in 0..300 {
        let mut body = valid.clone();
        match round % 3 {
            // Flip some bytes.
            0 => {
                for _ in 0..(next() % 4 + 1) {
                    let i = (next() as usize) % body.len();
                    body[i] = next() as u8;
                }
            }
            // Cut it short.
            1 => body.truncate((next() as usize) % body.len()),
            // Pure noise.
            _ => body = (0..(next() % 64)).map(|_| next() as u8).collect(),
        }
        let reply = post_raw(app(engine.clone()), Some("application/json"), body.clone()).await;
        let status = reply.status.as_u16();
        assert!(
            status == 200 || (400..500).contains(&status),
            "{status} for {:?}",
            String::from_utf8_lossy(&body)
        );
        if status != 200 {
            assert!(reply.body["error"]["message"].is_string());
        }
    }
    // Well-typed but odd values.
    for body in [
        json!({"model": TEXT_MODEL, "prompt": "", "max_tokens": 1}),
        json!({"model": TEXT_MODEL, "prompt": [""]}),
        json!({"model": TEXT_MODEL, "prompt": [4294967295u32]}),
        json!({"model": TEXT_MODEL, "prompt": [[]]}),
        json!({"model": TEXT_MODEL, "prompt": [1], "max_tokens": 4294967295u32}),
        json!({"model": TEXT_MODEL, "prompt": [1], "seed": 18446744073709551615u64}),
        json!({"model": TEXT_MODEL, "prompt": [1], "temperature": 1e308}),
        json!({"model": TEXT_MODEL, "prompt": [1], "top_k": 9007199254740993u64}),
        json!({"model": "", "prompt": [1]}),
    ] {
        let reply = complete(app(engine.clone()), body.clone()).await;
        let status = reply.status.as_u16();
        assert!(
            status == 200 || (400..500).contains(&status),
            "{status} for {body}"
        );
    }
}
