//! A sequence carried into a new epoch (a new coordinator leader) goes on exactly as if
//! nothing had happened: the same tokens as an uninterrupted run, with no recompute.

use std::path::Path;

use tessera_comm::collective::Solo;
use tessera_comm::proto::{Epoch, NewSeq, PrefillChunk, Sampling, SeqId, StepId, StepPlan, Term};
use tessera_model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache};
use tessera_model::loader;
use tessera_model::slice::{ModelSlice, SliceCache, SliceComm};
use tessera_shard::runner::StepRunner;
use tessera_topology::Rank;

fn model() -> ModelSlice {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/llama-gqa/f32");
    ModelSlice::Cpu(loader::load_weights(&dir).expect("fixture loads"))
}

fn runner(model: &ModelSlice) -> StepRunner {
    #[allow(irrefutable_let_patterns)] // a CUDA variant exists only with the `cuda` feature
    let ModelSlice::Cpu(llama) = model else {
        unreachable!("the fixture runs on the CPU")
    };
    let layout = llama.kv_layout(DEFAULT_BLOCK_SIZE);
    let cache = KvCache::new(layout, llama.config().num_hidden_layers, 64);
    StepRunner::new(Rank(0), Epoch(1), SliceCache::Cpu(cache))
}

fn new_seq(seq: u64, request: &str) -> NewSeq {
    NewSeq {
        seq: SeqId(seq),
        request: request.into(),
        prompt: vec![
            1, 15, 27, 99, 4, 8, 16, 23, 42, 7, 3, 11, 5, 19, 21, 30, 2, 9,
        ],
        generated: Vec::new(),
        sampling: Sampling {
            temperature: 0.9,
            top_k: 20,
            seed: 7,
            ..Sampling::default()
        },
        max_tokens: 12,
        stop_token_ids: Vec::new(),
    }
}

fn plan(epoch: u64, step: u64, new: Vec<NewSeq>, decode: &[u64]) -> StepPlan {
    let prefill = new
        .iter()
        .map(|n| PrefillChunk {
            seq: n.seq,
            tokens: n.prompt.len() as u32,
        })
        .collect();
    StepPlan {
        term: Term(epoch),
        epoch: Epoch(epoch),
        step: StepId(step),
        free: Vec::new(),
        new,
        prefill,
        decode: decode.iter().map(|&s| SeqId(s)).collect(),
    }
}

/// Tokens of sequence 1 over `steps` steps (the first prefills, the rest decode).
fn run(
    model: &ModelSlice,
    e: &mut StepRunner,
    epoch: u64,
    first_step: u64,
    steps: u64,
) -> Vec<u32> {
    let mut comm = Solo::default();
    let mut tokens = Vec::new();
    for i in 0..steps {
        let step = first_step + i;
        let p = if step == 0 && epoch == 1 {
            plan(epoch, 0, vec![new_seq(1, "cmpl-a"), new_seq(2, "")], &[])
        } else {
            plan(epoch, step, Vec::new(), &[1, 2])
        };
        let out = e
            .step(model, &p, &mut SliceComm::Host(&mut comm))
            .expect("step runs");
        tokens.extend(
            out.tokens
                .iter()
                .filter(|t| t.seq == SeqId(1))
                .map(|t| t.token),
        );
    }
    tokens
}

#[test]
fn a_carried_sequence_continues_with_the_same_tokens() {
    let model = model();
    let mut straight = runner(&model);
    let expected = run(&model, &mut straight, 1, 0, 8);
    assert_eq!(expected.len(), 8);

    let mut first = runner(&model);
    let before = run(&model, &mut first, 1, 0, 5);
    assert_eq!(before, expected[..5]);
    // Only the journaled sequence is reported, with what a new leader needs.
    let held = first.journaled_held();
    assert_eq!(held.len(), 1);
    let h = &held[0];
    assert_eq!(
        (h.seq, h.request.as_str(), h.prompt_len),
        (SeqId(1), "cmpl-a", 18)
    );
    assert_eq!(h.generated, before);
    assert_eq!(h.computed, 18 + 5 - 1);

    let free_before = first.free_blocks();
    let (mut second, kept) = first.carry(Epoch(2), &[SeqId(1)]);
    assert_eq!(kept, [SeqId(1)]);
    assert!(
        second.free_blocks() > free_before,
        "the sequence not kept is freed"
    );
    // Epoch 2 plans start at step 0 and only decode: nothing is recomputed.
    let mut comm = Solo::default();
    let mut after = Vec::new();
    for step in 0..3 {
        let out = second
            .step(
                &model,
                &plan(2, step, Vec::new(), &[1]),
                &mut SliceComm::Host(&mut comm),
            )
            .expect("decode of the carried sequence");
        after.extend(out.tokens.iter().map(|t| t.token));
    }
    assert_eq!(after, expected[5..]);
    // A decode of the sequence not kept is refused.
    let err = second
        .step(
            &model,
            &plan(2, 3, Vec::new(), &[2]),
            &mut SliceComm::Host(&mut comm),
        )
        .unwrap_err();
    assert!(err.to_string().contains("unknown sequence 2"), "{err}");
}
