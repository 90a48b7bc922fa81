use std::path::Path;

use tessera_comm::collective::Solo;
use tessera_comm::proto::{PrefillChunk, Sampling};
use tessera_kernels::cpu::sample_threshold;
use tessera_kernels::sampling::SamplingParams;
use tessera_model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache};
use tessera_model::loader;

use super::*;

fn seq(params: SamplingParams, top_logprobs: Option<u8>) -> Seq {
    Seq {
        request: String::new(),
        tokens: vec![1, 2, 3, 9, 9],
        prompt_len: 3,
        prefill_len: 3,
        computed: 4,
        table: Vec::new(),
        hashes: Vec::new(),
        max_tokens: 100,
        stop_token_ids: vec![5],
        sampler: Some(Sampler::new(params, 17)),
        top_logprobs,
        finished: false,
    }
}

fn seeded() -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 30,
        top_p: 0.95,
        seed: Some(4),
        ..SamplingParams::default()
    }
}

#[test]
fn rows_ask_for_a_device_draw_unless_penalties_or_the_switch_keep_them_here() {
    let s = seq(seeded(), None);
    let on = row_request(&s, true);
    let draw = on.draw.expect("a device draw");
    // The draw of the third generated token: the one the host sampler would use.
    assert_eq!(draw, s.sampler.as_ref().unwrap().draw(2));
    assert!(!on.logits);
    assert_eq!(row_request(&s, false), RowRequest::LOGITS);
    let logprobs = row_request(&seq(seeded(), Some(3)), true);
    assert!(logprobs.draw.is_some() && logprobs.logits);
    let penalized = seq(
        SamplingParams {
            repetition_penalty: 1.2,
            ..seeded()
        },
        None,
    );
    assert_eq!(row_request(&penalized, true), RowRequest::LOGITS);
    let mut other_rank = seq(seeded(), None);
    other_rank.sampler = None;
    assert_eq!(row_request(&other_rank, true), RowRequest::LOGITS);
}

#[test]
fn a_token_sampled_with_the_draw_is_the_token_the_host_samples() {
    // What the device returns is the twin's token for the row's draw; the host samples
    // the same logits with the same sampler: the same token, finish and logprobs.
    let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
    for params in [SamplingParams::default(), seeded()] {
        for top in [None, Some(2)] {
            let mut device = seq(params.clone(), top);
            let mut host = seq(params.clone(), top);
            let draw = row_request(&device, true).draw.expect("no penalties");
            let token = sample_threshold(&logits, draw.params, draw.uniform);
            let row = RowOutput::Token {
                token,
                logits: top.map(|_| logits.clone()),
            };
            let from_device = sample(SeqId(1), &mut device, row, 4096);
            let from_host = sample(SeqId(1), &mut host, RowOutput::Logits(logits.clone()), 4096);
            assert_eq!(from_device, from_host, "{params:?} {top:?}");
            assert_eq!(from_device.logprobs.is_some(), top.is_some());
        }
    }
}

#[test]
fn the_device_sampling_switch_leaves_a_cpu_shards_tokens_as_they_were() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/llama-gqa/f32");
    let llama = loader::load_weights(&dir).expect("fixture loads");
    let layout = llama.kv_layout(DEFAULT_BLOCK_SIZE);
    let layers = llama.config().num_hidden_layers;
    let model = ModelSlice::Cpu(llama);
    let sampling = [
        Sampling::default(),
        Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            seed: 3,
            logprobs: Some(2),
            ..Sampling::default()
        },
        Sampling {
            temperature: 1.1,
            presence_penalty: 0.4,
            seed: 9,
            ..Sampling::default()
        },
    ];
    let run = |device_sampling: bool| {
        let cache = SliceCache::Cpu(KvCache::new(layout, layers, 64));
        let mut runner =
            StepRunner::new(Rank(0), Epoch(1), cache).with_device_sampling(device_sampling);
        let new: Vec<NewSeq> = sampling
            .iter()
            .enumerate()
            .map(|(i, s)| NewSeq {
                seq: SeqId(i as u64),
                request: String::new(),
                prompt: vec![1, 15, 27, 99 + i as u32, 4, 8],
                generated: Vec::new(),
                sampling: s.clone(),
                max_tokens: 6,
                stop_token_ids: Vec::new(),
            })
            .collect();
        let ids: Vec<SeqId> = new.iter().map(|n| n.seq).collect();
        let mut outputs = Vec::new();
        for step in 0..6u64 {
            let plan = StepPlan {
                term: tessera_comm::proto::Term(1),
                epoch: Epoch(1),
                step: StepId(step),
                free: Vec::new(),
                new: if step == 0 { new.clone() } else { Vec::new() },
                prefill: if step == 0 {
                    ids.iter()
                        .map(|&seq| PrefillChunk { seq, tokens: 6 })
                        .collect()
                } else {
                    Vec::new()
                },
                decode: if step == 0 { Vec::new() } else { ids.clone() },
            };
            let out = runner
                .step(&model, &plan, &mut SliceComm::Host(&mut Solo::default()))
                .expect("step runs");
            outputs.push(out);
        }
        outputs
    };
    let (before, after) = (run(false), run(true));
    assert_eq!(before, after);
    assert_eq!(before.iter().map(|o| o.tokens.len()).sum::<usize>(), 18);
    assert!(before[1].tokens[1].logprobs.is_some());
}
