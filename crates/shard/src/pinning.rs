//! Which cores a cpu shard's compute threads run on: every cpu shard of the topology on one
//! host takes the next `threads` of the cores this process may use, in the topology's order
//! (groups, then ranks), when the host's shards ask for no more threads than there are
//! cores. Then no two ranks of a group share a core, and the collective's spinning peers
//! never wait behind each other's compute. With more threads than cores, nothing is pinned.

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;
use tessera_topology::{Rank, Topology};

/// Where one shard's compute threads go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pinning {
    /// Thread `i` on core `cores[i]`.
    Cores(Vec<usize>),
    /// Not pinned: the host's cpu shards ask for `threads`, this process may use `cores`.
    Oversubscribed { threads: usize, cores: usize },
    /// A cuda shard, or one missing from the topology: its threads stay where they are.
    None,
}

/// The cores of shard `rank` of group `group`, out of `allowed` (this process's affinity,
/// in order).
pub fn plan(topology: &Topology, group: &str, rank: Rank, allowed: &[usize]) -> Pinning {
    let Some(me) = (topology.group(group)).and_then(|g| g.shards.get(rank.0 as usize)) else {
        return Pinning::None;
    };
    if me.device.is_cuda() {
        return Pinning::None;
    }
    let on_host = (topology.groups.iter())
        .flat_map(|g| g.shards.iter().map(move |s| (g.name.as_str(), s)))
        .filter(|(_, s)| s.host == me.host && !s.device.is_cuda());
    let mut offset = None;
    let mut threads = 0;
    for (name, shard) in on_host {
        if name == group && shard.rank == rank {
            offset = Some(threads);
        }
        threads += shard.threads.max(1);
    }
    match offset {
        Some(_) if threads > allowed.len() => Pinning::Oversubscribed {
            threads,
            cores: allowed.len(),
        },
        Some(at) => Pinning::Cores(allowed[at..at + me.threads.max(1)].to_vec()),
        None => Pinning::None,
    }
}

/// The cores this process may run on, in order.
pub fn allowed_cores() -> std::io::Result<Vec<usize>> {
    let set = sched_getaffinity(Pid::from_raw(0))?;
    Ok((0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

/// Runs the calling thread on `core` only.
pub fn pin_current_thread(core: usize) -> std::io::Result<()> {
    let mut set = CpuSet::new();
    set.set(core)?;
    Ok(sched_setaffinity(Pid::from_raw(0), &set)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(text: &str) -> Topology {
        Topology::parse(text, std::path::Path::new("/t.toml")).expect("a topology")
    }

    /// Group g: ranks 0 (2 threads) and 1 (1) on host a; group h: rank 0 (4) on host b,
    /// rank 1 (1) on host a.
    const TWO_GROUPS: &str = r#"
[[coordinator]]
id = 1
host = "a"
quic = "127.0.0.1:7000"
http = "127.0.0.1:8000"

[[host]]
name = "a"
address = "127.0.0.1"

[[host]]
name = "b"
address = "127.0.0.2"

[[model]]
name = "m"
path = "/m"

[[group]]
name = "g"
model = "m"
tp = 2
collective = "tcp"
shard = [
  { rank = 0, host = "a", device = "cpu", threads = 2, port = 9000, kv_memory = "1MiB" },
  { rank = 1, host = "a", device = "cpu", threads = 1, port = 9001, kv_memory = "1MiB" },
]

[[group]]
name = "h"
model = "m"
tp = 2
collective = "tcp"
shard = [
  { rank = 0, host = "b", device = "cpu", threads = 4, port = 9000, kv_memory = "1MiB" },
  { rank = 1, host = "a", device = "cpu", threads = 1, port = 9002, kv_memory = "1MiB" },
]
"#;

    #[test]
    fn each_cpu_shard_of_a_host_takes_the_next_cores_in_topology_order() {
        let t = topology(TWO_GROUPS);
        let allowed = [0, 1, 2, 3, 6, 7];
        assert_eq!(plan(&t, "g", Rank(0), &allowed), Pinning::Cores(vec![0, 1]));
        assert_eq!(plan(&t, "g", Rank(1), &allowed), Pinning::Cores(vec![2]));
        assert_eq!(plan(&t, "h", Rank(1), &allowed), Pinning::Cores(vec![3]));
        // Host b has its one shard: the first 4 cores of its own process.
        assert_eq!(
            plan(&t, "h", Rank(0), &allowed),
            Pinning::Cores(vec![0, 1, 2, 3])
        );
        assert_eq!(plan(&t, "x", Rank(0), &allowed), Pinning::None);
        assert_eq!(plan(&t, "g", Rank(2), &allowed), Pinning::None);
    }

    #[test]
    fn more_threads_than_cores_pins_nothing() {
        let t = topology(TWO_GROUPS);
        let oversubscribed = Pinning::Oversubscribed {
            threads: 4,
            cores: 3,
        };
        assert_eq!(plan(&t, "g", Rank(1), &[0, 1, 2]), oversubscribed);
        assert_eq!(
            plan(&t, "h", Rank(0), &[0, 1]),
            Pinning::Oversubscribed {
                threads: 4,
                cores: 2
            }
        );
    }

    #[test]
    fn this_process_may_run_somewhere_and_can_be_pinned_there() {
        let allowed = allowed_cores().unwrap();
        assert!(!allowed.is_empty());
        let core = allowed[allowed.len() - 1];
        std::thread::spawn(move || {
            pin_current_thread(core).unwrap();
            assert_eq!(allowed_cores().unwrap(), vec![core]);
        })
        .join()
        .unwrap();
        assert!(pin_current_thread(1 << 20).is_err());
    }
}
