//! The leader as the API's [`Engine`]: each request is journaled (`Accept`) before it
//! starts on the groups, then pumped through its tail and journal ([`super::journal`]);
//! a journaled request is resumed from its tail; peer changes are checked against the
//! configuration and committed through Raft. [`crate::api`] drives it, on any peer:
//! a follower's calls wait for a leader or are refused naming it.

use tessera_comm::proto::WireError;
use tessera_topology::PeerId;
use tokio::sync::{mpsc, watch};
use tracing::info;

use super::journal::{self, Ending, Tail};
use super::{JOURNAL_TIMEOUT, Leadership, MEMBERSHIP_TIMEOUT, now_ms};
use crate::engine::{
    BoxFuture, ClusterStatus, Engine, GenerateRequest, GroupStatus, ModelStatus, PeerChange,
    Resumed, RolloutAction, TokenStream, TopologyApplied, VersionsStatus,
};
use crate::error::CoordinatorError;
use crate::replication::peer::MembershipChange;
use crate::replication::state::{AppliedTopology, Command, Journaled, Outcome, Rollout};

impl Engine for Leadership {
    fn generate(
        &self,
        id: String,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<TokenStream, WireError>> {
        Box::pin(async move {
            let Some(cluster) = self.cluster_soon().await else {
                return Err(self.not_leader());
            };
            cluster.admission(&request.model)?;
            let reservation = self.budget.reserve(&id, &request).await?;
            let accept = Command::Accept {
                id: id.clone(),
                request: request.clone(),
                at_ms: now_ms(),
            };
            let accepted = self.node.propose(accept, JOURNAL_TIMEOUT).await;
            // Applied (the journal counts the entry now) or not: the room is released.
            drop(reservation);
            match accepted {
                Ok(applied) if applied.outcome == Outcome::Applied => {}
                Ok(applied) => {
                    let outcome = applied.outcome;
                    return Err(CoordinatorError::AlreadyJournaled { id, outcome }.into());
                }
                Err(source) => return Err(CoordinatorError::NotJournaled { source }.into()),
            }
            let Some(tail) = self.tails.open(&id, Vec::new()) else {
                return Err(CoordinatorError::AlreadyRunning { id }.into());
            };
            let (journal, events) = mpsc::unbounded_channel();
            tokio::spawn(journal::write(
                self.node.clone(),
                id.clone(),
                Vec::new(),
                events,
                self.tails.clone(),
            ));
            match cluster.generate(id, request).await {
                Ok(inner) => {
                    let (client, stream) = mpsc::unbounded_channel();
                    let version = inner.version;
                    tokio::spawn(journal::pump(inner, tail, journal, Some(client)));
                    Ok(TokenStream::new(stream).versioned(version))
                }
                Err(error) => {
                    // Refused by the group: it never started, so it ends here.
                    let _ = journal.send(journal::JournalEvent::End(Ending::Cancelled));
                    Err(error)
                }
            }
        })
    }

    fn admission(&self, model: &str) -> Result<(), WireError> {
        // Without the groups here, `generate` waits for an election or names the leader.
        self.cluster().map_or(Ok(()), |c| c.admission(model))
    }

    fn ready(&self, model: &str) -> bool {
        self.cluster().is_some_and(|c| c.ready(model))
    }

    fn live(&self) -> Result<(), String> {
        match &*self.node.failure().borrow() {
            Some(reason) => Err(format!("the raft peer stopped: {reason}")),
            None => Ok(()),
        }
    }

    fn resume(&self, id: String) -> BoxFuture<'_, Result<Option<Resumed>, WireError>> {
        Box::pin(async move {
            let Some(cluster) = self.cluster_soon().await else {
                return Err(self.not_leader());
            };
            let key = id.clone();
            let entry = self.node.read(move |s| s.journal.get(&key).cloned()).await;
            let Some(entry) = entry.flatten() else {
                return Ok(None);
            };
            let tail = match (self.tails.get(&id), entry.finished) {
                (Some(tail), _) => tail,
                (None, Some((Some(reason), _))) => {
                    watch::channel(Tail {
                        tokens: entry.sent.clone(),
                        end: Some(Ending::Finished(reason)),
                    })
                    .1
                }
                (None, None) => self.continue_request(&cluster, &id, &entry).await?,
                // Ended without finishing (its client went away, its group failed it):
                // reopened within the journal's budget, it runs on from its checkpoint.
                (None, Some((None, _))) => {
                    self.reopen(&id, &entry).await?;
                    self.continue_request(&cluster, &id, &entry).await?
                }
            };
            Ok(Some(Resumed {
                request: entry.request,
                accepted_ms: entry.accepted_ms,
                tokens: journal::follow(tail),
            }))
        })
    }

