//! The scheduler of one group: a pure core (no I/O, no clock — `now` is an argument).
//!
//! Requests wait in a FIFO queue and are admitted while the group's KV blocks last (each
//! sequence reserves the blocks for its prompt plus `max_tokens` up front, so a running
//! sequence never runs out). Plans are pipelined: up to [`MAX_PLANS_IN_FLIGHT`] plans are
//! out at once, so shards find step N+1 waiting when they finish step N. Because a plan is
//! made before the previous step's tokens are known, a sequence that stopped early may be
//! planned once more; shards skip finished sequences, and the coordinator frees them in
//! the next plan.
//!
//! Continuous batching, chunked prefill and preemption come with the serving work; this
//! core already speaks in deltas (`free`, `prefill`, `decode`) as the protocol requires.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use tessera_comm::proto::{FinishReason, NewSeq, PrefillChunk, SeqId, SeqToken, StepPlan};

use crate::engine::{GenerateOutput, GenerateRequest};

/// Plans a group may have outstanding. Two keep the shards busy (one running, one
/// queued behind it) without planning far ahead of what the coordinator knows.
pub const MAX_PLANS_IN_FLIGHT: usize = 2;

/// Sequences a group runs at once. Every running sequence costs one forward pass per
/// step until batching lands, so a small number keeps inter-token latency sane.
pub const MAX_RUNNING: usize = 8;

/// A sequence that has been admitted.
#[derive(Debug)]
struct Running {
    tokens: Vec<u32>,
    /// Tokens the plans sent so far will have produced (one per plan that names it).
    planned: u32,
    max_tokens: u32,
    blocks: u32,
}

/// A plan whose results have not arrived.
#[derive(Debug)]
struct InFlight {
    step: u64,
    /// When the shards could start it: sent, and the plan before it done.
    started: Instant,
    /// Prompt + decode tokens it carries, for its deadline.
    tokens: usize,
}

/// What `on_step_done` finished.
#[derive(Debug, PartialEq)]
pub struct Finished {
    pub seq: SeqId,
    pub output: GenerateOutput,
}

/// Why a request cannot be admitted, ever.
#[derive(Debug, PartialEq, Eq)]
pub struct TooLarge {
    pub needed_blocks: u32,
    pub kv_blocks: u32,
}

#[derive(Debug)]
pub struct Scheduler {
    term: u64,
    epoch: u64,
    next_step: u64,
    kv_blocks: u32,
    block_size: u32,
    used_blocks: u32,
    queue: VecDeque<(SeqId, GenerateRequest, Instant)>,
    /// Admitted and not yet sent in a prefill.
    admitted: Vec<(SeqId, GenerateRequest)>,
    running: BTreeMap<SeqId, Running>,
    in_flight: VecDeque<InFlight>,
    to_free: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(term: u64) -> Scheduler {
        Scheduler {
            term,
            epoch: 0,
            next_step: 0,
            kv_blocks: 0,
            block_size: 1,
            used_blocks: 0,
            queue: VecDeque::new(),
            admitted: Vec::new(),
            running: BTreeMap::new(),
            in_flight: VecDeque::new(),
            to_free: Vec::new(),
        }
    }

    /// Starts serving `epoch` with the group's capacity. Nothing may be running (see
    /// [`Scheduler::fence`]).
    pub fn start_epoch(&mut self, epoch: u64, kv_blocks: u32, block_size: u32) {
        debug_assert!(self.running.is_empty() && self.admitted.is_empty());
        self.epoch = epoch;
        self.next_step = 0;
        self.kv_blocks = kv_blocks;
        self.block_size = block_size.max(1);
        self.used_blocks = 0;
        self.in_flight.clear();
        self.to_free.clear();
    }

