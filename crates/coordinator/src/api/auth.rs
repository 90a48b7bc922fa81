//! API keys: `Authorization: Bearer <key>` on every route but the probes (`/health`,
//! `/ready`, `/metrics`) and the status page's HTML (`/`, which holds no data and asks for a
//! key itself; the data it shows comes from `/v1/cluster`, which needs one).
//!
//! Three rights: inference keys (`--api-key`) call the API; priority keys
//! (`--priority-key`) call it too and may also set a request's `priority` ahead of the
//! default (below 0), which no inference key may, since it preempts other tenants' running
//! requests; admin keys (`--admin-key`) may do both, and they alone change the cluster (the
//! membership routes under `/v1/cluster/peers`, a group's drain under
//! `/v1/cluster/groups/`, model versions under `/v1/cluster/models/`, the topology at
//! `/v1/cluster/topology`). An inference key there gets 403. A coordinator with inference keys but no admin key refuses every cluster change (403,
//! naming `--admin-key`); one with no key at all (loopback only) lets every request
//! through. When inference needs no key, anyone may set any priority.
//!
//! The middleware leaves the request's [`Caller`] in its extensions: the per-key limits of
//! [`super::limits`] and the priority check read it there.
//!
//! Keys are compared in constant time: the time taken depends on the lengths only, never
//! on how many leading bytes of a guess are right. Every configured key is compared, with
//! no early exit. With no key configured every request passes; [`check_exposure`] keeps a
//! coordinator without keys on loopback addresses.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ApiErrorKind};

/// Paths served without a key.
const OPEN_PATHS: [&str; 4] = ["/health", "/ready", "/metrics", "/"];

/// Where only admin keys may go: changes to the cluster (its peers, a group's drain, a
/// model's versions, the topology), and a peer's drain.
const ADMIN_PREFIXES: [&str; 5] = [
    "/v1/cluster/peers",
    "/v1/cluster/groups/",
    "/v1/cluster/models/",
    "/v1/cluster/topology",
    "/v1/admin/",
];

/// The accepted keys. `Debug` never shows them.
#[derive(Clone, Default)]
pub struct ApiKeys {
    inference: KeySet,
    priority: KeySet,
    admin: KeySet,
}

/// Who sent a request, as far as the limits and rights care.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Caller {
    /// No key was needed (inference is open): one tenant for the per-key limits.
    Anyone,
    /// The key at `index` of its kind's list.
    Key { kind: KeyKind, index: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum KeyKind {
    Inference,
    Priority,
    Admin,
}

impl Caller {
    /// Whether the caller may set `priority` (lower runs first; 0 is the default).
    pub(crate) fn check_priority(self, priority: i32) -> Result<(), ApiError> {
        let allowed = match self {
            Caller::Anyone
            | Caller::Key {
                kind: KeyKind::Priority | KeyKind::Admin,
                ..
            } => true,
            Caller::Key {
                kind: KeyKind::Inference,
                ..
            } => false,
        };
        if priority < 0 && !allowed {
            return Err(ApiError::new(
                ApiErrorKind::Forbidden,
                format!(
                    "`priority` {priority} would run ahead of other requests, which this API \
                     key may not do: use 0 or more, or a priority key (--priority-key)"
                ),
            )
            .with_param("priority"));
        }
        Ok(())
    }
}

#[derive(Clone, Default)]
struct KeySet(Arc<[Vec<u8>]>);

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ApiKeys({} inference keys, {} priority keys, {} admin keys)",
            self.inference.0.len(),
            self.priority.0.len(),
            self.admin.0.len()
        )
    }
}

impl ApiKeys {
    /// Inference keys as given; surrounding white space is trimmed and empty ones are
    /// dropped.
    pub fn new(keys: impl IntoIterator<Item = String>) -> ApiKeys {
        ApiKeys {
            inference: KeySet::new(keys),
            ..ApiKeys::default()
        }
    }

    /// The same, with these priority keys: they call the API and may raise `priority`.
    pub fn with_priority(mut self, keys: impl IntoIterator<Item = String>) -> ApiKeys {
        self.priority = KeySet::new(keys);
        self
    }

    /// The same, with these admin keys.
    pub fn with_admin(mut self, keys: impl IntoIterator<Item = String>) -> ApiKeys {
        self.admin = KeySet::new(keys);
        self
    }

    /// Whether every inference request passes without a key.
    pub fn is_empty(&self) -> bool {
        self.inference.0.is_empty() && self.priority.0.is_empty()
    }

