//! A group's epochs: a shard's registration ([`Driver::attach`]), the assignment of a new
//! epoch once every rank is connected (with the NCCL id relayed from rank 0 when the
//! group uses NCCL), the ranks' `Ready`s that start it serving, the step and assignment
//! deadlines, and the fence that ends it on any failure. The driver's loop
//! ([`super::Driver`]) calls these as shard messages and ticks arrive.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tessera_comm::GroupToken;
use tessera_comm::proto::{
    Assignment, Bootstrap, CoordinatorMsg, Epoch, HeldSeq, ModelSource, Ready, SeqId, ShardMsg,
    StepId, Warmup,
};
use tessera_comm::wire;
use tessera_topology::Rank;
use tracing::{debug, info, warn};

use super::{Driver, FromShard, GroupCollective, Link, State, WarmupMode};
use crate::error::CoordinatorError;
use crate::group::ShardLink;
use crate::metrics as m;
use crate::replication::state::Command;

impl Driver {
    pub(super) async fn attach(&mut self, rank: Rank, link: ShardLink) {
        let r = rank.0 as usize;
        let conn = self.next_conn;
        self.next_conn += 1;
        info!(group = %self.config.name, rank = %rank, pid = link.pid, "shard registered");
        let tx = self.shard_tx.clone();
        let mut recv = link.recv;
        tokio::spawn(async move {
            loop {
                let msg =
                    match wire::read_frame::<_, ShardMsg>(&mut recv, wire::MAX_FRAME_BYTES).await {
                        Ok(Some(msg)) => Some(msg),
                        Ok(None) => None,
                        Err(error) => {
                            debug!(rank = %rank, %error, "shard stream ended");
                            None
                        }
                    };
                let end = msg.is_none();
                if tx.send(FromShard { rank, conn, msg }).is_err() || end {
                    return;
                }
            }
        });
        let shard = &mut self.status.shards[r];
        shard.state = "connected";
        shard.pid = Some(link.pid);
        shard.device = Some(link.device.clone());
        let replaced = self.links[r].replace(Link {
            conn,
            connection: link.connection,
            send: link.send,
        });
        if let Some(old) = replaced {
            old.connection
                .close(0u32.into(), b"replaced by a new registration");
            if !matches!(self.state, State::Down) {
                self.fence(
                    rank,
                    format!("rank {rank} restarted (new pid {})", link.pid),
                );
            }
        }
        self.held[r] = link.held;
        self.maybe_assign().await;
    }

    /// Rank 0's NCCL unique id for the epoch being assigned, to every rank (rank 0 ignores
    /// its own). Another rank sending one, or a group not on NCCL, is fenced.
    pub(super) async fn relay_nccl_id(&mut self, rank: Rank, epoch: Epoch, id: Vec<u8>) {
        if rank != Rank(0) || self.config.collective != GroupCollective::Nccl {
            self.fence(
                rank,
                format!("rank {rank} sent an NCCL id it was not asked for"),
            );
            return;
        }
        if !matches!(self.state, State::Assigning { epoch: e, .. } if e == epoch) {
            return; // an id for an epoch already over
        }
        debug!(group = %self.config.name, %epoch, "relaying the NCCL id");
        if let Err(rank) = self.broadcast(&CoordinatorMsg::NcclId { epoch, id }).await {
            self.fence(rank, format!("rank {rank} could not take the NCCL id"));
        }
    }

