//! Joining a [`super::TcpRing`]: each rank listens on its own address, dials the next rank
//! and accepts the previous one, at once (the two handshakes of a ring wait on each other,
//! so neither may wait for the other to finish).
//!
//! **Accepting.** Anyone who can reach the port can connect, so no single connection may
//! decide the join. Each accepted connection is a candidate, handshaken on its own thread
//! ([`handshake::as_acceptor`]) within [`HANDSHAKE_TIMEOUT`]; at most [`MAX_CANDIDATES`] at
//! once (more wait in the listen backlog). A candidate that sends garbage, another version,
//! the wrong rank or a wrong proof, stalls, or closes early is logged with its address and
//! reason and dropped; the first that proves the token becomes the link from the previous
//! rank, and the others are shut down.
//!
//! **Dialing.** The next rank may not listen yet, and the address may still be held by
//! something that refuses this rank (a shard of the previous epoch), so the dialer connects
//! and handshakes again until it succeeds.
//!
//! Both give up at the join's deadline: with [`CollectiveError::Unauthenticated`] and the
//! last refusal when some connection was refused, else [`CollectiveError::Timeout`].

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::warn;

use super::handshake::{self, Timed};
use super::hello::{Hello, JoinKey, Refusal};
use super::{Links, millis, rank_of};
use crate::collective::{CollectiveError, GroupToken, Op};

/// How long one connection may take for its handshake. A ring peer answers within
/// milliseconds; three seconds tolerates a loaded host, and bounds how long a connection
/// that stalls holds one of the [`MAX_CANDIDATES`] places.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// Candidates handshaken at once. The join needs one; eight lets the previous rank through
/// while a few others stall, and bounds the threads a flood of connections can start.
const MAX_CANDIDATES: usize = 8;
/// Pause between attempts to dial a rank that does not listen yet.
const CONNECT_RETRY: Duration = Duration::from_millis(5);
/// Pause before dialing again a rank whose address refused this rank's handshake.
const REFUSED_RETRY: Duration = Duration::from_millis(50);
/// How often the accept loop looks at the listener while no candidate finishes.
const ACCEPT_POLL: Duration = Duration::from_millis(1);

/// What both sides of the join share.
#[derive(Debug)]
struct Join {
    me: usize,
    world: usize,
    key: Arc<JoinKey>,
    started: Instant,
    deadline: Instant,
    /// Set when one side failed, so that the other stops too.
    stop: AtomicBool,
}

