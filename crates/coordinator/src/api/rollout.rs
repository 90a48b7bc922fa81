//! Model versions (`tessera model …`), all for admin keys:
//! - `GET /v1/cluster/models/{model}`: its versions, canary, events and groups;
//! - `POST /v1/cluster/models/{model}/deploy` with `{"path", "canary_percent"?,
//!   "groups"?}`: a new version, as a canary or stable on every group;
//! - `POST /v1/cluster/models/{model}/promote`: the canary becomes stable;
//! - `POST /v1/cluster/models/{model}/rollback` with `{"to"?}`: back to the stable
//!   version from a canary, or to an earlier version.
//!
//! Each answers, once the change is committed, with the model's versions. The groups
//! then move to their version one at a time (`running` and `switching` in the status).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use serde::Deserialize;

use super::error::{ApiError, ApiErrorKind};
use super::{ApiJson, ApiState};
use crate::engine::{RolloutAction, VersionsStatus};

/// The longest model path accepted.
const MAX_PATH_BYTES: usize = 4096;
/// The most groups a deploy may name.
const MAX_GROUPS: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Deploy {
    path: String,
    canary_percent: Option<i64>,
    #[serde(default)]
    groups: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Rollback {
    to: Option<u32>,
}

pub(crate) async fn status(
    state: State<Arc<ApiState>>,
    model: Result<Path<String>, PathRejection>,
) -> Result<Json<VersionsStatus>, ApiError> {
    act(state, model, None).await
}

pub(crate) async fn deploy(
    state: State<Arc<ApiState>>,
    model: Result<Path<String>, PathRejection>,
    ApiJson(deploy): ApiJson<Deploy>,
) -> Result<Json<VersionsStatus>, ApiError> {
    if deploy.path.is_empty() || deploy.path.len() > MAX_PATH_BYTES {
        let message = format!("give the new version's files, in at most {MAX_PATH_BYTES} bytes");
        return Err(ApiError::invalid("path", message));
    }
    if deploy.groups.len() > MAX_GROUPS {
        let message = format!("at most {MAX_GROUPS} groups");
        return Err(ApiError::invalid("groups", message));
    }
    let canary_percent = match deploy.canary_percent {
        None => None,
        Some(p) => Some(u8::try_from(p).ok().filter(|&p| p <= 100).ok_or_else(|| {
            let message = format!("a canary's weight is 0 to 100 percent, not {p}");
            ApiError::invalid("canary_percent", message)
        })?),
    };
    let action = RolloutAction::Deploy {
        path: deploy.path,
        canary_percent,
        groups: deploy.groups,
    };
    act(state, model, Some(action)).await
}

pub(crate) async fn promote(
    state: State<Arc<ApiState>>,
    model: Result<Path<String>, PathRejection>,
) -> Result<Json<VersionsStatus>, ApiError> {
    act(state, model, Some(RolloutAction::Promote)).await
}

pub(crate) async fn rollback(
    state: State<Arc<ApiState>>,
    model: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Json<VersionsStatus>, ApiError> {
    let to = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let body: Rollback = serde_json::from_slice(&body).map_err(|e| {
            let message = format!("the body is empty or {{\"to\": VERSION}}: {e}");
            ApiError::new(ApiErrorKind::InvalidRequest, message)
        })?;
        body.to
    };
    act(state, model, Some(RolloutAction::Rollback { to })).await
}

async fn act(
    State(state): State<Arc<ApiState>>,
    model: Result<Path<String>, PathRejection>,
    action: Option<RolloutAction>,
) -> Result<Json<VersionsStatus>, ApiError> {
    let Path(model) =
        model.map_err(|e| ApiError::new(ApiErrorKind::InvalidRequest, e.body_text()))?;
    Ok(Json(state.engine.rollout(model, action).await?))
}
