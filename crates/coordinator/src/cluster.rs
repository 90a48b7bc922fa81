//! The coordinator's view of the cluster: every group's handle, by model, and the
//! [`Engine`] the HTTP API calls — it routes a request to a group of its model.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tessera_comm::proto::{Epoch, ModelSource, Term, WireError};
use tessera_topology::{Collective, Group, Topology};

use crate::canary::Outcomes;
use crate::engine::{BoxFuture, ClusterStatus, Engine, GenerateRequest, GroupStatus, TokenStream};
use crate::error::CoordinatorError;
use crate::group::GroupHandle;
use crate::group::driver::{self, EpochJournal, GroupCollective, GroupConfig, Limits};
use crate::group::scheduler::SchedulerConfig;

/// Every group of the topology, with a running driver each.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// Groups come and go as topologies are applied ([`Cluster::add_group`],
    /// [`Cluster::remove_group`]).
    groups: Arc<RwLock<BTreeMap<String, GroupHandle>>>,
    /// What every group's driver starts with.
    spawn: Arc<Spawn>,
    /// Prompt prefix key → the group that last got it.
    affinity: Arc<Mutex<HashMap<u64, String>>>,
    /// Per model with a canary: how its requests split between versions.
    splits: Arc<Mutex<HashMap<String, Split>>>,
    /// Every request's end, per model version, as the groups count them.
    outcomes: Arc<Outcomes>,
}

/// What a group's driver is started with, besides its topology entry.
#[derive(Debug)]
struct Spawn {
    term: Term,
    limits: Limits,
    journal: Option<EpochJournal>,
    /// Numbered from the term up, so that sequences shards carry over from an earlier
    /// leader's epoch keep ids no new sequence takes.
    seq_ids: Arc<AtomicU64>,
}

/// A model's canary: `percent` of its requests go to groups serving `version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    version: u32,
    percent: u8,
    /// Requests split so far.
    routed: u64,
}

impl Cluster {
    /// Starts one driver per group of `topology`. Must run inside a tokio runtime.
    pub fn start(topology: &Topology, term: Term, limits: Limits) -> Cluster {
        Cluster::start_recorded(
            topology,
            term,
            limits,
            &BTreeMap::new(),
            None,
            &BTreeMap::new(),
        )
    }

    /// [`Cluster::start`], each group's epochs starting after `epochs[group]` and recorded,
    /// with its ready shards, in `journal`; each group serving the model version
    /// `sources[group]` (by default version 1, its topology's files).
    pub fn start_recorded(
        topology: &Topology,
        term: Term,
        limits: Limits,
        epochs: &BTreeMap<String, u64>,
        journal: Option<EpochJournal>,
        sources: &BTreeMap<String, ModelSource>,
    ) -> Cluster {
        let cluster = Cluster {
            groups: Arc::default(),
            spawn: Arc::new(Spawn {
                term,
                limits,
                journal,
                seq_ids: Arc::new(AtomicU64::new((term.0 << 40) + 1)),
            }),
            affinity: Arc::new(Mutex::new(HashMap::new())),
            splits: Arc::new(Mutex::new(HashMap::new())),
            outcomes: Arc::new(Outcomes::default()),
        };
        for g in &topology.groups {
            let epoch = Epoch(epochs.get(&g.name).copied().unwrap_or(0));
            let source = (sources.get(&g.name).cloned())
                .unwrap_or_else(|| first_version(topology, &g.model));
            cluster.add_group(topology, g, epoch, source);
        }
        cluster
    }

    /// Starts a driver for `group` of `topology`, its epochs after `epoch`, serving model
    /// version `source`. A group of that name already running is left as it is.
    pub fn add_group(&self, topology: &Topology, group: &Group, epoch: Epoch, source: ModelSource) {
        let mut groups = self.groups.write().unwrap_or_else(PoisonError::into_inner);
        if groups.contains_key(&group.name) {
            return;
        }
        let collective = match group.collective {
            Collective::Shm => GroupCollective::Shm,
            Collective::Nccl => GroupCollective::Nccl,
            Collective::Tcp => GroupCollective::Tcp {
                peers: (group.shards.iter())
                    .map(|s| {
                        let address = topology
                            .host(&s.host)
                            .map_or(s.host.as_str(), |h| h.address.as_str());
                        if address.contains(':') {
                            format!("[{address}]:{}", s.port)
                        } else {
                            format!("{address}:{}", s.port)
                        }
                    })
                    .collect(),
            },
        };
        let spawn = &self.spawn;
        let config = GroupConfig {
            name: group.name.clone(),
            model: group.model.clone(),
            tp: group.tp,
            collective,
            hosts: group.shards.iter().map(|s| s.host.clone()).collect(),
            term: spawn.term,
            limits: spawn.limits,
            scheduler: SchedulerConfig::default(),
            first_epoch: epoch,
            journal: spawn.journal.clone(),
            source,
            outcomes: Arc::clone(&self.outcomes),
        };
        let handle = driver::spawn(config, Arc::clone(&spawn.seq_ids));
        groups.insert(group.name.clone(), handle);
    }

