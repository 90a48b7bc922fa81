//! The task that drives one group: owns its shards' control streams and its
//! [`Scheduler`], and turns shard messages, requests and the clock into plans.
//!
//! States: `Down` (a rank is missing) → `Assigning` (every rank connected; `Assign` sent
//! for a new epoch, waiting for every `Ready`) → `Serving`. Any failure — a `Failed`
//! message, a lost connection, a rank re-registering, a missed step deadline — fences the
//! group: the epoch ends, its sequences fail with an error naming the group and the rank,
//! queued requests wait for the next epoch, and the group is re-assigned as soon as every
//! rank is connected.
//!
//! A new coordinator leader's first assignment keeps the journaled sequences every rank
//! reported held, alike, when it registered (`Assignment::keep`); the scheduler runs them
//! on when their requests are resumed, without recomputing their KV.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_comm::GroupToken;
use tessera_comm::proto::{
    Assignment, Bootstrap, CoordinatorMsg, HeldSeq, Ready, SeqId, ShardMsg, StepDone, WireError,
};
use tessera_comm::wire;
use tessera_topology::Rank;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::scheduler::{Admitted, Adopted, Emitted, Refused, Scheduler, SchedulerConfig};
use super::{GroupCommand, GroupHandle, ShardLink, Shared, TokenSender};
use crate::error::CoordinatorError;
use crate::engine::{GenerateRequest, GroupStatus, ShardStatus, TokenEvent};
use crate::metrics as m;
use crate::replication::state::Command;

mod telemetry;

use telemetry::{Rate, Totals};

/// How a group's ranks find each other, and the limits it runs under.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub name: String,
    pub model: String,
    pub tp: usize,
    /// How the ranks all-reduce (for tp > 1).
    pub collective: GroupCollective,
    /// The topology's host of each rank.
    pub hosts: Vec<String>,
    pub term: u64,
    pub limits: Limits,
    pub scheduler: SchedulerConfig,
    /// Epochs handed out start after this one (the replicated state's, so that epochs
    /// keep growing across coordinator leaders).
    pub first_epoch: u64,
    /// Where new epochs and ready shards are recorded (the replicated state).
    pub journal: Option<EpochJournal>,
}

/// The collective of a group, as the coordinator sets up each epoch's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupCollective {
    /// Shared memory (one host).
    Shm,
    /// TCP ring, `host:port` per rank.
    Tcp { peers: Vec<String> },
    /// NCCL: rank 0's unique id is relayed to the other ranks.
    Nccl,
}

/// Records a group's epochs (`Fence`) and ready shards (`ShardUp`); it must not block.
#[derive(Clone)]
pub struct EpochJournal(pub Arc<dyn Fn(Command) + Send + Sync>);

impl std::fmt::Debug for EpochJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EpochJournal")
    }
}

/// Deadlines of a group.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// A collective call waits this long for the other ranks.
    pub collective_deadline: Duration,
    /// A plan's results are due after `step_base + step_per_token × tokens in the plan`.
    pub step_base: Duration,
    pub step_per_token: Duration,
    /// Every rank must report `Ready` this long after `Assign` (the first one loads weights).
    pub assign_deadline: Duration,
    /// A request waits at most this long for the group to be serving.
    pub queue_wait: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            // Shared by every rank; see `CollectiveConfig::default` for the reasoning.
            collective_deadline: Duration::from_secs(2),
            // A step is milliseconds; the base absorbs scheduling noise on a busy host,
            // the per-token part a long prefill on CPU (SmolLM2 prefills at roughly
            // 1,000 tokens/s on one core: 20 ms per token leaves a wide margin).
            step_base: Duration::from_secs(5),
            step_per_token: Duration::from_millis(20),
            assign_deadline: Duration::from_secs(300),
            queue_wait: Duration::from_secs(60),
        }
    }
}

/// How long a carried sequence waits for its journaled request to be resumed (a new
/// leader resumes every open request as it starts) before it is freed.
const CARRIED_GRACE: Duration = Duration::from_secs(10);

