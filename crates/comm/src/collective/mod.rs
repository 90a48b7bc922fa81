//! Collectives between the ranks of one tensor-parallel group.
//!
//! [`Collective`] is the one interface the model's forward pass uses; a communicator is
//! owned by one thread (the shard's compute thread) and every call is blocking. Backends:
//! - [`Solo`]: a group of one (tp = 1); every operation is the identity.
//! - [`shm::ShmCollective`]: ranks on one host exchange through a shared-memory segment and
//!   wait on futexes (spin briefly, then sleep), so a waiting rank does not burn a core.
//! - [`tcp::TcpRing`]: ranks on any hosts, a ring of TCP connections (reduce-scatter +
//!   all-gather). Each connection is authenticated by a challenge–response over fresh
//!   nonces keyed with the group's per-epoch [`GroupToken`], which never crosses the wire;
//!   payloads are not encrypted (as with NCCL).
//!
//! Every call has a deadline ([`CollectiveConfig::deadline`]). A call that misses it aborts
//! the communicator — later calls on any rank fail at once — and the error names the rank
//! that did not arrive. All ranks of a group must issue the same calls in the same order
//! with the same lengths; results are bit-identical on every rank (the shared-memory and
//! local backends add in rank order; the TCP ring reduces each chunk once, along the ring,
//! and copies the reduced bits to every rank).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_topology::Rank;

pub mod connect;
pub mod local;
pub mod shm;
pub mod tcp;

/// A group's shared secret for one epoch: handed to each rank over the mutual-TLS control
/// channel, proven (never sent) when a TCP ring connection is made, written into the
/// private shared-memory segment of a one-host group, never logged.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupToken(pub [u8; 32]);

impl GroupToken {
    /// A fresh random token.
    pub fn random() -> GroupToken {
        use rand::TryRngCore;
        let mut bytes = [0u8; 32];
        // A machine without a working OS random source cannot run a cluster securely.
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .expect("the OS random source works");
        GroupToken(bytes)
    }

    /// Equality in time independent of where the tokens differ.
    pub fn matches(&self, other: &[u8]) -> bool {
        other.len() == self.0.len()
            && self
                .0
                .iter()
                .zip(other)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl fmt::Debug for GroupToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GroupToken(..)")
    }
}

/// Settings shared by every backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveConfig {
    /// How long one call may wait for the other ranks before it aborts the communicator.
    pub deadline: Duration,
    /// How long a waiting rank spins before it sleeps (futex or socket read). A few
    /// microseconds covers ranks that arrive together without holding a core when they
    /// do not.
    pub spin: Duration,
}

impl Default for CollectiveConfig {
    fn default() -> CollectiveConfig {
        CollectiveConfig {
            // Between two collectives of one step lies one layer's compute (milliseconds);
            // the first collective of a step also waits for the slowest rank to receive the
            // plan. Two seconds leaves a wide margin and still reports a dead rank quickly.
            deadline: Duration::from_secs(2),
            spin: Duration::from_micros(20),
        }
    }
}

/// Which operation a collective error happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    AllReduce,
    AllGather,
    Broadcast,
    Barrier,
    Connect,
}

impl Op {
    /// The operation's number in the host backends' frames and round headers, where ranks
    /// check that they all made the same call.
    pub(crate) fn code(self) -> u32 {
        match self {
            Op::AllReduce => 1,
            Op::AllGather => 2,
            Op::Broadcast => 3,
            Op::Barrier => 4,
            Op::Connect => 5,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::AllReduce => "all-reduce",
            Op::AllGather => "all-gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::Connect => "connect",
        })
    }
}

