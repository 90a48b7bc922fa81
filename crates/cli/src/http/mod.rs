//! The CLI's one HTTP client, for every command that talks to a running server:
//! `tessera generate --url` ([`crate::remote`]), `tessera bench` ([`crate::bench`]) and
//! `tessera cluster` ([`crate::cluster_cmd`]).
//!
//! It owns what those commands share: the server's base URL and API key as the commands
//! take them, a blocking `ureq` agent that hands every HTTP status to the caller, JSON
//! calls with their error messages, and POSTs whose answer the caller reads whole or as
//! server-sent events ([`sse`]). What to say about a failed POST stays with each command
//! (a benchmark counts failures, `generate` stops at the first), so [`Client::post`]
//! returns what went wrong as a [`PostError`] rather than a message.

pub mod sse;

use std::time::Duration;

use anyhow::{anyhow, bail};
use serde_json::Value;
use ureq::http::Response;
use ureq::{Body, RequestBuilder};

/// How long connecting to a server may take before the command gives up on it.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most bytes of an error answer kept: enough for any JSON error envelope.
const ERROR_BODY_LIMIT_BYTES: u64 = 64 * 1024;

/// How a [`Client`] connects and what its messages call the other end. `None` leaves
/// `ureq`'s default.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// How long connecting may take.
    pub connect_timeout: Option<Duration>,
    /// How long a whole request may take, its answer included.
    pub request_timeout: Option<Duration>,
    /// Connections kept alive for reuse, in all and per host.
    pub idle_connections: Option<usize>,
    /// What error messages call the other end ("cannot reach the server at …").
    pub server_noun: &'static str,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: None,
            request_timeout: None,
            idle_connections: None,
            server_noun: "server",
        }
    }
}

/// Talks to one server. Shareable across threads (`tessera bench` workers share one).
#[derive(Debug)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    /// The `Authorization` header value, when there is an API key.
    authorization: Option<String>,
    server_noun: &'static str,
}

/// Why a [`Client::post`] got no answer to read.
#[derive(Debug)]
pub enum PostError {
    /// The request did not get through (connection refused, timeout, TLS).
    Unreachable(ureq::Error),
    /// The server answered with a status other than 200; `body` is the start of its answer.
    Status { status: u16, body: String },
}

impl Client {
    /// A client for the server at `url` (see [`base_url`]); `api_key` is sent as a bearer
    /// token with every request.
    pub fn new(url: &str, api_key: Option<String>, options: ClientOptions) -> Self {
        // Statuses are answers to read (an error envelope), not transport failures.
        let mut config = ureq::Agent::config_builder().http_status_as_error(false);
        if let Some(timeout) = options.connect_timeout {
            config = config.timeout_connect(Some(timeout));
        }
        if let Some(timeout) = options.request_timeout {
            config = config.timeout_global(Some(timeout));
        }
        if let Some(n) = options.idle_connections {
            config = config
                .max_idle_connections(n)
                .max_idle_connections_per_host(n);
        }
        Self {
            agent: config.build().into(),
            base: base_url(url),
            authorization: api_key.map(|key| format!("Bearer {key}")),
            server_noun: options.server_noun,
        }
    }

    /// The server's base URL, without a trailing `/`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The full URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET path`, answered 2xx with JSON.
    pub fn get_json(&self, path: &str) -> anyhow::Result<Value> {
        let url = self.url(path);
        let sent = self.authorized(self.agent.get(&url)).call();
        self.json_answer("GET", &url, sent)
    }

    /// [`Client::get_json`], or `None` when the server cannot be reached (it stopped).
    pub fn get_json_if_up(&self, path: &str) -> anyhow::Result<Option<Value>> {
        let url = self.url(path);
        match self.authorized(self.agent.get(&url)).call() {
            Ok(response) => self.json_answer("GET", &url, Ok(response)).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// `POST path` with a JSON `body`, answered 2xx with JSON.
    pub fn post_json(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let url = self.url(path);
        let sent = self.authorized(self.agent.post(&url)).send_json(body);
        self.json_answer("POST", &url, sent)
    }

    /// `DELETE path`, answered 2xx with JSON.
    pub fn delete_json(&self, path: &str) -> anyhow::Result<Value> {
        let url = self.url(path);
        let sent = self.authorized(self.agent.delete(&url)).call();
        self.json_answer("DELETE", &url, sent)
    }

    /// `POST path` with a JSON `body`; the response of a 200, its body unread, for the
    /// caller to read whole or as a stream ([`sse::SseStream`]).
    pub fn post(&self, path: &str, body: &Value) -> Result<Response<Body>, PostError> {
        let url = self.url(path);
        let mut response = self
            .authorized(self.agent.post(&url))
            .send_json(body)
            .map_err(PostError::Unreachable)?;
        let status = response.status().as_u16();
        if status != 200 {
            let body = response
                .body_mut()
                .with_config()
                .limit(ERROR_BODY_LIMIT_BYTES)
                .read_to_string()
                .unwrap_or_default();
            return Err(PostError::Status { status, body });
        }
        Ok(response)
    }

    fn authorized<B>(&self, request: RequestBuilder<B>) -> RequestBuilder<B> {
        match &self.authorization {
            Some(authorization) => request.header("Authorization", authorization),
            None => request,
        }
    }

    /// The JSON of a 2xx answer; any other status fails with the server's message.
    fn json_answer(
        &self,
        method: &str,
        url: &str,
        sent: Result<Response<Body>, ureq::Error>,
    ) -> anyhow::Result<Value> {
        let mut response = sent.map_err(|e| {
            anyhow!(
                "cannot reach the {} at {} ({method} {url}): {e}",
                self.server_noun,
                self.base
            )
        })?;
        let status = response.status().as_u16();
        let answer: Value = response.body_mut().read_json().map_err(|e| {
            anyhow!("{method} {url} answered {status} with a body that is not JSON: {e}")
        })?;
        if !(200..300).contains(&status) {
            bail!(
                "{method} {url} answered {status}: {}",
                error_message(&answer)
            );
        }
        Ok(answer)
    }
}

/// The API key: `flag` (which clap fills from `TESSERA_API_KEY` when the flag is absent),
/// else OpenAI's usual `OPENAI_API_KEY`; an empty key is none.
pub fn api_key(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_owned)
        .or_else(|| std::env::var("OPENAI_API_KEY").ok())
        .filter(|key| !key.is_empty())
}

/// `url` without a trailing `/`, with `http://` when it names no scheme.
pub fn base_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// The message of an OpenAI error envelope, or the whole answer.
pub fn error_message(answer: &Value) -> String {
    match answer["error"]["message"].as_str() {
        Some(message) => message.to_owned(),
        None => answer.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn urls_get_a_scheme_and_lose_the_trailing_slash() {
        assert_eq!(base_url("127.0.0.1:8000/"), "http://127.0.0.1:8000");
        assert_eq!(base_url("https://h:1"), "https://h:1");
    }

    #[test]
    fn error_envelopes_give_their_message() {
        let envelope =
            json!({"error": {"message": "no model `x`", "type": "invalid_request_error"}});
        assert_eq!(error_message(&envelope), "no model `x`");
        assert_eq!(error_message(&json!({"detail": 1})), r#"{"detail":1}"#);
    }
}
