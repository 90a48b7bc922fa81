//! The topology in force, for admin keys (`tessera topology apply`):
//! - `GET /v1/cluster/topology`: the topology applied last (`generation`, `path`, `text`),
//!   or `{"generation": 0}` while each peer's file is in force;
//! - `POST /v1/cluster/topology` with `{"path", "text"}`: applies the topology `text`
//!   (read from file `path`, against whose directory its relative paths resolve). Groups
//!   and models it adds start; the ones it drops are drained, then their shards exit.
//!   Answered once committed, with what it adds and removes; a topology that would change
//!   what stays (a kept group's layout, a kept model's files, the coordinator peers) is
//!   refused with a 400 saying what to change.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{ApiJson, ApiState};
use crate::engine::TopologyApplied;
use crate::live::MAX_TOPOLOGY_BYTES;

/// The longest file path accepted.
const MAX_PATH_BYTES: usize = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Apply {
    path: String,
    text: String,
}

pub(crate) async fn show(State(state): State<Arc<ApiState>>) -> Json<Value> {
    Json(match state.engine.applied_topology() {
        Some(t) => json!({"generation": t.generation, "path": t.path, "text": t.text}),
        None => json!({"generation": 0}),
    })
}

pub(crate) async fn apply(
    State(state): State<Arc<ApiState>>,
    ApiJson(apply): ApiJson<Apply>,
) -> Result<Json<TopologyApplied>, ApiError> {
    if !apply.path.starts_with('/') || apply.path.len() > MAX_PATH_BYTES {
        let message = format!(
            "give the topology file's absolute path (relative paths in it resolve against \
             its directory), in at most {MAX_PATH_BYTES} bytes"
        );
        return Err(ApiError::invalid("path", message));
    }
    if apply.text.len() > MAX_TOPOLOGY_BYTES {
        let message = format!("a topology of at most {} KiB", MAX_TOPOLOGY_BYTES / 1024);
        return Err(ApiError::invalid("text", message));
    }
    let applied = state.engine.apply_topology(apply.path, apply.text).await?;
    Ok(Json(applied))
}
