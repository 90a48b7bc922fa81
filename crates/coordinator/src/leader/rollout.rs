//! Model rollouts while this peer leads. The versions live in the replicated state
//! ([`crate::replication::state::rollout`]); from them, this peer:
//! - answers `tessera model deploy|promote|rollback|status` ([`Leadership::versions`]),
//!   checking a deploy's files before it proposes it;
//! - splits each model's requests between its stable and canary groups;
//! - moves groups to the version they should serve, one group at a time: out of routing,
//!   its requests finish, a new epoch names the version (its shards load it), back in
//!   ([`switch_group`]);
//! - judges each canary every second over its window ([`crate::canary::judge`]) and rolls
//!   a failing one back, logged, counted and kept as an event for the status page.
//!
//! A new leader starts its groups on the versions the state names, and goes on from there.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_comm::proto::{ModelSource, Term, WireError};
use tessera_model::ModelConfig;
use tessera_topology::Topology;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{GROUP_DRAIN, JOURNAL_TIMEOUT, Leadership, now_ms};
use crate::canary::{self, Thresholds};
use crate::cluster::{Cluster, first_version};
use crate::engine::{GroupVersion, RolloutAction, VersionsStatus};
use crate::error::CoordinatorError;
use crate::group::GroupHandle;
use crate::metrics as m;
use crate::replication::state::{Command, Outcome, Rollout, RolloutCommand, Summary};

/// How often canaries are judged and groups checked, besides every committed change.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// The version each group of `topology` serves, as `summary` says; a group of a model
/// not recorded yet serves its topology's files as version 1 (what the leader records
/// as that model's version 1 then: no group moves when it is recorded).
pub(super) fn targets(summary: &Summary, topology: &Topology) -> BTreeMap<String, ModelSource> {
    let mut targets = BTreeMap::new();
    for group in &topology.groups {
        let source = match summary.versions(&group.model) {
            Ok(rollout) => {
                let version = rollout.version_for(&group.name);
                let Some(v) = rollout.version(version) else {
                    continue;
                };
                let path = v.path.clone();
                ModelSource { version, path }
            }
            Err(_) => first_version(topology, &group.model),
        };
        targets.insert(group.name.clone(), source);
    }
    targets
}

impl Leadership {
    /// `model`'s versions, after `action` is committed (when there is one).
    pub(super) async fn versions(
        &self,
        model: String,
        action: Option<RolloutAction>,
    ) -> Result<VersionsStatus, WireError> {
        let Some(cluster) = self.cluster_soon().await else {
            return Err(self.not_leader());
        };
        let summary = self.node.summary().borrow().clone();
        let rollout = match summary.versions(&model) {
            Ok(rollout) => rollout,
            Err(refusal) => {
                let reason = refusal.0;
                return Err(CoordinatorError::RolloutRefused { model, reason }.into());
            }
        };
        let acted = action.is_some();
        if let Some(action) = action {
            let groups = (summary.models.get(&model))
                .map(|m| m.groups.clone())
                .unwrap_or_default();
            let command = rollout_command(&model, &rollout, &groups, action)?;
            let manual_rollback = matches!(command, RolloutCommand::Rollback { .. });
            let proposal = self
                .node
                .propose(Command::Rollout(command), JOURNAL_TIMEOUT);
            let outcome = match proposal.await {
                Ok(applied) => applied.outcome,
                Err(source) => {
                    return Err(CoordinatorError::RolloutNotCommitted { model, source }.into());
                }
            };
            let reason = match outcome {
                Outcome::Applied => None,
                Outcome::Refused { reason } => Some(reason),
                other => Some(format!("{other:?}")),
            };
            if let Some(reason) = reason {
                return Err(CoordinatorError::RolloutRefused { model, reason }.into());
            }
            if manual_rollback {
                let labels = [("model", model.clone()), ("cause", "manual".to_string())];
                metrics::counter!(m::MODEL_ROLLBACKS, &labels).increment(1);
            }
        }
        let rollout = self
            .node
            .summary()
            .borrow()
            .versions(&model)
            .unwrap_or(rollout);
        if acted && let Some(event) = rollout.events.last() {
            info!(model, what = %event.what, "rollout");
        }
        Ok(status(&model, rollout, &cluster))
    }