/// Why a collective call failed. After any of these the communicator is unusable.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Serialize, Deserialize)]
pub enum CollectiveError {
    #[error("{op}: rank {missing} did not arrive within {waited_ms} ms")]
    Timeout {
        op: Op,
        missing: Rank,
        waited_ms: u64,
    },
    #[error("{op}: rank {peer} closed its connection")]
    PeerClosed { op: Op, peer: Rank },
    /// Another rank saw the failure first; `missing` is the rank it blamed.
    #[error("{op}: the group was aborted by rank {by}: {reason}")]
    Aborted {
        op: Op,
        by: Rank,
        missing: Rank,
        reason: String,
    },
    /// No connection (or segment) that claimed to be rank `peer` proved the group token by
    /// the deadline; `reason` is why the last one was refused.
    #[error("{op}: rank {peer} was not authenticated: {reason}")]
    Unauthenticated { op: Op, peer: Rank, reason: String },
    #[error("{op}: buffer of {len} elements does not fit ({detail})")]
    BadLength { op: Op, len: usize, detail: String },
    #[error("{op}: {message}")]
    Io { op: Op, message: String },
}

impl CollectiveError {
    /// The rank to blame, when one is known.
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            CollectiveError::Timeout { missing, .. } => Some(*missing),
            CollectiveError::PeerClosed { peer, .. } => Some(*peer),
            CollectiveError::Aborted { missing, .. } => Some(*missing),
            _ => None,
        }
    }
}

/// Counters a backend keeps, for the step timings and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CollectiveStats {
    pub calls: u64,
    /// Payload bytes this rank contributed.
    pub bytes: u64,
    /// Wall time spent inside collective calls (including waiting for other ranks).
    pub time: Duration,
}

/// The operations a tensor-parallel forward pass needs. Blocking; one owner thread.
pub trait Collective: Send + fmt::Debug {
    fn rank(&self) -> Rank;
    fn world_size(&self) -> usize;

    /// Element-wise sum over all ranks, in place; every rank gets the same bits.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError>;

    /// Concatenates every rank's `input` (all of one length) in rank order into `output`
    /// (`input.len() * world_size` elements).
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError>;

    /// Element-wise sum over all ranks in f64, in place: every rank gathers every rank's
    /// values and adds them in rank order, so every rank gets the same bits. The values
    /// travel as their bits in two f32 slots each (an all-gather copies without arithmetic).
    /// For partial sums that are rounded to f32 only once added, so that the total is the
    /// same whatever the number of ranks (`fast`'s row-parallel projections).
    fn all_reduce_sum_f64(&mut self, data: &mut [f64]) -> Result<(), CollectiveError> {
        let ranks = self.world_size();
        if ranks == 1 {
            return Ok(());
        }
        let halves: Vec<f32> = (data.iter())
            .flat_map(|v| {
                let bits = v.to_bits();
                [bits as u32, (bits >> 32) as u32].map(f32::from_bits)
            })
            .collect();
        let mut all = vec![0.0; halves.len() * ranks];
        self.all_gather(&halves, &mut all)?;
        for (i, total) in data.iter_mut().enumerate() {
            *total = (all.chunks_exact(halves.len()))
                .map(|rank| {
                    let [lo, hi] = [rank[2 * i], rank[2 * i + 1]].map(|h| u64::from(h.to_bits()));
                    f64::from_bits(lo | hi << 32)
                })
                .fold(0.0, |sum, v| sum + v);
        }
        Ok(())
    }

    /// Copies `root`'s `data` to every rank (all ranks pass the same length).
    fn broadcast(&mut self, data: &mut [u8], root: Rank) -> Result<(), CollectiveError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CollectiveError>;

    /// Counters since creation.
    fn stats(&self) -> CollectiveStats;
}

/// The group of one: tensor parallelism 1. Every operation is the identity.
#[derive(Debug, Default)]
pub struct Solo {
    stats: CollectiveStats,
}

impl Collective for Solo {
    fn rank(&self) -> Rank {
        Rank(0)
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&mut self, _data: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        if output.len() != input.len() {
            return Err(CollectiveError::BadLength {
                op: Op::AllGather,
                len: output.len(),
                detail: format!("output must hold {} elements", input.len()),
            });
        }
        output.copy_from_slice(input);
        Ok(())
    }

    fn broadcast(&mut self, _data: &mut [u8], _root: Rank) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn stats(&self) -> CollectiveStats {
        self.stats
    }
}
