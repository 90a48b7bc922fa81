//! `plan_step`: the next step's plan from the scheduler's state.
//!
//! In order, within the step's token budget: one decode token for each running sequence
//! that wants one (priority order; a sequence crossing a block boundary takes a block,
//! preempting the worst sequences when none is left), the next chunk of every prompt in
//! progress, then new sequences from the waiting queue while slots, budget and blocks
//! (above the watermark) last. A waiting sequence that outranks running ones may preempt
//! them for its blocks.

use std::time::Instant;

use tessera_comm::proto::{NewSeq, PrefillChunk, SeqId, StepId, StepPlan};

use super::{InFlight, MAX_QUEUE_WAITS, QueueKey, Running, Scheduler, Waiting};

/// What one plan is being filled with.
struct Draft {
    step: StepId,
    budget: usize,
    new: Vec<NewSeq>,
    prefill: Vec<PrefillChunk>,
    decode: Vec<SeqId>,
    now: Instant,
}

impl Scheduler {
    /// The next plan, if the pipeline has room and there is work.
    pub fn plan_step(&mut self, now: Instant) -> Option<StepPlan> {
        if self.in_flight.len() >= self.config.plans_in_flight || self.kv_blocks == 0 {
            return None;
        }
        let mut draft = Draft {
            step: self.next_step,
            budget: self.config.step_tokens,
            new: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
            now,
        };
        self.plan_decodes(&mut draft);
        self.plan_prefills(&mut draft);
        self.admit(&mut draft);
        if draft.decode.is_empty() && draft.prefill.is_empty() && self.to_free.is_empty() {
            return None;
        }
        self.next_step = self.next_step.next();
        self.in_flight.push_back(InFlight {
            step: draft.step,
            started: now,
            tokens: self.config.step_tokens - draft.budget,
        });
        Some(StepPlan {
            term: self.term,
            epoch: self.epoch,
            step: draft.step,
            free: std::mem::take(&mut self.to_free),
            new: draft.new,
            prefill: draft.prefill,
            decode: draft.decode,
        })
    }

    fn plan_decodes(&mut self, draft: &mut Draft) {
        let keys: Vec<(QueueKey, SeqId)> = self.running.iter().map(|(k, s)| (*k, *s)).collect();
        for (key, seq) in keys {
            if draft.budget == 0 {
                return;
            }
            let Some(r) = self.seqs.get(&seq) else {
                continue; // preempted for a better one in this loop
            };
            if !r.wants_decode() {
                continue;
            }
            let needed = self.blocks_for(u64::from(r.positions()) + 1);
            let more = needed.saturating_sub(r.blocks);
            if more > 0 && !self.make_room(more, key, draft.step) {
                self.preempt(seq);
                continue;
            }
            let r = self.seqs.get_mut(&seq).expect("still running");
            r.blocks += more;
            self.used_blocks += more;
            r.decode_planned += 1;
            r.last_step = draft.step;
            draft.decode.push(seq);
            draft.budget -= 1;
        }
    }

    fn plan_prefills(&mut self, draft: &mut Draft) {
        for seq in self.running.values() {
            if draft.budget == 0 {
                return;
            }
            let r = self.seqs.get_mut(seq).expect("running sequences are known");
            if r.prefill_planned_fully() || r.last_step == draft.step {
                continue;
            }
            let chunk = (r.prefill_len - r.prefill_planned).min(draft.budget as u32);
            r.prefill_planned += chunk;
            r.last_step = draft.step;
            draft.prefill.push(PrefillChunk {
                seq: *seq,
                tokens: chunk,
            });
            draft.budget -= chunk as usize;
        }
    }

