//! [`TcpRing`]: ranks on any hosts joined in a ring of TCP connections; rank `r` sends to
//! `r + 1` and receives from `r - 1` (mod world size).
//!
//! **Connecting.** Each rank listens on its own address, connects to the next rank
//! (retrying until the deadline, since the next rank may not listen yet) and accepts one
//! connection from the previous rank. Both ends of a connection send a hello (magic,
//! version, rank, world size, group token); the acceptor checks the connector's first and
//! answers with its own, so each side proves it holds the token. A wrong token or header
//! fails with [`CollectiveError::Unauthenticated`] and drops the connection; a connection
//! closed during the handshake is read as the peer refusing ours. Payloads are not
//! encrypted (as with NCCL): the ring belongs on the cluster's private network.
//!
//! **Frames.** Each step of an operation sends one frame: a 12-byte header (op, payload
//! bytes, total length) and the payload. The receiver checks the header against its own
//! call, so ranks that issue different calls fail with [`CollectiveError::BadLength`]
//! instead of mixing payloads. A rank that fails sends an abort frame to the next rank when
//! it can and closes both connections, so the failure travels around the ring and every
//! rank's call returns instead of waiting for its deadline.
//!
//! **All-reduce** is a ring reduce-scatter then a ring all-gather: the payload is cut into
//! world-size chunks (lengths differ by at most one element); in world − 1 steps each chunk
//! travels once around the ring accumulating every rank's values, ending fully reduced on
//! one rank; in world − 1 more steps the reduced chunks are passed around and copied. Chunk
//! `k` is summed in the cyclic rank order `k, k + 1, …, k − 1`, so the result can differ in
//! the last bits from a sum in rank order `0, 1, …` (and from [`super::shm::ShmCollective`])
//! when the world size is 3 or more. **Every rank still gets the same bits**: each chunk is
//! reduced exactly once, on one path around the ring, and the all-gather copies those bits
//! unchanged to every rank. The result is also the same from run to run (the order depends
//! only on the chunk index). Each rank sends and receives 2 × (world − 1) / world of the
//! payload, independent of the world size.
//!
//! **Blocking I/O.** The communicator is owned by one compute thread, so it uses blocking
//! `std::net` sockets, no runtime. A step sends and receives at once; with blocking writes
//! every rank could block writing a large frame to a neighbour that is itself blocked
//! writing. So the outgoing socket is non-blocking and the incoming one is read with short
//! timeouts while a send is pending, alternating between the two until both are done.
//! `CollectiveConfig::spin` is not used: a blocked socket read wakes when data arrives.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use tessera_topology::Rank;

use super::{Collective, CollectiveConfig, CollectiveError, CollectiveStats, GroupToken, Op};

/// "TRNG" in ASCII.
const MAGIC: u32 = 0x5452_4e47;
/// Bumped on any change to the hello or the frames.
const VERSION: u32 = 1;
const HELLO_BYTES: usize = 16 + 32;
const HEADER_BYTES: usize = 12;
/// Set in a frame's op word: the sender's group failed; the total word carries
/// `by << 16 | missing`.
const ABORT_FLAG: u32 = 1 << 31;
/// While a send is pending, a read waits at most this long before trying the send again.
/// Short enough not to stall a transfer that a full send buffer holds up.
const POLL: Duration = Duration::from_micros(200);
/// Pause between connection attempts to a rank that does not listen yet.
const CONNECT_RETRY: Duration = Duration::from_millis(5);
/// Broadcast payloads travel in pieces of this size, so that a piece is forwarded while the
/// next one arrives.
const BROADCAST_PIECE_BYTES: usize = 256 * 1024;

/// One rank of a TCP ring. Owned by the rank's compute thread.
#[derive(Debug)]
pub struct TcpRing {
    rank: Rank,
    world: usize,
    /// To rank + 1 (non-blocking) and from rank − 1 (blocking, read with timeouts). `None`
    /// for a group of one.
    links: Option<Links>,
    config: CollectiveConfig,
    /// Set once the ring failed: (by, missing, reason); every later call fails with it.
    failed: Option<(Rank, Rank, String)>,
    /// Received partial sums during the reduce-scatter.
    scratch: Vec<f32>,
    stats: CollectiveStats,
}

#[derive(Debug)]
struct Links {
    next: TcpStream,
    prev: TcpStream,
    /// The last frame sent to `next` was complete (an abort frame may follow).
    next_at_frame_start: bool,
}

impl TcpRing {
    /// Joins the ring of `peers.len()` ranks as `rank`; rank `r` listens on `peers[r]`
    /// (`host:port`). Returns once this rank's two connections are authenticated, or fails
    /// at `config.deadline`.
    pub fn connect(
        rank: Rank,
        peers: &[String],
        token: &GroupToken,
        config: CollectiveConfig,
    ) -> Result<TcpRing, CollectiveError> {
        let world = peers.len();
        let me = rank.0 as usize;
        if me >= world {
            return Err(CollectiveError::BadLength {
                op: Op::Connect,
                len: world,
                detail: format!("rank {rank} of a ring of {world} peers"),
            });
        }
        let links = if world == 1 {
            None
        } else {
            Some(connect_links(me, peers, token, config.deadline)?)
        };
        Ok(TcpRing {
            rank,
            world,
            links,
            config,
            failed: None,
            scratch: Vec::new(),
            stats: CollectiveStats::default(),
        })
    }

