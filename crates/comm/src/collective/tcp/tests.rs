//! Unit tests of the ring's helpers and the frame headers.

use super::frame::{ABORT_FLAG, StepFailure, check_header, frame_header};
use super::*;

#[test]
fn split_pair_borrows_both_ranges() {
    let mut buf = [0, 1, 2, 3, 4, 5];
    let (a, b) = split_pair(&mut buf, 4..6, 0..2);
    assert_eq!(a, &[4, 5]);
    b.copy_from_slice(&[9, 9]);
    let (a, b) = split_pair(&mut buf, 0..2, 3..4);
    assert_eq!(a, &[9, 9]);
    assert_eq!(b, &mut [3]);
    // Empty ranges, as when a payload is shorter than the world size.
    let (a, b) = split_pair(&mut buf, 0..0, 0..1);
    assert_eq!((a.len(), b.len()), (0, 1));
    let (a, b) = split_pair(&mut buf, 1..2, 1..1);
    assert_eq!((a, b.len()), (&[9][..], 0));
}

#[test]
fn frame_headers_detect_mismatch_and_abort() {
    let h = frame_header(1, 40, 10);
    assert!(check_header(&h, 1, 40, 10).is_ok());
    assert!(matches!(
        check_header(&h, 2, 40, 10),
        Err(StepFailure::Mismatch { .. })
    ));
    let abort = frame_header(ABORT_FLAG, 0, (3 << 16) | 1);
    assert!(matches!(
        check_header(&abort, 1, 40, 10),
        Err(StepFailure::Aborted { by: 3, missing: 1 })
    ));
}