    /// Follows the replicated versions while this peer leads in `term`: routing splits,
    /// canary verdicts, and groups moved one at a time. `sent`: the version each group
    /// was started on.
    pub(super) async fn follow_rollouts(
        self,
        cluster: Cluster,
        term: Term,
        thresholds: Thresholds,
        ready_wait: Duration,
    ) {
        let mut summary = self.node.summary();
        let mut tick = tokio::time::interval(FOLLOW_EVERY);
        let mut moving: Option<JoinHandle<()>> = None;
        loop {
            if self.leading().is_none_or(|l| l.term != term) {
                return;
            }
            let now = summary.borrow_and_update().clone();
            let mut rolled_back = false;
            for (model, rollout) in &now.rollouts {
                export(model, rollout);
                let canary = rollout.canary.as_ref().map(|c| (c.version, c.percent));
                cluster.set_split(model, canary);
                rolled_back |= self.judge(&cluster, model, rollout, &thresholds).await;
            }
            if rolled_back {
                continue; // the state changed: act on it now
            }
            if moving.as_ref().is_none_or(JoinHandle::is_finished) {
                // A group is compared with what it was last asked to serve (or started
                // with: a group the topology adds starts on its target).
                let targets = targets(&now, &self.topology.current());
                let next = (targets.into_iter())
                    .filter_map(|(name, source)| Some((cluster.group(&name)?, source)))
                    .find(|(group, source)| group.asked() != *source);
                if let Some((group, source)) = next {
                    // Out of routing before this loop goes on (a rolled-back canary
                    // takes no request from now on).
                    group.set_switching(true);
                    moving = Some(tokio::spawn(switch_group(group, source, ready_wait)));
                }
            }
            tokio::select! {
                changed = summary.changed() => if changed.is_err() { return },
                _ = tick.tick() => {}
            }
        }
    }

    /// Rolls `model`'s canary back when its requests over the window fail the
    /// thresholds; true when it did.
    async fn judge(
        &self,
        cluster: &Cluster,
        model: &str,
        rollout: &Rollout,
        thresholds: &Thresholds,
    ) -> bool {
        let since = Instant::now()
            .checked_sub(thresholds.window)
            .unwrap_or_else(Instant::now);
        let outcomes = cluster.outcomes();
        let Some(canary) = &rollout.canary else {
            outcomes.retain(model, &[rollout.stable], since);
            return false;
        };
        outcomes.retain(model, &[rollout.stable, canary.version], since);
        let trial = outcomes.since(model, canary.version, since);
        let stable = outcomes.since(model, rollout.stable, since);
        let Some(verdict) = canary::judge(&trial, &stable, thresholds) else {
            return false;
        };
        warn!(model, version = canary.version, %verdict, "canary failing: rolling it back");
        let command = Command::Rollout(RolloutCommand::Rollback {
            model: model.to_string(),
            to: None,
            reason: format!("automatic: {verdict}"),
            at_ms: now_ms(),
        });
        match self.node.propose(command, JOURNAL_TIMEOUT).await {
            Ok(applied) if applied.outcome == Outcome::Applied => {
                cluster.set_split(model, None);
                let labels = [("model", model.to_string()), ("cause", "automatic".into())];
                metrics::counter!(m::MODEL_ROLLBACKS, &labels).increment(1);
                true
            }
            Ok(applied) => {
                warn!(model, outcome = ?applied.outcome, "canary rollback refused");
                false
            }
            Err(error) => {
                warn!(model, %error, "canary rollback not committed");
                false
            }
        }
    }
}

