//! Raft messages between coordinator peers over QUIC with mutual TLS — the same endpoint
//! and certificates as the shards' control connections.
//!
//! Outbound, one task per remote peer keeps a connection and one stream open and writes
//! the peer's messages in order, each as a [`PeerMsg`] frame; a message it cannot write is
//! reported to Raft as unreachable (Raft retries on its own schedule, so nothing is queued
//! for long). A snapshot goes on a stream of its own, beside the others, so heartbeats and
//! appends do not wait behind it, and a message larger than [`PART_BYTES`] (a snapshot of
//! a large journal) crosses as several frames. Inbound, [`serve_inbound`] reads a
//! connected peer's frames, joins a message's parts (up to [`MAX_MESSAGE_BYTES`]), and
//! hands its messages to the local node, after checking that each claims to come from the
//! peer the certificate names.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use protobuf::Message as _;
use raft::prelude::Message;
use serde::{Deserialize, Serialize};
use tessera_comm::certs::Identity;
use tessera_comm::{quic, wire};
use tessera_topology::PeerId;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::node::{NodeHandle, Transport, is_snapshot};
use super::state::MAX_SNAPSHOT_BYTES;

/// One frame between coordinator peers.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerMsg {
    /// A Raft message, protobuf-encoded; or the last part of one, after its [`PeerMsg::Part`]s.
    Raft(Vec<u8>),
    /// The next bytes of a Raft message too large for one frame; the message ends with a
    /// [`PeerMsg::Raft`] frame holding its last bytes.
    Part(Vec<u8>),
    /// The first frame of a stream that carries no Raft: after it, the stream carries one
    /// HTTP/1.1 exchange, an API call forwarded to the leader ([`HttpStreams`]).
    Http,
}

/// [`PeerMsg::Http`] streams one peer may have open on its connection to another at once,
/// besides the Raft streams ([`quic::MAX_CONCURRENT_BIDI_STREAMS`]): its forwarded calls.
pub const HTTP_STREAMS_AT_ONCE: u32 = 4096;

/// Where a peer's [`PeerMsg::Http`] streams go, with the id of the peer that opened them
/// (its certificate's).
pub type HttpStreams = Arc<dyn Fn(PeerId, quinn::SendStream, quinn::RecvStream) + Send + Sync>;

/// The most bytes of a Raft message one frame carries.
pub const PART_BYTES: usize = 4 << 20;

/// The largest Raft message a peer accepts: a snapshot of [`MAX_SNAPSHOT_BYTES`] and the
/// message around it.
pub const MAX_MESSAGE_BYTES: usize = MAX_SNAPSHOT_BYTES + (1 << 20);

/// Why a Raft message did not reach its peer's stream. Raft hears of it as an unreachable
/// peer and retries on its own schedule; the error itself is only logged.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("the raft message to peer {to} does not encode: {source}")]
    Encode {
        to: PeerId,
        source: protobuf::ProtobufError,
    },
    #[error("writing to peer {to} failed: {source}")]
    Write {
        to: PeerId,
        source: tessera_comm::CommError,
    },
}

/// Messages queued for one peer before new ones are reported unreachable.
const QUEUE: usize = 512;
/// How long dialing a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between failed dials of one peer.
const REDIAL_PAUSE: Duration = Duration::from_millis(200);

/// The QUIC address of each peer, by id: the topology's, updated as members join.
pub type Addresses = Arc<RwLock<BTreeMap<PeerId, String>>>;

/// The local node, set once it has started (the transport exists before it does).
pub type NodeCell = Arc<OnceLock<NodeHandle>>;

/// Sends a peer's Raft messages over QUIC.
#[derive(Debug)]
pub struct QuicTransport {
    endpoint: quinn::Endpoint,
    addresses: Addresses,
    node: NodeCell,
    runtime: tokio::runtime::Handle,
    links: HashMap<PeerId, mpsc::Sender<Message>>,
}

impl QuicTransport {
    /// Dials from `endpoint`; spawns its link tasks on `runtime`.
    pub fn new(
        endpoint: quinn::Endpoint,
        addresses: Addresses,
        node: NodeCell,
        runtime: tokio::runtime::Handle,
    ) -> QuicTransport {
        QuicTransport {
            endpoint,
            addresses,
            node,
            runtime,
            links: HashMap::new(),
        }
    }
}

