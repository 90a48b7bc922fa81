//! A coordinator peer's Raft stream, as `serve_inbound` reads it: frames of `PeerMsg`
//! parts joined up to a limit, each message decoded and checked to come from its peer.
//! Any bytes end in messages or a reason, never a panic, and no message outgrows the
//! limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::wire::{MAX_FRAME_BYTES, split_frame};
use tessera_coordinator::replication::transport::{PeerMsg, read_raft_stream};

/// Small, so that joined messages reach it in generated input.
const LIMIT: usize = 4096;

/// The peer the connection's certificate names.
const FROM: u64 = 2;

fuzz_target!(|data: &[u8]| {
    // The first frame is read before the stream is known to carry Raft (it could be an
    // HTTP exchange instead); the rest are read by `read_raft_stream`.
    let Ok(Some((first, consumed))) = split_frame(data, MAX_FRAME_BYTES) else {
        return;
    };
    let Ok(first) = tessera_comm::wire::decode::<PeerMsg>(first, MAX_FRAME_BYTES) else {
        return;
    };
    if let PeerMsg::Http = first {
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime starts");
    let mut rest = &data[consumed..];
    runtime.block_on(async {
        let _ = read_raft_stream(first, &mut rest, FROM, LIMIT, |message| {
            assert_eq!(message.from, FROM, "a message from another peer got through");
        })
        .await;
    });
});
