//! A group whose ranks are threads of one process: [`LocalGroup::new`] returns one
//! [`LocalCollective`] per rank, to be moved to that rank's thread.
//!
//! For tests of the tensor-parallel forward pass and for tp > 1 inside one process. The
//! semantics are those of every [`Collective`]: calls block until every rank has made the
//! same call, reductions add in rank order (so every rank gets the same bits), and a call
//! that waits past [`CollectiveConfig::deadline`] aborts the group with a
//! [`CollectiveError::Timeout`] naming the first rank that did not arrive; every later call
//! on any rank fails at once with [`CollectiveError::Aborted`].
//!
//! The exchange is one round at a time under a `Mutex`: each rank deposits its contribution
//! for the round; the last to arrive combines them, publishes the result, and wakes the
//! others on a `Condvar`. A rank cannot deposit for round `g + 1` before it has read the
//! result of round `g`, so one result slot suffices. Waiting ranks sleep on the condvar
//! (`spin` is not used: a condvar wake is already cheap next to a layer's compute).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tessera_topology::Rank;

use super::{Collective, CollectiveConfig, CollectiveError, CollectiveStats, Op};

/// Creates the ranks of an in-process group.
#[derive(Debug)]
pub struct LocalGroup;

impl LocalGroup {
    /// `world_size` communicators, rank `r` at index `r`.
    // A group is nothing but its ranks, each moved to its own thread; there is no group
    // value to return.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize, config: CollectiveConfig) -> Vec<LocalCollective> {
        let shared = Arc::new(Shared {
            world_size,
            config,
            state: Mutex::new(State {
                contributions: (0..world_size).map(|_| None).collect(),
                completed_rounds: 0,
                result: Arc::new(Payload::Empty),
                failure: None,
                closed: vec![false; world_size],
            }),
            wake: Condvar::new(),
        });
        (0..world_size)
            .map(|r| LocalCollective {
                rank: rank_of(r),
                shared: Arc::clone(&shared),
                rounds: 0,
                stats: CollectiveStats::default(),
            })
            .collect()
    }
}

/// One rank of a [`LocalGroup`]. Owned by that rank's thread.
#[derive(Debug)]
pub struct LocalCollective {
    rank: Rank,
    shared: Arc<Shared>,
    /// Rounds this rank has entered.
    rounds: u64,
    stats: CollectiveStats,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    config: CollectiveConfig,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug)]
struct State {
    /// This round's deposits, by rank.
    contributions: Vec<Option<Contribution>>,
    completed_rounds: u64,
    /// The result of the last completed round.
    result: Arc<Payload>,
    /// Set once; the group is unusable afterwards.
    failure: Option<Failure>,
    /// Ranks whose communicator was dropped.
    closed: Vec<bool>,
}

#[derive(Debug)]
struct Contribution {
    op: Op,
    /// Elements (f32 or bytes) the rank passed: must agree across ranks.
    len: usize,
    payload: Payload,
}

#[derive(Debug)]
enum Payload {
    Empty,
    F32(Vec<f32>),
    Bytes(Vec<u8>),
}

/// Why the group stopped, as every rank but the one that found it will report it.
#[derive(Clone, Debug)]
struct Failure {
    by: Rank,
    missing: Rank,
    reason: String,
}

fn rank_of(r: usize) -> Rank {
    // A group has at most a few hundred ranks.
    Rank(u32::try_from(r).unwrap_or(u32::MAX))
}