impl Transport for QuicTransport {
    fn send(&mut self, message: Message) {
        let to = PeerId(message.to);
        let link = self.links.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            let link = Link {
                to,
                endpoint: self.endpoint.clone(),
                addresses: Arc::clone(&self.addresses),
                node: Arc::clone(&self.node),
            };
            self.runtime.spawn(link.run(rx));
            tx
        });
        if let Err(error) = link.try_send(message) {
            let message = match error {
                mpsc::error::TrySendError::Full(m) | mpsc::error::TrySendError::Closed(m) => m,
            };
            unreachable(&self.node, &message);
        }
    }
}

/// Starts driving `peer`, its messages going over QUIC from `endpoint` to the peers at
/// `addresses`. Must run inside a tokio runtime.
pub fn start(
    peer: super::peer::Peer,
    endpoint: quinn::Endpoint,
    addresses: Addresses,
) -> std::io::Result<NodeHandle> {
    let cell: NodeCell = Arc::default();
    let transport = QuicTransport::new(
        endpoint,
        addresses,
        Arc::clone(&cell),
        tokio::runtime::Handle::current(),
    );
    let node = super::node::spawn(peer, transport)?;
    let _ = cell.set(node.clone());
    Ok(node)
}

fn unreachable(node: &NodeCell, message: &Message) {
    if let Some(node) = node.get() {
        node.unreachable(PeerId(message.to), is_snapshot(message));
    }
}

/// The outbound side of one remote peer.
#[derive(Clone)]
struct Link {
    to: PeerId,
    endpoint: quinn::Endpoint,
    addresses: Addresses,
    node: NodeCell,
}

impl Link {
    async fn run(self, mut queue: mpsc::Receiver<Message>) {
        while let Some(first) = queue.recv().await {
            let Some((connection, mut send)) = self.open().await else {
                // Down or unknown: what is queued now is stale by the time it could go.
                unreachable(&self.node, &first);
                while let Ok(m) = queue.try_recv() {
                    unreachable(&self.node, &m);
                }
                tokio::time::sleep(REDIAL_PAUSE).await;
                continue;
            };
            let mut next = Some(first);
            while let Some(message) = next.take() {
                if is_snapshot(&message) {
                    tokio::spawn(self.clone().send_snapshot(connection.clone(), message));
                } else if let Err(error) = self.write(&mut send, &message).await {
                    debug!(to = self.to.0, %error, "raft link lost");
                    unreachable(&self.node, &message);
                    break;
                }
                next = queue.recv().await;
            }
        }
    }

    async fn open(&self) -> Option<(quinn::Connection, quinn::SendStream)> {
        let addr = self.addresses.read().ok()?.get(&self.to).cloned()?;
        let target: SocketAddr = tokio::net::lookup_host(&addr).await.ok()?.next()?;
        let identity = Identity::Coordinator(self.to);
        let connecting = quic::connect(&self.endpoint, target, &identity);
        let connection = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(error)) => {
                debug!(to = self.to.0, addr, %error, "raft peer not reachable");
                return None;
            }
            Err(_) => return None,
        };
        let (send, _recv) = connection.open_bi().await.ok()?;
        Some((connection, send))
    }

    /// Writes `message` on a stream of its own, then reports its delivery to Raft.
    async fn send_snapshot(self, connection: quinn::Connection, message: Message) {
        let sent = async {
            let (mut send, _recv) = connection.open_bi().await.ok()?;
            self.write(&mut send, &message).await.ok()?;
            send.finish().ok()
        };
        match sent.await {
            Some(()) => {
                if let Some(node) = self.node.get() {
                    node.snapshot_sent(self.to);
                }
            }
            None => {
                debug!(to = self.to.0, "snapshot not sent");
                unreachable(&self.node, &message);
            }
        }
    }

    /// Writes `message` as one frame, or as several when it is larger than [`PART_BYTES`].
    async fn write(
        &self,
        send: &mut quinn::SendStream,
        message: &Message,
    ) -> Result<(), TransportError> {
        let bytes = message
            .write_to_bytes()
            .map_err(|source| TransportError::Encode {
                to: self.to,
                source,
            })?;
        let (last, parts) = split_parts(&bytes);
        for part in parts {
            self.write_frame(send, &PeerMsg::Part(part.to_vec()))
                .await?;
        }
        self.write_frame(send, &PeerMsg::Raft(last.to_vec())).await
    }

    async fn write_frame(
        &self,
        send: &mut quinn::SendStream,
        frame: &PeerMsg,
    ) -> Result<(), TransportError> {
        wire::write_frame(send, frame)
            .await
            .map_err(|source| TransportError::Write {
                to: self.to,
                source,
            })
    }
}

