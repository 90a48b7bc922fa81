//! A group's maintenance drain (`tessera group drain|resume`): `POST
//! /v1/cluster/groups/{group}/drain` takes the group out of routing, `POST
//! /v1/cluster/groups/{group}/resume` puts it back. New requests for its model go to the
//! model's other groups (503 `every group … is drained` when none is left); the requests
//! it runs and holds queued finish. The change is replicated, so a new leader keeps it.
//! Both need an admin key and answer, once committed, with the group's status (`running`
//! and `waiting` say when it is idle).

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};

use super::ApiState;
use super::error::{ApiError, ApiErrorKind};
use crate::engine::GroupStatus;

pub(crate) async fn drain(
    state: State<Arc<ApiState>>,
    group: Result<Path<String>, PathRejection>,
) -> Result<Json<GroupStatus>, ApiError> {
    set_drained(state, group, true).await
}

pub(crate) async fn resume(
    state: State<Arc<ApiState>>,
    group: Result<Path<String>, PathRejection>,
) -> Result<Json<GroupStatus>, ApiError> {
    set_drained(state, group, false).await
}

async fn set_drained(
    State(state): State<Arc<ApiState>>,
    group: Result<Path<String>, PathRejection>,
    drained: bool,
) -> Result<Json<GroupStatus>, ApiError> {
    let Path(group) =
        group.map_err(|e| ApiError::new(ApiErrorKind::InvalidRequest, e.body_text()))?;
    Ok(Json(state.engine.drain_group(group, drained).await?))
}
