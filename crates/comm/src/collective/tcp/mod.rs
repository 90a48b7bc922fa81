//! [`TcpRing`]: ranks on any hosts joined in a ring of TCP connections; rank `r` sends to
//! `r + 1` and receives from `r - 1` (mod world size).
//!
//! This module holds the ring and its collective operations. Joining the ring (dialing the
//! next rank, accepting the previous one among any other connections) is in `join`; the
//! handshake of one connection in `handshake`; its hello and the proofs of the group token,
//! without I/O, in `hello`; the frames each step sends, the abort frame, and the
//! interleaved blocking I/O of one step in `frame`. [`fuzzing`] exposes the decoders to the
//! fuzz targets. The token never crosses the wire, but payloads are neither encrypted nor
//! authenticated once the ring is joined (as with NCCL): the ring belongs on the cluster's
//! private network.
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

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use tessera_topology::Rank;

use super::{Collective, CollectiveConfig, CollectiveError, CollectiveStats, GroupToken, Op};

mod frame;
pub mod fuzzing;
mod handshake;
mod hello;
mod join;
#[cfg(test)]
mod tests;

use frame::{abort_frame, transfer};
use join::connect_links;

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
                let frame = abort_frame(by, missing);
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
        let code = op.code();
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
                Op::AllGather.code(),
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
        let code = Op::Broadcast.code() | (root.0 << 8);
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