    /// Takes `group` out of the cluster: no request reaches it any more, and its driver
    /// asks its shards to exit ([`GroupHandle::stop`]). Drain it first.
    pub async fn remove_group(&self, group: &str) {
        let removed = (self.groups.write())
            .unwrap_or_else(PoisonError::into_inner)
            .remove(group);
        if let Some(handle) = removed {
            handle.stop().await;
        }
    }

    /// Every request's end, per model version.
    pub fn outcomes(&self) -> &Arc<Outcomes> {
        &self.outcomes
    }

    /// The groups, by name.
    pub fn groups(&self) -> Vec<GroupHandle> {
        let groups = self.groups.read().unwrap_or_else(PoisonError::into_inner);
        groups.values().cloned().collect()
    }

    /// Sends `percent` of `model`'s requests to its groups serving `version` (a canary),
    /// or, with `None`, routes by load alone.
    pub fn set_split(&self, model: &str, canary: Option<(u32, u8)>) {
        let mut splits = self.splits.lock().unwrap_or_else(PoisonError::into_inner);
        match canary {
            None => {
                splits.remove(model);
            }
            Some((version, percent)) => {
                let fresh = Split {
                    version,
                    percent,
                    routed: 0,
                };
                let split = splits.entry(model.to_string()).or_insert(fresh);
                // A new canary, or a new weight, counts its requests afresh.
                if (split.version, split.percent) != (version, percent) {
                    *split = fresh;
                }
            }
        }
    }

    /// Which side of `model`'s canary split the next request goes to: `Some(true)` for
    /// the canary version, `None` without a split.
    fn next_side(&self, model: &str) -> Option<(u32, bool)> {
        let mut splits = self.splits.lock().unwrap_or_else(PoisonError::into_inner);
        let split = splits.get_mut(model)?;
        let canary = to_canary(split.routed, split.percent);
        split.routed += 1;
        Some((split.version, canary))
    }

    pub fn group(&self, name: &str) -> Option<GroupHandle> {
        let groups = self.groups.read().unwrap_or_else(PoisonError::into_inner);
        groups.get(name).cloned()
    }

    /// Queues `request` (journal id `id`) on a group of its model, to go on after the
    /// `generated` tokens it produced before (a resumed request: the group runs it on from
    /// its shards' cache when they still hold it, else recomputes prompt + `generated`).
    /// With several groups of one model, the group chosen may not be the one that held
    /// it; that one frees it after a grace period.
    pub async fn generate_after(
        &self,
        id: String,
        request: GenerateRequest,
        generated: Vec<u32>,
    ) -> Result<TokenStream, WireError> {
        let Some(group) = self.route(&request) else {
            return Err(self.no_route(request.model));
        };
        group.generate(id, request, generated).await
    }

    /// Why no group of `model` takes requests: it has none, or every one is drained or
    /// moving to another version.
    fn no_route(&self, model: String) -> WireError {
        let groups = self.groups();
        let of_model = || groups.iter().filter(|g| g.model == model);
        let switching: Vec<String> = (of_model())
            .filter(|g| !g.is_drained())
            .map(|g| g.name.clone())
            .collect();
        let all: Vec<String> = of_model().map(|g| g.name.clone()).collect();
        if all.is_empty() {
            CoordinatorError::NoGroupForModel { model }.into()
        } else if switching.is_empty() {
            CoordinatorError::ModelDrained {
                model,
                drained: all,
            }
            .into()
        } else {
            CoordinatorError::ModelSwitching { model, switching }.into()
        }
    }

