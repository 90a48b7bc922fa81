//! Membership of the coordinator's Raft group, one voter at a time (`tessera cluster
//! add|remove|replace`): `POST /v1/cluster/peers` with `{"id", "http", "quic"}` adds a
//! peer (started with `tessera-coordinator --join`), `DELETE /v1/cluster/peers/{id}`
//! removes one. Both answer, once the change is committed, with `/v1/cluster`'s view.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use serde::Deserialize;
use tessera_topology::PeerId;

use super::error::{ApiError, ApiErrorKind};
use super::{ApiJson, ApiState};
use crate::engine::{ClusterStatus, PeerChange};

/// The longest address accepted (a DNS name and a port).
const MAX_ADDRESS_BYTES: usize = 260;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPeer {
    id: u64,
    http: String,
    quic: String,
}

pub(crate) async fn add(
    State(state): State<Arc<ApiState>>,
    ApiJson(peer): ApiJson<NewPeer>,
) -> Result<Json<ClusterStatus>, ApiError> {
    if peer.id == 0 {
        return Err(ApiError::invalid("id", "peer ids start at 1"));
    }
    check_address("http", &peer.http)?;
    check_address("quic", &peer.quic)?;
    let change = PeerChange::Add {
        id: PeerId(peer.id),
        http: peer.http,
        quic: peer.quic,
    };
    state.engine.change_peers(change).await?;
    Ok(Json(state.engine.status()))
}

pub(crate) async fn remove(
    State(state): State<Arc<ApiState>>,
    id: Result<Path<u64>, PathRejection>,
) -> Result<Json<ClusterStatus>, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::new(ApiErrorKind::InvalidRequest, e.body_text()))?;
    let change = PeerChange::Remove { id: PeerId(id) };
    state.engine.change_peers(change).await?;
    Ok(Json(state.engine.status()))
}

/// `host:port`, with a port.
fn check_address(field: &'static str, address: &str) -> Result<(), ApiError> {
    let port = address
        .rsplit_once(':')
        .map(|(host, port)| (host, port.parse::<u16>()));
    match port {
        Some((host, Ok(port)))
            if !host.is_empty() && port != 0 && address.len() <= MAX_ADDRESS_BYTES =>
        {
            Ok(())
        }
        _ => Err(ApiError::invalid(
            field,
            format!("`{address}` is not a `host:port` address"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::check_address;

    #[test]
    fn addresses_need_a_host_and_a_port() {
        assert!(check_address("http", "10.0.0.4:8000").is_ok());
        assert!(check_address("http", "[::1]:8000").is_ok());
        assert!(check_address("quic", "coord-4.internal:7000").is_ok());
        for bad in ["10.0.0.4", ":8000", "host:0", "host:99999", "host:x"] {
            assert!(check_address("http", bad).is_err(), "{bad}");
        }
    }
}
