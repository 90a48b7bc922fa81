//! The wire format: every message round-trips, and malformed input — oversize length
//! prefixes, garbage, trailing bytes, truncated frames, random and mutated bytes — is an
//! error, never a panic or a large allocation.

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tessera_comm::CommError;
use tessera_comm::GroupToken;
use tessera_comm::proto::{
    Assignment, Bootstrap, CoordinatorMsg, Epoch, ErrorClass, FinishReason, GpuStats, HeldSeq,
    ModelSource, NewSeq, PROTOCOL_VERSION, PrefillChunk, Ready, Register, Sampling, SeqId,
    SeqToken, ShardMsg, ShardStats, StepDone, StepId, StepPlan, StepTimings, Term, TokenLogprobs,
    Warmup, WireError,
};
use tessera_comm::wire::{
    FRAME_HEADER_BYTES, MAX_FRAME_BYTES, decode, encode, encode_frame, read_frame, split_frame,
    write_frame,
};
use tessera_topology::Rank;

fn shard_msgs() -> Vec<ShardMsg> {
    vec![
        ShardMsg::Register(Register {
            version: PROTOCOL_VERSION,
            group: "g0".into(),
            rank: Rank(3),
            pid: 4242,
            device: "cuda:1".into(),
            held: vec![HeldSeq {
                seq: SeqId(5 << 40 | 9),
                request: "cmpl-abc/1".into(),
                prompt_len: 12,
                generated: vec![7, 8, 9],
                computed: 14,
            }],
        }),
        ShardMsg::Loading {
            epoch: Epoch(2),
            layers_done: 12,
            layers: 80,
            weight_bytes: 3 << 30,
        },
        ShardMsg::Ready(Ready {
            epoch: Epoch(2),
            kv_blocks: 4096,
            block_size: 16,
            weight_bytes: 17 << 30,
            kept: vec![SeqId(5 << 40 | 9)],
            warmup_ms: Some(1234),
        }),
        ShardMsg::StepDone(StepDone {
            epoch: Epoch(2),
            step: StepId(u64::MAX),
            tokens: vec![
                SeqToken {
                    seq: SeqId(1),
                    token: 128_000,
                    finish: None,
                    logprobs: Some(TokenLogprobs {
                        logprob: -0.25,
                        top: vec![(128_000, -0.25), (5, -1.5)],
                    }),
                },
                SeqToken {
                    seq: SeqId(u64::MAX),
                    token: 0,
                    finish: Some(FinishReason::Stop),
                    logprobs: None,
                },
                SeqToken {
                    seq: SeqId(7),
                    token: 13,
                    finish: Some(FinishReason::Length),
                    logprobs: None,
                },
            ],
            free_blocks: 100,
            cached: vec![(SeqId(7), 48)],
            timings: StepTimings {
                step_us: 1500,
                collective_us: 300,
                idle_us: 20,
                collective_bytes: 4096,
            },
        }),
        ShardMsg::Failed {
            epoch: Epoch(3),
            error: WireError {
                class: ErrorClass::DeadlineExceeded,
                message: "rank 2 did not arrive".into(),
                rank: Some(Rank(2)),
            },
        },
        ShardMsg::NcclId {
            epoch: Epoch(3),
            id: (0..128).collect(),
        },
        ShardMsg::Stats(ShardStats {
            rss_bytes: 3 << 30,
            gpu: Some(GpuStats {
                utilization: 0.75,
                memory_used_bytes: 70 << 30,
                memory_total_bytes: 80 << 30,
                temperature_celsius: 61.0,
                power_watts: 512.5,
            }),
        }),
        ShardMsg::Stats(ShardStats {
            rss_bytes: 1,
            gpu: None,
        }),
    ]
}

fn step_plan() -> StepPlan {
    StepPlan {
        term: Term(5),
        epoch: Epoch(2),
        step: StepId(99),
        free: vec![SeqId(3), SeqId(4)],
        new: vec![NewSeq {
            seq: SeqId(10),
            request: "chatcmpl-xyz".into(),
            prompt: (0..5000).map(|i| i * 37 % 150_000).collect(),
            generated: vec![17, 18],
            sampling: Sampling {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: 0.5,
                frequency_penalty: -0.5,
                seed: 1234,
                logprobs: Some(5),
            },
            max_tokens: 256,
            stop_token_ids: vec![2, 128_001],
        }],
        prefill: vec![PrefillChunk {
            seq: SeqId(10),
            tokens: 512,
        }],
        decode: vec![SeqId(1), SeqId(2)],
    }
}

