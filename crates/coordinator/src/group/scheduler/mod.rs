//! The scheduler of one group: a pure core (no I/O, no clock — `now` is an argument).
//!
//! - **Continuous batching.** Every step carries one decode token for each running
//!   sequence and, within a per-step token budget, chunks of prompts (chunked prefill), so
//!   a long prompt never stalls the decoders for more than one budget's worth of compute.
//! - **Admission** by priority (lower `priority` first, then arrival) while the group's KV
//!   blocks last above a watermark. A sequence reserves the blocks of its whole prompt when
//!   admitted (the prefix cache may share some on the shards; the count here is an upper
//!   bound, so a shard never runs out) and one more block whenever decoding crosses a
//!   block boundary.
//! - **Preemption by recompute.** When a decoding sequence needs a block and none is left,
//!   the lowest-priority, latest sequence is freed on the shards and queued again with
//!   the tokens it already produced; re-admitted, it prefills prompt + those tokens and
//!   continues. Seeded sampling draws per token index, so its output is unchanged.
//! - **A bounded waiting queue**: [`Scheduler::submit`] refuses when it is full.
//! - **Carried sequences.** A new coordinator leader's first epoch may start with
//!   sequences the shards still hold from the old leader's (their KV intact). Each waits,
//!   counted in the blocks, for its journaled request: resubmitted with the tokens the
//!   journal holds, it runs on from where the shards are — no recompute — provided the
//!   journal's tokens are a prefix of the shards'. One not claimed within a grace period,
//!   or not matching, is freed and its request recomputed.
//! - **Pipelining**: up to [`SchedulerConfig::plans_in_flight`] plans are out at once, so
//!   the shards find step N+1 waiting when they finish step N. A plan is made before the
//!   previous step's tokens are known; shards skip what turned out to be finished.
//!
//! Plans are deltas (`free`, `new`, `prefill`, `decode`), as the protocol requires.

mod carry;
mod plan;
#[cfg(test)]
mod tests;

pub use carry::Adopted;
use carry::Carried;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use tessera_comm::proto::{Epoch, FinishReason, HeldSeq, SeqId, SeqToken, StepId, Term};

use crate::engine::GenerateRequest;

/// The knobs of one group's scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once (vLLM's `max_num_seqs`).
    pub max_running: usize,
    /// Tokens one step may compute: decodes plus prompt chunks (vLLM's
    /// `max_num_batched_tokens`). On CPU, 256 tokens of a 135M model is a few hundred ms.
    pub step_tokens: usize,
    /// Requests that may wait; more are refused (HTTP 429).
    pub max_waiting: usize,
    /// Blocks kept free at admission, for running sequences to grow into.
    pub watermark: f64,
    /// Plans outstanding at once. Two keep the shards busy (one running, one queued)
    /// without planning far ahead of what the coordinator knows.
    pub plans_in_flight: usize,
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            max_running: 256,
            step_tokens: 256,
            max_waiting: 1024,
            watermark: 0.01,
            plans_in_flight: 2,
        }
    }
}

/// The waiting queue's order: priority, then arrival.
type QueueKey = (i32, u64);

/// A request that is not running: new, or preempted with tokens already produced.
#[derive(Debug)]
struct Waiting {
    seq: SeqId,
    /// Its journal id (see [`NewSeq::request`](tessera_comm::proto::NewSeq)).
    tag: String,
    request: GenerateRequest,
    arrived: Instant,
    generated: Vec<u32>,
    /// A preempted sequence may still get tokens from plans sent before its preemption;
    /// it is re-admitted only after this step's results.
    not_before: Option<StepId>,
    /// A journaled request resumed by a new leader (`generated` are the journal's).
    resumed: bool,
}