/// The command for `action` on `model` (whose groups are `groups`), its files checked
/// here: a deploy's path must hold a model config this peer reads, with the vocabulary
/// of the stable version (the API tokenizes with it).
fn rollout_command(
    model: &str,
    rollout: &Rollout,
    groups: &[String],
    action: RolloutAction,
) -> Result<RolloutCommand, CoordinatorError> {
    let model = model.to_string();
    let at_ms = now_ms();
    Ok(match action {
        RolloutAction::Deploy {
            path,
            canary_percent,
            groups: on,
        } => {
            let path = checked_path(&path, rollout)?;
            let canary = match (canary_percent, on.is_empty()) {
                (None, true) => None,
                (Some(percent), true) => {
                    Some((percent, groups.last().cloned().into_iter().collect()))
                }
                (Some(percent), false) => Some((percent, on)),
                (None, false) => {
                    let share = 100 * on.len() / groups.len().max(1);
                    Some((u8::try_from(share).unwrap_or(100), on))
                }
            };
            RolloutCommand::Deploy {
                model,
                path,
                canary,
                at_ms,
            }
        }
        RolloutAction::Promote => RolloutCommand::Promote { model, at_ms },
        RolloutAction::Rollback { to } => RolloutCommand::Rollback {
            model,
            to,
            reason: "asked through the API".into(),
            at_ms,
        },
    })
}

/// `path` made absolute, once it holds a model whose vocabulary matches the stable
/// version's.
fn checked_path(path: &str, rollout: &Rollout) -> Result<String, CoordinatorError> {
    let bad = |reason: String| CoordinatorError::BadModelPath {
        path: path.to_string(),
        reason,
    };
    let absolute = std::fs::canonicalize(path).map_err(|e| bad(e.to_string()))?;
    let config = ModelConfig::from_path(&absolute).map_err(|e| bad(e.to_string()))?;
    let stable = rollout.version(rollout.stable).map(|v| Path::new(&v.path));
    if let Some(stable) = stable.and_then(|p| ModelConfig::from_path(p).ok())
        && stable.vocab_size != config.vocab_size
    {
        return Err(bad(format!(
            "its vocabulary has {} tokens, the stable version's {}: a new version must keep \
             the model's tokenizer",
            config.vocab_size, stable.vocab_size
        )));
    }
    Ok(absolute.display().to_string())
}

/// Moves `group` (taken out of routing by the caller) to model version `source`: its
/// requests finish (for up to [`GROUP_DRAIN`]), a new epoch serves the version, and it
/// is back in routing.
async fn switch_group(group: GroupHandle, source: ModelSource, ready_wait: Duration) {
    let version = source.version;
    info!(group = %group.name, version, "moving the group to another model version: draining it");
    group.until_idle(GROUP_DRAIN).await;
    if group.serve(source).await.is_ok() {
        let until = Instant::now() + ready_wait;
        while !(group.is_ready() && group.version() == version) {
            if Instant::now() >= until {
                warn!(group = %group.name, version, waited_s = ready_wait.as_secs(), "the group did not serve the new version in time");
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    if group.version() == version {
        info!(group = %group.name, version, "the group serves the new version");
    }
    group.set_switching(false);
}

/// `model`'s stable and canary versions and the canary's weight, as gauges.
fn export(model: &str, rollout: &Rollout) {
    let label = |role: &str| [("model", model.to_string()), ("role", role.to_string())];
    metrics::gauge!(m::MODEL_VERSION, &label("stable")).set(f64::from(rollout.stable));
    let (version, percent) = rollout
        .canary
        .as_ref()
        .map_or((0, 0), |c| (c.version, c.percent));
    metrics::gauge!(m::MODEL_VERSION, &label("canary")).set(f64::from(version));
    metrics::gauge!(m::MODEL_CANARY_PERCENT, "model" => model.to_string()).set(f64::from(percent));
}

/// What `tessera model status` shows.
fn status(model: &str, rollout: Rollout, cluster: &Cluster) -> VersionsStatus {
    let groups = cluster
        .groups()
        .into_iter()
        .filter(|g| g.model == model)
        .map(|g| {
            let status = g.status();
            GroupVersion {
                name: g.name.clone(),
                version: g.version(),
                target: rollout.version_for(&g.name),
                switching: g.is_switching(),
                state: status.state,
            }
        })
        .collect();
    VersionsStatus {
        model: model.to_string(),
        stable: rollout.stable,
        previous: rollout.previous,
        canary: rollout.canary,
        versions: rollout.versions,
        events: rollout.events,
        groups,
    }
}
