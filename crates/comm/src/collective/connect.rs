//! [`connect`]: builds the communicator a [`Bootstrap`] describes.
//!
//! Called by the shard on its compute thread once it has its assignment; the returned
//! communicator stays on that thread.

use tessera_topology::Rank;

use super::shm::ShmCollective;
use super::tcp::TcpRing;
use super::{Collective, CollectiveConfig, CollectiveError, GroupToken, Op, Solo};
use crate::proto::Bootstrap;

/// Payload capacity per rank of a shared-memory group, in f32 elements: 1 Mi elements,
/// 4 MiB. It holds one hidden-state all-reduce of a batch of 128 tokens × 8192 hidden
/// (the largest Llama-family width) in one round; larger payloads are cut into chunks of
/// this size. The segment holds two buffers per rank, so 8 MiB × world size of `/dev/shm`
/// (pages are only touched as payloads use them).
pub const SHM_CAPACITY_ELEMS: usize = 1 << 20;

/// Joins the group described by `bootstrap` as `rank` of `world_size`.
pub fn connect(
    bootstrap: &Bootstrap,
    rank: Rank,
    world_size: usize,
    token: &GroupToken,
    config: CollectiveConfig,
) -> Result<Box<dyn Collective>, CollectiveError> {
    match bootstrap {
        Bootstrap::Solo if world_size == 1 && rank == Rank(0) => Ok(Box::new(Solo::default())),
        Bootstrap::Solo => Err(CollectiveError::BadLength {
            op: Op::Connect,
            len: world_size,
            detail: format!("a solo bootstrap needs world size 1, got rank {rank} of {world_size}"),
        }),
        Bootstrap::Shm { name } => Ok(Box::new(ShmCollective::join(
            name,
            rank,
            world_size,
            token,
            SHM_CAPACITY_ELEMS,
            config,
        )?)),
        Bootstrap::Tcp { peers } if peers.len() == world_size => {
            Ok(Box::new(TcpRing::connect(rank, peers, token, config)?))
        }
        Bootstrap::Nccl => Err(CollectiveError::Io {
            op: Op::Connect,
            message: "an NCCL group is joined on the device, with the id rank 0 sends \
                      (tessera_comm::nccl::NcclGroup::join)"
                .into(),
        }),
        Bootstrap::Tcp { peers } => Err(CollectiveError::BadLength {
            op: Op::Connect,
            len: peers.len(),
            detail: format!(
                "{} peer addresses for a world size of {world_size}",
                peers.len()
            ),
        }),
    }
}
