//! The header words a joining rank reads from a shared-memory segment another process
//! wrote: any words give a verdict without a panic, and only the words of its own group's
//! header pass.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::collective::shm::fuzzing::{check_segment_header, segment_header};

fuzz_target!(|data: &[u8]| {
    let words: Vec<u32> = data
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    let ours = segment_header();
    match check_segment_header(&words) {
        None => assert_ne!(words.len(), ours.len()),
        Some(Ok(())) => assert_eq!(words, ours),
        Some(Err(_)) => assert_ne!(words, ours),
    }
    assert_eq!(check_segment_header(&ours), Some(Ok(())));
});
