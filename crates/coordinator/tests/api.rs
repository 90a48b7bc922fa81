//! The HTTP API over a mock engine: routes, validation, the error envelope, and the
//! requests the engine receives. The router is called in process (`oneshot`), no socket.
//! Streaming, chat and choices are in `api_generation.rs`; refusals in `api_errors.rs`;
//! keys, status and disconnects in `api_server.rs`.

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn health_is_ok() {
    let reply = get(app(MockEngine::new(Reply::EchoPrompt(1))), "/health").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, json!({"status": "ok"}));
}

/// An engine that stopped (a peer whose Raft stopped) fails the health probe, so that a
/// supervisor restarts the process; before, `/health` said 200 all the while.
#[tokio::test]
async fn health_fails_once_the_engine_has_stopped() {
    let engine = Arc::new(MockEngine {
        stopped: Some("the raft peer stopped: disk full".into()),
        ..MockEngine::with(Reply::EchoPrompt(1))
    });
    let reply = get(app(engine), "/health").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.body["status"], "failed");
    assert_eq!(reply.body["reason"], "the raft peer stopped: disk full");
}

#[tokio::test]
async fn ready_follows_the_engine() {
    let reply = get(app(MockEngine::new(Reply::EchoPrompt(1))), "/ready").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body["status"], "ready");

    let engine = Arc::new(MockEngine {
        ready: false,
        ..MockEngine::with(Reply::EchoPrompt(1))
    });
    let reply = get(app(engine), "/ready").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        reply.body["models"][1],
        json!({"id": IDS_MODEL, "ready": false})
    );
}

#[tokio::test]
async fn models_are_listed_openai_style() {
    let reply = get(app(MockEngine::new(Reply::EchoPrompt(1))), "/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.body,
        json!({"object": "list", "data": [
            {"id": TEXT_MODEL, "object": "model", "created": 1_700_000_000u64,
             "owned_by": "tessera", "max_model_len": CONTEXT_TOKENS},
            {"id": IDS_MODEL, "object": "model", "created": 1_700_000_001u64,
             "owned_by": "tessera", "max_model_len": CONTEXT_TOKENS},
        ]})
    );
    let reply = get(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        "/v1/models/ids-only",
    )
    .await;
    assert_eq!(reply.body["id"], IDS_MODEL);
    let reply = get(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        "/v1/models/org/nope",
    )
    .await;
    assert_error(&reply, 404, "invalid_request_error", Some("model"));
    assert_eq!(reply.body["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn text_prompt_round_trip() {
    let tok = tokenizer();
    let prompt = "Hello world, this is a test.";
    let expected = tok.encode(prompt, true).unwrap();
    assert!(tok.add_bos_token());
    assert_eq!(Some(expected[0]), tok.bos_token_id(), "BOS comes first");

    let engine = MockEngine::new(Reply::EchoPrompt(4));
    let reply = complete(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "prompt": prompt, "max_tokens": 5,
               "return_token_ids": true}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let body = &reply.body;
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], TEXT_MODEL);
    let id = body["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-") && id.len() == 5 + 32, "{id}");
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(body["prompt_token_ids"], json!(expected));

    let generated = &expected[..4];
    let choice = &body["choices"][0];
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"], tok.decode(generated, true).unwrap());
    assert!(!choice["text"].as_str().unwrap().contains("<s>"));
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["token_ids"], json!(generated));
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": expected.len(), "completion_tokens": 4,
               "total_tokens": expected.len() + 4})
    );

    let request = engine.last();
    assert_eq!(request.model, TEXT_MODEL);
    assert_eq!(request.prompt, expected);
    assert_eq!(request.max_tokens, 5);
    assert_eq!(request.stop_token_ids, tok.eos_token_ids());
}