    fn change_peers(&self, change: PeerChange) -> BoxFuture<'_, Result<(), WireError>> {
        Box::pin(async move {
            if self.cluster_soon().await.is_none() {
                return Err(self.not_leader());
            }
            let membership = membership_change(change, &self.node.voters())?;
            info!(change = ?membership, "membership change");
            self.node
                .change_membership(membership, MEMBERSHIP_TIMEOUT)
                .await
                .map(|_| ())
                .map_err(|source| CoordinatorError::MembershipNotCommitted { source }.into())
        })
    }

    fn drain_group(
        &self,
        group: String,
        drained: bool,
    ) -> BoxFuture<'_, Result<GroupStatus, WireError>> {
        Box::pin(async move {
            let Some(cluster) = self.cluster_soon().await else {
                return Err(self.not_leader());
            };
            let Some(handle) = cluster.group(&group) else {
                return Err(CoordinatorError::UnknownGroup { group }.into());
            };
            let command = Command::Drain {
                group: group.clone(),
                drained,
            };
            if let Err(source) = self.node.propose(command, JOURNAL_TIMEOUT).await {
                return Err(CoordinatorError::DrainNotCommitted { group, source }.into());
            }
            // Committed: routing follows now (the summary's watcher would, a moment later).
            handle.set_drained(drained);
            info!(group, drained, "group drain changed");
            Ok(handle.status())
        })
    }

    fn rollout(
        &self,
        model: String,
        action: Option<RolloutAction>,
    ) -> BoxFuture<'_, Result<VersionsStatus, WireError>> {
        Box::pin(self.versions(model, action))
    }

    fn apply_topology(
        &self,
        path: String,
        text: String,
    ) -> BoxFuture<'_, Result<TopologyApplied, WireError>> {
        Box::pin(Leadership::apply_topology(self, path, text))
    }

    fn applied_topology(&self) -> Option<AppliedTopology> {
        self.node.summary().borrow().topology.as_deref().cloned()
    }

    fn status(&self) -> ClusterStatus {
        let groups = self
            .cluster()
            .map(|c| c.status().groups)
            .unwrap_or_default();
        let summary = self.node.summary().borrow().clone();
        let models = (summary.models.iter())
            .map(|(name, m)| {
                let rollout = summary
                    .versions(name)
                    .unwrap_or_else(|_| Rollout::initial(m));
                ModelStatus {
                    name: name.clone(),
                    path: m.path.clone(),
                    groups: m.groups.clone(),
                    stable: rollout.stable,
                    canary: rollout.canary,
                    events: rollout.events,
                }
            })
            .collect();
        ClusterStatus {
            peers: self.peers(),
            models,
            groups,
        }
    }
}

impl Leadership {
    /// Opens journaled request `id` again, within the journal's budget.
    async fn reopen(&self, id: &str, entry: &Journaled) -> Result<(), WireError> {
        let reservation = self.budget.reserve(id, &entry.request).await?;
        let command = Command::Reopen { id: id.to_string() };
        let reopened = self.node.propose(command, JOURNAL_TIMEOUT).await;
        drop(reservation);
        match reopened {
            Ok(applied) if applied.outcome == Outcome::Applied => Ok(()),
            Ok(applied) => {
                let (id, outcome) = (id.to_string(), applied.outcome);
                Err(CoordinatorError::NotReopened { id, outcome }.into())
            }
            Err(source) => Err(CoordinatorError::NotJournaled { source }.into()),
        }
    }
}

/// The Raft membership change that makes `change`, checked against the current `voters`.
fn membership_change(
    change: PeerChange,
    voters: &[PeerId],
) -> Result<MembershipChange, CoordinatorError> {
    match change {
        PeerChange::Add { id, http, quic } => {
            if voters.contains(&id) {
                return Err(CoordinatorError::AlreadyMember { id });
            }
            Ok(MembershipChange::Join { id, http, quic })
        }
        PeerChange::Remove { id } => {
            if !voters.contains(&id) {
                let members = voters.to_vec();
                return Err(CoordinatorError::NotMember { id, members });
            }
            if voters.len() == 1 {
                return Err(CoordinatorError::LastPeer);
            }
            Ok(MembershipChange::Leave { id })
        }
    }
}
