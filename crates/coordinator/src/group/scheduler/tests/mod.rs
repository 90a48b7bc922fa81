use std::collections::{BTreeMap, HashSet};

use tessera_comm::proto::{FinishReason, Sampling, SeqToken, StepPlan};

use super::*;

mod queue;

fn request(prompt: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: (0..prompt as u32).collect(),
        max_tokens,
        sampling: Sampling::default(),
        stop_token_ids: vec![],
        stop: Vec::new(),
        priority: 0,
    }
}

fn config(step_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        step_tokens,
        ..SchedulerConfig::default()
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

fn chunks(p: &StepPlan) -> Vec<(u64, u32)> {
    p.prefill.iter().map(|c| (c.seq.0, c.tokens)).collect()
}

#[test]
fn pipelines_two_plans_and_finishes_at_max_tokens() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(1), config(256));
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(5, 3), Vec::new(), now)
        .unwrap();
    let p0 = s.plan_step(now).unwrap();
    assert_eq!(p0.new.len(), 1);
    assert_eq!(chunks(&p0), [(1, 5)]);
    assert!(p0.decode.is_empty());
    let p1 = s.plan_step(now).unwrap();
    assert_eq!(p1.decode, [SeqId(1)]);
    assert!(s.plan_step(now).is_none(), "at most two plans in flight");
    let out = s.on_step_done(StepId(0), vec![token(1, 7, None)], &[], now);
    assert_eq!(out[0].finish, None);
    let p2 = s.plan_step(now).unwrap();
    assert_eq!(p2.decode, [SeqId(1)]);
    s.on_step_done(StepId(1), vec![token(1, 8, None)], &[], now);
    // Three tokens planned: nothing left to decode.
    assert!(s.plan_step(now).is_none());
    let out = s.on_step_done(StepId(2), vec![token(1, 9, None)], &[], now);
    assert_eq!(out[0].finish, Some(FinishReason::Length));
    let p3 = s.plan_step(now).unwrap();
    assert_eq!(p3.free, [SeqId(1)]);
    assert!(s.is_idle());
}

#[test]
fn long_prompts_are_chunked_and_decodes_come_first() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(1), config(64));
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(10, 50), Vec::new(), now)
        .unwrap();
    s.plan_step(now).unwrap();
    s.on_step_done(StepId(0), vec![token(1, 1, None)], &[], now);
    s.submit(SeqId(2), "", request(150, 5), Vec::new(), now)
        .unwrap();
    let p = s.plan_step(now).unwrap();
    assert_eq!(p.decode, [SeqId(1)]);
    assert_eq!(chunks(&p), [(2, 63)], "one decode token + 63 prompt tokens");
    s.on_step_done(StepId(1), vec![token(1, 1, None)], &[], now);
    let p = s.plan_step(now).unwrap();
    assert_eq!(p.decode, [SeqId(1)]);
    assert_eq!(chunks(&p), [(2, 63)]);
    assert!(p.new.is_empty(), "a sequence is new once");
    s.on_step_done(StepId(2), vec![token(1, 1, None)], &[], now);
    let p = s.plan_step(now).unwrap();
    assert_eq!(chunks(&p), [(2, 24)]);
    s.on_step_done(
        StepId(3),
        vec![token(1, 1, None), token(2, 5, None)],
        &[],
        now,
    );
    let p = s.plan_step(now).unwrap();
    assert_eq!(p.decode, [SeqId(1), SeqId(2)]);
}

#[test]
fn a_prefix_cache_hit_shortens_the_prefill() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(1), config(64));
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(200, 5), Vec::new(), now)
        .unwrap();
    assert_eq!(chunks(&s.plan_step(now).unwrap()), [(1, 64)]);
    assert_eq!(chunks(&s.plan_step(now).unwrap()), [(1, 64)]);
    // The shards held 128 tokens: 128 + 128 planned leaves nothing after 200.
    s.on_step_done(StepId(0), vec![], &[(SeqId(1), 128)], now);
    let p = s.plan_step(now).unwrap();
    assert!(p.prefill.is_empty());
    assert_eq!(p.decode, [SeqId(1)]);
    assert_eq!(s.prefix_hit_tokens(), 128);
}

