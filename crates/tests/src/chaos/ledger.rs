//! The ledger of a chaos run: how every request ended, whether the greedy ones that
//! finished after a retry or a resume kept the tokens of a clean run, the faults as they
//! were applied, and each process's growth in memory, open files and journal bytes.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Value, json};

use super::client::{End, Mode, Outcome};

/// One process's resources at a moment.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub pid: i32,
    pub rss: u64,
    pub fds: u64,
    /// `tessera_journal_bytes` (coordinator peers only).
    pub journal_bytes: f64,
    /// `tessera_journal_entries` (coordinator peers only).
    pub journal_entries: f64,
}

/// A process from the start of the load to its end.
#[derive(Clone, Debug)]
pub struct Growth {
    pub name: String,
    pub start: Sample,
    pub end: Sample,
    /// How many times it was killed and started again.
    pub restarts: usize,
}

/// A fault as applied: when, what, on whom, and what happened.
#[derive(Clone, Debug)]
pub struct Applied {
    pub at_s: f64,
    pub kind: &'static str,
    pub note: String,
}

/// The `status code` of a `status code: message` reason.
fn status_code(why: &str) -> String {
    why.split(": ").next().unwrap_or(why).to_string()
}

#[derive(Debug, Default)]
pub struct Ledger {
    pub seed: u64,
    pub seconds: u64,
    pub sent: usize,
    pub accepted: usize,
    pub completed: usize,
    /// Completed after a retry of the key or a resumed stream.
    pub completed_after_reconnect: usize,
    pub left_by_client: usize,
    pub failed: BTreeMap<String, usize>,
    pub refused: BTreeMap<String, usize>,
    pub lost: Vec<String>,
    pub unanswered: Vec<String>,
    /// Greedy completions compared with the clean run: (all, after a reconnect).
    pub greedy_checked: (usize, usize),
    /// Greedy completions whose tokens differ: (without a reconnect, after one).
    pub greedy_differ: (Vec<String>, Vec<String>),
    pub by_mode: BTreeMap<String, usize>,
    pub faults: Vec<Applied>,
    pub processes: Vec<Growth>,
}

impl Ledger {
    /// Counts `outcomes`, comparing greedy completions with `clean` (tokens per prompt).
    pub fn tally(seed: u64, seconds: u64, outcomes: &[Outcome], clean: &[Vec<u32>]) -> Ledger {
        let mut ledger = Ledger {
            seed,
            seconds,
            sent: outcomes.len(),
            ..Ledger::default()
        };
        for o in outcomes {
            let mode = match (o.spec.mode, o.spec.greedy) {
                (Mode::Plain, true) => "plain greedy",
                (Mode::Plain, false) => "plain sampled",
                (Mode::Stream, true) => "stream greedy",
                (Mode::Stream, false) => "stream sampled",
                (Mode::LeaveEarly, _) => "stream left early",
            };
            *ledger.by_mode.entry(mode.into()).or_default() += 1;
            let what = format!("{} ({mode}, {} connections)", o.spec.key, o.connections);
            match &o.end {
                End::Completed { tokens, retried } => {
                    ledger.accepted += 1;
                    ledger.completed += 1;
                    ledger.completed_after_reconnect += usize::from(*retried);
                    if o.spec.greedy {
                        ledger.greedy_checked.0 += 1;
                        ledger.greedy_checked.1 += usize::from(*retried);
                        if *tokens != clean[o.spec.prompt] {
                            let line = format!("{what}: {tokens:?} != {:?}", clean[o.spec.prompt]);
                            if *retried {
                                ledger.greedy_differ.1.push(line);
                            } else {
                                ledger.greedy_differ.0.push(line);
                            }
                        }
                    }
                }
                End::Failed(why) => {
                    ledger.accepted += 1;
                    *ledger.failed.entry(status_code(why)).or_default() += 1;
                }
                End::Refused(why) => *ledger.refused.entry(status_code(why)).or_default() += 1,
                End::Left => {
                    ledger.accepted += 1;
                    ledger.left_by_client += 1;
                }
                End::Lost(why) => {
                    ledger.accepted += 1;
                    ledger.lost.push(format!("{what}: {why}"));
                }
                End::Unanswered(why) => ledger.unanswered.push(format!("{what}: {why}")),
            }
        }
        ledger
    }

    pub fn to_json(&self) -> Value {
        let processes: Vec<Value> = self
            .processes
            .iter()
            .map(|g| {
                json!({
                    "name": g.name,
                    "restarts": g.restarts,
                    "pid": [g.start.pid, g.end.pid],
                    "rss_bytes": [g.start.rss, g.end.rss],
                    "rss_growth_bytes": g.end.rss as i64 - g.start.rss as i64,
                    "open_fds": [g.start.fds, g.end.fds],
                    "fd_growth": g.end.fds as i64 - g.start.fds as i64,
                    "journal_bytes": [g.start.journal_bytes, g.end.journal_bytes],
                    "journal_bytes_growth": g.end.journal_bytes - g.start.journal_bytes,
                    "journal_entries": [g.start.journal_entries, g.end.journal_entries],
                })
            })
            .collect();
        let faults: Vec<Value> = self
            .faults
            .iter()
            .map(
                |f| json!({"at_s": (f.at_s * 10.0).round() / 10.0, "kind": f.kind, "note": f.note}),
            )
            .collect();
        json!({
            "seed": self.seed,
            "seconds": self.seconds,
            "sent": self.sent,
            "accepted": self.accepted,
            "completed": self.completed,
            "completed_after_reconnect": self.completed_after_reconnect,
            "left_by_client": self.left_by_client,
            "failed": self.failed,
            "refused": self.refused,
            "lost": self.lost.len(),
            "lost_requests": self.lost,
            "unanswered": self.unanswered.len(),
            "unanswered_requests": self.unanswered,
            "greedy_checked": self.greedy_checked.0,
            "greedy_checked_after_reconnect": self.greedy_checked.1,
            "greedy_differ_clean": self.greedy_differ.0,
            "greedy_differ_after_reconnect": self.greedy_differ.1,
            "by_mode": self.by_mode,
            "faults": faults,
            "processes": processes,
        })
    }

    /// A few lines for a person.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "ledger (seed {}, {} s): sent {}, accepted {}, completed {} ({} after a retry or \
             resume), left by the client {}, failed {:?}, refused {:?}, LOST {}, unanswered {}",
            self.seed,
            self.seconds,
            self.sent,
            self.accepted,
            self.completed,
            self.completed_after_reconnect,
            self.left_by_client,
            self.failed,
            self.refused,
            self.lost.len(),
            self.unanswered.len()
        );
        let _ = writeln!(
            s,
            "greedy: {} compared with the clean run ({} after a reconnect); {} differ without \
             a reconnect, {} after one",
            self.greedy_checked.0,
            self.greedy_checked.1,
            self.greedy_differ.0.len(),
            self.greedy_differ.1.len()
        );
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &self.faults {
            *kinds.entry(f.kind).or_default() += 1;
        }
        let _ = writeln!(s, "faults applied: {kinds:?}");
        for g in &self.processes {
            let _ = writeln!(
                s,
                "  {:<14} restarts {}  RSS {} → {} MiB  fds {} → {}  journal {:.0} → {:.0} bytes",
                g.name,
                g.restarts,
                g.start.rss >> 20,
                g.end.rss >> 20,
                g.start.fds,
                g.end.fds,
                g.start.journal_bytes,
                g.end.journal_bytes
            );
        }
        s
    }
}