/// How often the driver checks deadlines and abandoned requests.
const TICK: Duration = Duration::from_millis(100);
/// A write to a shard's control stream that takes longer than this means the shard is gone.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// A message from one of the reader tasks.
#[derive(Debug)]
struct FromShard {
    rank: Rank,
    conn: u64,
    /// `None`: the stream ended.
    msg: Option<ShardMsg>,
}

struct Link {
    conn: u64,
    connection: quinn::Connection,
    send: quinn::SendStream,
}

enum State {
    Down,
    Assigning {
        epoch: u64,
        since: Instant,
        ready: Vec<Option<(u32, u32)>>,
        /// The sequences every rank is to carry into the epoch.
        keep: Vec<HeldSeq>,
    },
    Serving {
        epoch: u64,
    },
}

/// Starts the driver of one group.
pub fn spawn(config: GroupConfig, seq_ids: Arc<AtomicU64>) -> GroupHandle {
    let (commands, command_rx) = mpsc::channel(super::COMMAND_BUFFER);
    let status = GroupStatus {
        name: config.name.clone(),
        model: config.model.clone(),
        tp: config.tp,
        state: "down",
        shards: (0..config.tp)
            .map(|r| ShardStatus {
                rank: r as u32,
                host: config.hosts.get(r).cloned().unwrap_or_default(),
                state: "disconnected",
                ..ShardStatus::default()
            })
            .collect(),
        ..GroupStatus::default()
    };
    let shared = Arc::new(Shared {
        max_waiting: config.scheduler.max_waiting,
        ..Shared::default()
    });
    let handle = GroupHandle {
        name: config.name.clone(),
        model: config.model.clone(),
        tp: config.tp,
        commands,
        shared: Arc::clone(&shared),
    };
    let (shard_tx, shard_rx) = mpsc::unbounded_channel();
    let driver = Driver {
        links: (0..config.tp).map(|_| None).collect(),
        sched: Scheduler::new(config.term, config.scheduler),
        state: State::Down,
        epoch: config.first_epoch,
        next_conn: 0,
        waiting: HashMap::new(),
        held: vec![Vec::new(); config.tp],
        last_done: vec![0; config.tp],
        totals: vec![Totals::default(); config.tp],
        config,
        seq_ids,
        shared,
        status,
        down_since: Instant::now(),
        rate: Rate::default(),
        preemptions: 0,
        resumed: (0, 0),
        shard_tx,
    };
    tokio::spawn(driver.run(command_rx, shard_rx));
    handle
}

struct Driver {
    config: GroupConfig,
    links: Vec<Option<Link>>,
    sched: Scheduler,
    state: State,
    /// The last epoch handed out.
    epoch: u64,
    next_conn: u64,
    waiting: HashMap<SeqId, TokenSender>,
    /// Per rank: the sequences it reported held when it registered (until the next
    /// assignment or a fence).
    held: Vec<Vec<HeldSeq>>,
    /// Per rank: the highest step it reported done in this epoch (plus one).
    last_done: Vec<u64>,
    totals: Vec<Totals>,
    seq_ids: Arc<AtomicU64>,
    shared: Arc<Shared>,
    /// Published to `shared` after every event.
    status: GroupStatus,
    /// When the group last stopped serving (or started).
    down_since: Instant,
    rate: Rate,
    /// Preemptions already counted in the metric.
    preemptions: u64,
    /// Resumed requests (carried, recomputed) already counted in the metric.
    resumed: (u64, u64),
    shard_tx: mpsc::UnboundedSender<FromShard>,
}