impl LocalCollective {
    /// Deposits `contribution`, waits for the round to complete and returns its result.
    fn exchange(&mut self, contribution: Contribution) -> Result<Arc<Payload>, CollectiveError> {
        let started = Instant::now();
        let (op, self_len) = (contribution.op, contribution.len);
        let shared = Arc::clone(&self.shared);
        let mut state = lock(&shared);
        if let Some(failure) = &state.failure {
            return Err(aborted(op, failure));
        }
        let me = self.rank.0 as usize;
        self.rounds += 1;
        let round = self.rounds;
        state.contributions[me] = Some(contribution);
        if state.contributions.iter().all(Option::is_some) {
            let deposits: Vec<Contribution> = state
                .contributions
                .iter_mut()
                .filter_map(Option::take)
                .collect();
            match combine(deposits) {
                Ok(result) => {
                    state.result = Arc::new(result);
                    state.completed_rounds = round;
                    shared.wake.notify_all();
                }
                Err(detail) => {
                    let error = CollectiveError::BadLength {
                        op,
                        len: self_len,
                        detail,
                    };
                    return Err(self.fail(&shared, &mut state, error));
                }
            }
        } else {
            state = self.wait_for(&shared, state, round, op, started)?;
        }
        let result = Arc::clone(&state.result);
        drop(state);
        self.stats.calls += 1;
        self.stats.time += started.elapsed();
        Ok(result)
    }