/// A message's bytes as the frames that carry it: the last piece, and the
/// [`PART_BYTES`]-long parts before it (none for a message that fits one frame).
fn split_parts(bytes: &[u8]) -> (&[u8], impl Iterator<Item = &[u8]>) {
    let whole = bytes.len().saturating_sub(1) / PART_BYTES * PART_BYTES;
    let (parts, last) = bytes.split_at(whole);
    (last, parts.chunks(PART_BYTES))
}

/// Joins the frames of one Raft message, up to `limit` bytes.
#[derive(Debug)]
struct Joiner {
    parts: Vec<u8>,
    limit: usize,
}

impl Joiner {
    fn new(limit: usize) -> Joiner {
        Joiner {
            parts: Vec::new(),
            limit,
        }
    }

    /// Takes one frame; the whole message once `frame` is its last.
    fn push(&mut self, frame: PeerMsg) -> Result<Option<Vec<u8>>, String> {
        let (bytes, last) = match frame {
            PeerMsg::Part(bytes) => (bytes, false),
            PeerMsg::Raft(bytes) => (bytes, true),
            PeerMsg::Http => return Err("an HTTP exchange inside a raft stream".into()),
        };
        if self.parts.len() + bytes.len() > self.limit {
            return Err(format!("a raft message of more than {} bytes", self.limit));
        }
        if !last {
            self.parts.extend_from_slice(&bytes);
            return Ok(None);
        }
        if self.parts.is_empty() {
            return Ok(Some(bytes));
        }
        let mut whole = std::mem::take(&mut self.parts);
        whole.extend_from_slice(&bytes);
        Ok(Some(whole))
    }
}

/// Reads the streams coordinator peer `from` opens, until the connection closes: Raft
/// messages go to `node`, and a stream that starts with [`PeerMsg::Http`] to `http`.
pub async fn serve_inbound(
    connection: quinn::Connection,
    from: PeerId,
    node: NodeHandle,
    http: HttpStreams,
) {
    connection.set_max_concurrent_bi_streams(quinn::VarInt::from_u32(
        quic::MAX_CONCURRENT_BIDI_STREAMS + HTTP_STREAMS_AT_ONCE,
    ));
    while let Ok((send, recv)) = connection.accept_bi().await {
        let node = node.clone();
        let http = Arc::clone(&http);
        tokio::spawn(serve_stream(from, send, recv, node, http));
    }
}

async fn serve_stream(
    from: PeerId,
    send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    node: NodeHandle,
    http: HttpStreams,
) {
    let first = match wire::read_frame::<_, PeerMsg>(&mut recv, wire::MAX_FRAME_BYTES).await {
        Ok(Some(frame)) => frame,
        Ok(None) => return,
        Err(error) => {
            warn!(from = from.0, %error, "bad frame from coordinator peer");
            return;
        }
    };
    // Only a stream's first frame may turn it into an HTTP exchange; a Raft stream
    // answers nothing, so its send half goes (finished) now.
    if let PeerMsg::Http = first {
        return http(from, send, recv);
    }
    drop(send);
    let read = read_raft_stream(first, &mut recv, from.0, MAX_MESSAGE_BYTES, |message| {
        node.receive(message);
    });
    if let Err(reason) = read.await {
        warn!(
            from = from.0,
            reason, "raft stream from coordinator peer ended"
        );
    }
}

/// Reads a Raft stream from peer `from` whose first frame was `first`: joins each
/// message's parts (up to `limit` bytes) and hands every message to `deliver`, until the
/// stream ends. A bad frame, an oversized message, or one that does not decode or claims
/// another sender ends it, with the reason.
pub async fn read_raft_stream<R: tokio::io::AsyncRead + Unpin>(
    first: PeerMsg,
    recv: &mut R,
    from: u64,
    limit: usize,
    mut deliver: impl FnMut(Message),
) -> Result<(), String> {
    let mut joiner = Joiner::new(limit);
    let mut frame = first;
    loop {
        if let Some(bytes) = joiner.push(frame)? {
            deliver(decode(&bytes, from)?);
        }
        frame = match wire::read_frame::<_, PeerMsg>(recv, wire::MAX_FRAME_BYTES).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return Ok(()),
            Err(error) => return Err(error.to_string()),
        };
    }
}

