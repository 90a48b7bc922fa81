//! The request journal within its budget. A new request reserves the bytes its entry is
//! counted for ([`counted_bytes`]: an open entry at its largest) before its `Accept` is
//! proposed, so the journal never counts more than the budget, however many requests
//! arrive at once. Finished requests make room when needed (earliest finished first);
//! when open requests fill the budget, new ones are refused with 503 and `Retry-After`.
//! Now and then the leader prunes finished requests past their retention and open ones
//! past their time to live. Every peer exports the journal's usage as metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tracing::{info, warn};

use super::{JOURNAL_TIMEOUT, Leadership, now_ms};
use crate::engine::GenerateRequest;
use crate::error::CoordinatorError;
use crate::metrics as m;
use crate::replication::node::NodeHandle;
use crate::replication::state::journal::counted_bytes;
use crate::replication::state::{Command, MAX_SNAPSHOT_BYTES};

/// How often the leader prunes the journal by age.
const PRUNE_EVERY: Duration = Duration::from_secs(30);

/// The request journal's bounds (`tessera-coordinator --journal-budget-mib`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalLimits {
    /// Bytes the journal may count.
    pub budget: u64,
    /// How long finished requests stay, for clients that reconnect late, while the
    /// budget has room for them.
    pub retention: Duration,
    /// How long a request may stay open: one that no leader runs any more (its `Accept`
    /// committed after its proposer gave up) is dropped then.
    pub open_ttl: Duration,
}

impl Default for JournalLimits {
    fn default() -> JournalLimits {
        JournalLimits {
            budget: 64 << 20,
            retention: Duration::from_secs(600),
            open_ttl: Duration::from_secs(3600),
        }
    }
}

impl JournalLimits {
    /// The largest budget: a full journal's snapshot (at most 5/4 of its count) must fit
    /// [`MAX_SNAPSHOT_BYTES`] with room to spare.
    pub const MAX_BUDGET: u64 = (MAX_SNAPSHOT_BYTES / 2) as u64;

    /// Refuses a budget too small for one request or too large for a snapshot, and a
    /// time to live under a minute.
    pub fn check(&self) -> Result<(), String> {
        let min = 1 << 20;
        if !(min..=Self::MAX_BUDGET).contains(&self.budget) {
            return Err(format!(
                "the journal budget must be between {} and {} MiB; it is {} bytes",
                min >> 20,
                Self::MAX_BUDGET >> 20,
                self.budget
            ));
        }
        if self.open_ttl < Duration::from_secs(60) {
            return Err(format!(
                "the journal's open time to live ({:?}) is shorter than a minute",
                self.open_ttl
            ));
        }
        Ok(())
    }
}

/// The journal's budget as the leader keeps it: room reserved by requests whose `Accept`
/// is being proposed, and the prunes that make room. Cheap to clone.
#[derive(Clone, Debug)]
pub struct JournalBudget {
    node: NodeHandle,
    limits: JournalLimits,
    reserved: Arc<Reserved>,
}

#[derive(Debug, Default)]
struct Reserved {
    bytes: AtomicU64,
    /// One prune at a time: requests that need room wait for it, then look again.
    prune: tokio::sync::Mutex<()>,
}

