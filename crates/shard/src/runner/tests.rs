use std::path::Path;

use tessera_comm::collective::Solo;
use tessera_comm::proto::{PrefillChunk, Sampling, Warmup};
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

/// The llama-gqa f32 fixture, and a runner on a new cache of 64 blocks for it.
fn fixture() -> (ModelSlice, impl Fn(bool) -> StepRunner) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/llama-gqa/f32");
    let llama = loader::load_weights(&dir).expect("fixture loads");
    let layout = llama.kv_layout(DEFAULT_BLOCK_SIZE);
    let layers = llama.config().num_hidden_layers;
    let runner = move |device_sampling: bool| {
        let cache = SliceCache::Cpu(KvCache::new(layout, layers, 64));
        StepRunner::new(Rank(0), Epoch(1), cache).with_device_sampling(device_sampling)
    };
    (ModelSlice::Cpu(llama), runner)
}

/// Six steps from step 0: one sequence per `(prompt, sampling)`, prefilled whole, then
/// five decodes.
fn six_steps(
    model: &ModelSlice,
    runner: &mut StepRunner,
    seqs: &[(Vec<u32>, Sampling)],
) -> Vec<StepOutput> {
    let new: Vec<NewSeq> = seqs
        .iter()
        .enumerate()
        .map(|(i, (prompt, sampling))| NewSeq {
            seq: SeqId(i as u64),
            request: String::new(),
            prompt: prompt.clone(),
            generated: Vec::new(),
            sampling: sampling.clone(),
            max_tokens: 6,
            stop_token_ids: Vec::new(),
        })
        .collect();
    let ids: Vec<SeqId> = new.iter().map(|n| n.seq).collect();
    let prefill: Vec<PrefillChunk> = new
        .iter()
        .map(|n| PrefillChunk {
            seq: n.seq,
            tokens: n.prompt.len() as u32,
        })
        .collect();
    (0..6u64)
        .map(|step| {
            let first = step == 0;
            let plan = StepPlan {
                term: tessera_comm::proto::Term(1),
                epoch: Epoch(1),
                step: StepId(step),
                free: Vec::new(),
                new: if first { new.clone() } else { Vec::new() },
                prefill: if first { prefill.clone() } else { Vec::new() },
                decode: if first { Vec::new() } else { ids.clone() },
            };
            runner
                .step(model, &plan, &mut SliceComm::Host(&mut Solo::default()))
                .expect("step runs")
        })
        .collect()
}

#[test]
fn the_device_sampling_switch_leaves_a_cpu_shards_tokens_as_they_were() {
    let (model, runner) = fixture();
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
    let seqs: Vec<(Vec<u32>, Sampling)> = sampling
        .into_iter()
        .enumerate()
        .map(|(i, s)| (vec![1, 15, 27, 99 + i as u32, 4, 8], s))
        .collect();
    let before = six_steps(&model, &mut runner(false), &seqs);
    let after = six_steps(&model, &mut runner(true), &seqs);
    assert_eq!(before, after);
    assert_eq!(before.iter().map(|o| o.tokens.len()).sum::<usize>(), 18);
    assert!(before[1].tokens[1].logprobs.is_some());
}

#[test]
fn a_warmed_up_runner_serves_exactly_as_a_new_one() {
    let (model, runner) = fixture();
    // A prompt of zeros, as the warmup's: blocks the warmup left in the prefix cache
    // would be found (`cached`), and a warmup sequence still held would be decoded.
    let seqs = [
        (vec![0; 20], Sampling::default()),
        (
            vec![3, 1, 4, 1, 5],
            Sampling {
                temperature: 0.7,
                seed: 5,
                ..Sampling::default()
            },
        ),
    ];
    let new = six_steps(&model, &mut runner(false), &seqs);
    let mut warmed = runner(false);
    let spec = Warmup {
        prefill_tokens: 40,
        decode_seqs: 8,
    };
    let mut solo = Solo::default();
    let run = warmed
        .warm_up(&model, &mut SliceComm::Host(&mut solo), spec, true)
        .expect("warms up");
    // A prefill of 40, the 8 prompts, decodes of 8, 4, 2 and 1, the free.
    assert_eq!(run.steps, 7);
    assert_eq!((run.prefill_tokens, run.decode_seqs), (40, 8));
    assert_eq!(run.tokens, 40 + 8 + 8 + 4 + 2 + 1);
    assert_eq!(warmed.free_blocks(), warmed.num_blocks());
    assert_eq!(six_steps(&model, &mut warmed, &seqs), new);
    let again = warmed.warm_up(&model, &mut SliceComm::Host(&mut solo), spec, true);
    assert!(again.is_err(), "a runner that has stepped cannot warm up");
}
