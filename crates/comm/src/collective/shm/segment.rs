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
//! The coordinator names the segment per assignment, with a random suffix
//! ([`crate::proto::Bootstrap::shm`]), and rank 0 removes the name once every rank has
//! joined, so a rank killed later leaves nothing under `/dev/shm`.

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
pub(super) const H_TOKEN: usize = 4; // 8 words, little-endian bytes of the token
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

/// Header words before [`H_READY`]: magic, version, world, capacity and the token.
pub(super) const HEADER_WORDS: usize = H_READY;

/// The header words of `header`, as rank 0 writes them.
pub(super) fn encode_header(header: &Header<'_>) -> [u32; HEADER_WORDS] {
    let mut words = [0u32; HEADER_WORDS];
    words[H_MAGIC] = MAGIC;
    words[H_VERSION] = VERSION;
    words[H_WORLD] = header.world;
    words[H_CAPACITY] = header.capacity;
    for (w, bytes) in words[H_TOKEN..]
        .iter_mut()
        .zip(header.token.0.chunks_exact(4))
    {
        *w = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    words
}

/// Whether a segment's header words are those of `expected`; if not, why not. The token is
/// compared in constant time, and always.
pub(super) fn check_header(
    words: &[u32; HEADER_WORDS],
    expected: &Header<'_>,
) -> Result<(), String> {
    let mut token = [0u8; 32];
    for (bytes, w) in token.chunks_exact_mut(4).zip(&words[H_TOKEN..]) {
        bytes.copy_from_slice(&w.to_le_bytes());
    }
    let token_ok = expected.token.matches(&token);
    let (magic, version) = (words[H_MAGIC], words[H_VERSION]);
    let (world, capacity) = (words[H_WORLD], words[H_CAPACITY]);
    if magic != MAGIC {
        Err(format!(
            "the segment is not a tessera group's (magic {magic:#010x})"
        ))
    } else if version != VERSION {
        Err(format!(
            "the segment speaks shared-memory protocol version {version}, this rank \
             version {VERSION}: run one tessera version across the group"
        ))
    } else if (world, capacity) != (expected.world, expected.capacity) {
        Err(format!(
            "the segment is for {world} ranks of {capacity} elements, this rank expects \
             {} of {}",
            expected.world, expected.capacity
        ))
    } else if !token_ok {
        Err("the segment holds another group token (another group or epoch)".into())
    } else {
        Ok(())
    }
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
    for (word, value) in ctl.iter().zip(encode_header(header)) {
        word.store(value, Ordering::Relaxed);
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
    let mut refused = None;
    loop {
        match ShmSegment::open(name, layout) {
            Ok(seg) => {
                let ctl = seg.control();
                if ctl[H_READY].load(Ordering::Acquire) == MAGIC {
                    let mut words = [0u32; HEADER_WORDS];
                    for (w, word) in words.iter_mut().zip(ctl) {
                        *w = word.load(Ordering::Relaxed);
                    }
                    match check_header(&words, header) {
                        Ok(()) => return Ok(seg),
                        Err(reason) => refused = Some(reason),
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidData
                ) =>
            {
                // Not created yet, or a stale segment of another size: rank 0 will replace it.
                if e.kind() == std::io::ErrorKind::InvalidData {
                    refused = Some(format!("the segment has another size: {e}"));
                }
            }
            Err(e) => return Err(io_error(e)),
        }
        if Instant::now() >= deadline {
            return Err(if let Some(reason) = refused {
                CollectiveError::Unauthenticated {
                    op: Op::Connect,
                    peer: Rank(0),
                    reason,
                }
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