    pub(super) fn on_ready(&mut self, rank: Rank, ready: Ready) {
        let State::Assigning {
            epoch,
            ready: slots,
            keep,
            ..
        } = &mut self.state
        else {
            return;
        };
        if ready.epoch != *epoch {
            return;
        }
        info!(
            group = %self.config.name, rank = %rank, epoch = %ready.epoch,
            kv_blocks = ready.kv_blocks, weight_bytes = ready.weight_bytes,
            kept = ready.kept.len(), "rank ready"
        );
        let r = rank.0 as usize;
        slots[r] = Some((ready.kv_blocks, ready.block_size));
        if !ready.kept.iter().eq(keep.iter().map(|h| &h.seq)) {
            let kept = ready.kept.len();
            let of = keep.len();
            self.fence(
                rank,
                format!("rank {rank} carried {kept} sequences into the epoch, not the {of} named"),
            );
            return;
        }
        self.record(Command::ShardUp {
            group: self.config.name.clone(),
            rank: rank.0,
            epoch: ready.epoch.0,
            host: self.config.hosts.get(r).cloned().unwrap_or_default(),
            pid: self.status.shards[r].pid.unwrap_or(0),
        });
        let shard = &mut self.status.shards[r];
        shard.state = "ready";
        shard.weight_bytes = ready.weight_bytes;
        shard.kv_blocks_free = ready.kv_blocks;
        let labels = self.labels(rank);
        metrics::gauge!(m::SHARD_WEIGHT_BYTES, &labels).set(ready.weight_bytes as f64);
        metrics::gauge!(m::SHARD_KV_BLOCKS, &labels).set(f64::from(ready.kv_blocks));
        if let Some(ms) = ready.warmup_ms {
            info!(group = %self.config.name, rank = %rank, warmup_ms = ms, "rank warmed up");
            metrics::gauge!(m::SHARD_WARMUP_SECONDS, &labels).set(ms as f64 / 1000.0);
        }
        self.maybe_serve();
    }

    /// Starts a new epoch when every rank is connected and the group is down.
    pub(super) async fn maybe_assign(&mut self) {
        if !matches!(self.state, State::Down) || self.links.iter().any(Option::is_none) {
            return;
        }
        self.epoch = self.epoch.next();
        let epoch = self.epoch;
        metrics::gauge!(m::GROUP_EPOCH, "group" => self.config.name.clone()).set(epoch.0 as f64);
        self.record(Command::Fence {
            group: self.config.name.clone(),
            epoch: epoch.0,
        });
        let bootstrap = match (&self.config.collective, self.config.tp) {
            (_, 1) => Bootstrap::Solo,
            (GroupCollective::Tcp { peers }, _) => Bootstrap::Tcp {
                peers: peers.clone(),
            },
            (GroupCollective::Nccl, _) => Bootstrap::Nccl,
            (GroupCollective::Shm, _) => Bootstrap::shm(&self.config.name, epoch),
        };
        let keep = held_alike(std::mem::take(&mut self.held));
        self.held = vec![Vec::new(); self.config.tp];
        let assignment = Assignment {
            term: self.config.term,
            epoch,
            token: GroupToken::random(),
            bootstrap,
            collective_deadline_ms: self.config.limits.collective_deadline.as_millis() as u64,
            keep: keep.iter().map(|h| h.seq).collect(),
            warmup: self.warmup(),
            model: self.config.source.clone(),
        };
        info!(group = %self.config.name, %epoch, keep = keep.len(), "assigning");
        self.state = State::Assigning {
            epoch,
            since: Instant::now(),
            ready: vec![None; self.config.tp],
            keep,
        };
        if let Err(rank) = self.broadcast(&CoordinatorMsg::Assign(assignment)).await {
            self.fence(rank, format!("rank {rank} could not be assigned"));
        }
    }

    /// What ranks run on a new KV cache before `Ready`: the largest steps this group's
    /// scheduler plans.
    fn warmup(&self) -> Warmup {
        let on_gpu = self
            .status
            .shards
            .iter()
            .any(|s| s.device.as_deref().is_some_and(|d| d.starts_with("cuda")));
        let warm = match self.config.limits.warmup {
            WarmupMode::Auto => on_gpu,
            WarmupMode::On => true,
            WarmupMode::Off => false,
        };
        if !warm {
            return Warmup::NONE;
        }
        let sched = &self.config.scheduler;
        Warmup {
            prefill_tokens: u32::try_from(sched.step_tokens).unwrap_or(u32::MAX),
            decode_seqs: u32::try_from(sched.max_running).unwrap_or(u32::MAX),
        }
    }

    fn maybe_serve(&mut self) {
        let State::Assigning {
            epoch, ready, keep, ..
        } = &mut self.state
        else {
            return;
        };
        if ready.iter().any(Option::is_none) {
            return;
        }
        let epoch = *epoch;
        let kv_blocks = ready.iter().flatten().map(|(b, _)| *b).min().unwrap_or(0);
        let block_size = ready.iter().flatten().map(|(_, s)| *s).max().unwrap_or(16);
        let carried = std::mem::take(keep);
        let adopted = self
            .sched
            .start_epoch(epoch, kv_blocks, block_size, carried, Instant::now());
        self.last_done = vec![StepId(0); self.config.tp];
        self.state = State::Serving { epoch };
        self.shared.ready.store(true, Ordering::Relaxed);
        self.shared.warmed.store(true, Ordering::Relaxed);
        (self.shared.version).store(self.config.source.version, Ordering::Relaxed);
        info!(group = %self.config.name, %epoch, kv_blocks, "group serving");
        for a in adopted {
            self.run_on(a);
        }
    }

