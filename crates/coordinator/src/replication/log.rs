//! raft-rs logs through `slog`; Tessera through `tracing`. [`logger`] forwards the first
//! to the second (target `tessera::raft`), with the record's key-value pairs appended to
//! its message. raft-rs's info level becomes debug: the driver logs what an operator
//! needs (leader changes) itself.

use std::fmt::Write as _;

use slog::{Drain, KV as _, Level, OwnedKVList, Record};
use tessera_topology::PeerId;

/// An `slog` logger whose records become `tracing` events.
pub fn logger(peer: PeerId) -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!("peer" => peer.0))
}

/// A logger that drops everything (simulations run thousands of peers).
pub fn discard() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

struct TracingDrain;

/// Collects `key=value` pairs.
struct Pairs(String);

impl slog::Serializer for Pairs {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), slog::Never> {
        let mut pairs = Pairs(String::new());
        let _ = record.kv().serialize(record, &mut pairs);
        let _ = values.serialize(record, &mut pairs);
        let message = record.msg();
        let pairs = pairs.0;
        match record.level() {
            Level::Critical | Level::Error => {
                tracing::error!(target: "tessera::raft", "{message}{pairs}")
            }
            Level::Warning => tracing::warn!(target: "tessera::raft", "{message}{pairs}"),
            // raft-rs's info is per election and per message refused: the driver logs
            // leader changes itself.
            Level::Info | Level::Debug => {
                tracing::debug!(target: "tessera::raft", "{message}{pairs}")
            }
            Level::Trace => tracing::trace!(target: "tessera::raft", "{message}{pairs}"),
        }
        Ok(())
    }
}