#[tokio::test]
async fn token_ids_are_only_returned_when_asked() {
    let reply = complete(
        app(MockEngine::new(Reply::EchoPrompt(2))),
        json!({"model": TEXT_MODEL, "prompt": "Hello"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        reply.body.get("prompt_token_ids").is_none(),
        "{}",
        reply.body
    );
    assert!(reply.body["choices"][0].get("token_ids").is_none());
}

#[tokio::test]
async fn token_prompt_without_tokenizer() {
    let engine = MockEngine::new(Reply::EchoPrompt(3));
    for prompt in [json!([5, 6, 7, 8]), json!([[5, 6, 7, 8]])] {
        let reply = complete(
            app(engine.clone()),
            json!({"model": IDS_MODEL, "prompt": prompt, "return_token_ids": true}),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        let choice = &reply.body["choices"][0];
        assert_eq!(choice["text"], "");
        assert_eq!(choice["token_ids"], json!([5, 6, 7]));
        assert_eq!(reply.body["prompt_token_ids"], json!([5, 6, 7, 8]));
        assert_eq!(engine.last().prompt, vec![5, 6, 7, 8]);
    }
    // One string in an array is a text prompt.
    let reply = complete(
        app(engine.clone()),
        json!({"model": TEXT_MODEL, "prompt": ["Hello"]}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(
        engine.last().prompt,
        tokenizer().encode("Hello", true).unwrap()
    );
}

#[tokio::test]
async fn sampling_defaults_and_values_reach_the_engine() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let reply = complete(
        app(engine.clone()),
        json!({"model": IDS_MODEL, "prompt": [1]}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let first = engine.last();
    assert_eq!(first.max_tokens, 16);
    // OpenAI's default temperature is 1.
    assert_eq!(first.sampling.temperature, 1.0);
    assert_eq!(first.sampling.top_p, 1.0);
    assert_eq!(first.sampling.top_k, 0);

    complete(
        app(engine.clone()),
        json!({"model": IDS_MODEL, "prompt": [1]}),
    )
    .await;
    assert_ne!(
        engine.last().sampling.seed,
        first.sampling.seed,
        "a seed is drawn per request"
    );

    let reply = complete(
        app(engine.clone()),
        json!({"model": IDS_MODEL, "prompt": [1], "temperature": 0, "top_p": 0.5,
               "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1,
               "presence_penalty": -0.5, "frequency_penalty": 0.5, "seed": 42,
               "max_tokens": 3, "n": 1, "user": "u"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let s = engine.last().sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
        (0.0, 0.5, 40, 0.1, 42)
    );
    assert_eq!(
        (
            s.repetition_penalty,
            s.presence_penalty,
            s.frequency_penalty
        ),
        (1.1, -0.5, 0.5)
    );
}

#[tokio::test]
async fn stop_ids_and_ignore_eos_reach_the_engine() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let body = json!({"model": IDS_MODEL, "prompt": [1], "stop_token_ids": [9, IDS_EOS, 9]});
    complete(app(engine.clone()), body).await;
    assert_eq!(engine.last().stop_token_ids, vec![IDS_EOS, 9]);

    let body = json!({"model": IDS_MODEL, "prompt": [1], "stop_token_ids": [9],
                      "ignore_eos": true});
    complete(app(engine.clone()), body).await;
    assert_eq!(engine.last().stop_token_ids, vec![9]);

    let body = json!({"model": IDS_MODEL, "prompt": [1], "ignore_eos": true});
    complete(app(engine.clone()), body).await;
    assert!(engine.last().stop_token_ids.is_empty());
}

#[tokio::test]
async fn unknown_fields_and_nulls_are_accepted() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let body = json!({"model": IDS_MODEL, "prompt": [1], "stream_options": {"x": 1},
                      "metadata": [1, 2], "max_tokens": null, "temperature": null,
                      "stop": null, "logprobs": null, "echo": false, "best_of": 1,
                      "suffix": "", "logit_bias": {}});
    let reply = complete(app(engine.clone()), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(engine.last().max_tokens, 16);
}
