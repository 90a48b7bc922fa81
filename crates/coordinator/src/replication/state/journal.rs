//! The request journal's size: what each entry is counted for ([`Journaled::bytes`]), the
//! running totals ([`JournalUsage`]), and [`Command::Prune`](super::Command::Prune), which
//! keeps the journal within the leader's budget.
//!
//! Every figure here is a pure function of the journal's entries, so every peer counts the
//! same and a pruning command drops the same entries everywhere.

use std::collections::BTreeMap;

use super::{ClusterState, Journaled, RequestId};
use crate::engine::GenerateRequest;

/// What an entry is counted for beyond its tokens and strings: its parameters, its place
/// in the map, and the encoding around it.
pub const ENTRY_OVERHEAD_BYTES: u64 = 256;

impl Journaled {
    /// The bytes this entry (under `id`) is counted for ([`counted_bytes`]).
    pub fn bytes(&self, id: &str) -> u64 {
        counted_bytes(id, &self.request, self.sent.len(), self.finished.is_none())
    }
}

/// The bytes a journal entry is counted for: 4 per token (prompt, stop ids, and the tokens
/// sent — while the request is open, as many as it may still send: `max_tokens`), its
/// strings, and [`ENTRY_OVERHEAD_BYTES`]. Close to what it takes in memory; a snapshot
/// encodes it in at most 5/4 of that (5 bytes for the largest token ids). An open entry
/// never grows past what it was counted for when it was accepted, so a budget checked at
/// acceptance holds until entries finish.
pub fn counted_bytes(id: &str, request: &GenerateRequest, sent: usize, open: bool) -> u64 {
    let sent = if open {
        sent.max(request.max_tokens as usize)
    } else {
        sent
    };
    let tokens = request.prompt.len() + request.stop_token_ids.len() + sent;
    let strings =
        id.len() + request.model.len() + request.stop.iter().map(String::len).sum::<usize>();
    ENTRY_OVERHEAD_BYTES + 4 * tokens as u64 + strings as u64
}

/// What the journal holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JournalUsage {
    pub entries: u64,
    /// Entries not finished yet.
    pub open: u64,
    /// [`Journaled::bytes`] of every entry.
    pub bytes: u64,
    /// [`Journaled::bytes`] of the open entries: what pruning cannot free.
    pub open_bytes: u64,
}

impl JournalUsage {
    /// The usage of a whole journal.
    pub fn of(journal: &BTreeMap<RequestId, Journaled>) -> JournalUsage {
        let mut usage = JournalUsage::default();
        for (id, entry) in journal {
            usage.add(id, entry);
        }
        usage
    }

    /// Counts `entry` in.
    pub fn add(&mut self, id: &str, entry: &Journaled) {
        let bytes = entry.bytes(id);
        self.entries += 1;
        self.bytes += bytes;
        if entry.finished.is_none() {
            self.open += 1;
            self.open_bytes += bytes;
        }
    }

    /// Counts `entry` out (it was counted in as it is now).
    pub fn remove(&mut self, id: &str, entry: &Journaled) {
        let bytes = entry.bytes(id);
        self.entries -= 1;
        self.bytes -= bytes;
        if entry.finished.is_none() {
            self.open -= 1;
            self.open_bytes -= bytes;
        }
    }

    /// Bytes of the finished entries: what pruning can free.
    pub fn finished_bytes(&self) -> u64 {
        self.bytes - self.open_bytes
    }
}

impl ClusterState {
    /// Applies a prune (see [`Command::Prune`](super::Command::Prune)).
    pub(super) fn prune(
        &mut self,
        finished_before_ms: u64,
        open_before_ms: u64,
        max_bytes: u64,
        running: &[RequestId],
    ) {
        let usage = &mut self.usage;
        self.journal.retain(|id, entry| {
            let keep = match entry.finished {
                Some((_, at)) => at >= finished_before_ms,
                None => entry.accepted_ms >= open_before_ms || running.contains(id),
            };
            if !keep {
                usage.remove(id, entry);
            }
            keep
        });
        if self.usage.bytes <= max_bytes {
            return;
        }
        // Earliest finished first; the acceptance index breaks ties, the same everywhere.
        let mut finished: Vec<(u64, u64, RequestId)> = self
            .journal
            .iter()
            .filter_map(|(id, e)| e.finished.map(|(_, at)| (at, e.accepted_index, id.clone())))
            .collect();
        finished.sort_unstable();
        for (_, _, id) in finished {
            if self.usage.bytes <= max_bytes {
                break;
            }
            if let Some(entry) = self.journal.remove(&id) {
                self.usage.remove(&id, &entry);
            }
        }
    }
}