/// Room held for one request until its `Accept` has been applied (or refused): drop it
/// then.
#[derive(Debug)]
pub struct Reservation {
    reserved: Arc<Reserved>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.reserved.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl JournalBudget {
    /// The budget `limits` sets for the journal `node` applies.
    pub fn new(node: NodeHandle, limits: JournalLimits) -> JournalBudget {
        JournalBudget {
            node,
            limits,
            reserved: Arc::default(),
        }
    }

    pub fn limits(&self) -> JournalLimits {
        self.limits
    }

    /// Reserves room in the journal for request `id`, pruning finished requests when
    /// that makes enough; [`CoordinatorError::JournalFull`] when open ones fill it.
    pub async fn reserve(
        &self,
        id: &str,
        request: &GenerateRequest,
    ) -> Result<Reservation, CoordinatorError> {
        let bytes = counted_bytes(id, request, 0, true);
        if bytes > self.limits.budget {
            let budget = self.limits.budget;
            return Err(CoordinatorError::TooLargeForJournal { bytes, budget });
        }
        if let Some(reservation) = self.try_reserve(bytes) {
            return Ok(reservation);
        }
        let budget = self.limits.budget;
        let _one = self.reserved.prune.lock().await;
        if let Some(reservation) = self.try_reserve(bytes) {
            return Ok(reservation);
        }
        let usage = self.node.journal_usage();
        let pending = self.reserved.bytes.load(Ordering::Acquire);
        let full = || {
            metrics::counter!(m::JOURNAL_REFUSED).increment(1);
            CoordinatorError::JournalFull {
                open: usage.open,
                open_bytes: usage.open_bytes,
                budget,
            }
        };
        if usage.open_bytes + pending + bytes > budget {
            return Err(full());
        }
        // Finished requests make room: down to three quarters of the budget, so that
        // the next requests find room without pruning again, or only as much as this
        // request needs when running ones hold more than that.
        let needed = budget - pending - bytes;
        let max_bytes = if usage.open_bytes <= budget / 4 * 3 {
            (budget / 4 * 3).min(needed)
        } else {
            needed
        };
        info!(
            bytes = usage.bytes,
            budget, max_bytes, "journal full: dropping finished requests"
        );
        self.prune(max_bytes, None).await;
        self.try_reserve(bytes).ok_or_else(full)
    }

    /// Reserves `bytes` if the journal's count and the other reservations leave room.
    fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let used = self.node.journal_usage().bytes;
        let pending = &self.reserved.bytes;
        let mut now = pending.load(Ordering::Acquire);
        loop {
            if used + now + bytes > self.limits.budget {
                return None;
            }
            match pending.compare_exchange(now, now + bytes, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    return Some(Reservation {
                        reserved: Arc::clone(&self.reserved),
                        bytes,
                    });
                }
                Err(current) => now = current,
            }
        }
    }

    /// Proposes a prune: finished requests past their retention, then down to
    /// `max_bytes`; with `running` (the requests this leader runs), also open requests
    /// past their time to live that are not among them.
    pub async fn prune(&self, max_bytes: u64, running: Option<Vec<String>>) {
        let now = now_ms();
        let limits = self.limits;
        let open_before_ms = match running {
            Some(_) => now.saturating_sub(limits.open_ttl.as_millis() as u64),
            None => 0,
        };
        let command = Command::Prune {
            finished_before_ms: now.saturating_sub(limits.retention.as_millis() as u64),
            open_before_ms,
            max_bytes,
            running: running.unwrap_or_default(),
        };
        if let Err(error) = self.node.propose(command, JOURNAL_TIMEOUT).await {
            warn!(%error, "journal not pruned");
        }
    }
}

impl Leadership {
    /// While leading, prunes the journal by age now and then.
    pub(super) async fn prune_by_age(self) {
        let mut every = tokio::time::interval(PRUNE_EVERY);
        loop {
            every.tick().await;
            if self.leading().is_some() {
                let running = self.tails.ids();
                self.budget.prune(u64::MAX, Some(running)).await;
            }
        }
    }
}

/// Exports the journal's usage as this peer applies it, until the peer stops.
pub(super) async fn export_usage(node: NodeHandle, budget: u64) {
    metrics::gauge!(m::JOURNAL_BUDGET_BYTES).set(budget as f64);
    let mut usage = node.journal();
    loop {
        let now = *usage.borrow_and_update();
        metrics::gauge!(m::JOURNAL_ENTRIES).set(now.entries as f64);
        metrics::gauge!(m::JOURNAL_OPEN_ENTRIES).set(now.open as f64);
        metrics::gauge!(m::JOURNAL_BYTES).set(now.bytes as f64);
        if usage.changed().await.is_err() {
            return;
        }
    }
}