#[test]
fn priority_orders_admission_and_the_queue_is_bounded() {
    let now = Instant::now();
    let mut s = Scheduler::new(
        Term(1),
        SchedulerConfig {
            max_waiting: 3,
            ..config(256)
        },
    );
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    let with = |p: i32| GenerateRequest {
        stop: Vec::new(),
        priority: p,
        ..request(4, 2)
    };
    s.submit(SeqId(1), "", with(5), Vec::new(), now).unwrap();
    s.submit(SeqId(2), "", with(-1), Vec::new(), now).unwrap();
    s.submit(SeqId(3), "", with(5), Vec::new(), now).unwrap();
    assert_eq!(
        s.submit(SeqId(4), "", with(0), Vec::new(), now),
        Err(Refused::QueueFull { waiting: 3 })
    );
    let p = s.plan_step(now).unwrap();
    let order: Vec<u64> = p.new.iter().map(|n| n.seq.0).collect();
    assert_eq!(order, [2, 1, 3]);
}

#[test]
fn admission_keeps_a_watermark_and_never_overtakes_on_blocks() {
    let now = Instant::now();
    let mut s = Scheduler::new(
        Term(1),
        SchedulerConfig {
            watermark: 0.25,
            ..config(256)
        },
    );
    s.start_epoch(Epoch(1), 8, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(60, 4), Vec::new(), now)
        .unwrap(); // 4 blocks
    s.submit(SeqId(2), "", request(40, 4), Vec::new(), now)
        .unwrap(); // 3 blocks: 7 + 2 > 8
    s.submit(SeqId(3), "", request(1, 1), Vec::new(), now)
        .unwrap(); // 1 block: must not overtake
    let p = s.plan_step(now).unwrap();
    assert_eq!(chunks(&p), [(1, 60)]);
    assert_eq!(
        s.submit(SeqId(4), "", request(200, 1), Vec::new(), now),
        Err(Refused::TooLarge {
            needed_blocks: 13,
            kv_blocks: 8
        })
    );
}

#[test]
fn fence_returns_running_and_keeps_the_queue() {
    let now = Instant::now();
    let mut s = Scheduler::new(
        Term(1),
        SchedulerConfig {
            max_running: 4,
            ..config(256)
        },
    );
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(2, 4), Vec::new(), now)
        .unwrap();
    s.plan_step(now).unwrap();
    for i in 2..=10 {
        s.submit(SeqId(i), "", request(2, 4), Vec::new(), now)
            .unwrap();
    }
    assert_eq!(s.fence(), [SeqId(1)]);
    assert!(s.plan_step(now).is_none(), "no plans without an epoch");
    s.start_epoch(Epoch(2), 100, 16, Vec::new(), now);
    let p = s.plan_step(now).unwrap();
    assert_eq!((p.epoch, p.step), (Epoch(2), StepId(0)));
    assert_eq!(p.new.len(), 4);
}

#[test]
fn deadline_and_expiry() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(1), config(256));
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(10, 4), Vec::new(), now)
        .unwrap();
    s.plan_step(now).unwrap();
    let (base, per) = (Duration::from_secs(1), Duration::from_millis(10));
    assert_eq!(
        s.overdue(now + Duration::from_millis(1099), base, per),
        None
    );
    assert_eq!(
        s.overdue(now + Duration::from_millis(1101), base, per),
        Some(StepId(0))
    );
    s.fence();
    s.submit(SeqId(2), "", request(1, 1), Vec::new(), now)
        .unwrap();
    let later = |secs| now + Duration::from_secs(secs);
    let wait = Duration::from_secs(2);
    assert!(s.expire(later(1), wait, now).is_empty());
    // Counted from when the group went down, if that is later than the arrival.
    assert!(s.expire(later(3), wait, later(2)).is_empty());
    assert_eq!(s.expire(later(3), wait, now), [SeqId(2)]);
}

/// A busy group's queue holds a new request for `max_wait` at most; running, preempted
/// and resumed ones stay.
#[test]
fn a_busy_queue_expires_only_new_requests_that_waited_too_long() {
    let now = Instant::now();
    let later = |ms| now + Duration::from_millis(ms);
    let mut s = Scheduler::new(
        Term(1),
        SchedulerConfig {
            max_running: 1,
            ..config(256)
        },
    );
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), now);
    s.submit(SeqId(1), "", request(4, 50), Vec::new(), now)
        .unwrap();
    s.plan_step(now).unwrap();
    s.submit(SeqId(2), "", request(4, 5), Vec::new(), now)
        .unwrap();
    s.submit(SeqId(3), "", request(4, 5), Vec::new(), later(500))
        .unwrap();
    s.submit(SeqId(4), "r", request(4, 5), vec![9], now)
        .unwrap();
    let wait = Duration::from_secs(1);
    assert!(s.expire_queued(later(999), wait).is_empty());
    assert_eq!(s.expire_queued(later(1000), wait), [SeqId(2)]);
    assert_eq!(s.expire_queued(later(1500), wait), [SeqId(3)]);
    assert!(s.expire_queued(later(60_000), wait).is_empty());
    assert_eq!((s.running(), s.waiting()), (1, 1));
}

