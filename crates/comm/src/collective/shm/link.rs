//! The round protocol of a [`ShmCollective`](super::ShmCollective): [`Link`] owns this
//! rank's mapping of the segment ([`super::segment`]) and moves the group through numbered
//! rounds, checking that every rank made the same call and failing the whole group at
//! once when one rank times out, closes or disagrees. The operations in [`super`] are
//! each a sequence of [`Link::round`]s with their own write and read steps.
//!
//! **Rounds.** Every operation is a sequence of rounds, numbered alike on every rank. In
//! round `r` each rank writes its slot of buffer `r % 2`, publishes `arrive = r`, waits for
//! every rank's `arrive >= r`, reads the slots it needs and publishes `done = r`. Before
//! writing round `r` a rank waits for every `done >= r - 2`, the last round that used the
//! same buffer; two buffers let a fast rank post round `r + 1` while a slow one still reads
//! round `r`. Each round also records (op, lengths) per rank, so mismatched calls fail with
//! [`CollectiveError::BadLength`] instead of mixing payloads.
//!
//! **Waiting.** A waiting rank spins for [`CollectiveConfig::spin`], then sleeps on a futex
//! "bell" that every publication rings (the wake syscall is skipped when nobody sleeps), in
//! slices of at most [`SLEEP_SLICE`] so the deadline is checked even if a wake is lost. A
//! rank that misses the deadline sets the header's abort word (its rank and the missing
//! one) and returns [`CollectiveError::Timeout`]; every later or waiting call on any rank
//! returns [`CollectiveError::Aborted`]. A dropped communicator marks its rank closed, so
//! ranks waiting for it fail with [`CollectiveError::PeerClosed`] at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tessera_kernels::shm::{FutexWait, ShmRangeError, ShmSegment, futex_wait, futex_wake};
use tessera_topology::Rank;

use super::millis;
use super::segment::{
    H_ABORT, H_BELL, H_SLEEPERS, JOIN_POLL, R_ARRIVE, R_CLOSED, R_DONE, R_META, R_PRESENT,
    RANK_BASE, RANK_STRIDE, io_error,
};
use crate::collective::{CollectiveConfig, CollectiveError, Op};

/// Longest a waiting rank sleeps before it looks at the clock and the peers again.
const SLEEP_SLICE: Duration = Duration::from_millis(20);

/// Abort kinds, in bits 24..31 of the abort word.
const ABORT_TIMEOUT: u32 = 1;
const ABORT_CLOSED: u32 = 2;
const ABORT_MISMATCH: u32 = 3;

/// The segment and the round protocol, apart from the buffers the operations use.
#[derive(Debug)]
pub(super) struct Link {
    pub(super) seg: ShmSegment,
    pub(super) rank: Rank,
    pub(super) world: usize,
    /// Elements per slot.
    pub(super) capacity_elems: usize,
    pub(super) slot_bytes: usize,
    pub(super) config: CollectiveConfig,
    /// Rounds this rank has completed (wrapping).
    pub(super) rounds: u32,
}

/// What a rank declares for one round; must agree across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Meta {
    /// [`Op::code`], with a broadcast's root in bits 8.. .
    pub(super) code: u32,
    pub(super) chunk_len: u32,
    pub(super) total_len: u32,
}

fn rank_of(r: usize) -> Rank {
    // `r < MAX_WORLD`.
    Rank(r as u32)
}

/// `x` has reached `target`, for counters that wrap.
fn reached(x: u32, target: u32) -> bool {
    // Reinterpreting the wrapped difference as signed is the point.
    (x.wrapping_sub(target) as i32) >= 0
}

/// The number a round's [`Meta`] carries for `op`; [`op_name`] reads it back.
/// How a mismatch report names the call behind a meta's `code`.
fn op_name(code: u32) -> String {
    let op = match code & 0xff {
        1 => Op::AllReduce,
        2 => Op::AllGather,
        3 => Op::Broadcast,
        4 => Op::Barrier,
        _ => Op::Connect,
    };
    match op {
        Op::Broadcast => format!("{op} from root {}", code >> 8),
        _ => op.to_string(),
    }
}

impl Link {
    fn ctl(&self) -> &[AtomicU32] {
        self.seg.control()
    }

    fn word(&self, rank: usize, field: usize) -> &AtomicU32 {
        &self.seg.control()[RANK_BASE + rank * RANK_STRIDE + field]
    }

    fn me(&self) -> usize {
        self.rank.0 as usize
    }

