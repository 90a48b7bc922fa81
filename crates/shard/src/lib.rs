//! The shard process (`tessera-shard`): one rank of a tensor-parallel group.
//!
//! - [`control`]: the async driver — one QUIC connection (mutual TLS) to the coordinator:
//!   register, receive the assignment and step plans, send results.
//! - [`worker`]: the compute thread — loads this rank's slice of the weights, joins the
//!   group's collective for each epoch (NCCL in two steps: rank 0's unique id travels
//!   through the coordinator), sizes or carries the KV cache, runs plans.
//! - [`runner`]: the step itself ([`runner::StepRunner`]) — sequences, one batched forward
//!   pass per step, rank 0's sampling shared through the collective.
//! - [`blocks`]: the KV block allocator — reference counts, free list, prefix cache with
//!   LRU eviction (a pure core).
//! - [`stats`]: the process's memory and (through NVML) its GPU, sent every few seconds.
//!
//! Feature `cuda` (on by default): shards on `cuda:N` devices and NCCL groups. Without it
//! the shard refuses a `cuda:N` device at start.
//!
//! Lifecycle: `Register` → `Assign` (load, join, `Ready`) → `Step`/`StepDone`… A failure
//! sends `Failed` naming the rank to blame and waits, weights kept, for a new `Assign`.

#![forbid(unsafe_code)]

pub mod blocks;
pub mod control;
mod error;
pub mod pinning;
pub mod runner;
pub mod stats;
pub mod worker;

pub use error::ShardError;

use tessera_topology::Device;

/// Refuses a device that this build cannot run: a `cuda:N` device needs the `cuda`
/// feature. The binary passes `cfg!(feature = "cuda")`; a parameter, so that the default
/// build tests the answer of a build without it.
pub fn check_device_built(device: Device, cuda_built: bool) -> Result<(), String> {
    if device.is_cuda() && !cuda_built {
        return Err(format!(
            "{device}: this tessera-shard is built without CUDA support (the `cuda` \
             feature); build it with the default features"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_without_cuda_refuses_a_cuda_device_and_says_how_to_get_one() {
        let err = check_device_built(Device::Cuda(1), false).unwrap_err();
        assert!(err.starts_with("cuda:1: "), "{err}");
        assert!(err.contains("built without CUDA support"), "{err}");
        assert!(err.contains("default features"), "{err}");
        assert_eq!(check_device_built(Device::Cuda(1), true), Ok(()));
        assert_eq!(check_device_built(Device::Cpu, false), Ok(()));
    }
}