/// Shards simulated exactly as the engine applies plans: each sequence's next token is a
/// function of its position, so a recomputed sequence produces the same tokens.
#[derive(Default)]
struct FakeShards {
    seqs: BTreeMap<SeqId, FakeSeq>,
    max_blocks_held: u32,
}

struct FakeSeq {
    tokens: usize,
    computed: usize,
    prefill_len: usize,
    max_tokens: usize,
    generated: usize,
    finished: bool,
}

impl FakeShards {
    fn run(&mut self, plan: &StepPlan, block_size: usize, kv_blocks: u32) -> Vec<SeqToken> {
        let mut named = HashSet::new();
        for id in &plan.free {
            self.seqs.remove(id);
        }
        for n in &plan.new {
            let len = n.prompt.len() + n.generated.len();
            self.seqs.insert(
                n.seq,
                FakeSeq {
                    tokens: len,
                    computed: 0,
                    prefill_len: len,
                    max_tokens: n.max_tokens as usize,
                    generated: n.generated.len(),
                    finished: false,
                },
            );
        }
        let mut out = Vec::new();
        for c in &plan.prefill {
            assert!(named.insert(c.seq), "{} twice in step {}", c.seq, plan.step);
            let s = self
                .seqs
                .get_mut(&c.seq)
                .expect("prefill of a held sequence");
            if s.computed >= s.prefill_len {
                continue;
            }
            s.computed = (s.computed + c.tokens as usize).min(s.prefill_len);
            if s.computed == s.prefill_len {
                out.push(Self::sample(c.seq, s));
            }
        }
        for id in &plan.decode {
            assert!(named.insert(*id), "{id} twice in step {}", plan.step);
            let s = self.seqs.get_mut(id).expect("decode of a held sequence");
            if s.finished || s.computed < s.prefill_len {
                continue;
            }
            s.computed += 1;
            out.push(Self::sample(*id, s));
        }
        let held: u32 = self
            .seqs
            .values()
            .map(|s| s.computed.div_ceil(block_size) as u32)
            .sum();
        assert!(
            held <= kv_blocks,
            "shards hold {held} of {kv_blocks} blocks"
        );
        self.max_blocks_held = self.max_blocks_held.max(held);
        out
    }

    fn sample(id: SeqId, s: &mut FakeSeq) -> SeqToken {
        let token = (id.0 * 1000 + s.tokens as u64) as u32;
        s.tokens += 1;
        s.generated += 1;
        s.finished = s.generated >= s.max_tokens;
        token_of(id.0, token, s.finished.then_some(FinishReason::Length))
    }
}

fn token_of(seq: u64, t: u32, finish: Option<FinishReason>) -> SeqToken {
    token(seq, t, finish)
}

/// Runs `requests` through a scheduler and the fake shards until all finish; returns
/// each sequence's tokens and how many preemptions happened.
fn simulate(
    requests: Vec<GenerateRequest>,
    kv_blocks: u32,
    step_tokens: usize,
) -> (BTreeMap<u64, Vec<u32>>, u32) {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(1), config(step_tokens));
    s.start_epoch(Epoch(1), kv_blocks, 4, Vec::new(), now);
    for (i, r) in requests.into_iter().enumerate() {
        s.submit(SeqId(i as u64 + 1), "", r, Vec::new(), now)
            .unwrap();
    }
    let mut shards = FakeShards::default();
    let mut outputs: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut preemptions = 0;
    let mut pending = VecDeque::new();
    for _ in 0..100_000 {
        while let Some(plan) = s.plan_step(now) {
            preemptions += plan
                .free
                .iter()
                .filter(|id| shards.seqs.get(id).is_some_and(|s| !s.finished))
                .count() as u32;
            let tokens = shards.run(&plan, 4, kv_blocks);
            pending.push_back((plan.step, tokens));
            assert!(s.used_blocks <= s.kv_blocks);
        }
        let Some((step, tokens)) = pending.pop_front() else {
            break;
        };
        for e in s.on_step_done(step, tokens, &[], now) {
            outputs.entry(e.seq.0).or_default().push(e.token.token);
        }
    }
    assert!(s.is_idle(), "every request finished");
    (outputs, preemptions)
}

