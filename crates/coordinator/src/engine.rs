//! The boundary between the HTTP API and whatever runs requests: a validated
//! [`GenerateRequest`] in, a [`GenerateOutput`] or a typed [`WireError`] out.
//!
//! The coordinator's group driver implements [`Engine`]; API tests use a mock.

use std::future::Future;
use std::pin::Pin;

use tessera_comm::proto::{FinishReason, Sampling, WireError};

/// One generation, already validated and tokenized by the API layer.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// The topology's model name.
    pub model: String,
    pub prompt: Vec<u32>,
    /// At least 1; prompt + max_tokens fits the model's context.
    pub max_tokens: u32,
    pub sampling: Sampling,
    /// End-of-sequence ids of the model plus the request's stop ids.
    pub stop_token_ids: Vec<u32>,
}

/// The tokens generated for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
}

/// A boxed future, so that [`Engine`] stays object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs generation requests.
pub trait Engine: Send + Sync + 'static {
    /// Runs `request` to completion. Errors carry their class (capacity, unavailable,
    /// deadline, internal) and, for a shard failure, the rank to blame.
    fn generate(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<GenerateOutput, WireError>>;

    /// True when at least one group serving `model` is ready to take a step.
    fn ready(&self, model: &str) -> bool;
}
