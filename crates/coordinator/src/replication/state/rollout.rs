//! Model versions and rollouts, as the replicated state holds them: a pure core.
//!
//! A model starts at version 1, the files its topology names. `Deploy` adds a version:
//! - with a canary, the groups named (by default the model's last group) serve it and
//!   routing sends it `percent` of the model's requests; the others keep the stable
//!   version. `Promote` makes it stable everywhere, `Rollback` takes it out.
//! - without a canary, it is stable at once, and every group moves to it.
//!
//! Which version each group should serve follows from this state alone
//! ([`Rollout::version_for`]); the leader moves groups there one at a time
//! (`crate::leader::rollout`). [`KEPT_VERSIONS`] versions stay known, so that a rollback
//! can go back to one of them; the last [`KEPT_EVENTS`] events are kept for the status.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ModelRecord;

/// How many versions of a model stay known.
pub const KEPT_VERSIONS: usize = 3;
/// How many rollout events of a model stay known.
pub const KEPT_EVENTS: usize = 8;

/// One version of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    pub version: u32,
    /// Its files, as the leader that recorded it resolved them.
    pub path: String,
    /// When it was deployed (Unix milliseconds; 0 for the topology's version 1).
    pub deployed_ms: u64,
}

/// A version on trial: served by `groups` and given `percent` of the model's requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Canary {
    pub version: u32,
    pub percent: u8,
    pub groups: Vec<String>,
}

/// Something that happened to a model's versions, for the status page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutEvent {
    pub at_ms: u64,
    pub what: String,
}

/// The versions of one model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    /// Oldest first; at most [`KEPT_VERSIONS`].
    pub versions: Vec<Version>,
    pub stable: u32,
    /// The version that was stable before `stable`: where a plain rollback goes.
    pub previous: Option<u32>,
    pub canary: Option<Canary>,
    /// Oldest first; at most [`KEPT_EVENTS`].
    pub events: Vec<RolloutEvent>,
}

/// A change to a model's versions, as the leader proposes it (checked again as it is
/// applied, so that of two racing proposals the second is refused).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutCommand {
    /// A new version from `path`; `canary`: its percent of the traffic and its groups.
    Deploy {
        model: String,
        path: String,
        canary: Option<(u8, Vec<String>)>,
        at_ms: u64,
    },
    /// The canary becomes the stable version on every group.
    Promote { model: String, at_ms: u64 },
    /// The canary is taken out; without one, version `to` (by default the previous
    /// stable one) becomes stable. `reason` says who asked, and why.
    Rollback {
        model: String,
        to: Option<u32>,
        reason: String,
        at_ms: u64,
    },
}

impl RolloutCommand {
    pub fn model(&self) -> &str {
        match self {
            RolloutCommand::Deploy { model, .. }
            | RolloutCommand::Promote { model, .. }
            | RolloutCommand::Rollback { model, .. } => model,
        }
    }
}

/// Why a rollout command changed nothing: a sentence saying what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

impl Rollout {
    /// A model as its topology serves it: version 1 from `record.path`, stable.
    pub fn initial(record: &ModelRecord) -> Rollout {
        Rollout {
            versions: vec![Version {
                version: 1,
                path: record.path.clone(),
                deployed_ms: 0,
            }],
            stable: 1,
            previous: None,
            canary: None,
            events: Vec::new(),
        }
    }

    /// The version `group` should serve.
    pub fn version_for(&self, group: &str) -> u32 {
        match &self.canary {
            Some(c) if c.groups.iter().any(|g| g == group) => c.version,
            _ => self.stable,
        }
    }

    pub fn version(&self, version: u32) -> Option<&Version> {
        self.versions.iter().find(|v| v.version == version)
    }

    /// Applies `command` to this model (whose groups are `groups`), or says why not.
    pub fn apply(&mut self, command: &RolloutCommand, groups: &[String]) -> Result<(), Refusal> {
        match command {
            RolloutCommand::Deploy {
                path,
                canary,
                at_ms,
                ..
            } => self.deploy(path, canary.as_ref(), groups, *at_ms),
            RolloutCommand::Promote { at_ms, .. } => {
                let Some(canary) = self.canary.take() else {
                    return Err(Refusal(
                        "there is no canary to promote: deploy one with --canary first".into(),
                    ));
                };
                self.previous = Some(self.stable);
                self.stable = canary.version;
                let what = format!("version {} promoted: stable on every group", canary.version);
                self.event(*at_ms, what);
                Ok(())
            }
            RolloutCommand::Rollback {
                to, reason, at_ms, ..
            } => self.rollback(*to, reason, *at_ms),
        }
    }