    /// Who a request for `path` with `presented` (its bearer token) is, if it may pass.
    fn check(&self, path: &str, presented: Option<&[u8]>) -> Result<Caller, Refusal> {
        let admin_path = ADMIN_PREFIXES.iter().any(|p| path.starts_with(p));
        let open = self.is_empty();
        if open && (self.admin.0.is_empty() || !admin_path) {
            return Ok(Caller::Anyone);
        }
        let Some(token) = presented else {
            return Err(Refusal::Unauthorized(
                "an API key is required: send it as `Authorization: Bearer <key>`",
            ));
        };
        // Every list is compared: the time taken says nothing of which kind matched.
        let admin = self.admin.position(token).map(|index| Caller::Key {
            kind: KeyKind::Admin,
            index,
        });
        let priority = self.priority.position(token).map(|index| Caller::Key {
            kind: KeyKind::Priority,
            index,
        });
        let inference = self.inference.position(token).map(|index| Caller::Key {
            kind: KeyKind::Inference,
            index,
        });
        match (admin_path, admin, priority.or(inference)) {
            (_, Some(caller), _) => Ok(caller),
            (false, None, Some(caller)) => Ok(caller),
            (true, None, Some(_)) if self.admin.0.is_empty() => Err(Refusal::Forbidden(
                "changes to the cluster and drains need an admin key, and this coordinator has none: \
                 start it with --admin-key (or TESSERA_ADMIN_KEYS)",
            )),
            (true, None, Some(_)) => Err(Refusal::Forbidden(
                "this API key may not change the cluster or drain a peer: use an admin key",
            )),
            (_, None, None) => Err(Refusal::Unauthorized("the API key is not valid")),
        }
    }
}

/// Why a request may not pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// No valid key: 401.
    Unauthorized(&'static str),
    /// A valid key without the right: 403.
    Forbidden(&'static str),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Unauthorized(message) => unauthorized(message),
            Refusal::Forbidden(message) => {
                ApiError::new(ApiErrorKind::Forbidden, message).into_response()
            }
        }
    }
}

impl KeySet {
    fn new(keys: impl IntoIterator<Item = String>) -> KeySet {
        KeySet(
            keys.into_iter()
                .map(|k| k.trim().as_bytes().to_vec())
                .filter(|k| !k.is_empty())
                .collect(),
        )
    }

    /// Where `presented` is in the list, if it is; every key is compared.
    fn position(&self, presented: &[u8]) -> Option<usize> {
        self.0.iter().enumerate().fold(None, |found, (index, key)| {
            let equal = constant_time_eq(key, presented);
            found.or(equal.then_some(index))
        })
    }
}

/// Equality whose time depends on the longer length only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Why a coordinator must not start: it would serve a non-loopback address to anyone.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the HTTP API would listen on {addr}, which is not a loopback address, with no API key: \
     set --api-key (or TESSERA_API_KEYS), or bind the API to 127.0.0.1"
)]
pub struct ExposureError {
    pub addr: SocketAddr,
}

/// Refuses an API reachable from other hosts without a key.
pub fn check_exposure(addr: SocketAddr, keys: &ApiKeys) -> Result<(), ExposureError> {
    if keys.is_empty() && !addr.ip().is_loopback() {
        return Err(ExposureError { addr });
    }
    Ok(())
}

/// The middleware: 401 in the OpenAI envelope unless the key is right.
pub(crate) async fn require_key(
    State(keys): State<ApiKeys>,
    mut request: Request,
    next: Next,
) -> Response {
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(bearer_token);
    match keys.check(request.uri().path(), presented) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(refusal) => refusal.into_response(),
    }
}

/// The token of `Bearer <token>` (the scheme in any case).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() <= SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    Some(value[SCHEME.len()..].trim_ascii())
}