#[test]
fn preemption_under_kv_pressure_completes_every_request_with_the_same_tokens() {
    let requests: Vec<GenerateRequest> = (0..12)
        .map(|i| request(3 + i % 5, 10 + (i as u32 % 7) * 3))
        .collect();
    // Alone with plenty of blocks: the reference.
    let (alone, none) = simulate(requests.clone(), 1000, 64);
    assert_eq!(none, 0);
    // 12 sequences of up to 37 positions (10 blocks of 4) in 24 blocks: preemption.
    let (pressed, preemptions) = simulate(requests, 24, 64);
    assert!(preemptions > 0, "the test must exercise preemption");
    assert_eq!(pressed, alone);
    for (i, tokens) in &alone {
        let max = 10 + ((i - 1) as usize % 7) * 3;
        assert_eq!(tokens.len(), max, "sequence {i}");
    }
}

#[test]
fn random_loads_keep_the_block_count_and_finish_everything() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    for seed in 0..20 {
        let mut rng = StdRng::seed_from_u64(seed);
        let requests: Vec<GenerateRequest> = (0..rng.random_range(1..30))
            .map(|_| GenerateRequest {
                stop: Vec::new(),
                priority: rng.random_range(-2..3),
                ..request(rng.random_range(1..40), rng.random_range(1..30))
            })
            .collect();
        let kv_blocks = rng.random_range(18..60);
        let step_tokens = rng.random_range(1..100);
        let (outputs, _) = simulate(requests.clone(), kv_blocks, step_tokens);
        let (alone, _) = simulate(requests, 10_000, 512);
        assert_eq!(outputs, alone, "seed {seed}");
    }
}

/// A sequence the shards carried over: prompt of `prompt` tokens, `generated` sampled.
fn carried(seq: u64, tag: &str, prompt: u32, generated: &[u32]) -> HeldSeq {
    HeldSeq {
        seq: SeqId(seq),
        request: tag.into(),
        prompt_len: prompt,
        generated: generated.to_vec(),
        computed: prompt + generated.len() as u32 - 1,
    }
}

#[test]
fn a_carried_sequence_runs_on_without_prefill_when_its_request_claims_it() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(2), config(256));
    // 20 prompt + 3 generated: 22 positions computed, 2 blocks of 16.
    s.start_epoch(
        Epoch(1),
        100,
        16,
        vec![carried(77, "cmpl-a", 20, &[5, 6, 7])],
        now,
    );
    assert_eq!(s.kv_usage().0, 2, "counted in use before it is claimed");
    assert!(
        s.plan_step(now).is_none(),
        "nothing runs it before its request comes"
    );
    // The journal recorded 2 of the 3 tokens: the third goes to the client first.
    let admitted = s.submit(SeqId(1), "cmpl-a", request(20, 10), vec![5, 6], now);
    assert_eq!(
        admitted,
        Ok(Admitted::Carried(Adopted {
            from: SeqId(1),
            seq: SeqId(77),
            extra: vec![7]
        }))
    );
    assert_eq!(s.resumed(), (1, 0));
    let p0 = s.plan_step(now).unwrap();
    assert!(p0.new.is_empty() && p0.prefill.is_empty(), "no recompute");
    assert_eq!(p0.decode, [SeqId(77)]);
    // It decodes up to max_tokens, counting the carried tokens: 3 + 7 more.
    let mut step = StepId(0);
    let mut emitted = 0;
    loop {
        let out = s.on_step_done(step, vec![token(77, 1, None)], &[], now);
        emitted += 1;
        step = step.next();
        if out[0].finish.is_some() {
            break;
        }
        let _ = s.plan_step(now);
    }
    assert_eq!(emitted, 7);
    assert_eq!(s.plan_step(now).unwrap().free, [SeqId(77)]);
    assert!(s.is_idle());
}

