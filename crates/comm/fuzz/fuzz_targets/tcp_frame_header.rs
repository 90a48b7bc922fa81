//! The header of each frame a TCP ring rank receives: any 12 bytes, checked against any
//! expected (op, bytes, total), give a verdict without a panic; only the header a sender
//! would write for that frame passes, and it always does unless it is an abort.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::collective::tcp::fuzzing::{check_frame_header, frame_header};

fuzz_target!(|data: &[u8]| {
    let word = |i: usize| {
        data.get(i..i + 4)
            .map_or(0, |w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
    };
    let (code, bytes, total) = (word(12), word(16), word(20));
    let header = &data[..data.len().min(12)];
    match check_frame_header(header, code, bytes, total) {
        None => assert!(header.len() < 12),
        Some(Ok(())) => assert_eq!(header, &frame_header(code, bytes, total)[..]),
        Some(Err(_)) => {}
    }
    let expected = frame_header(code, bytes, total);
    let verdict = check_frame_header(&expected, code, bytes, total).expect("12 bytes");
    assert_eq!(verdict.is_ok(), code & (1 << 31) == 0);
});