impl Driver {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<GroupCommand>,
        mut shards: mpsc::UnboundedReceiver<FromShard>,
    ) {
        let mut tick = tokio::time::interval(TICK);
        let mut report = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(GroupCommand::Attach { rank, link }) => self.attach(rank, link).await,
                    Some(GroupCommand::Submit { id, request, generated, events, reply }) => {
                        self.submit(&id, request, generated, events, reply);
                    }
                    None => {
                        self.release();
                        return;
                    }
                },
                Some(event) = shards.recv() => self.on_shard(event).await,
                _ = tick.tick() => self.on_tick().await,
                _ = report.tick() => self.report(),
            }
            self.pump().await;
            self.publish();
        }
    }

    /// Every handle is gone (this peer stopped leading, or the coordinator stops): close
    /// the shards' connections, so that they register with whoever leads now.
    fn release(&mut self) {
        for link in self.links.iter_mut().filter_map(Option::take) {
            link.connection
                .close(0u32.into(), b"this coordinator no longer leads");
        }
        info!(group = %self.config.name, "group released");
    }

    fn submit(
        &mut self,
        id: &str,
        request: GenerateRequest,
        generated: Vec<u32>,
        events: TokenSender,
        reply: oneshot::Sender<Result<(), WireError>>,
    ) {
        let seq = SeqId(self.seq_ids.fetch_add(1, Ordering::Relaxed));
        match self
            .sched
            .submit(seq, id, request, generated, Instant::now())
        {
            Ok(Admitted::Queued) => {
                self.waiting.insert(seq, events);
                let _ = reply.send(Ok(()));
            }
            Ok(Admitted::Carried(adopted)) => {
                self.waiting.insert(seq, events);
                self.run_on(adopted);
                let _ = reply.send(Ok(()));
            }
            Err(Refused::TooLarge {
                needed_blocks,
                kv_blocks,
            }) => {
                let group = self.config.name.clone();
                let error = CoordinatorError::TooLarge {
                    group,
                    needed_blocks,
                    kv_blocks,
                };
                let _ = reply.send(Err(error.into()));
            }
            Err(Refused::QueueFull { waiting }) => {
                metrics::counter!(m::SCHED_REJECTED, "group" => self.config.name.clone())
                    .increment(1);
                let group = self.config.name.clone();
                let error = CoordinatorError::QueueFull { group, waiting };
                let _ = reply.send(Err(error.into()));
            }
        }
    }

    /// A request runs on as a carried sequence: its stream follows the sequence, and
    /// gets first the tokens the shards generated beyond those it was submitted with.
    fn run_on(&mut self, adopted: Adopted) {
        let Adopted { from, seq, extra } = adopted;
        info!(group = %self.config.name, seq = %seq, extra = extra.len(), "a carried sequence runs on: no recompute");
        let Some(events) = self.waiting.remove(&from) else {
            self.sched.cancel(seq);
            return;
        };
        for token in extra {
            let event = TokenEvent {
                token,
                logprobs: None,
                finish: None,
            };
            let _ = events.send(Ok(event));
        }
        self.waiting.insert(seq, events);
    }

    async fn attach(&mut self, rank: Rank, link: ShardLink) {
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

    async fn on_shard(&mut self, event: FromShard) {
        let r = event.rank.0 as usize;
        if self.links[r].as_ref().map(|l| l.conn) != Some(event.conn) {
            return; // a replaced connection
        }
        let Some(msg) = event.msg else {
            self.links[r] = None;
            self.shard_state(event.rank, "disconnected");
            warn!(group = %self.config.name, rank = %event.rank, "shard disconnected");
            if !matches!(self.state, State::Down) {
                self.fence(event.rank, format!("rank {} disconnected", event.rank));
            }
            return;
        };
        match msg {
            ShardMsg::Register(_) | ShardMsg::Standby(_) => {
                self.fence(event.rank, "sent a second registration".into());
            }
            ShardMsg::Loading {
                epoch,
                layers_done,
                layers,
                weight_bytes,
            } => {
                info!(group = %self.config.name, rank = %event.rank, epoch, layers_done, layers, weight_bytes, "loading");
                self.shard_state(event.rank, "loading");
            }
            ShardMsg::Ready(ready) => self.on_ready(event.rank, ready),
            ShardMsg::NcclId { epoch, id } => self.relay_nccl_id(event.rank, epoch, id).await,
            ShardMsg::StepDone(done) => self.on_step_done(event.rank, done),
            ShardMsg::Failed { epoch, error } => {
                if self.current_epoch() == Some(epoch) {
                    let blamed = error.rank.unwrap_or(event.rank);
                    warn!(group = %self.config.name, rank = %event.rank, blamed = %blamed, %error, "shard failed");
                    self.fence(blamed, format!("rank {blamed} failed: {}", error.message));
                }
            }
        }
    }

    /// Rank 0's NCCL unique id for the epoch being assigned, to every rank (rank 0 ignores
    /// its own). Another rank sending one, or a group not on NCCL, is fenced.
    async fn relay_nccl_id(&mut self, rank: Rank, epoch: u64, id: Vec<u8>) {
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
        debug!(group = %self.config.name, epoch, "relaying the NCCL id");
        if let Err(rank) = self.broadcast(&CoordinatorMsg::NcclId { epoch, id }).await {
            self.fence(rank, format!("rank {rank} could not take the NCCL id"));
        }
    }

    fn on_ready(&mut self, rank: Rank, ready: Ready) {
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
            group = %self.config.name, rank = %rank, epoch = ready.epoch,
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
            epoch: ready.epoch,
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
        self.maybe_serve();
    }

    fn on_step_done(&mut self, rank: Rank, done: StepDone) {
        let State::Serving { epoch } = self.state else {
            return;
        };
        if done.epoch != epoch {
            return;
        }
        let r = rank.0 as usize;
        self.last_done[r] = done.step + 1;
        let labels = self.labels(rank);
        let seconds = |us: u64| us as f64 / 1e6;
        metrics::histogram!(m::SHARD_STEP_SECONDS, &labels).record(seconds(done.timings.step_us));
        metrics::histogram!(m::SHARD_COLLECTIVE_SECONDS, &labels)
            .record(seconds(done.timings.collective_us));
        metrics::histogram!(m::SHARD_IDLE_SECONDS, &labels).record(seconds(done.timings.idle_us));
        self.status.shards[r].kv_blocks_free = done.free_blocks;
        let t = &mut self.totals[r];
        t.steps += 1;
        t.step_us += done.timings.step_us;
        t.collective_us += done.timings.collective_us;
        t.idle_us += done.timings.idle_us;
        if rank != Rank(0) {
            return;
        }
        let now = Instant::now();
        for (seq, hit) in &done.cached {
            debug!(group = %self.config.name, seq = %seq, tokens = hit, "prefix cache hit");
        }
        let hits: u64 = done.cached.iter().map(|(_, t)| u64::from(*t)).sum();
        if hits > 0 {
            metrics::counter!(m::PREFIX_CACHE_HIT_TOKENS, "group" => self.config.name.clone())
                .increment(hits);
        }
        metrics::gauge!(m::KV_BLOCKS_FREE, "group" => self.config.name.clone())
            .set(f64::from(done.free_blocks));
        let emitted = self
            .sched
            .on_step_done(done.step, done.tokens, &done.cached, now);
        self.rate.add(emitted.len(), now);
        for Emitted { seq, token, finish } in emitted {
            let Some(events) = self.waiting.get(&seq) else {
                continue;
            };
            let event = TokenEvent {
                token: token.token,
                logprobs: token.logprobs,
                finish,
            };
            if events.send(Ok(event)).is_err() {
                self.waiting.remove(&seq);
                self.sched.cancel(seq);
            } else if finish.is_some() {
                self.waiting.remove(&seq);
            }
        }
    }

    async fn on_tick(&mut self) {
        let now = Instant::now();
        let limits = self.config.limits;
        // Requests whose client went away.
        let gone: Vec<SeqId> = self
            .waiting
            .iter()
            .filter(|(_, reply)| reply.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for seq in gone {
            self.waiting.remove(&seq);
            self.sched.cancel(seq);
        }
        let expired = match self.state {
            State::Serving { .. } => {
                self.sched.expire_carried(now, CARRIED_GRACE);
                Vec::new()
            }
            _ => self.sched.expire(now, limits.queue_wait, self.down_since),
        };
        for seq in expired {
            let error = CoordinatorError::NotReady {
                group: self.config.name.clone(),
                waited_s: limits.queue_wait.as_secs(),
                missing: self.missing_ranks(),
            };
            self.fail(seq, error);
        }
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
        self.maybe_assign().await;
    }

    /// Sends every plan the scheduler has ready.
    async fn pump(&mut self) {
        if !matches!(self.state, State::Serving { .. }) {
            return;
        }
        while let Some(plan) = self.sched.plan_step(Instant::now()) {
            let tokens = plan.decode.len()
                + plan
                    .prefill
                    .iter()
                    .map(|c| c.tokens as usize)
                    .sum::<usize>();
            metrics::histogram!(m::STEP_TOKENS, "group" => self.config.name.clone())
                .record(tokens as f64);
            let msg = CoordinatorMsg::Step(plan);
            if let Err(rank) = self.broadcast(&msg).await {
                self.fence(
                    rank,
                    format!("rank {rank} stopped reading its control stream"),
                );
                return;
            }
        }
    }

    /// Writes `msg` to every rank; on failure, the first rank that could not take it.
    async fn broadcast(&mut self, msg: &CoordinatorMsg) -> Result<(), Rank> {
        for (r, link) in self.links.iter_mut().enumerate() {
            let rank = Rank(r as u32);
            let Some(link) = link else { return Err(rank) };
            match tokio::time::timeout(WRITE_TIMEOUT, wire::write_frame(&mut link.send, msg)).await
            {
                Ok(Ok(())) => {}
                _ => return Err(rank),
            }
        }
        Ok(())
    }

    fn record(&self, command: Command) {
        if let Some(journal) = &self.config.journal {
            (journal.0)(command);
        }
    }

    /// Starts a new epoch when every rank is connected and the group is down.
    async fn maybe_assign(&mut self) {
        if !matches!(self.state, State::Down) || self.links.iter().any(Option::is_none) {
            return;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        metrics::gauge!(m::GROUP_EPOCH, "group" => self.config.name.clone()).set(epoch as f64);
        self.record(Command::Fence {
            group: self.config.name.clone(),
            epoch,
        });
        let bootstrap = match (&self.config.collective, self.config.tp) {
            (_, 1) => Bootstrap::Solo,
            (GroupCollective::Tcp { peers }, _) => Bootstrap::Tcp {
                peers: peers.clone(),
            },
            (GroupCollective::Nccl, _) => Bootstrap::Nccl,
            (GroupCollective::Shm, _) => Bootstrap::Shm {
                name: format!("tessera-{}-e{epoch}", self.config.name),
            },
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
        };
        info!(group = %self.config.name, epoch, keep = keep.len(), "assigning");
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
        self.last_done = vec![0; self.config.tp];
        self.state = State::Serving { epoch };
        self.shared.ready.store(true, Ordering::Relaxed);
        info!(group = %self.config.name, epoch, kv_blocks, "group serving");
        for a in adopted {
            self.run_on(a);
        }
    }

    /// Ends the current epoch, failing its sequences with `reason` (which names the rank).
    fn fence(&mut self, rank: Rank, reason: String) {
        self.shared.ready.store(false, Ordering::Relaxed);
        if matches!(self.state, State::Serving { .. }) {
            self.down_since = Instant::now();
        }
        self.state = State::Down;
        // What ranks held is stale once their sequences are failed here.
        self.held = vec![Vec::new(); self.config.tp];
        let lost = self.sched.fence();
        metrics::counter!(m::GROUP_FENCES, "group" => self.config.name.clone()).increment(1);
        warn!(group = %self.config.name, rank = %rank, epoch = self.epoch, lost = lost.len(), reason, "group fenced");
        for seq in lost {
            let error = CoordinatorError::Fenced {
                group: self.config.name.clone(),
                rank,
                reason: reason.clone(),
            };
            self.fail(seq, error);
        }
    }

    /// Ends `seq`'s token stream with `error`.
    fn fail(&mut self, seq: SeqId, error: CoordinatorError) {
        if let Some(events) = self.waiting.remove(&seq) {
            let _ = events.send(Err(error.into()));
        }
    }

    fn current_epoch(&self) -> Option<u64> {
        match self.state {
            State::Down => None,
            State::Assigning { epoch, .. } | State::Serving { epoch } => Some(epoch),
        }
    }

    /// The ranks not connected.
    fn missing_ranks(&self) -> Vec<usize> {
        (0..self.config.tp)
            .filter(|&r| self.links[r].is_none())
            .collect()
    }

    fn shard_state(&mut self, rank: Rank, state: &'static str) {
        self.status.shards[rank.0 as usize].state = state;
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
