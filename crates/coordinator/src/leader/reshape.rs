//! Topologies applied through the API while this peer leads (`tessera topology apply`):
//! - [`Leadership::apply_topology`] checks a topology against the one in force
//!   ([`TopologyChange::between`]) and the files of every model whose groups it adds, then
//!   commits it; every peer then follows it ([`crate::live`]);
//! - [`Leadership::follow_topology`] starts a driver for each group of the topology in
//!   force that has none, and retires each group it no longer names: out of routing, its
//!   requests finish (for up to [`GROUP_DRAIN`]), then its shards are told to exit. The
//!   other groups run on untouched.
//!
//! A new leader starts the groups of the topology in force, and goes on from there.

use std::collections::BTreeSet;
use std::time::Duration;

use tessera_comm::proto::{Epoch, Term, WireError};
use tessera_model::loader;
use tessera_topology::{Severity, Topology};
use tracing::{info, warn};

use super::rollout::targets;
use super::{GROUP_DRAIN, JOURNAL_TIMEOUT, Leadership};
use crate::cluster::{Cluster, first_version};
use crate::engine::TopologyApplied;
use crate::error::CoordinatorError;
use crate::live::{MAX_TOPOLOGY_BYTES, TopologyChange, model_records, parse_text};
use crate::replication::state::{Command, Outcome};

/// How often the groups are checked against the topology, besides every change of it.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

fn refused(reason: String) -> WireError {
    CoordinatorError::TopologyRefused { reason }.into()
}

impl Leadership {
    /// Applies topology `text`, read from file `path` (relative paths in it resolve
    /// against that file's directory): what it adds and removes, once committed.
    pub(super) async fn apply_topology(
        &self,
        path: String,
        text: String,
    ) -> Result<TopologyApplied, WireError> {
        if self.cluster_soon().await.is_none() {
            return Err(self.not_leader());
        }
        if text.len() > MAX_TOPOLOGY_BYTES {
            let kib = MAX_TOPOLOGY_BYTES / 1024;
            return Err(refused(format!("the topology is over {kib} KiB")));
        }
        let next = parse_text(&text, &path).map_err(refused)?;
        let summary = self.node.summary().borrow().clone();
        let canaries: Vec<String> = (summary.rollouts.iter())
            .filter(|(_, r)| r.canary.is_some())
            .map(|(model, _)| model.clone())
            .collect();
        let current = self.topology.current();
        let change = TopologyChange::between(&current, &next, &canaries).map_err(refused)?;
        let generation = summary.topology.as_ref().map_or(0, |t| t.generation);
        if change.is_empty() {
            return Ok(TopologyApplied { generation, change });
        }
        check_models(&next, &change).await?;
        let command = Command::Topology {
            generation: generation + 1,
            path,
            text,
            models: model_records(&next),
        };
        match self.node.propose(command, JOURNAL_TIMEOUT).await {
            Ok(applied) => match applied.outcome {
                Outcome::Applied => {}
                Outcome::Refused { reason } => return Err(refused(reason)),
                other => return Err(refused(format!("{other:?}"))),
            },
            Err(source) => return Err(CoordinatorError::TopologyNotCommitted { source }.into()),
        }
        info!(
            generation = generation + 1,
            added = ?change.added_groups,
            removed = ?change.removed_groups,
            "topology applied"
        );
        Ok(TopologyApplied {
            generation: generation + 1,
            change,
        })
    }

    /// Keeps `cluster`'s groups those of the topology in force while this peer leads in
    /// `term`.
    pub(super) async fn follow_topology(self, cluster: Cluster, term: Term) {
        let mut changes = self.topology.subscribe();
        let mut tick = tokio::time::interval(FOLLOW_EVERY);
        let mut retiring = BTreeSet::new();
        loop {
            if self.leading().is_none_or(|l| l.term != term) {
                return;
            }
            let topology = changes.borrow_and_update().clone();
            let summary = self.node.summary().borrow().clone();
            let running = cluster.groups();
            let sources = targets(&summary, &topology);
            for group in &topology.groups {
                if running.iter().any(|g| g.name == group.name) {
                    continue;
                }
                info!(group = %group.name, "group added: waiting for its shards");
                let epoch = Epoch(summary.groups.get(&group.name).map_or(0, |r| r.epoch));
                let source = (sources.get(&group.name).cloned())
                    .unwrap_or_else(|| first_version(&topology, &group.model));
                cluster.add_group(&topology, group, epoch, source);
            }
            retiring.retain(|name| running.iter().any(|g| &g.name == name));
            for group in running {
                if topology.group(&group.name).is_some() || !retiring.insert(group.name.clone()) {
                    continue;
                }
                let cluster = cluster.clone();
                tokio::spawn(async move {
                    info!(group = %group.name, "group removed from the topology: draining it");
                    group.set_drained(true);
                    if !group.until_idle(GROUP_DRAIN).await {
                        warn!(group = %group.name, "requests still running: they fail");
                    }
                    cluster.remove_group(&group.name).await;
                });
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = tick.tick() => {}
            }
        }
    }
}

/// Checks the files of every model that `change` adds groups of: each must hold a model
/// this peer reads, whose shape fits its groups of `next`.
async fn check_models(next: &Topology, change: &TopologyChange) -> Result<(), WireError> {
    let models: BTreeSet<&str> = (change.added_groups.iter())
        .filter_map(|g| next.group(g))
        .map(|g| g.model.as_str())
        .collect();
    for name in models {
        let Some(model) = next.model(name) else {
            continue;
        };
        let path = model.path.clone();
        let meta = tokio::task::spawn_blocking(move || loader::load_metadata(&path))
            .await
            .map_err(|e| refused(e.to_string()))?
            .map_err(|e| refused(format!("model `{name}` at {}: {e}", model.path.display())))?;
        let issues: Vec<String> = (next.check_model(name, &meta.config.shape()).iter())
            .filter(|i| i.severity == Severity::Error)
            .map(ToString::to_string)
            .collect();
        if !issues.is_empty() {
            return Err(refused(issues.join("; ")));
        }
    }
    Ok(())
}
