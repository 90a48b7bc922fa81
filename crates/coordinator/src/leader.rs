//! A coordinator peer under Raft. It drives the groups only while it leads: when it
//! becomes leader of term T it starts a [`Cluster`] whose plans carry T (shards ignore
//! plans of an older term), and when it stops leading it drops that cluster, which closes
//! the shards' connections so they register with the new leader.
//!
//! As the API's [`Engine`](crate::engine::Engine) ([`engine`]), it journals each request before the request starts: an
//! `Accept` entry is committed first, then the tokens are checkpointed as they come
//! (`Progress`, batched by the commit latency), and the end (`Finish`). A new leader
//! resumes every request the journal holds open: it runs the prompt plus the tokens
//! already checkpointed, for the tokens still to come ([`journal`]), and a client that
//! reconnects reads the request's tail from any token offset on
//! ([`Engine::resume`](crate::engine::Engine::resume)).

mod bounds;
mod engine;
mod journal;
mod reshape;
mod rollout;

use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_comm::proto::{FinishReason, Term, WireError};
use tessera_topology::{CoordinatorPeer, PeerId};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::canary::Thresholds;
use crate::cluster::Cluster;
use crate::engine::PeerStatus;
use crate::error::CoordinatorError;
use crate::group::driver::{EpochJournal, Limits};
use crate::live::{LiveTopology, model_records};
use crate::replication::node::NodeHandle;
use crate::replication::peer::Role;
use crate::replication::state::{Command, Journaled, Member, Summary};
use journal::{Ending, Tail, Tails};