/// A sequence with state on the shards.
#[derive(Debug)]
struct Running {
    key: QueueKey,
    tag: String,
    request: GenerateRequest,
    arrived: Instant,
    /// Tokens produced so far (received from rank 0), including before any preemption.
    generated: Vec<u32>,
    /// Tokens computed before the first sample of this admission: prompt + tokens
    /// generated before a preemption.
    prefill_len: u32,
    /// Prompt tokens planned (or found in the prefix cache).
    prefill_planned: u32,
    /// Decode steps planned.
    decode_planned: u32,
    /// Generated tokens when admitted.
    generated_at_admission: u32,
    /// Blocks counted for it.
    blocks: u32,
    /// The last step that names it.
    last_step: StepId,
}

impl Running {
    fn prefill_planned_fully(&self) -> bool {
        self.prefill_planned >= self.prefill_len
    }

    /// Tokens the plans sent so far will have produced in all.
    fn tokens_planned(&self) -> u32 {
        self.generated_at_admission + u32::from(self.prefill_planned_fully()) + self.decode_planned
    }

    fn wants_decode(&self) -> bool {
        self.prefill_planned_fully() && self.tokens_planned() < self.request.max_tokens
    }

    /// Positions on the shards once the plans sent so far have run.
    fn positions(&self) -> u32 {
        self.prefill_planned.min(self.prefill_len) + self.decode_planned
    }
}

/// How [`Scheduler::submit`] took a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Admitted {
    /// Queued under the sequence id given.
    Queued,
    /// It runs on as a carried sequence (see [`Adopted`]).
    Carried(Adopted),
}

/// A plan whose results have not arrived.
#[derive(Debug)]
struct InFlight {
    step: StepId,
    /// When the shards could start it: sent, and the plan before it done.
    started: Instant,
    /// Tokens it computes, for its deadline.
    tokens: usize,
}

/// One token for a client.
#[derive(Debug, PartialEq)]
pub struct Emitted {
    pub seq: SeqId,
    pub token: SeqToken,
    /// Set when the sequence ended with this token.
    pub finish: Option<FinishReason>,
}

/// Why a request was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// It could never fit this group's KV cache.
    TooLarge { needed_blocks: u32, kv_blocks: u32 },
    /// The waiting queue is full.
    QueueFull { waiting: usize },
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    term: Term,
    epoch: Epoch,
    next_step: StepId,
    kv_blocks: u32,
    block_size: u32,
    used_blocks: u32,
    arrivals: u64,
    waiting: BTreeMap<QueueKey, Waiting>,
    running: BTreeMap<QueueKey, SeqId>,
    seqs: HashMap<SeqId, Running>,
    in_flight: VecDeque<InFlight>,
    to_free: Vec<SeqId>,
    /// Carried sequences not yet claimed, by journal id.
    carried: HashMap<String, Carried>,
    /// Prompt tokens the shards found in their prefix cache, since start.
    prefix_hit_tokens: u64,
    preemptions: u64,
    /// Resumed requests run on as carried sequences / recomputed, since start.
    resumed_carried: u64,
    resumed_recomputed: u64,
    /// How long each new request waited before its first admission, since the driver
    /// last took them ([`Scheduler::take_queue_waits`]); at most [`MAX_QUEUE_WAITS`].
    queue_waits: Vec<Duration>,
}

/// Queue waits kept between two takes (the driver takes them every tick).
const MAX_QUEUE_WAITS: usize = 4096;