    /// Takes `group` out of routing, or back in; `false` when there is no such group.
    pub fn set_drained(&self, group: &str, drained: bool) -> bool {
        self.group(group).map(|g| g.set_drained(drained)).is_some()
    }

    /// The group for a request: see [`pick`]. Remembers which group got which prompt
    /// prefix, so that requests sharing one land where its KV blocks are cached.
    fn route(&self, request: &GenerateRequest) -> Option<GroupHandle> {
        let all = self.groups();
        let mut groups: Vec<&GroupHandle> = all
            .iter()
            .filter(|g| g.model == request.model && !g.is_drained() && !g.is_switching())
            .collect();
        // With a canary, the split picks the version's groups (while both sides have
        // one: a side whose groups are all away gives its share to the other).
        if let Some((version, canary)) = self.next_side(&request.model) {
            let side: Vec<&GroupHandle> = (groups.iter().copied())
                .filter(|g| (g.version() == version) == canary)
                .collect();
            if !side.is_empty() {
                groups = side;
            }
        }
        let loads: Vec<Load> = groups.iter().map(|g| Load::of(&g.status())).collect();
        let key = prefix_key(&request.prompt);
        let mut affinity = self.affinity.lock().unwrap_or_else(PoisonError::into_inner);
        let preferred = key
            .and_then(|k| affinity.get(&k))
            .and_then(|name| groups.iter().position(|g| &g.name == name));
        let chosen = groups.get(pick(&loads, preferred)?)?;
        if let Some(k) = key {
            if affinity.len() >= AFFINITY_ENTRIES {
                affinity.clear();
            }
            affinity.insert(k, chosen.name.clone());
        }
        Some((*chosen).clone())
    }
}

/// Prompt prefixes remembered for routing (cleared when full: a cheap bound).
const AFFINITY_ENTRIES: usize = 4096;

/// Tokens of a prompt that key its routing affinity: a few KV blocks' worth, so requests
/// with one system prompt share a key.
const AFFINITY_TOKENS: usize = 64;

fn prefix_key(prompt: &[u32]) -> Option<u64> {
    (prompt.len() > AFFINITY_TOKENS).then(|| {
        let mut h = DefaultHasher::new();
        prompt[..AFFINITY_TOKENS].hash(&mut h);
        h.finish()
    })
}

/// What routing weighs of one group.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Load {
    serving: bool,
    waiting: usize,
    running: usize,
    /// Fraction of KV blocks not in use.
    headroom: f64,
}

impl Load {
    fn of(s: &GroupStatus) -> Load {
        Load {
            serving: s.state == "serving",
            waiting: s.waiting,
            running: s.running,
            headroom: if s.kv_blocks == 0 {
                0.0
            } else {
                1.0 - f64::from(s.kv_blocks_used) / f64::from(s.kv_blocks)
            },
        }
    }

    /// Lower is better: queued work first, then running work, less the free KV share.
    fn cost(&self) -> f64 {
        4.0 * self.waiting as f64 + self.running as f64 - 8.0 * self.headroom
    }
}

/// The group to route to: serving groups before others (a request may wait for a group
/// to come up), the least loaded first; the `preferred` one (prefix affinity) when its
/// cost is within a few requests of the best.
fn pick(loads: &[Load], preferred: Option<usize>) -> Option<usize> {
    let serving = loads.iter().any(|l| l.serving);
    let candidates = (0..loads.len()).filter(|&i| loads[i].serving || !serving);
    let best = candidates.min_by(|&a, &b| loads[a].cost().total_cmp(&loads[b].cost()))?;
    match preferred {
        Some(p)
            if (loads[p].serving || !serving) && loads[p].cost() <= loads[best].cost() + 8.0 =>
        {
            Some(p)
        }
        _ => Some(best),
    }
}

impl Engine for Cluster {
    fn generate(
        &self,
        id: String,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<TokenStream, WireError>> {
        Box::pin(self.generate_after(id, request, Vec::new()))
    }

    fn admission(&self, model: &str) -> Result<(), WireError> {
        let groups = self.groups();
        let mut of_model = groups.iter().filter(|g| g.model == model).peekable();
        if of_model.peek().is_none() {
            return Ok(());
        }
        let mut open = of_model
            .filter(|g| !g.is_drained() && !g.is_switching())
            .peekable();
        if open.peek().is_none() {
            return Err(self.no_route(model.to_string()));
        }
        if open.any(|g| !g.queue_full()) {
            return Ok(());
        }
        let model = model.to_string();
        Err(CoordinatorError::QueuesFull { model }.into())
    }

    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            peers: Vec::new(),
            models: Vec::new(),
            groups: self.groups().iter().map(GroupHandle::status).collect(),
        }
    }

    fn ready(&self, model: &str) -> bool {
        let groups = self.groups();
        model_ready(groups.iter().filter(|g| g.model == model).map(|g| {
            let serving = g.is_ready() && !g.is_drained() && !g.is_switching();
            (g.has_warmed(), serving)
        }))
    }
}

