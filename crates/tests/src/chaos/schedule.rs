//! The fault schedule of a chaos run: drawn from a seed alone, so that one seed gives the
//! same faults, targets, times and durations on every machine. What a fault's target is at
//! the time (which peer leads) is found when it is applied.

use std::fmt;
use std::time::Duration;

/// SplitMix64: a tiny generator whose output depends only on the seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A number in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + unit * (hi - lo)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.range(0.0, 1.0) < p
    }
}

/// Which coordinator peer a fault hits: the leader, or a follower (the `pick`-th of those
/// that follow at the time, modulo their number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower { pick: u64 },
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Leader => write!(f, "the leader"),
            Role::Follower { pick } => write!(f, "follower #{}", pick % 2),
        }
    }
}

/// One kind of fault and its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` a coordinator peer; it restarts from its data dir after the hold.
    KillPeer(Role),
    /// SIGSTOP a coordinator peer for the hold, then SIGCONT.
    StopPeer(Role),
    /// Cut a coordinator peer's network link for the hold (network namespaces).
    PartitionPeer(Role),
    /// Every Raft persist of a peer sleeps 1 s for the hold (the `failpoints` feature).
    DiskStall(Role),
    /// `kill -9` the shard of group `n`; `tessera up` restarts it.
    KillShard(usize),
    /// SIGSTOP the shard of group `n` for the hold, then SIGCONT.
    StopShard(usize),
}

impl Fault {
    /// A short stable name, the ledger's key.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillPeer(Role::Leader) => "kill-leader",
            Fault::KillPeer(_) => "kill-follower",
            Fault::StopPeer(_) => "sigstop-peer",
            Fault::PartitionPeer(_) => "partition-peer",
            Fault::DiskStall(_) => "disk-stall",
            Fault::KillShard(_) => "kill-shard",
            Fault::StopShard(_) => "sigstop-shard",
        }
    }
}

/// A fault at a time after the load starts, held for a while.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
    pub hold: Duration,
}

impl fmt::Display for Planned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.at.as_secs_f64();
        let hold = self.hold.as_secs_f64();
        write!(f, "t+{at:6.1}s  ")?;
        match self.fault {
            Fault::KillPeer(role) => write!(f, "kill -9 {role}; restart it {hold:.1} s later"),
            Fault::StopPeer(role) => write!(f, "SIGSTOP {role} for {hold:.1} s"),
            Fault::PartitionPeer(role) => write!(f, "cut {role} off the network for {hold:.1} s"),
            Fault::DiskStall(role) => {
                write!(f, "stall {role}'s disk (1 s a persist) for {hold:.1} s")
            }
            Fault::KillShard(g) => {
                write!(f, "kill -9 the shard of group {g}; tessera up restarts it")
            }
            Fault::StopShard(g) => write!(f, "SIGSTOP the shard of group {g} for {hold:.1} s"),
        }
    }
}

/// The faults of a run, one at a time (a Raft group of three survives one), each followed
/// by a quiet gap.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub seed: u64,
    pub seconds: u64,
    pub faults: Vec<Planned>,
}

impl Schedule {
    /// The schedule of `seed` for a run of `seconds` over `groups` shard groups: the first
    /// fault after 10 s, 6 to 14 s of quiet after each, none holding past 10 s before the
    /// end.
    pub fn new(seed: u64, seconds: u64, groups: usize) -> Schedule {
        let mut rng = Rng::new(seed);
        let mut faults = Vec::new();
        let mut t = 10.0;
        loop {
            let role = |rng: &mut Rng| {
                if rng.chance(0.5) {
                    Role::Leader
                } else {
                    Role::Follower { pick: rng.below(2) }
                }
            };
            // Weights: leader kills most often, the rest in turn.
            let (fault, hold) = match rng.below(13) {
                0..=2 => (Fault::KillPeer(Role::Leader), rng.range(1.0, 4.0)),
                3 => (
                    Fault::KillPeer(Role::Follower { pick: rng.below(2) }),
                    rng.range(1.0, 4.0),
                ),
                4 | 5 => (Fault::StopPeer(role(&mut rng)), rng.range(2.0, 6.0)),
                6 | 7 => (Fault::PartitionPeer(role(&mut rng)), rng.range(3.0, 8.0)),
                8 | 9 => (Fault::DiskStall(role(&mut rng)), rng.range(3.0, 6.0)),
                10 | 11 => (Fault::KillShard(rng.below(groups as u64) as usize), 0.0),
                _ => (
                    Fault::StopShard(rng.below(groups as u64) as usize),
                    rng.range(2.0, 5.0),
                ),
            };
            if t + hold + 10.0 > seconds as f64 {
                break;
            }
            faults.push(Planned {
                at: Duration::from_secs_f64(t),
                fault,
                hold: Duration::from_secs_f64(hold),
            });
            t += hold + rng.range(6.0, 14.0);
        }
        Schedule {
            seed,
            seconds,
            faults,
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos schedule: seed {} (TESSERA_CHAOS_SEED), {} s, {} faults",
            self.seed,
            self.seconds,
            self.faults.len()
        )?;
        for planned in &self.faults {
            writeln!(f, "  {planned}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_gives_one_schedule() {
        let a = Schedule::new(42, 600, 2);
        assert_eq!(a, Schedule::new(42, 600, 2));
        assert_ne!(a, Schedule::new(43, 600, 2));
        assert!(a.faults.len() > 20, "{a}");
        let kinds: std::collections::BTreeSet<&str> =
            a.faults.iter().map(|p| p.fault.kind()).collect();
        assert_eq!(kinds.len(), 7, "every kind in ten minutes: {kinds:?}");
        assert!(a.faults.windows(2).all(|w| w[0].at + w[0].hold < w[1].at));
    }
}
