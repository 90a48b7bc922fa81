//! The topology in force on this peer: its file's, until a topology is applied through
//! the API (`tessera topology apply`); then the last one applied, as the replicated state
//! holds it, on every peer alike, whatever their files say.
//!
//! - [`change`]: what an apply adds and removes, and what it may not change (pure).
//! - [`LiveTopology`]: the topology now, for the shard registrations, the leader's groups
//!   and the API's models; [`LiveTopology::follow`] keeps it in step with the state.

pub mod change;

use std::path::Path;
use std::sync::Arc;

use tessera_topology::Topology;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::metrics as m;
use crate::replication::node::NodeHandle;
use crate::replication::state::AppliedTopology;

pub use change::{TopologyChange, model_records};

/// The largest topology text an apply may carry.
pub const MAX_TOPOLOGY_BYTES: usize = 256 * 1024;

/// The topology in force, shared by every part of this peer; cheap to clone.
#[derive(Clone, Debug)]
pub struct LiveTopology {
    now: Arc<watch::Sender<Arc<Topology>>>,
}

impl LiveTopology {
    /// A peer's topology before it follows the replicated state: its file's.
    pub fn new(file: Topology) -> LiveTopology {
        LiveTopology {
            now: Arc::new(watch::Sender::new(Arc::new(file))),
        }
    }

    pub fn current(&self) -> Arc<Topology> {
        self.now.borrow().clone()
    }

    /// Sees every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Topology>> {
        self.now.subscribe()
    }

    /// Follows the topology `node`'s state applies, from now until the node stops. Must
    /// run inside a tokio runtime.
    pub fn follow(&self, node: NodeHandle) {
        let now = Arc::clone(&self.now);
        tokio::spawn(async move {
            let mut summary = node.summary();
            let mut generation = 0;
            metrics::gauge!(m::TOPOLOGY_GENERATION).set(0.0);
            loop {
                let applied = summary.borrow_and_update().topology.clone();
                if let Some(applied) = applied.filter(|a| a.generation != generation) {
                    generation = applied.generation;
                    match parse(&applied) {
                        Ok(topology) => {
                            info!(generation, path = %applied.path, "topology applied");
                            now.send_replace(Arc::new(topology));
                            metrics::gauge!(m::TOPOLOGY_GENERATION).set(generation as f64);
                        }
                        Err(error) => warn!(generation, %error, "applied topology unreadable"),
                    }
                }
                if summary.changed().await.is_err() {
                    return;
                }
            }
        });
    }
}

/// The topology of an applied text: relative paths resolve against its file's directory,
/// as they did on the peer that applied it.
pub fn parse(applied: &AppliedTopology) -> Result<Topology, String> {
    parse_text(&applied.text, &applied.path)
}

/// The topology `text` of file `path`, or every issue found, in one line.
pub fn parse_text(text: &str, path: &str) -> Result<Topology, String> {
    Topology::parse(text, Path::new(path)).map_err(|issues| {
        let issues: Vec<String> = issues.iter().map(ToString::to_string).collect();
        issues.join("; ")
    })
}