    /// Sleeps until round `round` completes, the group fails, or the deadline passes.
    fn wait_for<'a>(
        &self,
        shared: &'a Shared,
        mut state: MutexGuard<'a, State>,
        round: u64,
        op: Op,
        started: Instant,
    ) -> Result<MutexGuard<'a, State>, CollectiveError> {
        let deadline = started + shared.config.deadline;
        loop {
            if state.completed_rounds >= round {
                return Ok(state);
            }
            if let Some(failure) = &state.failure {
                return Err(aborted(op, failure));
            }
            let missing = (0..shared.world_size).find(|&r| state.contributions[r].is_none());
            if let Some(peer) = missing.filter(|&r| state.closed[r]) {
                let peer = rank_of(peer);
                return Err(self.fail(
                    shared,
                    &mut state,
                    CollectiveError::PeerClosed { op, peer },
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                let error = CollectiveError::Timeout {
                    op,
                    missing: rank_of(missing.unwrap_or(0)),
                    waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                };
                return Err(self.fail(shared, &mut state, error));
            }
            state = shared
                .wake
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Aborts the group on behalf of this rank, wakes the others, and returns `error`,
    /// which this rank reports itself.
    fn fail(&self, shared: &Shared, state: &mut State, error: CollectiveError) -> CollectiveError {
        state.failure = Some(Failure {
            by: self.rank,
            missing: error.culprit().unwrap_or(self.rank),
            reason: error.to_string(),
        });
        shared.wake.notify_all();
        error
    }
}

/// Combines one round's deposits (in rank order) into its result, or says why they do
/// not fit together.
fn combine(deposits: Vec<Contribution>) -> Result<Payload, String> {
    let first = &deposits[0];
    let (op, len) = (first.op, first.len);
    if let Some((r, other)) = deposits
        .iter()
        .enumerate()
        .find(|(_, c)| c.op != op || c.len != len)
    {
        return Err(format!(
            "rank 0 called {op} with {len} elements, rank {r} called {} with {}",
            other.op, other.len
        ));
    }
    Ok(match op {
        Op::AllReduce => {
            let mut parts = deposits.into_iter().map(|c| c.payload);
            let mut sum = match parts.next() {
                Some(Payload::F32(v)) => v,
                _ => Vec::new(),
            };
            for part in parts {
                if let Payload::F32(v) = part {
                    sum.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
                }
            }
            Payload::F32(sum)
        }
        Op::AllGather => {
            let mut all = Vec::with_capacity(len * deposits.len());
            for c in deposits {
                if let Payload::F32(v) = c.payload {
                    all.extend_from_slice(&v);
                }
            }
            Payload::F32(all)
        }
        Op::Broadcast => deposits
            .into_iter()
            .find_map(|c| match c.payload {
                Payload::Bytes(b) => Some(Payload::Bytes(b)),
                _ => None,
            })
            .unwrap_or(Payload::Empty),
        Op::Barrier | Op::Connect => Payload::Empty,
    })
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A rank that panicked while holding the lock left the state consistent: every update
    // under the lock is a plain assignment.
    shared
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn aborted(op: Op, failure: &Failure) -> CollectiveError {
    CollectiveError::Aborted {
        op,
        by: failure.by,
        missing: failure.missing,
        reason: failure.reason.clone(),
    }
}

impl Collective for LocalCollective {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.stats.bytes += (data.len() * 4) as u64;
        let result = self.exchange(Contribution {
            op: Op::AllReduce,
            len: data.len(),
            payload: Payload::F32(data.to_vec()),
        })?;
        if let Payload::F32(sum) = &*result {
            data.copy_from_slice(sum);
        }
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        let world = self.shared.world_size;
        if output.len() != input.len() * world {
            return Err(CollectiveError::BadLength {
                op: Op::AllGather,
                len: output.len(),
                detail: format!(
                    "output must hold {} elements ({} × {world} ranks)",
                    input.len() * world,
                    input.len()
                ),
            });
        }
        self.stats.bytes += (input.len() * 4) as u64;
        let result = self.exchange(Contribution {
            op: Op::AllGather,
            len: input.len(),
            payload: Payload::F32(input.to_vec()),
        })?;
        if let Payload::F32(all) = &*result {
            output.copy_from_slice(all);
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [u8], root: Rank) -> Result<(), CollectiveError> {
        if root.0 as usize >= self.shared.world_size {
            return Err(CollectiveError::BadLength {
                op: Op::Broadcast,
                len: data.len(),
                detail: format!(
                    "root {root} is not a rank of a group of {}",
                    self.shared.world_size
                ),
            });
        }
        let payload = if root == self.rank {
            self.stats.bytes += data.len() as u64;
            Payload::Bytes(data.to_vec())
        } else {
            Payload::Empty
        };
        let result = self.exchange(Contribution {
            op: Op::Broadcast,
            len: data.len(),
            payload,
        })?;
        if let Payload::Bytes(bytes) = &*result {
            data.copy_from_slice(bytes);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.exchange(Contribution {
            op: Op::Barrier,
            len: 0,
            payload: Payload::Empty,
        })
        .map(drop)
    }

    fn stats(&self) -> CollectiveStats {
        self.stats
    }
}

impl Drop for LocalCollective {
    /// A rank that goes away fails the ranks waiting for it with `PeerClosed` instead of
    /// leaving them to the deadline.
    fn drop(&mut self) {
        let mut state = lock(&self.shared);
        state.closed[self.rank.0 as usize] = true;
        drop(state);
        self.shared.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::thread;
    use std::time::Duration;

    use super::*;

    /// Deadline of tests that expect a timeout: short, so the suite stays fast.
    const SHORT_DEADLINE: Duration = Duration::from_millis(100);

    /// Runs `body(rank's collective)` on one thread per rank; results in rank order.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        config: CollectiveConfig,
        body: impl Fn(LocalCollective) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = Arc::new(body);
        let handles: Vec<_> = LocalGroup::new(world, config)
            .into_iter()
            .map(|c| {
                let body = Arc::clone(&body);
                thread::spawn(move || body(c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    #[test]
    fn all_reduce_adds_in_rank_order_with_identical_bits() {
        let results = on_ranks(3, CollectiveConfig::default(), |mut c| {
            let r = c.rank().0 as f32;
            // Values whose sum depends on the order of addition.
            let mut data = vec![1e8 * (1.0 - r), 1.0 + r, 0.1 * r];
            for _ in 0..50 {
                c.all_reduce_sum(&mut data).unwrap();
                data.iter_mut().for_each(|x| *x /= 3.0);
            }
            data
        });
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&results[0]), bits(&results[1]));
        assert_eq!(bits(&results[0]), bits(&results[2]));

        let once = on_ranks(3, CollectiveConfig::default(), |mut c| {
            let r = c.rank().0 as f32;
            let mut data = vec![1e8 * (1.0 - r), 1.0 + r];
            c.all_reduce_sum(&mut data).unwrap();
            data
        });
        // ((1e8 + 0) + -1e8): rank order; (1 + 2) + 3 = 6.
        assert_eq!(once[0], vec![(1e8f32 + 0.0) + -1e8, 6.0]);
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let results = on_ranks(4, CollectiveConfig::default(), |mut c| {
            let r = c.rank().0 as f32;
            let mut out = vec![0.0; 8];
            c.all_gather(&[r, r + 0.5], &mut out).unwrap();
            out
        });
        for out in results {
            assert_eq!(out, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
        }
    }

    #[test]
    fn broadcast_copies_the_root_and_barrier_waits_for_all() {
        let results = on_ranks(3, CollectiveConfig::default(), |mut c| {
            let mut data = [c.rank().0 as u8; 4];
            c.broadcast(&mut data, Rank(2)).unwrap();
            c.barrier().unwrap();
            data
        });
        assert!(results.iter().all(|d| *d == [2; 4]));
    }

    #[test]
    fn a_missing_rank_times_out_by_name_and_aborts_the_group() {
        let config = CollectiveConfig {
            deadline: SHORT_DEADLINE,
            ..CollectiveConfig::default()
        };
        let mut ranks = LocalGroup::new(3, config);
        let mut late = ranks.pop().unwrap();
        // Ranks 0 and 1 arrive, rank 2 does not: the first to time out names rank 2 and
        // aborts the group; the other reports the abort (or its own timeout).
        let waiters: Vec<_> = ranks
            .into_iter()
            .map(|mut c| thread::spawn(move || (c.barrier(), c)))
            .collect();
        let results: Vec<_> = waiters.into_iter().map(|h| h.join().unwrap()).collect();
        let errors: Vec<_> = results
            .iter()
            .map(|(r, _)| r.clone().unwrap_err())
            .collect();
        let timeouts = errors
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    CollectiveError::Timeout {
                        op: Op::Barrier,
                        missing: Rank(2),
                        ..
                    }
                )
            })
            .count();
        assert!(timeouts >= 1, "{errors:?}");
        assert!(
            errors.iter().all(|e| matches!(
                e,
                CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. }
            )),
            "{errors:?}"
        );
        // The late rank's call fails at once.
        let started = Instant::now();
        assert!(matches!(
            late.all_reduce_sum(&mut [1.0]),
            Err(CollectiveError::Aborted { .. })
        ));
        assert!(started.elapsed() < SHORT_DEADLINE);
    }

    #[test]
    fn a_dropped_rank_fails_the_others_as_peer_closed() {
        let mut ranks = LocalGroup::new(2, CollectiveConfig::default());
        let rank1 = ranks.pop().unwrap();
        let mut rank0 = ranks.pop().unwrap();
        drop(rank1);
        let started = Instant::now();
        let err = rank0.all_reduce_sum(&mut [1.0]).unwrap_err();
        assert_eq!(
            err,
            CollectiveError::PeerClosed {
                op: Op::AllReduce,
                peer: Rank(1)
            }
        );
        assert!(started.elapsed() < CollectiveConfig::default().deadline);
    }

    #[test]
    fn mismatched_lengths_are_refused_on_every_rank() {
        let results = on_ranks(2, CollectiveConfig::default(), |mut c| {
            let mut data = vec![0.0; 2 + c.rank().0 as usize];
            c.all_reduce_sum(&mut data)
        });
        assert!(results.iter().all(Result::is_err), "{results:?}");
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(CollectiveError::BadLength { .. }))),
            "{results:?}"
        );
    }

    #[test]
    fn a_group_of_one_is_the_identity() {
        let mut c = LocalGroup::new(1, CollectiveConfig::default())
            .pop()
            .unwrap();
        let mut data = [1.5, -2.0];
        c.all_reduce_sum(&mut data).unwrap();
        assert_eq!(data, [1.5, -2.0]);
        let mut out = [0.0; 2];
        c.all_gather(&data, &mut out).unwrap();
        assert_eq!(out, data);
        assert_eq!(c.stats().calls, 2);
    }
}