    fn next_rank(&self) -> Rank {
        rank_of((self.rank.0 as usize + 1) % self.world)
    }

    fn prev_rank(&self) -> Rank {
        rank_of((self.rank.0 as usize + self.world - 1) % self.world)
    }

    fn check_failed(&self, op: Op) -> Result<(), CollectiveError> {
        match &self.failed {
            Some((by, missing, reason)) => Err(CollectiveError::Aborted {
                op,
                by: *by,
                missing: *missing,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the ring failed, tells the next rank when a frame boundary allows, closes both
    /// connections, and returns `error` for this rank to report.
    fn fail(&mut self, error: CollectiveError) -> CollectiveError {
        let (by, reason) = match &error {
            CollectiveError::Aborted { by, reason, .. } => (*by, reason.clone()),
            other => (self.rank, other.to_string()),
        };
        let missing = error.culprit().unwrap_or(self.rank);
        if let Some(links) = &mut self.links {
            if links.next_at_frame_start {
                let mut frame = [0u8; HEADER_BYTES];
                frame[..4].copy_from_slice(&ABORT_FLAG.to_le_bytes());
                frame[8..].copy_from_slice(&((by.0 << 16) | (missing.0 & 0xffff)).to_le_bytes());
                // Best effort on a non-blocking socket: the close below reaches the next
                // rank either way.
                let _ = links.next.write(&frame);
            }
            let _ = links.next.shutdown(Shutdown::Both);
            let _ = links.prev.shutdown(Shutdown::Both);
        }
        self.failed = Some((by, missing, reason));
        error
    }

    /// Sends `send` to the next rank and receives `recv` from the previous one at once,
    /// each as one frame tagged `code`/`total`. Either may be `None`.
    fn step(
        &mut self,
        op: Op,
        code: u32,
        total: usize,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (next, prev) = (self.next_rank(), self.prev_rank());
        let Some(links) = &mut self.links else {
            return Ok(());
        };
        let result = transfer(links, code, total as u32, send, recv, deadline);
        result.map_err(|failure| {
            let error = failure.into_error(op, prev, next, total, deadline, self.config);
            self.fail(error)
        })
    }

    fn finish(&mut self, started: Instant, bytes: usize) {
        self.stats.calls += 1;
        self.stats.bytes += bytes as u64;
        self.stats.time += started.elapsed();
    }

    /// The ring all-reduce (see the module docs), tagged `op`.
    fn ring_all_reduce(&mut self, op: Op, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.check_failed(op)?;
        let deadline = Instant::now() + self.config.deadline;
        let (n, me, len) = (self.world, self.rank.0 as usize, data.len());
        let code = op_code(op);
        let chunk = |k: usize| (len * k / n)..(len * (k + 1) / n);
        let mut scratch = std::mem::take(&mut self.scratch);
        // Reduce-scatter: after step s, chunk (me - s - 1) holds ranks (me - s - 1 ..= me).
        for s in 0..n - 1 {
            let (send, recv) = (chunk((me + n - s) % n), chunk((me + 2 * n - s - 1) % n));
            scratch.clear();
            scratch.resize(recv.len(), 0.0);
            let sent = bytemuck::cast_slice(&data[send]);
            let got = bytemuck::cast_slice_mut(&mut scratch[..]);
            if let Err(e) = self.step(op, code, len, Some(sent), Some(got), deadline) {
                self.scratch = scratch;
                return Err(e);
            }
            // The chunk's running sum, in ring order from its first rank, plus mine (IEEE
            // addition is commutative, so `mine + partial` has the bits of `partial + mine`).
            for (x, partial) in data[recv].iter_mut().zip(&scratch) {
                *x += *partial;
            }
        }
        self.scratch = scratch;
        // All-gather: rank me owns chunk (me + 1); pass the reduced chunks around.
        for s in 0..n - 1 {
            let (send, recv) = (chunk((me + 1 + n - s) % n), chunk((me + n - s) % n));
            let (sent, got) = split_pair(data, send, recv);
            let (sent, got) = (bytemuck::cast_slice(sent), bytemuck::cast_slice_mut(got));
            self.step(op, code, len, Some(sent), Some(got), deadline)?;
        }
        Ok(())
    }
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges (either may be empty).
fn split_pair<T>(
    buf: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    if a.end <= b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        (&right[..a.end - a.start], &mut left[b])
    }
}

fn rank_of(r: usize) -> Rank {
    // A ring has at most a few thousand ranks.
    Rank(u32::try_from(r).unwrap_or(u32::MAX))
}

fn op_code(op: Op) -> u32 {
    match op {
        Op::AllReduce => 1,
        Op::AllGather => 2,
        Op::Broadcast => 3,
        Op::Barrier => 4,
        Op::Connect => 5,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Why a step failed, before it is named after an op and a rank.
#[derive(Debug)]
enum StepFailure {
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
    fn into_error(
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
fn transfer(
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

fn frame_header(code: u32, bytes: u32, total: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&code.to_le_bytes());
    h[4..8].copy_from_slice(&bytes.to_le_bytes());
    h[8..].copy_from_slice(&total.to_le_bytes());
    h
}

fn check_header(
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

fn hello(rank: usize, world: usize, token: &GroupToken) -> [u8; HELLO_BYTES] {
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
fn hello_ok(h: &[u8; HELLO_BYTES], from: usize, world: usize, token: &GroupToken) -> bool {
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
fn connect_links(
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

impl Collective for TcpRing {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let started = Instant::now();
        self.ring_all_reduce(Op::AllReduce, data)?;
        self.finish(started, data.len() * 4);
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        let started = Instant::now();
        self.check_failed(Op::AllGather)?;
        let (n, me, m) = (self.world, self.rank.0 as usize, input.len());
        if output.len() != m * n {
            return Err(CollectiveError::BadLength {
                op: Op::AllGather,
                len: output.len(),
                detail: format!("output must hold {} elements ({m} × {n} ranks)", m * n),
            });
        }
        let deadline = started + self.config.deadline;
        output[me * m..(me + 1) * m].copy_from_slice(input);
        let block = |k: usize| k * m..(k + 1) * m;
        for s in 0..n - 1 {
            let (send, recv) = (block((me + n - s) % n), block((me + 2 * n - s - 1) % n));
            let (sent, got) = split_pair(output, send, recv);
            let (sent, got) = (bytemuck::cast_slice(sent), bytemuck::cast_slice_mut(got));
            self.step(
                Op::AllGather,
                op_code(Op::AllGather),
                m,
                Some(sent),
                Some(got),
                deadline,
            )?;
        }
        self.finish(started, m * 4);
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [u8], root: Rank) -> Result<(), CollectiveError> {
        let started = Instant::now();
        self.check_failed(Op::Broadcast)?;
        if root.0 as usize >= self.world {
            return Err(CollectiveError::BadLength {
                op: Op::Broadcast,
                len: data.len(),
                detail: format!("root {root} is not a rank of a group of {}", self.world),
            });
        }
        let deadline = started + self.config.deadline;
        let code = op_code(Op::Broadcast) | (root.0 << 8);
        let (is_root, next_is_root) = (self.rank == root, self.next_rank() == root);
        // A chain from the root around the ring: receive a piece, forward it.
        let pieces = data.len().div_ceil(BROADCAST_PIECE_BYTES).max(1);
        let len = data.len();
        for i in 0..pieces {
            let at = i * BROADCAST_PIECE_BYTES;
            let piece = &mut data[at.min(len)..(at + BROADCAST_PIECE_BYTES).min(len)];
            if !is_root {
                self.step(Op::Broadcast, code, len, None, Some(piece), deadline)?;
            }
            if !next_is_root {
                self.step(Op::Broadcast, code, len, Some(piece), None, deadline)?;
            }
        }
        self.finish(started, if is_root { len } else { 0 });
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let started = Instant::now();
        self.ring_all_reduce(Op::Barrier, &mut [0.0])?;
        self.finish(started, 0);
        Ok(())
    }

    fn stats(&self) -> CollectiveStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_pair_borrows_both_ranges() {
        let mut buf = [0, 1, 2, 3, 4, 5];
        let (a, b) = split_pair(&mut buf, 4..6, 0..2);
        assert_eq!(a, &[4, 5]);
        b.copy_from_slice(&[9, 9]);
        let (a, b) = split_pair(&mut buf, 0..2, 3..4);
        assert_eq!(a, &[9, 9]);
        assert_eq!(b, &mut [3]);
        // Empty ranges, as when a payload is shorter than the world size.
        let (a, b) = split_pair(&mut buf, 0..0, 0..1);
        assert_eq!((a.len(), b.len()), (0, 1));
        let (a, b) = split_pair(&mut buf, 1..2, 1..1);
        assert_eq!((a, b.len()), (&[9][..], 0));
    }

    #[test]
    fn hellos_check_rank_world_and_token() {
        let token = GroupToken([7; 32]);
        let h = hello(2, 4, &token);
        assert!(hello_ok(&h, 2, 4, &token));
        assert!(!hello_ok(&h, 1, 4, &token));
        assert!(!hello_ok(&h, 2, 3, &token));
        assert!(!hello_ok(&h, 2, 4, &GroupToken([8; 32])));
    }

    #[test]
    fn frame_headers_detect_mismatch_and_abort() {
        let h = frame_header(1, 40, 10);
        assert!(check_header(&h, 1, 40, 10).is_ok());
        assert!(matches!(
            check_header(&h, 2, 40, 10),
            Err(StepFailure::Mismatch { .. })
        ));
        let abort = frame_header(ABORT_FLAG, 0, (3 << 16) | 1);
        assert!(matches!(
            check_header(&abort, 1, 40, 10),
            Err(StepFailure::Aborted { by: 3, missing: 1 })
        ));
    }
}
