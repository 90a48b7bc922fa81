//! Sequences carried over from an earlier coordinator leader's epoch: the shards still
//! hold their KV, so a resumed request whose journaled tokens they extend runs on with
//! no recompute. Requests and carried sequences meet in either order — a request queued
//! before the shards registered is matched when the epoch starts, one submitted after is
//! matched at once.

use std::time::{Duration, Instant};

use tessera_comm::proto::{HeldSeq, SeqId, StepId};

use super::{QueueKey, Running, Scheduler, Waiting};
use crate::engine::GenerateRequest;

/// A sequence carried into this epoch, waiting for its request (by journal id).
#[derive(Debug)]
pub(super) struct Carried {
    held: HeldSeq,
    blocks: u32,
    since: Instant,
}

/// A request that runs on as a carried sequence.
#[derive(Debug, PartialEq, Eq)]
pub struct Adopted {
    /// The id it was submitted under.
    pub from: SeqId,
    /// The carried sequence it now is.
    pub seq: SeqId,
    /// Tokens the shards generated beyond those submitted (the old leader never
    /// journaled them): they go to the client first.
    pub extra: Vec<u32>,
}

impl Scheduler {
    /// Counts the carried sequences in the blocks and runs on the queued requests they
    /// belong to. A shard's report is checked first: a sequence whose positions do not add
    /// up, one of a request named twice, or one past the group's blocks (prefix-shared
    /// blocks count once on the shards, once per sequence here) is freed instead.
    pub(super) fn install_carried(&mut self, carried: Vec<HeldSeq>, now: Instant) -> Vec<Adopted> {
        self.carried.clear();
        let mut twice = Vec::new();
        for held in carried {
            let blocks = self.blocks_for(u64::from(held.computed));
            let consistent = !held.generated.is_empty()
                && held.computed as usize + 1 == held.prompt_len as usize + held.generated.len();
            if !consistent || self.used_blocks + blocks > self.kv_blocks {
                self.to_free.push(held.seq);
                continue;
            }
            self.used_blocks += blocks;
            let tag = held.request.clone();
            let carried = Carried {
                held,
                blocks,
                since: now,
            };
            if let Some(first) = self.carried.insert(tag.clone(), carried) {
                self.free_carried(first);
                twice.push(tag);
            }
        }
        // Two sequences of one request (not from this coordinator): keep neither.
        for tag in twice {
            if let Some(c) = self.carried.remove(&tag) {
                self.free_carried(c);
            }
        }
        let keys: Vec<QueueKey> = self
            .waiting
            .iter()
            .filter(|(_, w)| self.carried.contains_key(&w.tag))
            .map(|(k, _)| *k)
            .collect();
        let mut adopted = Vec::new();
        for key in keys {
            let w = self.waiting.remove(&key).expect("listed above");
            match self.claim(&w.tag, &w.request, &w.generated) {
                Some(c) => adopted.push(self.run_carried(key, w, c)),
                None => {
                    self.waiting.insert(key, w);
                }
            }
        }
        adopted
    }

    /// Frees carried sequences that no request claimed within `grace`.
    pub fn expire_carried(&mut self, now: Instant, grace: Duration) {
        let old: Vec<String> = self
            .carried
            .iter()
            .filter(|(_, c)| now.duration_since(c.since) > grace)
            .map(|(tag, _)| tag.clone())
            .collect();
        for tag in old {
            if let Some(c) = self.carried.remove(&tag) {
                self.free_carried(c);
            }
        }
    }

    fn free_carried(&mut self, c: Carried) {
        self.used_blocks -= c.blocks;
        self.to_free.push(c.held.seq);
    }

    /// The carried sequence of journal id `tag`, taken when its tokens extend the
    /// `generated` ones; a carried sequence that does not is freed.
    pub(super) fn claim(
        &mut self,
        tag: &str,
        request: &GenerateRequest,
        generated: &[u32],
    ) -> Option<Carried> {
        let c = self.carried.remove(tag)?;
        let h = &c.held;
        let fits = h.prompt_len as usize == request.prompt.len()
            && h.generated.starts_with(generated)
            && h.generated.len() < request.max_tokens as usize
            // Logprobs of tokens the old leader never saw are gone: recompute them.
            && (request.sampling.logprobs.is_none() || h.generated.len() == generated.len());
        if fits {
            Some(c)
        } else {
            tracing::info!(
                request = tag,
                held_prompt = h.prompt_len,
                prompt = request.prompt.len(),
                held_tokens = h.generated.len(),
                journaled = generated.len(),
                "a carried sequence does not extend its journal: recomputing"
            );
            self.free_carried(c);
            None
        }
    }

    /// Runs request `w` on as carried sequence `c`, at queue position `key`.
    pub(super) fn run_carried(&mut self, key: QueueKey, w: Waiting, c: Carried) -> Adopted {
        let h = c.held;
        let extra = h.generated[w.generated.len()..].to_vec();
        self.resumed_carried += 1;
        self.running.insert(key, h.seq);
        self.seqs.insert(
            h.seq,
            Running {
                key,
                tag: w.tag,
                request: w.request,
                arrived: w.arrived,
                // The computed positions stand for the prompt; the last token is decoded.
                prefill_len: h.computed,
                prefill_planned: h.computed,
                decode_planned: 0,
                generated_at_admission: h.generated.len() as u32 - 1,
                generated: h.generated,
                blocks: c.blocks,
                last_step: StepId(0),
            },
        );
        Adopted {
            from: w.seq,
            seq: h.seq,
            extra,
        }
    }
}
