//! What applying a topology changes, decided from the topology in force and the new one
//! alone (a pure core; the leader checks the model files and proposes it).
//!
//! An apply adds and removes groups and models. It never changes what stays: a group kept
//! under its name keeps its model, ranks, devices, ports and hosts' addresses (a shard
//! would be running the old layout), a model kept keeps its files (a new version is a
//! rollout: `tessera model deploy`), and the coordinator peers are the same (a peer is
//! added or removed with `tessera cluster add|remove`). Each refusal says what to change.

use std::collections::BTreeMap;

use serde::Serialize;
use tessera_topology::{Group, Topology};

use crate::replication::state::ModelRecord;

/// The groups and models an apply adds and removes, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TopologyChange {
    pub added_groups: Vec<String>,
    pub removed_groups: Vec<String>,
    pub added_models: Vec<String>,
    pub removed_models: Vec<String>,
}

impl TopologyChange {
    pub fn is_empty(&self) -> bool {
        self.added_groups.is_empty()
            && self.removed_groups.is_empty()
            && self.added_models.is_empty()
            && self.removed_models.is_empty()
    }

    /// What `next` changes of `current`; `canaries`: the models with a canary running,
    /// whose groups stay as they are until it is promoted or rolled back.
    pub fn between(
        current: &Topology,
        next: &Topology,
        canaries: &[String],
    ) -> Result<TopologyChange, String> {
        let peers = |t: &Topology| -> Vec<String> {
            (t.coordinators.iter())
                .map(|c| format!("{} {} {} {}", c.id, c.host, c.quic, c.http))
                .collect()
        };
        if peers(current) != peers(next) {
            return Err(
                "the coordinator peers differ from the cluster's: keep them as they \
                        are, and add or remove a peer with `tessera cluster add|remove`"
                    .into(),
            );
        }
        for model in &next.models {
            if let Some(old) = current.model(&model.name)
                && (old.path != model.path
                    || old.format != model.format
                    || old.dtype != model.dtype)
            {
                return Err(format!(
                    "model `{}` changes its files ({} to {}): keep them, and deploy a new \
                     version with `tessera model deploy`",
                    model.name,
                    old.path.display(),
                    model.path.display()
                ));
            }
        }
        for group in &next.groups {
            if let Some(old) = current.group(&group.name)
                && layout(current, old) != layout(next, group)
            {
                return Err(format!(
                    "group `{}` changes its model, ranks, devices, ports or hosts: give the \
                     new layout another name, apply, then remove the old group",
                    group.name
                ));
            }
        }
        let names = |groups: &[Group]| groups.iter().map(|g| g.name.clone()).collect::<Vec<_>>();
        let change = TopologyChange {
            added_groups: only_in(&names(&next.groups), &names(&current.groups)),
            removed_groups: only_in(&names(&current.groups), &names(&next.groups)),
            added_models: only_in(&model_names(next), &model_names(current)),
            removed_models: only_in(&model_names(current), &model_names(next)),
        };
        let touched = (change.added_groups.iter())
            .filter_map(|g| next.group(g))
            .chain(
                change
                    .removed_groups
                    .iter()
                    .filter_map(|g| current.group(g)),
            )
            .map(|g| &g.model);
        if let Some(model) = touched.into_iter().find(|m| canaries.contains(m)) {
            return Err(format!(
                "model `{model}` has a canary running: promote it or roll it back \
                 (`tessera model promote|rollback`) before its groups change"
            ));
        }
        Ok(change)
    }
}

/// Each model of `topology` with its files and groups, as the replicated state records it.
pub fn model_records(topology: &Topology) -> BTreeMap<String, ModelRecord> {
    (topology.models.iter())
        .map(|model| {
            let record = ModelRecord {
                path: model.path.display().to_string(),
                groups: (topology.groups_of(&model.name))
                    .map(|g| g.name.clone())
                    .collect(),
            };
            (model.name.clone(), record)
        })
        .collect()
}

/// What must not change of a kept group: everything its shards run with, and the
/// addresses of their hosts.
fn layout(topology: &Topology, group: &Group) -> String {
    let addresses: Vec<&str> = (group.shards.iter())
        .map(|s| topology.host(&s.host).map_or("", |h| h.address.as_str()))
        .collect();
    format!(
        "{} {} {} {:?} {addresses:?}",
        group.model, group.tp, group.collective, group.shards
    )
}

fn model_names(topology: &Topology) -> Vec<String> {
    topology.models.iter().map(|m| m.name.clone()).collect()
}

/// The names in `a` that are not in `b`, in `a`'s order.
fn only_in(a: &[String], b: &[String]) -> Vec<String> {
    a.iter().filter(|n| !b.contains(n)).cloned().collect()
}

#[cfg(test)]
mod tests;