fn coordinator_msgs() -> Vec<CoordinatorMsg> {
    let assignment = |bootstrap| {
        CoordinatorMsg::Assign(Assignment {
            term: Term(5),
            epoch: Epoch(2),
            token: GroupToken([7; 32]),
            bootstrap,
            collective_deadline_ms: 2000,
            keep: vec![SeqId(1), SeqId(2)],
            warmup: Warmup {
                prefill_tokens: 256,
                decode_seqs: 64,
            },
            model: ModelSource {
                version: 3,
                path: "/models/llama-v3".into(),
            },
        })
    };
    vec![
        assignment(Bootstrap::Solo),
        assignment(Bootstrap::Shm {
            name: "tessera-g0-2".into(),
        }),
        assignment(Bootstrap::Tcp {
            peers: vec!["10.0.0.1:7101".into(), "10.0.0.2:7101".into()],
        }),
        assignment(Bootstrap::Nccl),
        CoordinatorMsg::NcclId {
            epoch: Epoch(2),
            id: vec![9; 128],
        },
        CoordinatorMsg::Step(step_plan()),
        CoordinatorMsg::Step(StepPlan {
            term: Term(0),
            epoch: Epoch(0),
            step: StepId(0),
            free: Vec::new(),
            new: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
        }),
        CoordinatorMsg::Drain,
        CoordinatorMsg::Shutdown,
        CoordinatorMsg::Refused {
            error: WireError {
                class: ErrorClass::InvalidRequest,
                message: "protocol version 2 is not 1".into(),
                rank: None,
            },
        },
    ]
}

/// Every encoded message of both directions, as (payload, which direction).
fn valid_payloads() -> Vec<Vec<u8>> {
    let mut payloads: Vec<Vec<u8>> = shard_msgs().iter().map(|m| encode(m).unwrap()).collect();
    payloads.extend(coordinator_msgs().iter().map(|m| encode(m).unwrap()));
    payloads
}

#[test]
fn every_message_round_trips() {
    for msg in shard_msgs() {
        let bytes = encode(&msg).unwrap();
        assert_eq!(decode::<ShardMsg>(&bytes, MAX_FRAME_BYTES).unwrap(), msg);
    }
    for msg in coordinator_msgs() {
        let bytes = encode(&msg).unwrap();
        assert_eq!(
            decode::<CoordinatorMsg>(&bytes, MAX_FRAME_BYTES).unwrap(),
            msg
        );
    }
}

#[tokio::test]
async fn frames_round_trip_over_a_stream() {
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let sent = coordinator_msgs();
    let writer = {
        let sent = sent.clone();
        tokio::spawn(async move {
            for msg in &sent {
                write_frame(&mut a, msg).await.unwrap();
            }
        })
    };
    let mut received = Vec::new();
    while let Some(msg) = read_frame::<_, CoordinatorMsg>(&mut b, MAX_FRAME_BYTES)
        .await
        .unwrap()
    {
        received.push(msg);
    }
    writer.await.unwrap();
    assert_eq!(received, sent);
}

#[tokio::test]
async fn oversize_length_prefix_is_refused_before_allocation() {
    // 4 GiB - 1 announced, 4 bytes present: refused on the header alone.
    let mut input: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4];
    let err = read_frame::<_, ShardMsg>(&mut input, MAX_FRAME_BYTES)
        .await
        .unwrap_err();
    assert!(
        matches!(err, CommError::FrameTooLarge { len: 0xffff_ffff, limit } if limit == MAX_FRAME_BYTES),
        "{err}"
    );
    // The header was consumed, the body was not read.
    assert_eq!(input, [1, 2, 3, 4]);

    // A caller's smaller limit applies too.
    let frame = encode_frame(&step_plan()).unwrap();
    let err = read_frame::<_, CoordinatorMsg>(&mut frame.as_slice(), 64)
        .await
        .unwrap_err();
    assert!(
        matches!(err, CommError::FrameTooLarge { limit: 64, .. }),
        "{err}"
    );
}

#[test]
fn encoding_past_the_frame_limit_is_refused_at_the_sender() {
    let mut plan = step_plan();
    plan.new[0].prompt = vec![u32::MAX; MAX_FRAME_BYTES / 4];
    let err = encode(&CoordinatorMsg::Step(plan)).unwrap_err();
    assert!(matches!(err, CommError::FrameTooLarge { .. }), "{err}");
}

#[test]
fn garbage_is_a_decode_error() {
    for bytes in [
        &[][..],
        &[0xff],
        &[200, 1, 2, 3],
        &[0, 253, 0xff, 0xff, 0xff, 0xff],
        b"GET / HTTP/1.1\r\n\r\n",
    ] {
        assert!(
            decode::<ShardMsg>(bytes, MAX_FRAME_BYTES).is_err(),
            "{bytes:?}"
        );
        assert!(
            decode::<CoordinatorMsg>(bytes, MAX_FRAME_BYTES).is_err(),
            "{bytes:?}"
        );
    }
    // Register with a group name that is not UTF-8.
    let mut bytes = encode(&shard_msgs()[0]).unwrap();
    let at = bytes.windows(2).position(|w| w == b"g0").unwrap();
    bytes[at] = 0xc3;
    let err = decode::<ShardMsg>(&bytes, MAX_FRAME_BYTES).unwrap_err();
    assert!(matches!(err, CommError::Decode { .. }), "{err}");
}

