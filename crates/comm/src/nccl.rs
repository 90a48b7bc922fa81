//! NCCL between the ranks of a GPU group (cudarc's bindings, loaded at run time: no build
//! needs NCCL). One communicator per group and epoch, owned by the compute thread that
//! made it.
//!
//! Every collective is enqueued on the communicator's stream, then waited for by polling
//! an event against the group's deadline. A collective still running at its deadline
//! aborts the communicator (`ncclCommAbort`, which cudarc runs when the `Comm` is dropped)
//! and reports this rank, so a dead or stalled peer fails the epoch instead of hanging the
//! shard; an aborted group refuses every later call.
//!
//! The unique id (128 bytes) is made by rank 0, whose host runs NCCL's bootstrap root, and
//! reaches the other ranks over the coordinator's mutual-TLS control channel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use tessera_topology::Rank;

use crate::collective::{Collective, CollectiveError, CollectiveStats, Op};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// How long the first collective of a new group may take (NCCL connects then).
pub const JOIN_DEADLINE: Duration = Duration::from_secs(60);

/// How often a waiting collective looks at its stream.
const POLL: Duration = Duration::from_micros(20);

/// Why an NCCL group failed.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error(
        "NCCL was not found: libnccl.so must be on the library path (a link to the CUDA \
         installation's libnccl.so.2 will do; scripts/gpu-check.sh makes one)"
    )]
    NoLibrary,
    #[error("rank {rank}: {op}: {message}")]
    Nccl {
        rank: Rank,
        op: &'static str,
        message: String,
    },
    #[error(
        "rank {rank}: {op} did not complete within {waited_ms} ms (a peer is dead or \
         stalled); the communicator was aborted"
    )]
    Deadline {
        rank: Rank,
        op: &'static str,
        waited_ms: u64,
    },
    #[error("rank {rank}: the communicator was aborted by an earlier failure")]
    Aborted { rank: Rank },
    #[error("rank {rank}: {op}: {detail}")]
    BadLength {
        rank: Rank,
        op: &'static str,
        detail: String,
    },
}