#[test]
fn a_carried_sequence_that_does_not_extend_the_journal_is_freed_and_recomputed() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(2), config(256));
    s.start_epoch(
        Epoch(1),
        100,
        16,
        vec![carried(77, "cmpl-a", 20, &[5, 6, 7])],
        now,
    );
    // The journal disagrees on the second token.
    let admitted = s.submit(SeqId(1), "cmpl-a", request(20, 10), vec![5, 9], now);
    assert_eq!(admitted, Ok(Admitted::Queued));
    let p0 = s.plan_step(now).unwrap();
    assert_eq!(p0.free, [SeqId(77)]);
    assert_eq!(p0.new.len(), 1);
    assert_eq!(p0.new[0].seq, SeqId(1));
    assert_eq!(p0.new[0].request, "cmpl-a");
    assert_eq!(
        p0.new[0].generated,
        [5, 9],
        "recomputed, never sampled again"
    );
    assert_eq!(chunks(&p0), [(1, 22)]);
    assert_eq!(s.resumed(), (0, 1));
    // Blocks: the freed sequence's 2 are returned; the new one holds 22 positions.
    assert_eq!(s.kv_usage().0, 2);
}

#[test]
fn an_unclaimed_carried_sequence_is_freed_after_the_grace_period() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(2), config(256));
    s.start_epoch(
        Epoch(1),
        100,
        16,
        vec![carried(77, "cmpl-a", 20, &[5])],
        now,
    );
    s.expire_carried(now + Duration::from_secs(1), Duration::from_secs(10));
    assert!(s.plan_step(now).is_none());
    s.expire_carried(now + Duration::from_secs(11), Duration::from_secs(10));
    assert_eq!(s.kv_usage().0, 0);
    assert_eq!(s.plan_step(now).unwrap().free, [SeqId(77)]);
    // Its request, coming late, is recomputed.
    let late = s.submit(SeqId(1), "cmpl-a", request(20, 10), vec![5], now);
    assert_eq!(late, Ok(Admitted::Queued));
}

#[test]
fn a_request_queued_before_the_epoch_runs_on_as_its_carried_sequence() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(2), config(256));
    // The new leader resumes its journal before the shards have registered.
    s.submit(SeqId(1), "cmpl-a", request(20, 10), vec![5, 6], now)
        .unwrap();
    s.submit(SeqId(2), "cmpl-b", request(8, 10), vec![4], now)
        .unwrap();
    let adopted = s.start_epoch(
        Epoch(1),
        100,
        16,
        vec![carried(77, "cmpl-a", 20, &[5, 6, 7])],
        now,
    );
    assert_eq!(
        adopted,
        [Adopted {
            from: SeqId(1),
            seq: SeqId(77),
            extra: vec![7]
        }]
    );
    // The carried one decodes; the other, not held by the shards, is recomputed.
    let p0 = s.plan_step(now).unwrap();
    assert_eq!(p0.decode, [SeqId(77)]);
    assert_eq!(p0.new.len(), 1);
    assert_eq!(p0.new[0].seq, SeqId(2));
    assert_eq!(p0.new[0].generated, [4]);
    assert_eq!(s.resumed(), (1, 1));
}

#[test]
fn carried_sequences_that_do_not_add_up_or_fit_are_freed() {
    let now = Instant::now();
    let mut s = Scheduler::new(Term(2), config(256));
    let mut inconsistent = carried(5, "cmpl-b", 20, &[1, 2]);
    inconsistent.computed = 30;
    let empty = HeldSeq {
        generated: Vec::new(),
        computed: 19,
        ..carried(6, "cmpl-c", 20, &[1])
    };
    // 40 + 1 positions need 3 blocks of 16; the group has 5: the second does not fit.
    let big = |seq, tag| carried(seq, tag, 40, &[1, 2]);
    let held = vec![
        inconsistent,
        empty,
        big(7, "cmpl-d"),
        big(8, "cmpl-e"),
        carried(9, "cmpl-f", 4, &[1]),
        carried(10, "cmpl-f", 4, &[1]),
    ];
    s.start_epoch(Epoch(1), 5, 16, held, now);
    assert_eq!(s.kv_usage().0, 3, "only cmpl-d is counted");
    let mut freed = s.plan_step(now).unwrap().free;
    freed.sort();
    assert_eq!(freed, [SeqId(5), SeqId(6), SeqId(8), SeqId(9), SeqId(10)]);
    let claimed = s.submit(SeqId(1), "cmpl-d", request(40, 10), vec![1], now);
    assert!(matches!(claimed, Ok(Admitted::Carried(_))), "{claimed:?}");
}