#[test]
fn trailing_bytes_are_refused() {
    let with_tail = |msg: &dyn erased::Encode| {
        let mut bytes = msg.encode();
        bytes.extend_from_slice(&[0, 0, 0]);
        bytes
    };
    let trailing =
        |r: Result<(), CommError>| matches!(r, Err(CommError::TrailingBytes { count: 3 }));
    for msg in shard_msgs() {
        let bytes = with_tail(&msg);
        assert!(
            trailing(decode::<ShardMsg>(&bytes, MAX_FRAME_BYTES).map(drop)),
            "{msg:?}"
        );
    }
    for msg in coordinator_msgs() {
        let bytes = with_tail(&msg);
        assert!(
            trailing(decode::<CoordinatorMsg>(&bytes, MAX_FRAME_BYTES).map(drop)),
            "{msg:?}"
        );
    }
}

mod erased {
    /// Object-safe encoding, so one closure takes messages of both directions.
    pub trait Encode {
        fn encode(&self) -> Vec<u8>;
    }

    impl<T: serde::Serialize> Encode for T {
        fn encode(&self) -> Vec<u8> {
            tessera_comm::wire::encode(self).unwrap()
        }
    }
}

#[tokio::test]
async fn truncated_frames_are_errors() {
    let frame = encode_frame(&step_plan()).unwrap();
    for cut in [
        1,
        3,
        FRAME_HEADER_BYTES,
        FRAME_HEADER_BYTES + 1,
        frame.len() - 1,
    ] {
        let mut input = &frame[..cut];
        let err = read_frame::<_, CoordinatorMsg>(&mut input, MAX_FRAME_BYTES)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CommError::Truncated { got, .. } if got == cut),
            "cut at {cut}: {err}"
        );
    }
    // The payload of a truncated frame decodes as an error too.
    let (payload, _) = split_frame(&frame, MAX_FRAME_BYTES).unwrap().unwrap();
    assert!(decode::<CoordinatorMsg>(&payload[..payload.len() - 1], MAX_FRAME_BYTES).is_err());
    // An empty stream is a clean end, not an error.
    let none = read_frame::<_, ShardMsg>(&mut &[][..], MAX_FRAME_BYTES)
        .await
        .unwrap();
    assert_eq!(none, None);
}

/// Decodes `bytes` every way a peer's bytes are decoded; must return, whatever the input.
fn decode_all_ways(bytes: &[u8], runtime: &tokio::runtime::Runtime) {
    let _ = decode::<ShardMsg>(bytes, MAX_FRAME_BYTES);
    let _ = decode::<CoordinatorMsg>(bytes, MAX_FRAME_BYTES);
    let _ = split_frame(bytes, MAX_FRAME_BYTES);
    runtime.block_on(async {
        let mut input = bytes;
        while let Ok(Some(_)) = read_frame::<_, ShardMsg>(&mut input, MAX_FRAME_BYTES).await {}
        let mut input = bytes;
        while let Ok(Some(_)) = read_frame::<_, CoordinatorMsg>(&mut input, MAX_FRAME_BYTES).await {
        }
    });
}

/// A stable stand-in for the fuzz targets (`scripts/fuzz.sh`): random byte strings and
/// mutations of valid messages and frames never panic.
#[test]
fn random_and_mutated_input_never_panics() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(0x7e55e7a);
    for _ in 0..3000 {
        let len = rng.random_range(0..256);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        decode_all_ways(&bytes, &runtime);
    }
    let payloads = valid_payloads();
    for _ in 0..3000 {
        let payload = &payloads[rng.random_range(0..payloads.len())];
        let mut bytes = if rng.random_bool(0.5) {
            payload.clone()
        } else {
            let mut frame = u32::try_from(payload.len()).unwrap().to_le_bytes().to_vec();
            frame.extend_from_slice(payload);
            frame
        };
        for _ in 0..rng.random_range(1..4) {
            match rng.random_range(0..4) {
                // Flip one byte.
                0 => {
                    let at = rng.random_range(0..bytes.len());
                    bytes[at] = rng.random();
                }
                // Cut the tail.
                1 => bytes.truncate(rng.random_range(0..bytes.len())),
                // Insert a byte.
                2 => {
                    let at = rng.random_range(0..=bytes.len());
                    bytes.insert(at, rng.random());
                }
                // A large varint length (0xfb/0xfc/0xfd prefixes) somewhere.
                _ => {
                    let at = rng.random_range(0..=bytes.len());
                    let prefix = [0xfb, 0xfc, 0xfd][rng.random_range(0..3)];
                    bytes.splice(at..at, [prefix, 0xff, 0xff, 0xff, 0x7f]);
                }
            }
            if bytes.is_empty() {
                break;
            }
        }
        decode_all_ways(&bytes, &runtime);
    }
}
