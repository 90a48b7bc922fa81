//! `plan_step` at serving scale: 256 running sequences decoding and 1,000 waiting. Each
//! iteration is one whole step of coordinator work: plan it, then apply rank 0's 256
//! tokens. Target: under 50 µs per step.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use tessera_comm::proto::{Epoch, Sampling, SeqId, SeqToken, Term};
use tessera_coordinator::engine::GenerateRequest;
use tessera_coordinator::group::scheduler::{Scheduler, SchedulerConfig};

fn request(i: u64) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: (0..64).map(|t| (t + i as u32) % 1000).collect(),
        max_tokens: 1_000_000,
        sampling: Sampling::default(),
        stop_token_ids: vec![2],
        stop: Vec::new(),
        priority: (i % 3) as i32,
    }
}

fn plan_step(c: &mut Criterion) {
    let now = Instant::now();
    let config = SchedulerConfig {
        max_running: 256,
        step_tokens: 256 * 64 + 256,
        max_waiting: 2000,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(Term(1), config);
    // Enough blocks for every running sequence to grow for the whole benchmark.
    s.start_epoch(Epoch(1), 4_000_000, 16, Vec::new(), now);
    for i in 0..1256 {
        s.submit(SeqId(i), "", request(i), Vec::new(), now)
            .expect("queued");
    }
    let step_tokens = |plan: &tessera_comm::proto::StepPlan| -> Vec<SeqToken> {
        plan.decode
            .iter()
            .chain(plan.prefill.iter().map(|c| &c.seq))
            .map(|&seq| SeqToken {
                seq,
                token: 7,
                finish: None,
                logprobs: None,
            })
            .collect()
    };
    // Admit 256 and bring them to decoding.
    for _ in 0..4 {
        let plan = s.plan_step(now).expect("a plan");
        let tokens = step_tokens(&plan);
        s.on_step_done(plan.step, tokens, &[], now);
    }
    assert_eq!((s.running(), s.waiting()), (256, 1000));
    c.bench_function("plan_step+results/256 running, 1000 waiting", |b| {
        b.iter(|| {
            let plan = s.plan_step(now).expect("a plan");
            debug_assert_eq!(plan.decode.len(), 256);
            let tokens = step_tokens(&plan);
            black_box(s.on_step_done(plan.step, tokens, &[], now));
        });
    });
}

criterion_group!(benches, plan_step);
criterion_main!(benches);
