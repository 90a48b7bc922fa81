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
//!
//! This file holds the task's state and its loop; the work is split by what it is about:
//! [`epoch`] (registration, assignment, NCCL id relay, deadlines, fencing), [`serve`]
//! (requests, step plans, step results, token streams) and [`telemetry`] (status,
//! metrics, timing reports).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_comm::proto::{
    CoordinatorMsg, Epoch, HeldSeq, ModelSource, SeqId, ShardMsg, StepId, Term,
};
use tessera_comm::wire;
use tessera_topology::Rank;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::scheduler::{Scheduler, SchedulerConfig};
use super::{GroupCommand, GroupHandle, Shared, TokenSender};
use crate::canary::Outcomes;
use crate::engine::{GroupStatus, ShardStatus};
use crate::metrics as m;
use crate::replication::state::Command;

mod epoch;
mod serve;
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
    pub term: Term,
    pub limits: Limits,
    pub scheduler: SchedulerConfig,
    /// Epochs handed out start after this one (the replicated state's, so that epochs
    /// keep growing across coordinator leaders).
    pub first_epoch: Epoch,
    /// Where new epochs and ready shards are recorded (the replicated state).
    pub journal: Option<EpochJournal>,
    /// The model version the group serves (until told another: [`GroupHandle::serve`]).
    pub source: ModelSource,
    /// Where each request's end (and time to first token) is counted, per version.
    pub outcomes: Arc<Outcomes>,
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

/// Deadlines of a group, and whether its ranks warm up.
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
    /// A request waits at most this long in a serving group's queue; then it gets 429, so
    /// that under overload every request ends within a bound.
    pub queue_timeout: Duration,
    /// Whether ranks warm up on a new KV cache before they say `Ready` (the largest
    /// steps the scheduler plans; see [`tessera_comm::proto::Warmup`]).
    pub warmup: WarmupMode,
}

/// When a group's ranks warm up before they say `Ready`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WarmupMode {
    /// When a rank of the group runs on a GPU: there the first steps of each size capture
    /// decode graphs and set up libraries. A CPU shard's first request was measured as
    /// fast as its later ones, and the warmup's 256-sequence decode takes seconds there.
    #[default]
    Auto,
    On,
    Off,
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
            queue_timeout: Duration::from_secs(30),
            warmup: WarmupMode::Auto,
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
        epoch: Epoch,
        since: Instant,
        ready: Vec<Option<(u32, u32)>>,
        /// The sequences every rank is to carry into the epoch.
        keep: Vec<HeldSeq>,
    },
    Serving {
        epoch: Epoch,
    },
}

/// Starts the driver of one group.
pub fn spawn(config: GroupConfig, seq_ids: Arc<AtomicU64>) -> GroupHandle {
    // The group's counters exist from the start, at 0, so that alerts and dashboards on
    // them evaluate before the first event.
    let group = [("group", config.name.clone())];
    for counter in [
        m::GROUP_FENCES,
        m::SCHED_PREEMPTIONS,
        m::SCHED_REJECTED,
        m::PREFIX_CACHE_HIT_TOKENS,
    ] {
        metrics::counter!(counter, &group).increment(0);
    }
    for rank in 0..config.tp {
        let labels = [("group", config.name.clone()), ("rank", rank.to_string())];
        metrics::counter!(m::SHARD_COLLECTIVE_BYTES, &labels).increment(0);
    }
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
        asked: Mutex::new(config.source.clone()),
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
        started: HashMap::new(),
        held: vec![Vec::new(); config.tp],
        last_done: vec![StepId(0); config.tp],
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
    epoch: Epoch,
    next_conn: u64,
    waiting: HashMap<SeqId, TokenSender>,
    /// New requests (not resumed ones) until they end: when each was submitted, and its
    /// time to first token once it has one. Counted in [`GroupConfig::outcomes`].
    started: HashMap<SeqId, (Instant, Option<Duration>)>,
    /// Per rank: the sequences it reported held when it registered (until the next
    /// assignment or a fence).
    held: Vec<Vec<HeldSeq>>,
    /// Per rank: the highest step it reported done in this epoch (plus one).
    last_done: Vec<StepId>,
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
                    Some(GroupCommand::Serve { source }) => self.switch(source),
                    Some(GroupCommand::Stop) => {
                        self.stop().await;
                        return;
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

    /// The group leaves the cluster: each shard is told to exit (`Shutdown`), and its
    /// connection closes once the shard has read that, or after a second.
    async fn stop(&mut self) {
        for mut link in self.links.iter_mut().filter_map(Option::take) {
            let shutdown = wire::write_frame(&mut link.send, &CoordinatorMsg::Shutdown);
            let _ = tokio::time::timeout(WRITE_TIMEOUT, shutdown).await;
            let _ = link.send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(1), link.send.stopped()).await;
            link.connection.close(0u32.into(), b"group removed");
        }
        info!(group = %self.config.name, "group removed: its shards were asked to exit");
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
                info!(group = %self.config.name, rank = %event.rank, %epoch, layers_done, layers, weight_bytes, "loading");
                self.shard_state(event.rank, "loading");
            }
            ShardMsg::Ready(ready) => self.on_ready(event.rank, ready),
            ShardMsg::NcclId { epoch, id } => self.relay_nccl_id(event.rank, epoch, id).await,
            ShardMsg::StepDone(done) => self.on_step_done(event.rank, done),
            ShardMsg::Stats(stats) => self.on_stats(event.rank, &stats),
            ShardMsg::Failed { epoch, error } => {
                if self.current_epoch() == Some(epoch) {
                    let blamed = error.rank.unwrap_or(event.rank);
                    warn!(group = %self.config.name, rank = %event.rank, blamed = %blamed, %error, "shard failed");
                    self.fence(blamed, format!("rank {blamed} failed: {}", error.message));
                }
            }
        }
    }

    /// Every [`TICK`]: abandoned and expired requests, deadlines, a new epoch if due.
    async fn on_tick(&mut self) {
        let now = Instant::now();
        self.drop_abandoned();
        self.expire_waiting(now);
        self.check_deadlines(now);
        self.maybe_assign().await;
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

    fn shard_state(&mut self, rank: Rank, state: &'static str) {
        self.status.shards[rank.0 as usize].state = state;
    }
}
