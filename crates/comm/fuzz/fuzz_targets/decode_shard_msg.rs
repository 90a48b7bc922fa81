//! Any bytes given to `decode::<ShardMsg>` give a message or an error, never a panic, and
//! a decoded message re-encodes to bytes that decode and re-encode identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::proto::ShardMsg;
use tessera_comm::wire::{MAX_FRAME_BYTES, decode, encode};

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode::<ShardMsg>(data, MAX_FRAME_BYTES) {
        // bincode accepts non-minimal varints, so `data` itself need not be canonical;
        // its re-encoding must be, and must decode to the same encoding again.
        let canonical = encode(&msg).expect("a decoded message encodes");
        let again = decode::<ShardMsg>(&canonical, MAX_FRAME_BYTES).expect("its encoding decodes");
        assert_eq!(encode(&again).expect("encodes"), canonical);
    }
});
