//! `read_frame` over an in-memory stream: every frame is read or refused without a panic,
//! and the async reader agrees with the buffer parser `split_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::proto::ShardMsg;
use tessera_comm::wire::{decode, encode, read_frame, split_frame};

/// Small, so oversize length prefixes are common in generated input.
const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime starts");
    runtime.block_on(async {
        let mut input = data;
        let mut buffer = data;
        loop {
            let read = read_frame::<_, ShardMsg>(&mut input, LIMIT).await;
            let split = split_frame(buffer, LIMIT);
            match (read, split) {
                (Ok(Some(msg)), Ok(Some((payload, consumed)))) => {
                    // Compared as bytes: a NaN logprob never equals itself as a value.
                    let parsed = decode::<ShardMsg>(payload, LIMIT).expect("split_frame's payload decodes");
                    assert_eq!(encode(&parsed).ok(), encode(&msg).ok());
                    buffer = &buffer[consumed..];
                }
                (Ok(None), Ok(None)) => {
                    assert!(buffer.is_empty(), "clean end with bytes left");
                    break;
                }
                (Err(_), _) => break,
                (read, split) => panic!("read_frame {read:?} but split_frame {split:?}"),
            }
        }
    });
});
