//! The frames of a [`super::TcpRing`] and the transfer of one step.
//!
//! **Frames.** Each step of an operation sends one frame: a 12-byte header (op, payload
//! bytes, total length) and the payload. The receiver checks the header against its own
//! call, so ranks that issue different calls fail with [`CollectiveError::BadLength`]
//! instead of mixing payloads. A rank that fails sends an abort frame ([`abort_frame`]) to
//! the next rank when it can and closes both connections, so the failure travels around the
//! ring and every rank's call returns instead of waiting for its deadline.
//!
//! **Blocking I/O.** The communicator is owned by one compute thread, so it uses blocking
//! `std::net` sockets, no runtime. A step sends and receives at once; with blocking writes
//! every rank could block writing a large frame to a neighbour that is itself blocked
//! writing. So the outgoing socket is non-blocking and the incoming one is read with short
//! timeouts while a send is pending, alternating between the two until both are done.
//! `CollectiveConfig::spin` is not used: a blocked socket read wakes when data arrives.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use tessera_topology::Rank;

use super::{Links, millis};
use crate::collective::{CollectiveConfig, CollectiveError, Op};

pub(super) const HEADER_BYTES: usize = 12;
/// Set in a frame's op word: the sender's group failed; the total word carries
/// `by << 16 | missing`.
pub(super) const ABORT_FLAG: u32 = 1 << 31;
/// While a send is pending, a read waits at most this long before trying the send again.
/// Short enough not to stall a transfer that a full send buffer holds up.
const POLL: Duration = Duration::from_micros(200);

/// Why a step failed, before it is named after an op and a rank.
#[derive(Debug)]
pub(super) enum StepFailure {
    /// Waiting for the previous rank's frame (`true`) or for room to send (`false`).
    Timeout {
        receiving: bool,
    },
    PrevClosed,
    NextClosed,
    Mismatch {
        code: u32,
        total: u32,
        bytes: u32,
    },
    Aborted {
        by: u32,
        missing: u32,
    },
}

impl StepFailure {
    pub(super) fn into_error(
        self,
        op: Op,
        prev: Rank,
        next: Rank,
        total: usize,
        deadline: Instant,
        config: CollectiveConfig,
    ) -> CollectiveError {
        match self {
            StepFailure::Timeout { receiving } => CollectiveError::Timeout {
                op,
                missing: if receiving { prev } else { next },
                waited_ms: millis(
                    config.deadline + Instant::now().saturating_duration_since(deadline),
                ),
            },
            StepFailure::PrevClosed => CollectiveError::PeerClosed { op, peer: prev },
            StepFailure::NextClosed => CollectiveError::PeerClosed { op, peer: next },
            StepFailure::Mismatch {
                code,
                total: theirs,
                bytes,
            } => CollectiveError::BadLength {
                op,
                len: total,
                detail: format!(
                    "rank {prev} sent a frame for op {code} of {theirs} elements \
                     ({bytes} bytes) where this rank expected {op} of {total}"
                ),
            },
            StepFailure::Aborted { by, missing } => CollectiveError::Aborted {
                op,
                by: Rank(by),
                missing: Rank(missing),
                reason: format!("rank {by} failed waiting on rank {missing}"),
            },
        }
    }
}

fn closed(e: &io::Error) -> bool {
    !matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// One frame out to `next` and one in from `prev`, interleaved (see the module docs).
pub(super) fn transfer(
    links: &mut Links,
    code: u32,
    total: u32,
    send: Option<&[u8]>,
    recv: Option<&mut [u8]>,
    deadline: Instant,
) -> Result<(), StepFailure> {
    let send_len = send.map_or(0, <[u8]>::len);
    let header_out = frame_header(code, send_len as u32, total);
    let send_total = send.map_or(0, |s| HEADER_BYTES + s.len());
    let mut sent = 0;
    let mut header_in = [0u8; HEADER_BYTES];
    let mut recv = recv;
    let recv_total = recv.as_ref().map_or(0, |r| HEADER_BYTES + r.len());
    let mut got = 0;
    while sent < send_total || got < recv_total {
        if sent < send_total {
            links.next_at_frame_start = false;
            let payload = send.unwrap_or_default();
            let part = if sent < HEADER_BYTES {
                &header_out[sent..]
            } else {
                &payload[sent - HEADER_BYTES..]
            };
            match links.next.write(part) {
                Ok(0) => return Err(StepFailure::NextClosed),
                Ok(n) => sent += n,
                Err(e) if closed(&e) => return Err(StepFailure::NextClosed),
                Err(_) => {}
            }
            links.next_at_frame_start = sent == send_total;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(StepFailure::Timeout {
                receiving: got < recv_total,
            });
        }
        if got < recv_total {
            let Some(buf) = recv.as_deref_mut() else {
                break;
            };
            let wait = if sent < send_total {
                POLL
            } else {
                deadline - now
            };
            // A zero timeout means "none" to the OS; the deadline check above keeps it > 0.
            let _ = links
                .prev
                .set_read_timeout(Some(wait.max(Duration::from_micros(1))));
            let target = if got < HEADER_BYTES {
                &mut header_in[got..]
            } else {
                &mut buf[got - HEADER_BYTES..]
            };
            match links.prev.read(target) {
                Ok(0) => return Err(StepFailure::PrevClosed),
                Ok(n) => {
                    got += n;
                    if got == HEADER_BYTES || (got > HEADER_BYTES && got - n < HEADER_BYTES) {
                        check_header(&header_in, code, buf.len() as u32, total)?;
                    }
                }
                Err(e) if closed(&e) => return Err(StepFailure::PrevClosed),
                Err(_) => {}
            }
        } else if sent < send_total {
            // Only the send is left and the next rank's buffer is full: let it drain.
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    Ok(())
}

pub(super) fn frame_header(code: u32, bytes: u32, total: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&code.to_le_bytes());
    h[4..8].copy_from_slice(&bytes.to_le_bytes());
    h[8..].copy_from_slice(&total.to_le_bytes());
    h
}

pub(super) fn check_header(
    h: &[u8; HEADER_BYTES],
    code: u32,
    bytes: u32,
    total: u32,
) -> Result<(), StepFailure> {
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let (their_code, their_bytes, their_total) = (word(0), word(4), word(8));
    if their_code & ABORT_FLAG != 0 {
        return Err(StepFailure::Aborted {
            by: their_total >> 16,
            missing: their_total & 0xffff,
        });
    }
    if (their_code, their_bytes, their_total) != (code, bytes, total) {
        return Err(StepFailure::Mismatch {
            code: their_code,
            total: their_total,
            bytes: their_bytes,
        });
    }
    Ok(())
}

/// The frame that tells the next rank the ring failed: `by` gave up waiting on `missing`.
pub(super) fn abort_frame(by: Rank, missing: Rank) -> [u8; HEADER_BYTES] {
    frame_header(ABORT_FLAG, 0, (by.0 << 16) | (missing.0 & 0xffff))
}
