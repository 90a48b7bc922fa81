//! The control endpoint (QUIC, mutual TLS). A coordinator peer's connection carries Raft
//! messages ([`crate::replication::transport`]) and the API calls it forwards to this one
//! ([`crate::forward::tunnel`]). A shard's registration is checked against
//! the certificate's identity and the topology and, on the leader, handed to the group's
//! driver; a follower answers `NotLeader` with the leader it knows. Anything else is
//! refused with a reason.

use std::time::Duration;

use tessera_comm::certs::Identity;
use tessera_comm::proto::{CoordinatorMsg, PROTOCOL_VERSION, Register, ShardMsg, Term};
use tessera_comm::{quic, wire};
use tessera_topology::Topology;
use tracing::{info, warn};

use crate::error::CoordinatorError;
use crate::group::ShardLink;
use crate::leader::Leadership;
use crate::live::LiveTopology;
use crate::replication::transport::{self, HttpStreams};

/// A registration must arrive this soon after the handshake.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts connections until the endpoint closes.
pub async fn accept_loop(
    endpoint: quinn::Endpoint,
    topology: LiveTopology,
    leadership: Leadership,
    forwarded: HttpStreams,
) {
    while let Some(incoming) = endpoint.accept().await {
        let topology = topology.current();
        let leadership = leadership.clone();
        let forwarded = std::sync::Arc::clone(&forwarded);
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            if let Err(reason) = handle(incoming, &topology, &leadership, forwarded).await {
                warn!(%remote, reason, "connection refused");
            }
        });
    }
}

async fn handle(
    incoming: quinn::Incoming,
    topology: &Topology,
    leadership: &Leadership,
    forwarded: HttpStreams,
) -> Result<(), String> {
    let connection = incoming
        .await
        .map_err(|e| format!("handshake failed: {e}"))?;
    let identity = quic::peer_identity(&connection).map_err(|e| {
        connection.close(1u32.into(), b"unknown identity");
        e.to_string()
    })?;
    // Another peer's Raft traffic (a peer never dials itself: its own certificate
    // presented here is someone else, refused below like any non-shard).
    if let Identity::Coordinator(peer) = identity
        && peer != leadership.id()
    {
        transport::serve_inbound(connection, peer, leadership.node(), forwarded).await;
        return Ok(());
    }
    let (mut send, mut recv) = tokio::time::timeout(REGISTER_TIMEOUT, connection.accept_bi())
        .await
        .map_err(|_| "no stream opened".to_string())?
        .map_err(|e| format!("connection lost: {e}"))?;
    let first = tokio::time::timeout(
        REGISTER_TIMEOUT,
        wire::read_frame::<_, ShardMsg>(&mut recv, wire::MAX_FRAME_BYTES),
    )
    .await
    .map_err(|_| "no registration within 5 s".to_string())?;
    let (register, standby) = match first {
        Ok(Some(ShardMsg::Register(register))) => (register, false),
        Ok(Some(ShardMsg::Standby(register))) => (register, true),
        Ok(Some(_)) => {
            return refuse(&connection, &mut send, CoordinatorError::FirstNotRegister).await;
        }
        Ok(None) => return Err("closed before registering".into()),
        Err(source) => {
            let error = CoordinatorError::BadRegistration { source };
            return refuse(&connection, &mut send, error).await;
        }
    };
    if let Err(error) = check(&identity, &register, topology) {
        return refuse(&connection, &mut send, error).await;
    }
    if standby {
        return hold_standby(&connection, send, recv, leadership).await;
    }
    let Some(cluster) = leadership.cluster_soon().await else {
        let leader = leadership.role().leader;
        let _ = wire::write_frame(&mut send, &CoordinatorMsg::NotLeader { leader }).await;
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
        connection.close(3u32.into(), b"not the leader");
        return Ok(());
    };
    let Some(group) = cluster.group(&register.group) else {
        // A group of a topology just applied whose driver is not started yet: the
        // shard registers again in a moment.
        connection.close(4u32.into(), b"group not started yet");
        return Err(format!("group `{}` not started yet", register.group));
    };
    info!(group = %register.group, rank = %register.rank, pid = register.pid, "registration accepted");
    let link = ShardLink {
        connection,
        send,
        recv,
        pid: register.pid,
        device: register.device.clone(),
        held: register.held,
    };
    group
        .attach(register.rank, link)
        .await
        .map_err(|e| e.message)
}

/// Holds a shard's standby connection: each time this peer starts leading a term, it
/// says so, and the shard registers here without waiting for its old leader to time out.
async fn hold_standby(
    connection: &quinn::Connection,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    leadership: &Leadership,
) -> Result<(), String> {
    let mut role = leadership.node().role();
    let mut told = Term(0);
    loop {
        let now = *role.borrow_and_update();
        if now.is_leader() && now.term != told {
            let leading = CoordinatorMsg::Leading {
                peer: leadership.id(),
                term: now.term,
            };
            if wire::write_frame(&mut send, &leading).await.is_err() {
                return Ok(());
            }
            told = now.term;
        }
        let mut byte = [0u8; 1];
        tokio::select! {
            changed = role.changed() => {
                if changed.is_err() {
                    connection.close(0u32.into(), b"coordinator stopping");
                    return Ok(());
                }
            }
            // The shard sends nothing more: anything, or the end, closes the standby.
            _ = recv.read(&mut byte) => return Ok(()),
        }
    }
}

/// Why `register` from a peer holding `identity` is not acceptable, if it is not.
pub fn check(
    identity: &Identity,
    register: &Register,
    topology: &Topology,
) -> Result<(), CoordinatorError> {
    if register.version != PROTOCOL_VERSION {
        return Err(CoordinatorError::ProtocolVersion {
            version: register.version,
            supported: PROTOCOL_VERSION,
        });
    }
    let Identity::Shard { group, rank } = identity else {
        let identity = identity.clone();
        return Err(CoordinatorError::NotAShard { identity });
    };
    if *group != register.group || *rank != register.rank {
        return Err(CoordinatorError::CertificateMismatch {
            group: group.clone(),
            rank: *rank,
            registered_group: register.group.clone(),
            registered_rank: register.rank,
        });
    }
    let Some(g) = topology.group(group) else {
        let group = group.clone();
        return Err(CoordinatorError::UnknownGroup { group });
    };
    if rank.0 as usize >= g.tp {
        return Err(CoordinatorError::NoSuchRank {
            group: group.clone(),
            tp: g.tp,
            rank: *rank,
        });
    }
    Ok(())
}

/// Answers a registration with `Refused` and closes the connection; `Err` with the reason.
async fn refuse(
    connection: &quinn::Connection,
    send: &mut quinn::SendStream,
    error: CoordinatorError,
) -> Result<(), String> {
    let reason = error.to_string();
    let msg = CoordinatorMsg::Refused {
        error: error.into(),
    };
    let _ = wire::write_frame(send, &msg).await;
    let _ = send.finish();
    // Give the refusal a moment to reach the peer before the connection closes.
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    connection.close(2u32.into(), b"refused");
    Err(reason)
}
