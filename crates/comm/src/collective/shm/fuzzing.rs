//! The seam for the fuzz targets in `crates/comm/fuzz`: the check a joining rank makes of
//! the header words of a segment that another process wrote. Public only for fuzzing;
//! nothing else should call these.

use super::segment::{HEADER_WORDS, Header, check_header, encode_header};
use crate::collective::GroupToken;

/// The expected header of the seam: 2 ranks, 1024 elements, a fixed token.
fn expected(token: &GroupToken) -> Header<'_> {
    Header {
        world: 2,
        capacity: 1024,
        token,
    }
}

const TOKEN: GroupToken = GroupToken([0x5a; 32]);

/// Checks `words` (exactly the header's words, else `None`) against the seam's header;
/// `Err` says why the segment is not this group's.
pub fn check_segment_header(words: &[u32]) -> Option<Result<(), String>> {
    let words = <&[u32; HEADER_WORDS]>::try_from(words).ok()?;
    Some(check_header(words, &expected(&TOKEN)))
}

/// The header words of the seam's group, the only ones [`check_segment_header`] accepts.
pub fn segment_header() -> Vec<u32> {
    encode_header(&expected(&TOKEN)).to_vec()
}