    /// Moves waiting sequences into the plan, best first.
    fn admit(&mut self, draft: &mut Draft) {
        while draft.budget > 0 && self.seqs.len() < self.config.max_running {
            let Some((&key, w)) = self.waiting.iter().find(|(_, w)| w.not_before.is_none()) else {
                return;
            };
            let prefill_len = (w.request.prompt.len() + w.generated.len()) as u32;
            let blocks = self.blocks_for(u64::from(prefill_len));
            if !self.fits(blocks) && !self.preempt_worse_than(key, blocks, draft.step) {
                return;
            }
            let w = self.waiting.remove(&key).expect("found above");
            if w.resumed {
                self.resumed_recomputed += 1;
            } else if w.generated.is_empty() && self.queue_waits.len() < MAX_QUEUE_WAITS {
                self.queue_waits
                    .push(draft.now.saturating_duration_since(w.arrived));
            }
            let chunk = prefill_len.min(draft.budget as u32);
            draft.budget -= chunk as usize;
            draft.prefill.push(PrefillChunk {
                seq: w.seq,
                tokens: chunk,
            });
            draft.new.push(NewSeq {
                seq: w.seq,
                request: w.tag.clone(),
                prompt: w.request.prompt.clone(),
                generated: w.generated.clone(),
                sampling: w.request.sampling.clone(),
                max_tokens: w.request.max_tokens,
                stop_token_ids: w.request.stop_token_ids.clone(),
            });
            self.used_blocks += blocks;
            self.running.insert(key, w.seq);
            self.seqs.insert(
                w.seq,
                Running {
                    key,
                    tag: w.tag,
                    arrived: w.arrived,
                    prefill_len,
                    prefill_planned: chunk,
                    decode_planned: 0,
                    generated_at_admission: w.generated.len() as u32,
                    generated: w.generated,
                    blocks,
                    last_step: draft.step,
                    request: w.request,
                },
            );
        }
    }

    /// Whether `blocks` more can be counted at admission: under the watermark, unless
    /// nothing runs (a lone request may use the whole cache).
    fn fits(&self, blocks: u32) -> bool {
        let watermark = (f64::from(self.kv_blocks) * self.config.watermark).ceil() as u32;
        let after = self.used_blocks + blocks;
        after <= self.kv_blocks && (self.used_blocks == 0 || after + watermark <= self.kv_blocks)
    }

    /// Frees `more` blocks for the sequence at `key` by preempting worse sequences (not
    /// named in the plan being made); false when only `key` itself or better remain.
    fn make_room(&mut self, more: u32, key: QueueKey, step: StepId) -> bool {
        while self.kv_blocks - self.used_blocks < more {
            let victim = self
                .running
                .iter()
                .rev()
                .find(|(k, s)| **k > key && self.seqs[*s].last_step != step)
                .map(|(_, s)| *s);
            match victim {
                Some(seq) => self.preempt(seq),
                None => return false,
            }
        }
        true
    }

    /// Preempts running sequences worse than the waiting `key` until `blocks` fit.
    fn preempt_worse_than(&mut self, key: QueueKey, blocks: u32, step: StepId) -> bool {
        let outranked = self
            .running
            .iter()
            .rev()
            .any(|(k, s)| *k > key && self.seqs[s].last_step != step);
        if !outranked || blocks > self.kv_blocks {
            return false;
        }
        while !self.fits(blocks) {
            if !self.make_room(self.kv_blocks - self.used_blocks + 1, key, step) {
                return self.fits(blocks);
            }
        }
        true
    }

    /// Frees a running sequence on the shards and queues it again, with its tokens, to be
    /// recomputed once the plans that name it have run.
    pub(super) fn preempt(&mut self, seq: SeqId) {
        let Some(r) = self.seqs.remove(&seq) else {
            return;
        };
        self.running.remove(&r.key);
        self.used_blocks -= r.blocks;
        self.to_free.push(seq);
        self.preemptions += 1;
        let pending = self.in_flight.iter().any(|f| f.step <= r.last_step);
        self.waiting.insert(
            r.key,
            Waiting {
                seq,
                tag: r.tag,
                request: r.request,
                arrived: r.arrived,
                generated: r.generated,
                not_before: pending.then_some(r.last_step),
                resumed: false,
            },
        );
    }
}