    /// Ends the current epoch, failing its sequences with `reason` (which names the rank).
    pub(super) fn fence(&mut self, rank: Rank, reason: String) {
        let lost = self.end_epoch();
        metrics::counter!(m::GROUP_FENCES, "group" => self.config.name.clone()).increment(1);
        warn!(group = %self.config.name, rank = %rank, epoch = %self.epoch, lost = lost.len(), reason, "group fenced");
        for seq in lost {
            let error = CoordinatorError::Fenced {
                group: self.config.name.clone(),
                rank,
                reason: reason.clone(),
            };
            self.fail(seq, error);
        }
    }

    /// Serves model version `source` from the next epoch on: the current one ends now
    /// (the leader drains the group first, so normally nothing runs in it), and the
    /// next assignment names the new version. Not a fence: nothing failed.
    pub(super) fn switch(&mut self, source: ModelSource) {
        if source == self.config.source {
            return;
        }
        // Sequences failed here count against the version they ran on.
        info!(group = %self.config.name, from = self.config.source.version, to = source.version, path = %source.path, "switching model version");
        if !matches!(self.state, State::Down) {
            let reason = format!("the group switched to model version {}", source.version);
            for seq in self.end_epoch() {
                let error = CoordinatorError::Fenced {
                    group: self.config.name.clone(),
                    rank: Rank(0),
                    reason: reason.clone(),
                };
                self.fail(seq, error);
            }
        }
        self.config.source = source;
    }

    /// Ends the current epoch: the group is down until the next assignment serves. The
    /// sequences it ran, to be failed.
    fn end_epoch(&mut self) -> Vec<SeqId> {
        self.shared.ready.store(false, Ordering::Relaxed);
        if matches!(self.state, State::Serving { .. }) {
            self.down_since = Instant::now();
        }
        self.state = State::Down;
        // What ranks held is stale once their sequences are failed here.
        self.held = vec![Vec::new(); self.config.tp];
        self.sched.fence()
    }

    pub(super) fn current_epoch(&self) -> Option<Epoch> {
        match self.state {
            State::Down => None,
            State::Assigning { epoch, .. } | State::Serving { epoch } => Some(epoch),
        }
    }

    /// The ranks not connected.
    pub(super) fn missing_ranks(&self) -> Vec<usize> {
        (0..self.config.tp)
            .filter(|&r| self.links[r].is_none())
            .collect()
    }

    /// Fences the group when a step's results or an assignment's `Ready`s are overdue,
    /// blaming the rank that lags.
    pub(super) fn check_deadlines(&mut self, now: Instant) {
        let limits = self.config.limits;
        match &self.state {
            State::Serving { .. } => {
                if let Some(step) = self
                    .sched
                    .overdue(now, limits.step_base, limits.step_per_token)
                {
                    let laggard = (0..self.config.tp)
                        .min_by_key(|&r| self.last_done[r])
                        .map_or(Rank(0), |r| Rank(r as u32));
                    self.fence(
                        laggard,
                        format!("rank {laggard} missed the deadline of step {step}"),
                    );
                }
            }
            State::Assigning { since, ready, .. } => {
                if now.duration_since(*since) > limits.assign_deadline {
                    let missing = ready.iter().position(Option::is_none).unwrap_or(0);
                    let rank = Rank(missing as u32);
                    self.fence(
                        rank,
                        format!(
                            "rank {rank} did not report ready within {} s",
                            limits.assign_deadline.as_secs()
                        ),
                    );
                }
            }
            State::Down => {}
        }
    }
}

/// The sequences every rank holds alike (same id, request, tokens and cached
/// positions), in id order: those a new epoch may carry.
fn held_alike(mut per_rank: Vec<Vec<HeldSeq>>) -> Vec<HeldSeq> {
    let Some(first) = per_rank.pop() else {
        return Vec::new();
    };
    first
        .into_iter()
        .filter(|h| per_rank.iter().all(|other| other.contains(h)))
        .collect()
}