impl Scheduler {
    pub fn new(term: Term, config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config,
            term,
            epoch: Epoch(0),
            next_step: StepId(0),
            kv_blocks: 0,
            block_size: 1,
            used_blocks: 0,
            arrivals: 0,
            waiting: BTreeMap::new(),
            running: BTreeMap::new(),
            seqs: HashMap::new(),
            in_flight: VecDeque::new(),
            to_free: Vec::new(),
            carried: HashMap::new(),
            prefix_hit_tokens: 0,
            preemptions: 0,
            resumed_carried: 0,
            resumed_recomputed: 0,
            queue_waits: Vec::new(),
        }
    }

    /// Starts serving `epoch` with the group's capacity and the sequences the shards
    /// carried into it; returns the queued requests that run on as carried sequences.
    /// Nothing may be running (see [`Scheduler::fence`]).
    pub fn start_epoch(
        &mut self,
        epoch: Epoch,
        kv_blocks: u32,
        block_size: u32,
        carried: Vec<HeldSeq>,
        now: Instant,
    ) -> Vec<Adopted> {
        debug_assert!(self.seqs.is_empty());
        self.epoch = epoch;
        self.next_step = StepId(0);
        self.kv_blocks = kv_blocks;
        self.block_size = block_size.max(1);
        self.used_blocks = 0;
        self.in_flight.clear();
        self.to_free.clear();
        for w in self.waiting.values_mut() {
            w.not_before = None;
        }
        self.install_carried(carried, now)
    }

    /// Ends the epoch: every running sequence is returned (to be failed); the queue,
    /// preempted sequences included, stays for the next epoch.
    pub fn fence(&mut self) -> Vec<SeqId> {
        let lost: Vec<SeqId> = self.running.values().copied().collect();
        self.carried.clear();
        self.running.clear();
        self.seqs.clear();
        self.in_flight.clear();
        self.to_free.clear();
        self.used_blocks = 0;
        self.kv_blocks = 0;
        lost
    }

    /// Queues a request under `seq`, or runs it on as the carried sequence of journal id
    /// `tag`. `generated`: tokens it produced before (a journaled request resumed), which
    /// are recomputed with the prompt, never sampled again.
    pub fn submit(
        &mut self,
        seq: SeqId,
        tag: &str,
        request: GenerateRequest,
        generated: Vec<u32>,
        now: Instant,
    ) -> Result<Admitted, Refused> {
        if let Some(c) = self.claim(tag, &request, &generated) {
            self.arrivals += 1;
            let key = (request.priority, self.arrivals);
            let waiting = Waiting {
                seq,
                tag: tag.to_string(),
                request,
                arrived: now,
                generated,
                not_before: None,
                resumed: true,
            };
            return Ok(Admitted::Carried(self.run_carried(key, waiting, c)));
        }
        if self.kv_blocks > 0 {
            let positions = request.prompt.len() as u64 + u64::from(request.max_tokens);
            let needed = self.blocks_for(positions);
            if needed > self.kv_blocks {
                return Err(Refused::TooLarge {
                    needed_blocks: needed,
                    kv_blocks: self.kv_blocks,
                });
            }
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(Refused::QueueFull {
                waiting: self.waiting.len(),
            });
        }
        self.arrivals += 1;
        let key = (request.priority, self.arrivals);
        self.waiting.insert(
            key,
            Waiting {
                seq,
                tag: tag.to_string(),
                request,
                arrived: now,
                resumed: !generated.is_empty(),
                generated,
                not_before: None,
            },
        );
        Ok(Admitted::Queued)
    }

    /// Removes and returns queued requests (never started) that waited longer than
    /// `max_wait` since they arrived or since `down_since` (when the group stopped
    /// serving), whichever is later: a request waits for a group to come up, not for a
    /// busy group (the bounded queue limits that).
    pub fn expire(&mut self, now: Instant, max_wait: Duration, down_since: Instant) -> Vec<SeqId> {
        let mut expired = Vec::new();
        self.waiting.retain(|_, w| {
            let since = w.arrived.max(down_since);
            let keep = !w.generated.is_empty() || now.duration_since(since) < max_wait;
            if !keep {
                expired.push(w.seq);
            }
            keep
        });
        expired
    }

    /// Removes and returns new requests (never started, not resumed) that have waited
    /// `max_wait` in the queue of a serving group: past that, the client is better told to
    /// come back than kept waiting.
    pub fn expire_queued(&mut self, now: Instant, max_wait: Duration) -> Vec<SeqId> {
        let mut expired = Vec::new();
        self.waiting.retain(|_, w| {
            let fresh = w.generated.is_empty() && !w.resumed;
            let keep = !fresh || now.duration_since(w.arrived) < max_wait;
            if !keep {
                expired.push(w.seq);
            }
            keep
        });
        expired
    }

    /// Removes a waiting or running sequence (the client went away); returns whether it
    /// was known. A running one is freed on the shards by the next plan.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|_, w| w.seq != seq);
        if self.waiting.len() != before {
            return true;
        }
        self.drop_running(seq)
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.seqs.is_empty() && self.carried.is_empty()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.seqs.len()
    }

    /// (blocks counted in use, blocks of the group, positions per block).
    pub fn kv_usage(&self) -> (u32, u32, u32) {
        (self.used_blocks, self.kv_blocks, self.block_size)
    }

    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix_hit_tokens
    }

    /// Resumed requests (journaled, from an earlier leader) since start: (run on as
    /// carried sequences, recomputed).
    pub fn resumed(&self) -> (u64, u64) {
        (self.resumed_carried, self.resumed_recomputed)
    }

    /// How long the requests admitted since the last call waited in the queue before
    /// their first step (resumed and preempted ones are not counted).
    pub fn take_queue_waits(&mut self) -> Vec<Duration> {
        std::mem::take(&mut self.queue_waits)
    }

    /// Sequences preempted since start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The step of the oldest outstanding plan when it has run longer than its deadline
    /// (`base` plus `per_token` for each token it computes), counted from when the shards
    /// could start it: a pipelined plan waits for the one before it.
    pub fn overdue(&self, now: Instant, base: Duration, per_token: Duration) -> Option<StepId> {
        let oldest = self.in_flight.front()?;
        let allowed = base + per_token * u32::try_from(oldest.tokens).unwrap_or(u32::MAX);
        (now.duration_since(oldest.started) > allowed).then_some(oldest.step)
    }

    /// Applies rank 0's results of `step`: the tokens for the clients, in order.
    pub fn on_step_done(
        &mut self,
        step: StepId,
        tokens: Vec<SeqToken>,
        cached: &[(SeqId, u32)],
        now: Instant,
    ) -> Vec<Emitted> {
        match self.in_flight.front() {
            Some(f) if f.step == step => {
                self.in_flight.pop_front();
            }
            _ => return Vec::new(),
        }
        // The next plan was sent while this one ran; its shards start it only now.
        if let Some(next) = self.in_flight.front_mut() {
            next.started = next.started.max(now);
        }
        for &(seq, hit) in cached {
            self.prefix_hit_tokens += u64::from(hit);
            // Shards start a cached prompt's chunks after the hit.
            if let Some(r) = self.seqs.get_mut(&seq) {
                r.prefill_planned = (r.prefill_planned + hit).min(r.prefill_len);
            }
        }
        let mut emitted = Vec::with_capacity(tokens.len());
        for t in tokens {
            if let Some(e) = self.take_token(t) {
                emitted.push(e);
            }
        }
        for w in self.waiting.values_mut() {
            if w.not_before.is_some_and(|s| s <= step) {
                w.not_before = None;
            }
        }
        emitted
    }

    /// Records one token of a running or preempted sequence.
    fn take_token(&mut self, t: SeqToken) -> Option<Emitted> {
        let (generated, max_tokens) = if let Some(r) = self.seqs.get_mut(&t.seq) {
            (&mut r.generated, r.request.max_tokens)
        } else {
            let w = self.waiting.values_mut().find(|w| w.seq == t.seq)?;
            (&mut w.generated, w.request.max_tokens)
        };
        generated.push(t.token);
        let finish = t
            .finish
            .or_else(|| (generated.len() >= max_tokens as usize).then_some(FinishReason::Length));
        if finish.is_some() {
            let seq = t.seq;
            if !self.drop_running(seq) {
                self.waiting.retain(|_, w| w.seq != seq);
            }
        }
        Some(Emitted {
            seq: t.seq,
            token: t,
            finish,
        })
    }

    /// Forgets a running sequence and frees it on the shards with the next plan.
    fn drop_running(&mut self, seq: SeqId) -> bool {
        let Some(r) = self.seqs.remove(&seq) else {
            return false;
        };
        self.running.remove(&r.key);
        self.used_blocks -= r.blocks;
        self.to_free.push(seq);
        true
    }

    fn blocks_for(&self, positions: u64) -> u32 {
        u32::try_from(positions.div_ceil(u64::from(self.block_size))).unwrap_or(u32::MAX)
    }
}
