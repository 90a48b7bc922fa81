//! The shared-memory segment of a [`ShmCollective`](super::ShmCollective) group: where
//! each word lives (header, per-rank counters, data slots) and how the ranks come to map
//! the same segment. The round protocol ([`super::link`]) reads and writes the words laid
//! out here; nothing else touches the segment's bytes.
//!
//! **Segment.** Rank 0 creates it under a private name, writes the header (magic, version,
//! world size, capacity, the group token) and publishes it by renaming it over `name`, so a
//! joiner never sees a half-written header and a stale segment of the same name is replaced
//! atomically. Other ranks retry opening `name` until the deadline and must find the same
//! header and token, else [`CollectiveError::Unauthenticated`]. The file is mode 0600: only
//! the user that runs the shards (who could read their memory anyway) can read the token.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_kernels::shm::{ShmLayout, ShmSegment};
use tessera_topology::Rank;

use super::millis;
use crate::collective::{CollectiveError, GroupToken, Op};

/// "TSHM" in ASCII.
pub(super) const MAGIC: u32 = 0x5453_484d;
/// Bumped on any change to the segment layout or the round protocol.
pub(super) const VERSION: u32 = 1;
/// Ranks are packed into 12 bits of the abort word; far above any tensor-parallel group.
pub(super) const MAX_WORLD: usize = 1024;

/// Header words.
pub(super) const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 1;
pub(super) const H_WORLD: usize = 2;
pub(super) const H_CAPACITY: usize = 3;
pub(super) const H_TOKEN: usize = 4; // 8 words
pub(super) const H_READY: usize = 12;
pub(super) const H_ABORT: usize = 13;
pub(super) const H_BELL: usize = 14;
pub(super) const H_SLEEPERS: usize = 15;
/// Per-rank words start on their own cache line, one line per rank so that ranks polling
/// each other's counters do not also contend on their neighbours'.
pub(super) const RANK_BASE: usize = 16;
pub(super) const RANK_STRIDE: usize = 16;
/// Per-rank words, relative to the rank's base.
pub(super) const R_ARRIVE: usize = 0;
pub(super) const R_DONE: usize = 1;
pub(super) const R_CLOSED: usize = 2;
pub(super) const R_PRESENT: usize = 3;
/// Two metas, one per buffer: op code (| root << 8), chunk length, total length.
pub(super) const R_META: usize = 4;

/// How long a joiner sleeps between attempts to open the segment.
pub(super) const JOIN_POLL: Duration = Duration::from_micros(500);

/// What rank 0 writes into the header and every joiner must find there.
pub(super) struct Header<'a> {
    pub(super) world: u32,
    pub(super) capacity: u32,
    pub(super) token: &'a GroupToken,
}

fn token_words(token: &GroupToken) -> [u32; 8] {
    let mut words = [0u32; 8];
    for (w, bytes) in words.iter_mut().zip(token.0.chunks_exact(4)) {
        *w = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    words
}

pub(super) fn io_error(e: std::io::Error) -> CollectiveError {
    CollectiveError::Io {
        op: Op::Connect,
        message: format!("shared-memory segment: {e}"),
    }
}

/// Rank 0: fills a segment under a private name, then renames it over `name`.
pub(super) fn create(
    name: &str,
    layout: ShmLayout,
    header: &Header<'_>,
) -> Result<ShmSegment, CollectiveError> {
    let staging = format!("{name}.init-{}", std::process::id());
    ShmSegment::remove(&staging).map_err(io_error)?;
    let mut seg = ShmSegment::create(&staging, layout).map_err(io_error)?;
    let ctl = seg.control();
    ctl[H_MAGIC].store(MAGIC, Ordering::Relaxed);
    ctl[H_VERSION].store(VERSION, Ordering::Relaxed);
    ctl[H_WORLD].store(header.world, Ordering::Relaxed);
    ctl[H_CAPACITY].store(header.capacity, Ordering::Relaxed);
    for (i, w) in token_words(header.token).into_iter().enumerate() {
        ctl[H_TOKEN + i].store(w, Ordering::Relaxed);
    }
    ctl[H_READY].store(MAGIC, Ordering::Release);
    seg.rename(name).map_err(io_error)?;
    Ok(seg)
}

/// Other ranks: opens `name` until it holds a complete header for this group. A segment
/// with a wrong token may be a stale one about to be replaced, so it is retried too; at
/// the deadline it is reported as `Unauthenticated`.
pub(super) fn open(
    name: &str,
    layout: ShmLayout,
    header: &Header<'_>,
    deadline: Instant,
) -> Result<ShmSegment, CollectiveError> {
    let started = Instant::now();
    let mut refused = false;
    loop {
        match ShmSegment::open(name, layout) {
            Ok(seg) => {
                let ctl = seg.control();
                if ctl[H_READY].load(Ordering::Acquire) == MAGIC {
                    let token = token_words(header.token);
                    let token_ok = (0..8).fold(0u32, |acc, i| {
                        acc | (ctl[H_TOKEN + i].load(Ordering::Relaxed) ^ token[i])
                    }) == 0;
                    let header_ok = ctl[H_MAGIC].load(Ordering::Relaxed) == MAGIC
                        && ctl[H_VERSION].load(Ordering::Relaxed) == VERSION
                        && ctl[H_WORLD].load(Ordering::Relaxed) == header.world
                        && ctl[H_CAPACITY].load(Ordering::Relaxed) == header.capacity;
                    if token_ok && header_ok {
                        return Ok(seg);
                    }
                    refused = true;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidData
                ) =>
            {
                // Not created yet, or a stale segment of another size: rank 0 will replace it.
                refused |= e.kind() == std::io::ErrorKind::InvalidData;
            }
            Err(e) => return Err(io_error(e)),
        }
        if Instant::now() >= deadline {
            return Err(if refused {
                CollectiveError::Unauthenticated { op: Op::Connect }
            } else {
                CollectiveError::Timeout {
                    op: Op::Connect,
                    missing: Rank(0),
                    waited_ms: millis(started.elapsed()),
                }
            });
        }
        std::thread::sleep(JOIN_POLL);
    }
}
