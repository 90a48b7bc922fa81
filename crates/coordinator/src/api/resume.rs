//! `GET /v1/streams/{id}`: a request again by the `id` of its response (`cmpl-…`,
//! `chatcmpl-…`; `…/N` for choice N of a request with `n` > 1), from the request journal,
//! on any coordinator peer (followers forward it to the leader).
//!
//! - Streaming (the default): server-sent events in the shape of the original endpoint,
//!   from the token after the `Last-Event-ID` header's offset (`{id}:{tokens}`, as every
//!   event of the original stream carried it) to `[DONE]` — no gap, no duplicate. Without
//!   the header, from the first token. A request still running is followed live; one that
//!   lost its leader is resumed by the new one.
//! - `?stream=false`: the whole response body, once the request has finished.
//!
//! Resumed chunks carry `token_ids` (whatever the original asked), no logprobs and no
//! usage chunk: the journal holds tokens, not the response options. The request's stop
//! strings apply again, so a stream that one ended ends at the same place.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::ApiState;
use super::chat::ChatShape;
use super::choice::{ChoicePart, Meta, Shape};
use super::completions::CompletionShape;
use super::error::{ApiError, ApiErrorKind};
use super::respond;
use super::stream::{parse_event_id, sse};
use crate::engine::Resumed;

#[derive(Debug, Deserialize)]
pub(crate) struct ResumeQuery {
    stream: Option<bool>,
}

pub(crate) async fn resume(
    State(state): State<Arc<ApiState>>,
    id: Result<Path<String>, PathRejection>,
    query: Result<Query<ResumeQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let invalid = |message: String| ApiError::new(ApiErrorKind::InvalidRequest, message);
    let Path(id) = id.map_err(|e| invalid(e.body_text()))?;
    let Query(query) = query.map_err(|e| invalid(e.body_text()))?;
    let stream = query.stream.unwrap_or(true);
    let from = match headers.get("last-event-id") {
        Some(value) if stream => {
            let text = value.to_str().unwrap_or_default();
            parse_event_id(&id, text).ok_or_else(|| {
                ApiError::new(
                    ApiErrorKind::InvalidRequest,
                    format!("Last-Event-ID `{text}` is not an event id of {id} (`{id}:<tokens>`)"),
                )
            })?
        }
        _ => 0,
    };
    let Some(resumed) = state.engine.resume(id.clone()).await? else {
        return Err(ApiError::new(
            ApiErrorKind::NotFound,
            format!("no request `{id}` in the journal (never accepted, or expired)"),
        ));
    };
    replay(&state, id, resumed, from, stream, start).await
}

/// Answers with journaled request `id` from completion token `from` on: as the original
/// endpoint's events, or its whole body when `stream` is false.
pub(crate) async fn replay(
    state: &ApiState,
    id: String,
    resumed: Resumed,
    from: usize,
    stream: bool,
    start: Instant,
) -> Result<Response, ApiError> {
    let model = &state.model(&resumed.request.model)?;
    let stop = Arc::from(resumed.request.stop);
    let response_id = id.split('/').next().unwrap_or(&id).to_string();
    let meta = Meta {
        id: response_id,
        created: resumed.accepted_ms / 1000,
        model: model.name.clone(),
        tokenizer: model.tokenizer.clone(),
        logprobs: false,
        return_token_ids: true,
        include_usage: false,
        prompt: resumed.request.prompt,
        n: 1,
        resume_from: from,
    };
    let parts = respond::resumed_parts(
        id.clone(),
        resumed.tokens,
        model.tokenizer.clone(),
        stop,
        from,
        start,
    );
    if id.starts_with("chatcmpl-") {
        answer(meta, parts, ChatShape, stream, start).await
    } else {
        answer(meta, parts, CompletionShape, stream, start).await
    }
}

async fn answer(
    meta: Meta,
    parts: futures_util::stream::BoxStream<'static, Result<ChoicePart, ApiError>>,
    shape: impl Shape,
    stream: bool,
    start: Instant,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(sse(meta, parts, shape, start));
    }
    let body = respond::collect(&meta, parts, &shape, start).await?;
    Ok(Json(body).into_response())
}
