//! A serving group's requests: submitting a sequence to the scheduler, sending its step
//! plans to every rank, turning rank 0's step results into tokens on each sequence's
//! stream, and ending streams whose client went away or whose wait ran out. The driver's
//! loop ([`super::Driver`]) calls these for each request, step result and tick.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tessera_comm::proto::{CoordinatorMsg, SeqId, StepDone, WireError};
use tessera_topology::Rank;
use tokio::sync::oneshot;
use tracing::{debug, info};

use super::{CARRIED_GRACE, Driver, State};
use crate::engine::{GenerateRequest, TokenEvent};
use crate::error::CoordinatorError;
use crate::group::TokenSender;
use crate::group::scheduler::{Admitted, Adopted, Emitted, Refused};
use crate::metrics as m;

impl Driver {
    pub(super) fn submit(
        &mut self,
        id: &str,
        request: GenerateRequest,
        generated: Vec<u32>,
        events: TokenSender,
        reply: oneshot::Sender<Result<(), WireError>>,
    ) {
        let seq = SeqId(self.seq_ids.fetch_add(1, Ordering::Relaxed));
        let fresh = generated.is_empty();
        match self
            .sched
            .submit(seq, id, request, generated, Instant::now())
        {
            Ok(Admitted::Queued) => {
                self.waiting.insert(seq, events);
                if fresh {
                    self.started.insert(seq, (Instant::now(), None));
                }
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
    pub(super) fn run_on(&mut self, adopted: Adopted) {
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

    pub(super) fn on_step_done(&mut self, rank: Rank, done: StepDone) {
        let State::Serving { epoch } = self.state else {
            return;
        };
        if done.epoch != epoch {
            return;
        }
        let r = rank.0 as usize;
        self.last_done[r] = done.step.next();
        let labels = self.labels(rank);
        let seconds = |us: u64| us as f64 / 1e6;
        metrics::histogram!(m::SHARD_STEP_SECONDS, &labels).record(seconds(done.timings.step_us));
        metrics::histogram!(m::SHARD_COLLECTIVE_SECONDS, &labels)
            .record(seconds(done.timings.collective_us));
        metrics::histogram!(m::SHARD_IDLE_SECONDS, &labels).record(seconds(done.timings.idle_us));
        metrics::counter!(m::SHARD_COLLECTIVE_BYTES, &labels)
            .increment(done.timings.collective_bytes);
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
            if let Some((at, first @ None)) = self.started.get_mut(&seq) {
                *first = Some(now.duration_since(*at));
            }
            if events.send(Ok(event)).is_err() {
                self.waiting.remove(&seq);
                self.started.remove(&seq);
                self.sched.cancel(seq);
            } else if finish.is_some() {
                self.waiting.remove(&seq);
                self.count_end(seq, false);
            }
        }
    }

    /// Sends every plan the scheduler has ready.
    pub(super) async fn pump(&mut self) {
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

    /// Ends `seq`'s token stream with `error`.
    pub(super) fn fail(&mut self, seq: SeqId, error: CoordinatorError) {
        if let Some(events) = self.waiting.remove(&seq) {
            let _ = events.send(Err(error.into()));
        }
        self.count_end(seq, true);
    }

    /// Counts a new request's end against the version this group serves.
    fn count_end(&mut self, seq: SeqId, failed: bool) {
        if let Some((_, ttft)) = self.started.remove(&seq) {
            let version = self.config.source.version;
            (self.config.outcomes).record(&self.config.model, version, failed, ttft);
        }
    }

    /// Cancels the sequences whose client went away.
    pub(super) fn drop_abandoned(&mut self) {
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
        // A request whose stream is gone is not counted: it ended without an outcome.
        let waiting = &self.waiting;
        self.started.retain(|seq, _| waiting.contains_key(seq));
    }

    /// Fails the requests that waited too long for the group to serve; while it serves,
    /// frees the carried sequences no resumed request claimed in time.
    pub(super) fn expire_waiting(&mut self, now: Instant) {
        let limits = self.config.limits;
        let group = self.config.name.clone();
        if let State::Serving { .. } = self.state {
            self.sched.expire_carried(now, CARRIED_GRACE);
            for seq in self.sched.expire_queued(now, limits.queue_timeout) {
                let waited_s = limits.queue_timeout.as_secs();
                let error = CoordinatorError::QueueTimeout {
                    group: group.clone(),
                    waited_s,
                };
                self.fail(seq, error);
            }
            return;
        }
        for seq in self.sched.expire(now, limits.queue_wait, self.down_since) {
            let error = CoordinatorError::NotReady {
                group: group.clone(),
                waited_s: limits.queue_wait.as_secs(),
                missing: self.missing_ranks(),
            };
            self.fail(seq, error);
        }
    }
}