    /// Publishes a change: bumps the bell and wakes sleepers, if any.
    fn ring(&self) {
        let ctl = self.ctl();
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        if ctl[H_SLEEPERS].load(Ordering::SeqCst) > 0 {
            futex_wake(&ctl[H_BELL], u32::MAX);
        }
    }

    /// The join barrier: marks this rank present and waits for all. `Ok(false)` if the
    /// segment was replaced meanwhile (a joiner that opened a stale one). Rank 0 removes
    /// the segment's name after this returns `Ok(true)` to it.
    pub(super) fn meet(&mut self, started: Instant) -> Result<bool, CollectiveError> {
        let me = self.me();
        if self
            .word(me, R_PRESENT)
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(CollectiveError::Io {
                op: Op::Connect,
                message: format!("rank {me} joined the segment twice"),
            });
        }
        self.ring();
        let deadline = started + self.config.deadline;
        let first_missing =
            || (0..self.world).find(|&j| self.word(j, R_PRESENT).load(Ordering::SeqCst) == 0);
        loop {
            let Some(missing) = first_missing() else {
                return Ok(true);
            };
            if me != 0 && self.seg.is_unlinked().map_err(io_error)? {
                // Rank 0 removes the name once every rank is present (then all are, read
                // again), or a newer rank 0 replaced the segment (then some never come).
                return Ok(first_missing().is_none());
            }
            if Instant::now() >= deadline {
                let error = CollectiveError::Timeout {
                    op: Op::Connect,
                    missing: rank_of(missing),
                    waited_ms: millis(started.elapsed()),
                };
                return Err(self.fail(error, ABORT_TIMEOUT, missing));
            }
            std::thread::sleep(JOIN_POLL);
        }
    }

    /// The group's abort, as this rank reports it, if any.
    fn aborted(&self, op: Op) -> Option<CollectiveError> {
        let word = self.ctl()[H_ABORT].load(Ordering::SeqCst);
        if word == 0 {
            return None;
        }
        let (kind, by, missing) = ((word >> 24) & 0x7f, (word >> 12) & 0xfff, word & 0xfff);
        let reason = match kind {
            ABORT_TIMEOUT => format!("rank {missing} did not arrive in time"),
            ABORT_CLOSED => format!("rank {missing} closed its communicator"),
            _ => format!("ranks {by} and {missing} made different calls"),
        };
        Some(CollectiveError::Aborted {
            op,
            by: Rank(by),
            missing: Rank(missing),
            reason,
        })
    }

    /// Aborts the group on behalf of this rank (unless another rank already did) and
    /// returns `error`, which this rank reports itself.
    fn fail(&self, error: CollectiveError, kind: u32, missing: usize) -> CollectiveError {
        let word = (1 << 31) | (kind << 24) | ((self.me() as u32) << 12) | missing as u32;
        let ctl = self.ctl();
        let _ = ctl[H_ABORT].compare_exchange(0, word, Ordering::SeqCst, Ordering::SeqCst);
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        futex_wake(&ctl[H_BELL], u32::MAX);
        error
    }

    /// Waits until every rank's `field` has reached `target`.
    fn wait_all(
        &self,
        field: usize,
        target: u32,
        op: Op,
        started: Instant,
    ) -> Result<(), CollectiveError> {
        let deadline = started + self.config.deadline;
        let spin_until = Instant::now() + self.config.spin;
        let ctl = self.ctl();
        loop {
            // Read the bell before the condition: a publication after this read changes
            // the bell, so the futex below returns at once instead of missing it.
            let bell = ctl[H_BELL].load(Ordering::SeqCst);
            if let Some(error) = self.aborted(op) {
                return Err(error);
            }
            let missing = (0..self.world)
                .find(|&j| !reached(self.word(j, field).load(Ordering::Acquire), target));
            let Some(missing) = missing else {
                return Ok(());
            };
            if self.word(missing, R_CLOSED).load(Ordering::SeqCst) != 0 {
                let peer = rank_of(missing);
                let error = CollectiveError::PeerClosed { op, peer };
                return Err(self.fail(error, ABORT_CLOSED, missing));
            }
            let now = Instant::now();
            if now >= deadline {
                let error = CollectiveError::Timeout {
                    op,
                    missing: rank_of(missing),
                    waited_ms: millis(started.elapsed()),
                };
                return Err(self.fail(error, ABORT_TIMEOUT, missing));
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            ctl[H_SLEEPERS].fetch_add(1, Ordering::SeqCst);
            // Every outcome (woken, changed, timed out, interrupted) means "look again".
            let _: FutexWait = futex_wait(&ctl[H_BELL], bell, SLEEP_SLICE.min(deadline - now));
            ctl[H_SLEEPERS].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Runs one round: `write(segment, offset of this rank's slot, state)` fills this
    /// rank's slot; once every rank has posted, `read(segment, slot offset by rank, state)`
    /// consumes them. `state` is the caller's buffer, lent to one closure at a time.
    pub(super) fn round<S: ?Sized>(
        &mut self,
        op: Op,
        meta: Meta,
        started: Instant,
        state: &mut S,
        write: impl FnOnce(&ShmSegment, usize, &S) -> Result<(), ShmRangeError>,
        read: impl FnOnce(&ShmSegment, &dyn Fn(usize) -> usize, &mut S) -> Result<(), ShmRangeError>,
    ) -> Result<(), CollectiveError> {
        if let Some(error) = self.aborted(op) {
            return Err(error);
        }
        let round = self.rounds.wrapping_add(1);
        let buffer = (round % 2) as usize;
        let me = self.me();
        // The buffer's previous round (round - 2) must be read by everyone.
        self.wait_all(R_DONE, round.wrapping_sub(2), op, started)?;
        let slot_bytes = self.slot_bytes;
        let world = self.world;
        let slot = move |j: usize| (buffer * world + j) * slot_bytes;
        write(&self.seg, slot(me), state).map_err(|e| self.range_error(op, meta, e))?;
        let meta_base = R_META + 3 * buffer;
        self.word(me, meta_base).store(meta.code, Ordering::Relaxed);
        self.word(me, meta_base + 1)
            .store(meta.chunk_len, Ordering::Relaxed);
        self.word(me, meta_base + 2)
            .store(meta.total_len, Ordering::Relaxed);
        self.word(me, R_ARRIVE).store(round, Ordering::Release);
        self.ring();

        self.wait_all(R_ARRIVE, round, op, started)?;
        for j in 0..world {
            let theirs = Meta {
                code: self.word(j, meta_base).load(Ordering::Relaxed),
                chunk_len: self.word(j, meta_base + 1).load(Ordering::Relaxed),
                total_len: self.word(j, meta_base + 2).load(Ordering::Relaxed),
            };
            if theirs != meta {
                let error = CollectiveError::BadLength {
                    op,
                    len: meta.total_len as usize,
                    detail: format!(
                        "rank {me} called {} with {} elements, rank {j} called {} with {}",
                        op_name(meta.code),
                        meta.total_len,
                        op_name(theirs.code),
                        theirs.total_len
                    ),
                };
                return Err(self.fail(error, ABORT_MISMATCH, j));
            }
        }
        read(&self.seg, &slot, state).map_err(|e| self.range_error(op, meta, e))?;
        self.word(me, R_DONE).store(round, Ordering::Release);
        self.rounds = round;
        self.ring();
        Ok(())
    }

    fn range_error(&self, op: Op, meta: Meta, e: ShmRangeError) -> CollectiveError {
        // Chunks never exceed the slot, so this is a bug; report it rather than panic.
        CollectiveError::BadLength {
            op,
            len: meta.chunk_len as usize,
            detail: e.to_string(),
        }
    }

    /// The metas of a call of `total_len` elements in chunks of at most the capacity:
    /// (offset, chunk length, meta) per round; one empty round for an empty call.
    pub(super) fn chunks(
        &self,
        code: u32,
        total_len: usize,
    ) -> impl Iterator<Item = (usize, usize, Meta)> {
        let cap = self.capacity_elems;
        let rounds = total_len.div_ceil(cap).max(1);
        (0..rounds).map(move |i| {
            let offset = i * cap;
            let len = cap.min(total_len - offset.min(total_len));
            let meta = Meta {
                code,
                chunk_len: len as u32,
                // Only the low 32 bits take part in the cross-rank check.
                total_len: total_len as u32,
            };
            (offset, len, meta)
        })
    }
}

impl Drop for Link {
    /// A rank that goes away fails the ranks waiting for it with `PeerClosed` instead of
    /// leaving them to the deadline.
    fn drop(&mut self) {
        self.word(self.me(), R_CLOSED).store(1, Ordering::SeqCst);
        let ctl = self.ctl();
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        futex_wake(&ctl[H_BELL], u32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_counters_compare_by_distance() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(0, u32::MAX - 1), "round 1 needs done >= round -1");
        assert!(reached(2, u32::MAX));
        assert!(!reached(u32::MAX, 2));
    }
}