/// How long a request waits for its journal entry to commit.
pub const JOURNAL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a group leaving routing (moving to another model version, or removed from
/// the topology) waits for its requests to finish; what still runs then fails (and may
/// be resumed by its client).
const GROUP_DRAIN: Duration = Duration::from_secs(30);
/// How long a membership change may take to commit (a new peer may catch up first).
const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a request waits for an election under way before it is refused.
pub const ELECTION_WAIT: Duration = Duration::from_secs(3);

pub use bounds::{JournalBudget, JournalLimits, Reservation};

/// This peer's place in the coordinator group; cheap to clone.
#[derive(Clone, Debug)]
pub struct Leadership {
    me: PeerId,
    node: NodeHandle,
    /// The topology in force: the file's, or the last one applied.
    topology: LiveTopology,
    leading: Arc<RwLock<Option<Leading>>>,
    tails: Tails,
    budget: JournalBudget,
    /// When a canary is rolled back.
    canary: Thresholds,
}

#[derive(Clone, Debug)]
struct Leading {
    term: Term,
    cluster: Cluster,
}

/// Who leads, as [`Leadership::leader_soon`] finds out.
#[derive(Debug)]
pub enum Leader {
    /// This peer: its groups.
    This(Cluster),
    /// Another peer, at these addresses.
    Other {
        id: PeerId,
        http: String,
        quic: String,
    },
    /// No leader within [`ELECTION_WAIT`].
    Unknown,
}

/// This process, as it announces itself to the others.
#[derive(Clone, Debug)]
pub struct Announce {
    pub http: String,
    pub quic: String,
    pub pid: u32,
}

impl Leadership {
    /// Follows `node`'s role from now on, and announces this peer's addresses and pid in
    /// the replicated state. Must run inside a tokio runtime.
    pub fn start(
        me: PeerId,
        node: NodeHandle,
        topology: LiveTopology,
        limits: Limits,
        journal: JournalLimits,
        canary: Thresholds,
        announce: Announce,
    ) -> Leadership {
        let this = Leadership {
            canary,
            budget: JournalBudget::new(node.clone(), journal),
            me,
            node,
            topology,
            leading: Arc::default(),
            tails: Tails::default(),
        };
        tokio::spawn(this.clone().follow_role(limits));
        tokio::spawn(this.clone().announce(announce));
        tokio::spawn(this.clone().prune_by_age());
        tokio::spawn(bounds::export_usage(this.node.clone(), journal.budget));
        this
    }

    async fn follow_role(self, limits: Limits) {
        let mut role = self.node.role();
        loop {
            let now = *role.borrow_and_update();
            self.on_role(now, limits);
            if role.changed().await.is_err() {
                self.set(None);
                return;
            }
        }
    }

    fn on_role(&self, role: Role, limits: Limits) {
        let term = self.leading().map(|l| l.term);
        match (term, role.is_leader()) {
            (Some(t), true) if t == role.term => {}
            (_, true) => {
                info!(term = %role.term, "leading: driving the groups");
                let epochs = self
                    .node
                    .summary()
                    .borrow()
                    .groups
                    .iter()
                    .map(|(name, g)| (name.clone(), g.epoch))
                    .collect();
                let node = self.node.clone();
                let journal = EpochJournal(Arc::new(move |command| {
                    let node = node.clone();
                    tokio::spawn(async move {
                        if let Err(error) = node.propose(command, JOURNAL_TIMEOUT).await {
                            warn!(%error, "group change not recorded");
                        }
                    });
                }));
                let topology = self.topology.current();
                let sources = rollout::targets(&self.node.summary().borrow(), &topology);
                let cluster = Cluster::start_recorded(
                    &topology,
                    role.term,
                    limits,
                    &epochs,
                    Some(journal),
                    &sources,
                );
                self.set(Some(Leading {
                    term: role.term,
                    cluster: cluster.clone(),
                }));
                // Before any request is routed; then as every committed change says.
                set_drains(&cluster, &self.node.summary().borrow());
                tokio::spawn(self.clone().follow_drains(cluster.clone(), role.term));
                tokio::spawn(self.clone().follow_rollouts(
                    cluster.clone(),
                    role.term,
                    self.canary,
                    limits.assign_deadline,
                ));
                tokio::spawn(self.clone().follow_topology(cluster.clone(), role.term));
                tokio::spawn(self.clone().resume_open(cluster));
                tokio::spawn(self.clone().record_models());
            }
            (Some(_), false) => {
                info!(
                    term = %role.term,
                    leader = role.leader.map(|l| l.0),
                    "no longer leading: shards released"
                );
                self.set(None);
            }
            (None, false) => {}
        }
    }

    fn set(&self, leading: Option<Leading>) {
        *self.leading.write().unwrap_or_else(PoisonError::into_inner) = leading;
    }

    fn leading(&self) -> Option<Leading> {
        self.leading
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// This peer's id.
    pub fn id(&self) -> PeerId {
        self.me
    }

    /// The local Raft node.
    pub fn node(&self) -> NodeHandle {
        self.node.clone()
    }

    /// The groups, while this peer leads.
    pub fn cluster(&self) -> Option<Cluster> {
        self.leading().map(|l| l.cluster)
    }

    /// Who leads, waiting up to [`ELECTION_WAIT`] while no leader is known (an election
    /// under way) or while this peer, elected, is starting its groups.
    pub async fn leader_soon(&self) -> Leader {
        let deadline = Instant::now() + ELECTION_WAIT;
        loop {
            if let Some(cluster) = self.cluster() {
                return Leader::This(cluster);
            }
            if let Some((id, http)) = self.other_leader() {
                let quic = self.quic_of(id).unwrap_or_default();
                return Leader::Other { id, http, quic };
            }
            if Instant::now() >= deadline {
                return Leader::Unknown;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The groups, once this peer leads ([`Leadership::leader_soon`]).
    pub async fn cluster_soon(&self) -> Option<Cluster> {
        match self.leader_soon().await {
            Leader::This(cluster) => Some(cluster),
            _ => None,
        }
    }

    /// This peer's Raft role.
    pub fn role(&self) -> Role {
        *self.node.role().borrow()
    }

    /// The leader's id and HTTP address, when a leader is known and it is another peer.
    pub fn other_leader(&self) -> Option<(PeerId, String)> {
        let leader = self.role().leader.filter(|&l| l != self.me)?;
        Some((leader, self.http_of(leader)?))
    }

    fn http_of(&self, id: PeerId) -> Option<String> {
        self.address_of(id, |m| m.http.clone(), |c| c.http.to_string())
    }

    fn quic_of(&self, id: PeerId) -> Option<String> {
        self.address_of(id, |m| m.quic.clone(), |c| c.quic.to_string())
    }

    /// An address of peer `id`: as it announced itself, or else as the topology lists it.
    fn address_of(
        &self,
        id: PeerId,
        announced: impl Fn(&Member) -> String,
        listed: impl Fn(&CoordinatorPeer) -> String,
    ) -> Option<String> {
        if let Some(member) = self.node.summary().borrow().members.get(&id) {
            return Some(announced(member));
        }
        self.topology
            .current()
            .coordinators
            .iter()
            .find(|c| c.id == id)
            .map(listed)
    }

    /// Why this peer cannot take a request: another leads, or none does yet.
    pub fn not_leader(&self) -> WireError {
        let error = match self.other_leader() {
            Some((leader, http)) => CoordinatorError::NotLeader {
                me: self.me,
                leader,
                http,
            },
            None => CoordinatorError::NoLeader,
        };
        error.into()
    }

    /// Every peer of the configuration, as this peer sees them.
    pub fn peers(&self) -> Vec<PeerStatus> {
        let role = self.role();
        let summary = self.node.summary().borrow().clone();
        // The configuration's voters; the topology's peers until one is known.
        let mut ids = self.node.voters();
        if ids.is_empty() {
            ids = (self.topology.current().coordinators.iter())
                .map(|c| c.id)
                .collect();
        }
        ids.into_iter()
            .map(|id| {
                let member = summary.members.get(&id);
                PeerStatus {
                    id,
                    http: self.http_of(id).unwrap_or_default(),
                    role: match role.leader {
                        None => "unknown",
                        Some(l) if l == id => "leader",
                        Some(_) => "follower",
                    },
                    term: role.term,
                    pid: member.map(|m| m.pid).filter(|&p| p != 0),
                    this: id == self.me,
                }
            })
            .collect()
    }

    /// Resumes every request the journal holds open, in the order they were accepted.
    async fn resume_open(self, cluster: Cluster) {
        let open = self
            .node
            .read(|state| {
                let open = state.unfinished().into_iter();
                open.map(|(id, j)| (id.clone(), j.clone()))
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
        info!(
            requests = open.len(),
            "resuming the journal's open requests"
        );
        for (id, entry) in open {
            if let Err(error) = self.continue_request(&cluster, &id, &entry).await {
                warn!(request = %id, %error, "journaled request not resumed");
            }
        }
    }

    /// Runs the rest of journaled request `id` (no client attached: it runs to its end);
    /// its tail, which readers follow.
    async fn continue_request(
        &self,
        cluster: &Cluster,
        id: &str,
        entry: &Journaled,
    ) -> Result<watch::Receiver<Tail>, WireError> {
        let Some(tail) = self.tails.open(id, entry.sent.clone()) else {
            // Running already.
            return self.tails.get(id).ok_or_else(|| self.not_leader());
        };
        let readers = tail.subscribe();
        let (journal, events) = mpsc::unbounded_channel();
        tokio::spawn(journal::write(
            self.node.clone(),
            id.to_string(),
            entry.sent.clone(),
            events,
            self.tails.clone(),
        ));
        let sent = entry.sent.len();
        if sent >= entry.request.max_tokens as usize {
            // Every token was sent; only the end was lost.
            let ending = Ending::Finished(FinishReason::Length);
            tail.send_modify(|t| t.end = Some(ending));
            let _ = journal.send(journal::JournalEvent::End(ending));
            return Ok(readers);
        }
        info!(request = %id, sent, "resuming a journaled request");
        let request = entry.request.clone();
        match cluster
            .generate_after(id.to_string(), request, entry.sent.clone())
            .await
        {
            Ok(inner) => {
                tokio::spawn(journal::pump(inner, tail, journal, None));
                Ok(readers)
            }
            Err(error) => {
                tail.send_modify(|t| t.end = Some(Ending::Interrupted));
                let _ = journal.send(journal::JournalEvent::End(Ending::Interrupted));
                Err(error)
            }
        }
    }

    /// Keeps the groups' routing as the replicated state says (`GroupRecord::drained`)
    /// while this peer leads in `term`: at once, then on every change committed.
    async fn follow_drains(self, cluster: Cluster, term: Term) {
        let mut summary = self.node.summary();
        loop {
            set_drains(&cluster, &summary.borrow_and_update());
            if summary.changed().await.is_err() || self.leading().is_none_or(|l| l.term != term) {
                return;
            }
        }
    }

    /// Records the models this leader's file serves, where the replicated state holds
    /// them otherwise (a first leader, or a file changed across a restart). Once a
    /// topology is applied, its models stand (the state refuses these).
    async fn record_models(self) {
        let (recorded, applied) = {
            let summary = self.node.summary().borrow().clone();
            (summary.models.clone(), summary.topology.is_some())
        };
        if applied {
            return;
        }
        for (name, record) in model_records(&self.topology.current()) {
            if recorded.get(&name) == Some(&record) {
                continue;
            }
            let command = Command::Model {
                name: name.clone(),
                record,
            };
            if let Err(error) = self.node.propose(command, JOURNAL_TIMEOUT).await {
                warn!(model = %name, %error, "model not recorded");
            }
        }
    }

    /// Records this peer's addresses and pid, retrying until a leader commits them.
    async fn announce(self, me: Announce) {
        let command = Command::Member {
            id: self.me,
            http: me.http,
            quic: me.quic,
            pid: me.pid,
        };
        loop {
            match self.node.propose(command.clone(), JOURNAL_TIMEOUT).await {
                Ok(_) => return,
                Err(crate::replication::node::ProposalError::Stopped) => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Routing as `summary` says: each group drained or not.
fn set_drains(cluster: &Cluster, summary: &Summary) {
    for (name, group) in &summary.groups {
        cluster.set_drained(name, group.drained);
    }
}