    fn deploy(
        &mut self,
        path: &str,
        canary: Option<&(u8, Vec<String>)>,
        groups: &[String],
        at_ms: u64,
    ) -> Result<(), Refusal> {
        if let Some(c) = &self.canary {
            return Err(Refusal(format!(
                "version {} is still a canary: promote it or roll it back before deploying \
                 another version",
                c.version
            )));
        }
        let version = self.versions.iter().map(|v| v.version).max().unwrap_or(0) + 1;
        let what = match canary {
            Some((percent, on)) => {
                check_canary(*percent, on, groups)?;
                self.canary = Some(Canary {
                    version,
                    percent: *percent,
                    groups: on.clone(),
                });
                format!(
                    "version {version} deployed from {path} as a canary: {percent}% of the \
                     requests, on {}",
                    on.join(", ")
                )
            }
            None => {
                self.previous = Some(self.stable);
                self.stable = version;
                format!("version {version} deployed from {path}: stable, rolling group by group")
            }
        };
        self.versions.push(Version {
            version,
            path: path.to_string(),
            deployed_ms: at_ms,
        });
        self.trim();
        self.event(at_ms, what);
        Ok(())
    }

    fn rollback(&mut self, to: Option<u32>, reason: &str, at_ms: u64) -> Result<(), Refusal> {
        if let Some(canary) = self.canary.take() {
            if let Some(to) = to.filter(|&t| t != self.stable) {
                self.canary = Some(canary);
                return Err(Refusal(format!(
                    "version {to} is not stable: while a canary runs, a rollback returns to \
                     the stable version {} (leave out --to)",
                    self.stable
                )));
            }
            let what = format!(
                "canary version {} rolled back ({reason}): version {} serves every group",
                canary.version, self.stable
            );
            self.event(at_ms, what);
            return Ok(());
        }
        let Some(target) = to.or(self.previous) else {
            return Err(Refusal(
                "there is no earlier version to roll back to: name one with --to".into(),
            ));
        };
        if target == self.stable {
            return Err(Refusal(format!("version {target} is already stable")));
        }
        if self.version(target).is_none() {
            return Err(Refusal(format!(
                "version {target} is not known: the known versions are {}",
                self.known()
            )));
        }
        self.previous = Some(self.stable);
        self.stable = target;
        let what = format!("rolled back to version {target} ({reason})");
        self.event(at_ms, what);
        Ok(())
    }

    /// The known versions, as a list for a message.
    fn known(&self) -> String {
        let known: Vec<String> = self
            .versions
            .iter()
            .map(|v| v.version.to_string())
            .collect();
        known.join(", ")
    }

    /// Drops the oldest versions that nothing refers to, down to [`KEPT_VERSIONS`].
    fn trim(&mut self) {
        while self.versions.len() > KEPT_VERSIONS {
            let used = |v: u32| {
                v == self.stable
                    || self.previous == Some(v)
                    || self.canary.as_ref().is_some_and(|c| c.version == v)
            };
            let Some(i) = self.versions.iter().position(|v| !used(v.version)) else {
                return;
            };
            self.versions.remove(i);
        }
        if self.previous.is_some_and(|p| self.version(p).is_none()) {
            self.previous = None;
        }
    }

    fn event(&mut self, at_ms: u64, what: String) {
        self.events.push(RolloutEvent { at_ms, what });
        if self.events.len() > KEPT_EVENTS {
            self.events.remove(0);
        }
    }
}

/// `model`'s versions as `rollouts` holds them (version 1 alone, for a model never
/// deployed to) and its record; or, for a model not recorded, why not (a sentence
/// for after the model's name).
pub fn versions_of<'a>(
    models: &'a BTreeMap<String, ModelRecord>,
    rollouts: &BTreeMap<String, Rollout>,
    model: &str,
) -> Result<(Rollout, &'a ModelRecord), Refusal> {
    let Some(record) = models.get(model) else {
        let known: Vec<&str> = models.keys().map(String::as_str).collect();
        return Err(Refusal(format!(
            "not served here: the models are {}",
            known.join(", ")
        )));
    };
    let rollout = (rollouts.get(model).cloned()).unwrap_or_else(|| Rollout::initial(record));
    Ok((rollout, record))
}

/// A canary's weight is 0 to 100, and its groups are some, not all, of the model's.
fn check_canary(percent: u8, on: &[String], groups: &[String]) -> Result<(), Refusal> {
    if percent > 100 {
        return Err(Refusal(format!(
            "canary weight {percent}% is outside 0 to 100"
        )));
    }
    if on.is_empty() {
        return Err(Refusal("a canary needs at least one group".into()));
    }
    if let Some(unknown) = on.iter().find(|g| !groups.contains(g)) {
        return Err(Refusal(format!(
            "group `{unknown}` does not serve this model: its groups are {}",
            groups.join(", ")
        )));
    }
    if on.len() >= groups.len() {
        return Err(Refusal(format!(
            "a canary on every group ({}) leaves none to serve the stable version: name \
             fewer groups, or deploy without --canary to roll every group",
            groups.join(", ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