    /// Ends the epoch: every admitted or running sequence is returned (to be failed); the
    /// queue stays for the next epoch.
    pub fn fence(&mut self) -> Vec<SeqId> {
        let mut lost: Vec<SeqId> = self.running.keys().copied().collect();
        lost.extend(self.admitted.drain(..).map(|(id, _)| id));
        self.running.clear();
        self.in_flight.clear();
        self.to_free.clear();
        self.used_blocks = 0;
        self.kv_blocks = 0;
        lost
    }

    /// Queues a request. Returns `Err` when it could never fit this group's KV cache.
    pub fn submit(
        &mut self,
        seq: SeqId,
        request: GenerateRequest,
        now: Instant,
    ) -> Result<(), TooLarge> {
        if self.kv_blocks > 0 {
            let needed = self.blocks_for(&request);
            if needed > self.kv_blocks {
                return Err(TooLarge {
                    needed_blocks: needed,
                    kv_blocks: self.kv_blocks,
                });
            }
        }
        self.queue.push_back((seq, request, now));
        Ok(())
    }

    /// Removes and returns queued requests that waited longer than `max_wait`.
    pub fn expire(&mut self, now: Instant, max_wait: Duration) -> Vec<SeqId> {
        let mut expired = Vec::new();
        self.queue.retain(|(id, _, at)| {
            let keep = now.duration_since(*at) < max_wait;
            if !keep {
                expired.push(*id);
            }
            keep
        });
        expired
    }

    /// Removes a queued or running sequence (the client went away); returns whether it
    /// was known.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        let queued = self.queue.len();
        self.queue.retain(|(id, _, _)| *id != seq);
        if self.queue.len() != queued {
            return true;
        }
        if let Some(pos) = self.admitted.iter().position(|(id, _)| *id == seq) {
            let (_, request) = self.admitted.remove(pos);
            self.used_blocks -= self.blocks_for(&request);
            return true;
        }
        if let Some(r) = self.running.remove(&seq) {
            self.used_blocks -= r.blocks;
            self.to_free.push(seq);
            return true;
        }
        false
    }

    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.admitted.is_empty()
    }

    /// The step of the oldest outstanding plan when it has run longer than its deadline
    /// (`base` plus `per_token` for each token it carries), counted from when the shards
    /// could start it: a pipelined plan waits for the one before it.
    pub fn overdue(&self, now: Instant, base: Duration, per_token: Duration) -> Option<u64> {
        let oldest = self.in_flight.front()?;
        let allowed = base + per_token * u32::try_from(oldest.tokens).unwrap_or(u32::MAX);
        (now.duration_since(oldest.started) > allowed).then_some(oldest.step)
    }

    /// The next plan, if the pipeline has room and there is work.
    pub fn next_plan(&mut self, now: Instant) -> Option<StepPlan> {
        if self.in_flight.len() >= MAX_PLANS_IN_FLIGHT || self.kv_blocks == 0 {
            return None;
        }
        self.admit();
        let decode: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| r.planned < r.max_tokens)
            .map(|(id, _)| *id)
            .collect();
        if decode.is_empty() && self.admitted.is_empty() && self.to_free.is_empty() {
            return None;
        }
        for id in &decode {
            self.running.get_mut(id).expect("listed above").planned += 1;
        }
        let mut tokens = decode.len();
        let mut prefill = Vec::with_capacity(self.admitted.len());
        let mut new = Vec::with_capacity(self.admitted.len());
        for (seq, request) in self.admitted.drain(..) {
            tokens += request.prompt.len();
            let blocks = blocks_needed(&request, self.block_size);
            self.running.insert(
                seq,
                Running {
                    tokens: Vec::new(),
                    planned: 1,
                    max_tokens: request.max_tokens,
                    blocks,
                },
            );
            prefill.push(PrefillChunk {
                seq,
                tokens: request.prompt.len() as u32,
            });
            new.push(NewSeq {
                seq,
                generated: Vec::new(),
                prompt: request.prompt,
                sampling: request.sampling,
                max_tokens: request.max_tokens,
                stop_token_ids: request.stop_token_ids,
            });
        }
        let step = self.next_step;
        self.next_step += 1;
        self.in_flight.push_back(InFlight {
            step,
            started: now,
            tokens,
        });
        Some(StepPlan {
            term: self.term,
            epoch: self.epoch,
            step,
            free: std::mem::take(&mut self.to_free),
            new,
            prefill,
            decode,
        })
    }

    /// Applies rank 0's results of `step`. Returns the sequences that finished.
    pub fn on_step_done(&mut self, step: u64, tokens: &[SeqToken], now: Instant) -> Vec<Finished> {
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
        let mut finished = Vec::new();
        for t in tokens {
            let Some(r) = self.running.get_mut(&t.seq) else {
                continue; // cancelled meanwhile
            };
            r.tokens.push(t.token);
            let finish = t.finish.or_else(|| {
                (r.tokens.len() >= r.max_tokens as usize).then_some(FinishReason::Length)
            });
            if let Some(finish) = finish {
                let r = self.running.remove(&t.seq).expect("present above");
                self.used_blocks -= r.blocks;
                self.to_free.push(t.seq);
                finished.push(Finished {
                    seq: t.seq,
                    output: GenerateOutput {
                        tokens: r.tokens,
                        logprobs: Vec::new(),
                        finish,
                    },
                });
            }
        }
        finished
    }

    /// Moves queued requests into the next prefill while blocks and slots last (FIFO: the
    /// head of the queue is never overtaken).
    fn admit(&mut self) {
        while self.running.len() + self.admitted.len() < MAX_RUNNING {
            let Some((_, request, _)) = self.queue.front() else {
                break;
            };
            let needed = self.blocks_for(request);
            if self.used_blocks + needed > self.kv_blocks {
                break;
            }
            let (seq, request, _) = self.queue.pop_front().expect("front exists");
            self.used_blocks += needed;
            self.admitted.push((seq, request));
        }
    }

    fn blocks_for(&self, request: &GenerateRequest) -> u32 {
        blocks_needed(request, self.block_size)
    }
}