/// Version 1 of `model`: its files as `topology` names them.
pub fn first_version(topology: &Topology, model: &str) -> ModelSource {
    let path = topology.model(model).map(|m| m.path.display().to_string());
    ModelSource {
        version: 1,
        path: path.unwrap_or_default(),
    }
}

/// Whether request `n` (from 0) of a split goes to the canary: exactly `percent` of
/// every 100 consecutive requests do, spread evenly.
fn to_canary(n: u64, percent: u8) -> bool {
    let p = u64::from(percent.min(100));
    (n + 1) * p / 100 > n * p / 100
}

/// Whether a model whose groups are `(warmed up, serving now and not drained)` is ready:
/// it has groups, every one has warmed up (served an epoch), so none gets its first
/// requests cold, and one serves now.
fn model_ready(groups: impl Iterator<Item = (bool, bool)>) -> bool {
    let (mut any, mut all_warmed, mut serving) = (false, true, false);
    for (warmed, ready) in groups {
        any = true;
        all_warmed &= warmed;
        serving |= ready;
    }
    any && all_warmed && serving
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_ready_once_every_group_has_warmed_up_and_one_serves() {
        let ready = |groups: &[(bool, bool)]| model_ready(groups.iter().copied());
        assert!(!ready(&[]), "no group");
        assert!(ready(&[(true, true)]));
        assert!(
            !ready(&[(true, true), (false, false)]),
            "a group still warming up"
        );
        assert!(
            ready(&[(true, true), (true, false)]),
            "a group fenced later"
        );
        assert!(!ready(&[(true, false), (true, false)]), "none serving");
    }

    fn load(serving: bool, waiting: usize, running: usize, headroom: f64) -> Load {
        Load {
            serving,
            waiting,
            running,
            headroom,
        }
    }

    #[test]
    fn routing_prefers_serving_then_light_then_affine_groups() {
        assert_eq!(pick(&[], None), None);
        // A group that is down only gets requests when no group serves.
        let down_idle = load(false, 0, 0, 1.0);
        let busy = load(true, 3, 10, 0.2);
        assert_eq!(pick(&[down_idle, busy], None), Some(1));
        assert_eq!(pick(&[down_idle, load(false, 5, 0, 0.0)], None), Some(0));
        // The least loaded serving group…
        let light = load(true, 0, 2, 0.9);
        assert_eq!(pick(&[busy, light], None), Some(1));
        // …unless the prefix's group is close enough.
        let warm = load(true, 0, 5, 0.7);
        assert_eq!(pick(&[light, warm], Some(1)), Some(1));
        assert_eq!(pick(&[light, busy], Some(1)), Some(0));
    }

    #[test]
    fn a_split_sends_exactly_its_percent_to_the_canary_in_every_hundred() {
        for percent in [0u8, 1, 10, 25, 33, 50, 99, 100] {
            for start in [0u64, 100, 1_000_000] {
                let sent = (start..start + 100)
                    .filter(|&n| to_canary(n, percent))
                    .count();
                assert_eq!(sent, usize::from(percent), "{percent}% from {start}");
            }
        }
        // Spread: 25% is one request in every 4.
        let first: Vec<bool> = (0..8).map(|n| to_canary(n, 25)).collect();
        assert_eq!(first.iter().filter(|&&c| c).count(), 2);
        assert!(!first[..3].iter().all(|&c| c) && first[..4].iter().any(|&c| c));
    }

    #[test]
    fn only_prompts_longer_than_the_affinity_window_have_a_key() {
        let long: Vec<u32> = (0..100).collect();
        let mut other = long.clone();
        other[99] = 7;
        assert_eq!(prefix_key(&long), prefix_key(&other));
        assert!(prefix_key(&long[..64]).is_none());
    }
}