impl Join {
    fn left(&self) -> Option<Duration> {
        self.deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    fn hello(&self) -> Result<Hello, CollectiveError> {
        Hello::fresh(self.me as u32, self.world as u32)
    }

    /// The join's failure once `peer` did not join by the deadline.
    fn gave_up(&self, peer: usize, refused: Option<String>) -> CollectiveError {
        match refused {
            Some(reason) => CollectiveError::Unauthenticated {
                op: Op::Connect,
                peer: rank_of(peer),
                reason,
            },
            None => CollectiveError::Timeout {
                op: Op::Connect,
                missing: rank_of(peer),
                waited_ms: millis(self.started.elapsed()),
            },
        }
    }
}

fn connect_error(e: io::Error) -> CollectiveError {
    CollectiveError::Io {
        op: Op::Connect,
        message: e.to_string(),
    }
}

/// Listens, dials the next rank and accepts the previous one, authenticating both.
pub(super) fn connect_links(
    me: usize,
    peers: &[String],
    token: &GroupToken,
    deadline_after: Duration,
) -> Result<Links, CollectiveError> {
    let started = Instant::now();
    let world = peers.len();
    let join = Join {
        me,
        world,
        key: Arc::new(JoinKey::new(token, peers)),
        started,
        deadline: started + deadline_after,
        stop: AtomicBool::new(false),
    };
    let listener = TcpListener::bind(&peers[me]).map_err(connect_error)?;
    listener.set_nonblocking(true).map_err(connect_error)?;
    let next_addr = &peers[(me + 1) % world];
    let (next, prev) = std::thread::scope(|s| {
        let dialer = s.spawn(|| stop_on_error(&join, dial_next(&join, next_addr)));
        let prev = stop_on_error(&join, accept_prev(&join, &listener));
        let next = dialer.join().unwrap_or_else(|_| {
            Err(CollectiveError::Io {
                op: Op::Connect,
                message: "the thread dialing the next rank panicked".into(),
            })
        });
        (next, prev)
    });
    let (next, prev) = match (next, prev) {
        (Ok(next), Ok(prev)) => (next, prev),
        // A refusal says more than the timeout it may have caused on the other side, and
        // the acceptor's, which checked a proof, more than the dialer's.
        (_, Err(e @ CollectiveError::Unauthenticated { .. }))
        | (Err(e @ CollectiveError::Unauthenticated { .. }), _)
        | (_, Err(e))
        | (Err(e), _) => return Err(e),
    };
    next.set_nodelay(true).map_err(connect_error)?;
    next.set_nonblocking(true).map_err(connect_error)?;
    prev.set_nodelay(true).map_err(connect_error)?;
    prev.set_nonblocking(false).map_err(connect_error)?;
    Ok(Links {
        next,
        prev,
        next_at_frame_start: true,
    })
}

fn stop_on_error<T>(join: &Join, result: Result<T, CollectiveError>) -> Result<T, CollectiveError> {
    if result.is_err() {
        join.stop.store(true, Ordering::Relaxed);
    }
    result
}

/// Dials `addr` (the next rank) and handshakes until one connection is authenticated.
fn dial_next(join: &Join, addr: &str) -> Result<TcpStream, CollectiveError> {
    let next = (join.me + 1) % join.world;
    let mut refused = None;
    loop {
        let left = match join.left() {
            Some(left) if !join.stop.load(Ordering::Relaxed) => left,
            _ => return Err(join.gave_up(next, refused)),
        };
        let addrs = addr.to_socket_addrs().map_err(connect_error)?;
        let Some(stream) = addrs
            .filter_map(|a| TcpStream::connect_timeout(&a, left).ok())
            .next()
        else {
            std::thread::sleep(CONNECT_RETRY);
            continue;
        };
        let mine = join.hello()?;
        let attempt = Instant::now();
        let until = join.deadline.min(attempt + HANDSHAKE_TIMEOUT);
        let mut channel = Timed::new(&stream, attempt, until);
        match handshake::as_connector(&mut channel, &join.key, &mine, next as u32) {
            Ok(()) => return Ok(stream),
            Err(refusal) => {
                let remote = stream
                    .peer_addr()
                    .map_or_else(|_| addr.into(), |a| a.to_string());
                warn!(
                    rank = %rank_of(next),
                    remote = %remote,
                    reason = %refusal,
                    "ring join: the next rank's address refused the handshake; dialing again"
                );
                refused = Some(format!("rank {next} at {remote} {refusal}"));
                std::thread::sleep(REFUSED_RETRY);
            }
        }
    }
}

/// A candidate's outcome, from its handshake thread to the accept loop.
struct Outcome {
    id: u64,
    remote: SocketAddr,
    result: Result<TcpStream, Refusal>,
}

/// Accepts candidates until one proves it is the previous rank (see the module docs).
fn accept_prev(join: &Join, listener: &TcpListener) -> Result<TcpStream, CollectiveError> {
    let prev = (join.me + join.world - 1) % join.world;
    let (tx, rx) = mpsc::channel::<Outcome>();
    // Clones of the candidates in flight, to shut them down once the join is decided.
    let mut in_flight: Vec<(u64, TcpStream)> = Vec::new();
    let mut next_id = 0u64;
    let mut refused = None;
    let mut woken_by = None;
    let result = loop {
        for outcome in woken_by.take().into_iter().chain(rx.try_iter()) {
            in_flight.retain(|(id, _)| *id != outcome.id);
            match outcome.result {
                Ok(stream) => return finish(in_flight, Ok(stream)),
                Err(refusal) => {
                    warn!(
                        rank = %rank_of(prev),
                        remote = %outcome.remote,
                        reason = %refusal,
                        "ring join: refused a connection that claimed the previous rank"
                    );
                    refused = Some(format!("{} {refusal}", outcome.remote));
                }
            }
        }
        let Some(left) = join.left().filter(|_| !join.stop.load(Ordering::Relaxed)) else {
            break Err(join.gave_up(prev, refused));
        };
        if in_flight.len() < MAX_CANDIDATES {
            match listener.accept() {
                Ok((stream, remote)) => {
                    let id = next_id;
                    next_id += 1;
                    match start_candidate(join, stream, remote, id, prev, left, &tx) {
                        Ok(Some(clone)) => in_flight.push((id, clone)),
                        Ok(None) => {}
                        Err(e) => break Err(e),
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The connection went away before it was accepted.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => break Err(connect_error(e)),
            }
        }
        // Wakes early when a candidate finishes.
        woken_by = rx.recv_timeout(ACCEPT_POLL.min(left)).ok();
    };
    finish(in_flight, result)
}

/// Shuts down the candidates still in flight (their threads then end at once) and returns
/// the join's result.
fn finish(
    in_flight: Vec<(u64, TcpStream)>,
    result: Result<TcpStream, CollectiveError>,
) -> Result<TcpStream, CollectiveError> {
    for (_, stream) in in_flight {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    result
}

/// Starts the handshake of one accepted connection on its own thread. Returns a clone of
/// the connection to shut it down later, or `None` when it was dropped at once.
fn start_candidate(
    join: &Join,
    stream: TcpStream,
    remote: SocketAddr,
    id: u64,
    prev: usize,
    left: Duration,
    tx: &mpsc::Sender<Outcome>,
) -> Result<Option<TcpStream>, CollectiveError> {
    let mine = join.hello()?;
    let refuse = |reason: &dyn std::fmt::Display| {
        warn!(remote = %remote, reason = %reason, "ring join: dropped a connection");
    };
    // Accepted sockets of a non-blocking listener may be non-blocking too.
    let clone = match stream
        .set_nonblocking(false)
        .and_then(|()| stream.try_clone())
    {
        Ok(clone) => clone,
        Err(e) => {
            refuse(&e);
            return Ok(None);
        }
    };
    let (key, tx) = (Arc::clone(&join.key), tx.clone());
    let spawned = std::thread::Builder::new()
        .name("ring-join".into())
        .spawn(move || {
            let started = Instant::now();
            let until = started + left.min(HANDSHAKE_TIMEOUT);
            let mut channel = Timed::new(&stream, started, until);
            let result =
                handshake::as_acceptor(&mut channel, &key, &mine, prev as u32).map(|()| stream);
            // The join may be decided already; then nobody listens.
            let _ = tx.send(Outcome { id, remote, result });
        });
    match spawned {
        Ok(_) => Ok(Some(clone)),
        Err(e) => {
            refuse(&e);
            Ok(None)
        }
    }
}
