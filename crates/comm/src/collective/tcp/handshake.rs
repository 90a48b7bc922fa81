//! Connecting a [`super::TcpRing`]: each rank listens on its own address, connects to the
//! next rank (retrying until the deadline, since the next rank may not listen yet) and
//! accepts one connection from the previous rank. Both ends of a connection send a hello
//! (magic, version, rank, world size, group token); the acceptor checks the connector's
//! first and answers with its own, so each side proves it holds the token. A wrong token or
//! header fails with [`CollectiveError::Unauthenticated`] and drops the connection; a
//! connection closed during the handshake is read as the peer refusing ours.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::{Links, millis, rank_of};
use crate::collective::{CollectiveError, GroupToken, Op};

/// "TRNG" in ASCII.
const MAGIC: u32 = 0x5452_4e47;
/// Bumped on any change to the hello or the frames.
const VERSION: u32 = 1;
const HELLO_BYTES: usize = 16 + 32;
/// Pause between connection attempts to a rank that does not listen yet.
const CONNECT_RETRY: Duration = Duration::from_millis(5);

pub(super) fn hello(rank: usize, world: usize, token: &GroupToken) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    h[12..16].copy_from_slice(&(world as u32).to_le_bytes());
    h[16..].copy_from_slice(&token.0);
    h
}

/// Whether `h` is the hello of rank `from` of this group. The token is compared in
/// constant time, and always, so the answer's timing does not depend on the header.
pub(super) fn hello_ok(
    h: &[u8; HELLO_BYTES],
    from: usize,
    world: usize,
    token: &GroupToken,
) -> bool {
    let expected = hello(from, world, token);
    let token_ok = token.matches(&h[16..]);
    token_ok && h[..16] == expected[..16]
}

fn connect_error(e: io::Error) -> CollectiveError {
    CollectiveError::Io {
        op: Op::Connect,
        message: e.to_string(),
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// Reads a hello within the deadline; a closed connection or a bad hello is a refusal.
fn read_hello(
    stream: &mut TcpStream,
    from: usize,
    world: usize,
    token: &GroupToken,
    deadline: Instant,
    started: Instant,
) -> Result<(), CollectiveError> {
    let timeout = |missing| CollectiveError::Timeout {
        op: Op::Connect,
        missing: rank_of(missing),
        waited_ms: millis(started.elapsed()),
    };
    let wait = remaining(deadline).ok_or_else(|| timeout(from))?;
    stream.set_read_timeout(Some(wait)).map_err(connect_error)?;
    let mut h = [0u8; HELLO_BYTES];
    match stream.read_exact(&mut h) {
        Ok(()) if hello_ok(&h, from, world, token) => Ok(()),
        Ok(()) => Err(CollectiveError::Unauthenticated { op: Op::Connect }),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(timeout(from))
        }
        Err(_) => Err(CollectiveError::Unauthenticated { op: Op::Connect }),
    }
}

/// Listens, connects to the next rank, accepts the previous one and authenticates both.
pub(super) fn connect_links(
    me: usize,
    peers: &[String],
    token: &GroupToken,
    deadline_after: Duration,
) -> Result<Links, CollectiveError> {
    let started = Instant::now();
    let deadline = started + deadline_after;
    let world = peers.len();
    let (next_r, prev_r) = ((me + 1) % world, (me + world - 1) % world);
    let timeout = |missing| CollectiveError::Timeout {
        op: Op::Connect,
        missing: rank_of(missing),
        waited_ms: millis(started.elapsed()),
    };
    let listener = TcpListener::bind(&peers[me]).map_err(connect_error)?;
    listener.set_nonblocking(true).map_err(connect_error)?;

    // Connect to the next rank, which may not listen yet.
    let mut next = loop {
        let addrs = peers[next_r].to_socket_addrs().map_err(connect_error)?;
        let wait = remaining(deadline).ok_or_else(|| timeout(next_r))?;
        if let Some(stream) = addrs
            .filter_map(|a| TcpStream::connect_timeout(&a, wait).ok())
            .next()
        {
            break stream;
        }
        if remaining(deadline).is_none() {
            return Err(timeout(next_r));
        }
        std::thread::sleep(CONNECT_RETRY);
    };
    next.set_nodelay(true).map_err(connect_error)?;
    next.write_all(&hello(me, world, token))
        .map_err(connect_error)?;

    // Accept the previous rank and check its hello before answering with ours.
    let mut prev = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if remaining(deadline).is_none() {
                    return Err(timeout(prev_r));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(connect_error(e)),
        }
    };
    prev.set_nonblocking(false).map_err(connect_error)?;
    prev.set_nodelay(true).map_err(connect_error)?;
    read_hello(&mut prev, prev_r, world, token, deadline, started)?;
    prev.write_all(&hello(me, world, token))
        .map_err(connect_error)?;

    // The next rank's answer proves it holds the token too.
    read_hello(&mut next, next_r, world, token, deadline, started)?;
    next.set_nonblocking(true).map_err(connect_error)?;
    Ok(Links {
        next,
        prev,
        next_at_frame_start: true,
    })
}