fn unauthorized(message: &str) -> Response {
    let mut response = ApiError::new(ApiErrorKind::Unauthorized, message)
        .with_code("invalid_api_key")
        .into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly() {
        let keys = KeySet::new(["abc".to_string(), " def ".to_string(), String::new()]);
        assert_eq!(keys.0.len(), 2);
        assert_eq!(keys.position(b"abc"), Some(0));
        assert_eq!(keys.position(b"def"), Some(1));
        assert_eq!(keys.position(b"ab"), None);
        assert_eq!(keys.position(b"abcd"), None);
        assert_eq!(keys.position(b""), None);
        assert_eq!(KeySet::default().position(b""), None);
        let keys = ApiKeys::new(["abc".to_string()]).with_admin(["adm".to_string()]);
        assert_eq!(
            format!("{keys:?}"),
            "ApiKeys(1 inference keys, 0 priority keys, 1 admin keys)"
        );
    }

    /// The status of each refusal: 401 without a valid key, 403 for an inference key where
    /// only admin keys may go (and for every key where the coordinator has no admin key).
    #[test]
    fn admin_routes_take_admin_keys_only() {
        let status = |keys: &ApiKeys, path: &str, key: Option<&str>| {
            keys.check(path, key.map(str::as_bytes))
                .map_or_else(|r| r.into_response().status().as_u16(), |_| 200)
        };
        let peers = "/v1/cluster/peers";
        let infer = "/v1/completions";
        let both = ApiKeys::new(["user".to_string()]).with_admin(["root".to_string()]);
        assert_eq!(status(&both, infer, Some("user")), 200);
        assert_eq!(status(&both, infer, Some("root")), 200);
        assert_eq!(status(&both, infer, None), 401);
        assert_eq!(status(&both, peers, Some("root")), 200);
        assert_eq!(status(&both, "/v1/cluster/peers/3", Some("root")), 200);
        assert_eq!(status(&both, peers, Some("user")), 403);
        assert_eq!(status(&both, "/v1/cluster/peers/3", Some("user")), 403);
        assert_eq!(status(&both, peers, Some("guess")), 401);
        assert_eq!(status(&both, peers, None), 401);
        // A peer's drain is the admin's too.
        assert_eq!(status(&both, "/v1/admin/drain", Some("root")), 200);
        assert_eq!(status(&both, "/v1/admin/drain", Some("user")), 403);
        // Inference keys and no admin key: no one changes the cluster.
        let users = ApiKeys::new(["user".to_string()]);
        assert_eq!(status(&users, peers, Some("user")), 403);
        assert_eq!(status(&users, infer, Some("user")), 200);
        // Admin keys only: inference is open, the cluster is not.
        let admins = ApiKeys::default().with_admin(["root".to_string()]);
        assert_eq!(status(&admins, infer, None), 200);
        assert_eq!(status(&admins, peers, None), 401);
        assert_eq!(status(&admins, peers, Some("root")), 200);
        // No key at all (loopback only): everything passes.
        assert_eq!(status(&ApiKeys::default(), peers, None), 200);
    }

    /// Only priority and admin keys (or anyone, when inference needs no key) may run a
    /// request ahead of the default priority; every key may run one behind it.
    #[test]
    fn priority_ahead_of_the_default_needs_the_right() {
        let keys = ApiKeys::new(["user".to_string()])
            .with_priority(["vip".to_string()])
            .with_admin(["root".to_string()]);
        let caller = |key: &str| keys.check("/v1/completions", Some(key.as_bytes())).unwrap();
        let user = caller("user");
        assert_eq!(
            user,
            Caller::Key {
                kind: KeyKind::Inference,
                index: 0
            }
        );
        assert!(user.check_priority(0).is_ok());
        assert!(user.check_priority(5).is_ok());
        let refused = user.check_priority(-1).unwrap_err();
        assert_eq!(refused.kind, ApiErrorKind::Forbidden);
        assert_eq!(refused.param, Some("priority"));
        assert!(caller("vip").check_priority(-10).is_ok());
        assert!(caller("root").check_priority(-10).is_ok());
        // A priority key is an inference key too, and not an admin key.
        let peers = keys.check("/v1/cluster/peers", Some(b"vip"));
        assert_eq!(
            peers,
            Err(Refusal::Forbidden(
                "this API key may not change the cluster or drain a peer: use an admin key"
            ))
        );
        let open = ApiKeys::default().check("/v1/completions", None).unwrap();
        assert_eq!(open, Caller::Anyone);
        assert!(open.check_priority(-10).is_ok());
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token(b"Bearer k1"), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"bearer  k1 "), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"Basic k1"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
    }

    #[test]
    fn exposure_needs_a_key_off_loopback() {
        let open: SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let local6: SocketAddr = "[::1]:8000".parse().unwrap();
        let none = ApiKeys::default();
        let some = ApiKeys::new(["k".to_string()]);
        assert!(check_exposure(open, &none).is_err());
        assert!(check_exposure(open, &some).is_ok());
        assert!(check_exposure(local, &none).is_ok());
        assert!(check_exposure(local6, &none).is_ok());
        let message = check_exposure(open, &none).unwrap_err().to_string();
        assert!(message.contains("--api-key"), "{message}");
    }
}