/// A Raft message from peer `from`, which must say it is from `from` (raft-rs's own id,
/// at the edge where the message is decoded).
fn decode(bytes: &[u8], from: u64) -> Result<Message, String> {
    let message = Message::parse_from_bytes(bytes).map_err(|e| e.to_string())?;
    if message.from != from {
        return Err(format!(
            "peer {from} sent a message claiming to be from peer {}",
            message.from
        ));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use raft::prelude::MessageType;

    use super::*;

    #[test]
    fn a_peer_cannot_speak_for_another() {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgHeartbeat);
        message.from = 2;
        message.to = 1;
        message.term = 7;
        let bytes = message.write_to_bytes().expect("encode");
        assert_eq!(decode(&bytes, 2).expect("from 2"), message);
        assert!(decode(&bytes, 3).unwrap_err().contains("claiming"));
        assert!(decode(&[0xff, 0xff, 0xff], 2).is_err());
    }

    /// A message crosses as frames no larger than `PART_BYTES` and is joined whole on
    /// the other side, at every length around the part boundaries.
    #[test]
    fn a_large_message_crosses_in_parts_and_is_joined_whole() {
        for len in [
            0,
            1,
            PART_BYTES - 1,
            PART_BYTES,
            PART_BYTES + 1,
            3 * PART_BYTES + 5,
        ] {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let (last, parts) = split_parts(&bytes);
            let mut frames: Vec<PeerMsg> = parts.map(|p| PeerMsg::Part(p.to_vec())).collect();
            frames.push(PeerMsg::Raft(last.to_vec()));
            assert_eq!(
                frames.len(),
                len.saturating_sub(1) / PART_BYTES + 1,
                "{len}"
            );
            let mut joiner = Joiner::new(MAX_MESSAGE_BYTES);
            let mut whole = None;
            for frame in frames {
                let size = match &frame {
                    PeerMsg::Part(b) | PeerMsg::Raft(b) => b.len(),
                    PeerMsg::Http => unreachable!("only parts here"),
                };
                assert!(size <= PART_BYTES && wire::encode(&frame).is_ok(), "{len}");
                assert!(whole.is_none(), "{len}: joined before the last frame");
                whole = joiner.push(frame).expect("within the limit");
            }
            assert_eq!(whole.as_deref(), Some(&bytes[..]), "{len}");
        }
    }

    #[test]
    fn a_message_past_the_limit_is_refused_as_its_parts_arrive() {
        let mut joiner = Joiner::new(10);
        assert_eq!(joiner.push(PeerMsg::Part(vec![1; 6])), Ok(None));
        let refused = joiner.push(PeerMsg::Part(vec![2; 5])).unwrap_err();
        assert!(refused.contains("more than 10 bytes"), "{refused}");
        assert_eq!(joiner.parts.len(), 6);
        let mut joiner = Joiner::new(10);
        assert!(joiner.push(PeerMsg::Raft(vec![0; 11])).is_err());
        assert_eq!(
            Joiner::new(10).push(PeerMsg::Raft(vec![3; 10])),
            Ok(Some(vec![3; 10]))
        );
    }

    /// A stream's frames as `serve_inbound` reads them: a message in parts is joined, and
    /// a message claiming another sender ends the stream after those before it.
    #[tokio::test]
    async fn a_raft_stream_delivers_joined_messages_until_a_bad_one() {
        let message = |from: u64, term: u64| {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgAppend);
            m.from = from;
            m.to = 1;
            m.term = term;
            m.write_to_bytes().expect("encode")
        };
        let whole = message(2, 5);
        let (head, tail) = whole.split_at(whole.len() / 2);
        let mut bytes = Vec::new();
        for frame in [
            PeerMsg::Raft(message(2, 4)),
            PeerMsg::Part(head.to_vec()),
            PeerMsg::Raft(tail.to_vec()),
            PeerMsg::Raft(message(3, 6)),
            PeerMsg::Raft(message(2, 7)),
        ] {
            bytes.extend(wire::encode_frame(&frame).expect("a frame"));
        }
        let mut input = &bytes[..];
        let first = wire::read_frame::<_, PeerMsg>(&mut input, wire::MAX_FRAME_BYTES)
            .await
            .expect("a frame")
            .expect("not the end");
        let mut terms = Vec::new();
        let read = read_raft_stream(first, &mut input, 2, MAX_MESSAGE_BYTES, |m| {
            terms.push(m.term)
        });
        let ended = read.await.unwrap_err();
        assert!(ended.contains("claiming to be from peer 3"), "{ended}");
        assert_eq!(terms, vec![4, 5]);
    }
}