/// Whether libnccl can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// A fresh unique id, made on rank 0's host (it names that host's bootstrap root).
pub fn unique_id() -> Result<[u8; ID_BYTES], NcclError> {
    if !nccl_present() {
        return Err(NcclError::NoLibrary);
    }
    let id = Id::new().map_err(|e| NcclError::Nccl {
        rank: Rank(0),
        op: "ncclGetUniqueId",
        message: format!("{e:?}"),
    })?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's communicator of a group, with the deadline of its collectives.
#[derive(Debug)]
pub struct NcclGroup {
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    rank: Rank,
    world: usize,
    deadline: Duration,
    stats: CollectiveStats,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `&mut
// self` on every operation makes the calls exclusive, so moving the group to another
// thread (the `Collective` bound) is sound. cudarc leaves `Comm` !Send only because it
// holds a raw pointer.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// Joins the group of `world` ranks that `id` names, as `rank`, on `stream`. Blocks
    /// until every rank has joined (NCCL's initialization has no timeout of its own: a
    /// shard runs this on a thread of its own, see `tessera_shard`'s `assign`), then runs
    /// one all-reduce under [`JOIN_DEADLINE`], so that NCCL's connections, set up at the
    /// first collective, are in place before the group's deadline applies.
    pub fn join(
        stream: Arc<CudaStream>,
        rank: Rank,
        world: usize,
        id: &[u8; ID_BYTES],
        deadline: Duration,
    ) -> Result<NcclGroup, NcclError> {
        if !nccl_present() {
            return Err(NcclError::NoLibrary);
        }
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm =
            Comm::from_rank(Arc::clone(&stream), rank.0 as usize, world, id).map_err(|e| {
                NcclError::Nccl {
                    rank,
                    op: "ncclCommInitRank",
                    message: format!("{e:?}"),
                }
            })?;
        let mut group = NcclGroup {
            comm: Some(comm),
            stream,
            rank,
            world,
            deadline: deadline.max(JOIN_DEADLINE),
            stats: CollectiveStats::default(),
        };
        let mut one = group
            .stream
            .clone_htod(&[0.0f32])
            .map_err(|e| NcclError::Nccl {
                rank,
                op: "join",
                message: e.to_string(),
            })?;
        group.all_reduce_sum(&mut one)?;
        group.deadline = deadline;
        group.stats = CollectiveStats::default();
        Ok(group)
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Sums `buf` over the ranks, in place.
    pub fn all_reduce_sum(&mut self, buf: &mut CudaSlice<f32>) -> Result<(), NcclError> {
        self.counted(buf.len() * 4, |g| {
            let rank = g.rank;
            let comm = g.comm.as_ref().ok_or(NcclError::Aborted { rank })?;
            comm.all_reduce_in_place(buf, &ReduceOp::Sum)
                .map_err(|e| nccl_error(rank, "all-reduce", e))?;
            g.wait("all-reduce")
        })
    }

    /// Every rank's `input`, in rank order, into `output` (world × input's length).
    pub fn all_gather(
        &mut self,
        input: &CudaSlice<f32>,
        output: &mut CudaSlice<f32>,
    ) -> Result<(), NcclError> {
        let rank = self.rank;
        if output.len() != input.len() * self.world {
            return Err(NcclError::BadLength {
                rank,
                op: "all-gather",
                detail: format!(
                    "output holds {} values, not {} ranks × {}",
                    output.len(),
                    self.world,
                    input.len()
                ),
            });
        }
        self.counted(input.len() * 4, |g| {
            let comm = g.comm.as_ref().ok_or(NcclError::Aborted { rank })?;
            comm.all_gather(input, output)
                .map_err(|e| nccl_error(rank, "all-gather", e))?;
            g.wait("all-gather")
        })
    }

    /// `root`'s `buf` onto every rank, in place.
    pub fn broadcast<T: NcclType>(
        &mut self,
        buf: &mut CudaSlice<T>,
        root: Rank,
    ) -> Result<(), NcclError> {
        self.counted(buf.len() * size_of::<T>(), |g| {
            let rank = g.rank;
            let comm = g.comm.as_ref().ok_or(NcclError::Aborted { rank })?;
            comm.broadcast_in_place(buf, root.0 as i32)
                .map_err(|e| nccl_error(rank, "broadcast", e))?;
            g.wait("broadcast")
        })
    }

    /// Waits for the stream's work so far, aborting the communicator at the deadline.
    fn wait(&mut self, op: &'static str) -> Result<(), NcclError> {
        let rank = self.rank;
        let driver = |e: cudarc::driver::DriverError| NcclError::Nccl {
            rank,
            op,
            message: e.to_string(),
        };
        let done = self.stream.record_event(None).map_err(driver)?;
        let started = Instant::now();
        loop {
            if done.try_is_complete().map_err(driver)? {
                return Ok(());
            }
            if started.elapsed() >= self.deadline {
                // Dropping the communicator aborts it: the stalled kernel returns.
                self.comm = None;
                return Err(NcclError::Deadline {
                    rank,
                    op,
                    waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                });
            }
            std::thread::sleep(POLL);
        }
    }
}

fn nccl_error(rank: Rank, op: &'static str, e: cudarc::nccl::result::NcclError) -> NcclError {
    NcclError::Nccl {
        rank,
        op,
        message: format!("{e:?}"),
    }
}

impl NcclGroup {
    /// Runs `f`, counting one call of `bytes` and its time.
    fn counted<R>(&mut self, bytes: usize, f: impl FnOnce(&mut Self) -> R) -> R {
        let started = Instant::now();
        let out = f(self);
        self.stats.calls += 1;
        self.stats.bytes += bytes as u64;
        self.stats.time += started.elapsed();
        out
    }

    fn upload<T: DeviceRepr>(&self, op: Op, host: &[T]) -> Result<CudaSlice<T>, CollectiveError> {
        self.stream
            .clone_htod(host)
            .map_err(|e| CollectiveError::Io {
                op,
                message: format!("rank {}: copying to the device: {e}", self.rank),
            })
    }

    fn download<T: DeviceRepr>(
        &self,
        op: Op,
        dev: &CudaSlice<T>,
        host: &mut [T],
    ) -> Result<(), CollectiveError> {
        self.stream
            .memcpy_dtoh(dev, host)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| CollectiveError::Io {
                op,
                message: format!("rank {}: copying to the host: {e}", self.rank),
            })
    }
}

impl NcclError {
    /// This failure as the collectives report it (NCCL cannot tell which peer is missing:
    /// the message names this rank and the operation).
    pub fn in_op(self, op: Op) -> CollectiveError {
        CollectiveError::Io {
            op,
            message: self.to_string(),
        }
    }
}

fn collective_error(op: Op, e: NcclError) -> CollectiveError {
    e.in_op(op)
}

/// The host-memory collective over NCCL: each call copies its buffer to the device, runs
/// the NCCL operation and copies the result back. The model's device path calls
/// [`NcclGroup`]'s own methods on device buffers instead ([`Collective::nccl`]).
impl Collective for NcclGroup {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        // Every rank passes the same length: all skip an empty call alike (a device
        // allocation of nothing is an error).
        if data.is_empty() {
            return Ok(());
        }
        let op = Op::AllReduce;
        let mut dev = self.upload(op, data)?;
        NcclGroup::all_reduce_sum(self, &mut dev).map_err(|e| collective_error(op, e))?;
        self.download(op, &dev, data)
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        if output.len() != input.len() * self.world {
            return Err(CollectiveError::BadLength {
                op: Op::AllGather,
                len: output.len(),
                detail: format!("{} ranks × {} values", self.world, input.len()),
            });
        }
        if input.is_empty() {
            return Ok(());
        }
        let op = Op::AllGather;
        let dev_in = self.upload(op, input)?;
        let mut dev_out = self.upload(op, output)?;
        NcclGroup::all_gather(self, &dev_in, &mut dev_out).map_err(|e| collective_error(op, e))?;
        self.download(op, &dev_out, output)
    }

    fn broadcast(&mut self, data: &mut [u8], root: Rank) -> Result<(), CollectiveError> {
        if data.is_empty() {
            return Ok(());
        }
        let op = Op::Broadcast;
        let mut dev = self.upload(op, data)?;
        NcclGroup::broadcast(self, &mut dev, root).map_err(|e| collective_error(op, e))?;
        self.download(op, &dev, data)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let op = Op::Barrier;
        let mut one = [0.0f32];
        let mut dev = self.upload(op, &one)?;
        NcclGroup::all_reduce_sum(self, &mut dev).map_err(|e| collective_error(op, e))?;
        self.download(op, &dev, &mut one)
    }

    fn stats(&self) -> CollectiveStats {
        self.stats
    }
}