/// Blocks for the prompt and every token the sequence may generate.
fn blocks_needed(request: &GenerateRequest, block_size: u32) -> u32 {
    let positions = request.prompt.len() as u64 + u64::from(request.max_tokens);
    u32::try_from(positions.div_ceil(u64::from(block_size))).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_comm::proto::Sampling;

    fn request(prompt: usize, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            model: "m".into(),
            prompt: vec![1; prompt],
            max_tokens,
            sampling: Sampling::default(),
            stop_token_ids: vec![2],
            priority: 0,
        }
    }

    fn token(seq: u64, token: u32, finish: Option<FinishReason>) -> SeqToken {
        SeqToken {
            seq: SeqId(seq),
            token,
            finish,
            logprobs: None,
        }
    }

    #[test]
    fn pipelines_two_plans_and_finishes_at_max_tokens() {
        let now = Instant::now();
        let mut s = Scheduler::new(1);
        s.start_epoch(1, 100, 16);
        s.submit(SeqId(1), request(5, 3), now).unwrap();
        let p0 = s.next_plan(now).unwrap();
        assert_eq!(p0.prefill.len(), 1);
        assert!(p0.decode.is_empty());
        // The decode of step 1 goes out before step 0's token is known.
        let p1 = s.next_plan(now).unwrap();
        assert_eq!(p1.decode, vec![SeqId(1)]);
        assert!(s.next_plan(now).is_none(), "at most two plans in flight");
        assert!(s.on_step_done(0, &[token(1, 7, None)], now).is_empty());
        let p2 = s.next_plan(now).unwrap();
        assert_eq!(p2.decode, vec![SeqId(1)]);
        assert!(s.on_step_done(1, &[token(1, 8, None)], now).is_empty());
        // Three tokens planned: nothing left to decode.
        assert!(s.next_plan(now).is_none());
        let done = s.on_step_done(2, &[token(1, 9, Some(FinishReason::Length))], now);
        assert_eq!(done[0].output.tokens, vec![7, 8, 9]);
        assert_eq!(done[0].output.finish, FinishReason::Length);
        let p3 = s.next_plan(now).unwrap();
        assert_eq!(p3.free, vec![SeqId(1)]);
        assert!(s.is_idle());
    }

    #[test]
    fn an_early_stop_frees_the_sequence_once() {
        let now = Instant::now();
        let mut s = Scheduler::new(1);
        s.start_epoch(1, 100, 16);
        s.submit(SeqId(1), request(2, 10), now).unwrap();
        s.next_plan(now).unwrap();
        s.next_plan(now).unwrap();
        let done = s.on_step_done(0, &[token(1, 2, Some(FinishReason::Stop))], now);
        assert_eq!(done.len(), 1);
        // Step 1 had planned a decode the shards skip; its (empty) result changes nothing.
        assert!(s.on_step_done(1, &[], now).is_empty());
        let p = s.next_plan(now).unwrap();
        assert_eq!(p.free, vec![SeqId(1)]);
        assert!(p.decode.is_empty());
        assert!(s.next_plan(now).is_none());
    }

    #[test]
    fn admission_waits_for_blocks_in_fifo_order() {
        let now = Instant::now();
        let mut s = Scheduler::new(1);
        s.start_epoch(1, 4, 16);
        s.submit(SeqId(1), request(40, 8), now).unwrap(); // 3 blocks
        s.submit(SeqId(2), request(20, 8), now).unwrap(); // 2 blocks: waits
        s.submit(SeqId(3), request(1, 1), now).unwrap(); // 1 block: must not overtake
        let p = s.next_plan(now).unwrap();
        assert_eq!(
            p.prefill.iter().map(|n| n.seq).collect::<Vec<_>>(),
            [SeqId(1)]
        );
        assert_eq!(
            s.submit(SeqId(4), request(100, 1), now),
            Err(TooLarge {
                needed_blocks: 7,
                kv_blocks: 4
            })
        );
    }

    #[test]
    fn fence_returns_running_and_keeps_the_queue() {
        let now = Instant::now();
        let mut s = Scheduler::new(1);
        s.start_epoch(1, 100, 16);
        s.submit(SeqId(1), request(2, 4), now).unwrap();
        s.next_plan(now).unwrap();
        for i in 2..=10 {
            s.submit(SeqId(i), request(2, 4), now).unwrap();
        }
        let lost = s.fence();
        assert_eq!(lost, vec![SeqId(1)]);
        assert!(s.next_plan(now).is_none(), "no plans without an epoch");
        s.start_epoch(2, 100, 16);
        let p = s.next_plan(now).unwrap();
        assert_eq!((p.epoch, p.step), (2, 0));
        assert_eq!(p.prefill.len(), MAX_RUNNING);
    }

    #[test]
    fn deadline_and_expiry() {
        let now = Instant::now();
        let mut s = Scheduler::new(1);
        s.start_epoch(1, 100, 16);
        s.submit(SeqId(1), request(10, 4), now).unwrap();
        s.next_plan(now).unwrap();
        let base = Duration::from_secs(1);
        let per = Duration::from_millis(10);
        assert_eq!(
            s.overdue(now + Duration::from_millis(1099), base, per),
            None
        );
        assert_eq!(
            s.overdue(now + Duration::from_millis(1101), base, per),
            Some(0)
        );
        s.fence();
        s.submit(SeqId(2), request(1, 1), now).unwrap();
        assert!(
            s.expire(now + Duration::from_secs(1), Duration::from_secs(2))
                .is_empty()
        );
        assert_eq!(
            s.expire(now + Duration::from_secs(3), Duration::from_secs(2)),
            [SeqId(2)]
        );
    }
}
