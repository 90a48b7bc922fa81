//! [`ShmCollective`]: the ranks of a group on one host exchange payloads through one
//! shared-memory segment ([`tessera_kernels::shm::ShmSegment`]) under `/dev/shm`.
//!
//! **Segment.** Rank 0 creates it under a private name, writes the header (magic, version,
//! world size, capacity, the group token) and publishes it by renaming it over `name`, so a
//! joiner never sees a half-written header and a stale segment of the same name is replaced
//! atomically. Other ranks retry opening `name` until the deadline and must find the same
//! header and token, else [`CollectiveError::Unauthenticated`]. The file is mode 0600: only
//! the user that runs the shards (who could read their memory anyway) can read the token.
//!
//! **Rounds.** Every operation is a sequence of rounds, numbered alike on every rank. In
//! round `r` each rank writes its slot of buffer `r % 2`, publishes `arrive = r`, waits for
//! every rank's `arrive >= r`, reads the slots it needs and publishes `done = r`. Before
//! writing round `r` a rank waits for every `done >= r - 2`, the last round that used the
//! same buffer; two buffers let a fast rank post round `r + 1` while a slow one still reads
//! round `r`. Each round also records (op, lengths) per rank, so mismatched calls fail with
//! [`CollectiveError::BadLength`] instead of mixing payloads.
//!
//! **All-reduce.** Every element is summed in rank order `((x0 + x1) + x2) + …`, so every
//! rank gets the same bits and the result does not depend on timing. Small chunks take one
//! round (every rank sums every slot); large ones take two (each rank sums a 1/world slice,
//! then all gather the slices), which reads each slot once per rank instead of world times.
//! Both paths add in the same order, so they agree bit for bit. Payloads larger than the
//! per-rank capacity are cut into chunks of at most the capacity.
//!
//! **Waiting.** A waiting rank spins for [`CollectiveConfig::spin`], then sleeps on a futex
//! "bell" that every publication rings (the wake syscall is skipped when nobody sleeps), in
//! slices of at most [`SLEEP_SLICE`] so the deadline is checked even if a wake is lost. A
//! rank that misses the deadline sets the header's abort word (its rank and the missing
//! one) and returns [`CollectiveError::Timeout`]; every later or waiting call on any rank
//! returns [`CollectiveError::Aborted`]. A dropped communicator marks its rank closed, so
//! ranks waiting for it fail with [`CollectiveError::PeerClosed`] at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tessera_kernels::shm::{
    FutexWait, ShmLayout, ShmRangeError, ShmSegment, futex_wait, futex_wake,
};
use tessera_topology::Rank;

use super::{Collective, CollectiveConfig, CollectiveError, CollectiveStats, GroupToken, Op};

/// "TSHM" in ASCII.
const MAGIC: u32 = 0x5453_484d;
/// Bumped on any change to the segment layout or the round protocol.
const VERSION: u32 = 1;
/// Ranks are packed into 12 bits of the abort word; far above any tensor-parallel group.
const MAX_WORLD: usize = 1024;

/// Header words.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_WORLD: usize = 2;
const H_CAPACITY: usize = 3;
const H_TOKEN: usize = 4; // 8 words
const H_READY: usize = 12;
const H_ABORT: usize = 13;
const H_BELL: usize = 14;
const H_SLEEPERS: usize = 15;
/// Per-rank words start on their own cache line, one line per rank so that ranks polling
/// each other's counters do not also contend on their neighbours'.
const RANK_BASE: usize = 16;
const RANK_STRIDE: usize = 16;
/// Per-rank words, relative to the rank's base.
const R_ARRIVE: usize = 0;
const R_DONE: usize = 1;
const R_CLOSED: usize = 2;
const R_PRESENT: usize = 3;
/// Two metas, one per buffer: op code (| root << 8), chunk length, total length.
const R_META: usize = 4;

/// Longest a waiting rank sleeps before it looks at the clock and the peers again.
const SLEEP_SLICE: Duration = Duration::from_millis(20);
/// Chunks up to this many bytes are all-reduced in one round (every rank sums all slots);
/// larger ones in two (reduce a slice, gather slices). Below this size the second round's
/// synchronisation (a few µs) costs more than reading world × the data from cache.
const ONE_ROUND_MAX_BYTES: usize = 64 * 1024;
/// How long a joiner sleeps between attempts to open the segment.
const JOIN_POLL: Duration = Duration::from_micros(500);

/// Abort kinds, in bits 24..31 of the abort word.
const ABORT_TIMEOUT: u32 = 1;
const ABORT_CLOSED: u32 = 2;
const ABORT_MISMATCH: u32 = 3;

/// One rank of a group that exchanges through a shared-memory segment. Owned by the rank's
/// compute thread.
#[derive(Debug)]
pub struct ShmCollective {
    link: Link,
    /// This rank's reduced slice between the two rounds of a large all-reduce.
    scratch: Vec<f32>,
    stats: CollectiveStats,
}

/// The segment and the round protocol, apart from the buffers the operations use.
#[derive(Debug)]
struct Link {
    seg: ShmSegment,
    rank: Rank,
    world: usize,
    /// Elements per slot.
    capacity_elems: usize,
    slot_bytes: usize,
    config: CollectiveConfig,
    /// Rounds this rank has completed (wrapping).
    rounds: u32,
}

/// What a rank declares for one round; must agree across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta {
    /// [`op_code`], with a broadcast's root in bits 8.. .
    code: u32,
    chunk_len: u32,
    total_len: u32,
}

impl ShmCollective {
    /// Joins the group of `world_size` ranks that meets in segment `name`, as `rank`.
    /// `max_elems` is the payload capacity per rank and round (f32 elements; broadcasts
    /// get the same number of bytes × 4); longer payloads are cut into chunks. Every rank
    /// passes the same `name`, `world_size`, `max_elems` and `token`. Rank 0 creates the
    /// segment (replacing a stale one); the others retry until `config.deadline`. Returns
    /// once every rank has joined.
    pub fn join(
        name: &str,
        rank: Rank,
        world_size: usize,
        token: &GroupToken,
        max_elems: usize,
        config: CollectiveConfig,
    ) -> Result<ShmCollective, CollectiveError> {
        let started = Instant::now();
        let bad = |detail: String| CollectiveError::BadLength {
            op: Op::Connect,
            len: max_elems,
            detail,
        };
        if world_size == 0 || world_size > MAX_WORLD || rank.0 as usize >= world_size {
            return Err(bad(format!(
                "rank {rank} of a group of {world_size} (at most {MAX_WORLD} ranks)"
            )));
        }
        let capacity = u32::try_from(max_elems)
            .ok()
            .filter(|&c| c > 0 && c <= u32::MAX / 4)
            .ok_or_else(|| bad("capacity must be 1..=2^30 elements".into()))?;
        let slot_bytes = (max_elems * 4).next_multiple_of(64);
        let data_bytes = slot_bytes
            .checked_mul(2 * world_size)
            .ok_or_else(|| bad(format!("2 × {world_size} slots overflow")))?;
        let layout = ShmLayout {
            control_words: RANK_BASE + RANK_STRIDE * world_size,
            data_bytes,
        };
        let header = Header {
            world: world_size as u32,
            capacity,
            token,
        };
        loop {
            let seg = if rank.0 == 0 {
                create(name, layout, &header)?
            } else {
                open(name, layout, &header, started + config.deadline)?
            };
            let mut link = Link {
                seg,
                rank,
                world: world_size,
                capacity_elems: max_elems,
                slot_bytes,
                config,
                rounds: 0,
            };
            if link.meet(started)? {
                return Ok(ShmCollective {
                    link,
                    scratch: Vec::new(),
                    stats: CollectiveStats::default(),
                });
            }
            // The segment we joined was replaced by a newer rank 0: join that one.
        }
    }

    fn finish(&mut self, started: Instant, bytes: usize) {
        self.stats.calls += 1;
        self.stats.bytes += bytes as u64;
        self.stats.time += started.elapsed();
    }

    fn all_reduce_chunk(
        &mut self,
        chunk: &mut [f32],
        meta: Meta,
        started: Instant,
    ) -> Result<(), CollectiveError> {
        let (link, scratch) = (&mut self.link, &mut self.scratch);
        let world = link.world;
        if chunk.len() * 4 <= ONE_ROUND_MAX_BYTES || world == 1 {
            return link.round(
                Op::AllReduce,
                meta,
                started,
                chunk,
                |seg, mine, chunk| seg.write_f32(mine, chunk),
                |seg, slot, chunk| {
                    seg.read_f32(slot(0), chunk)?;
                    (1..world).try_for_each(|j| seg.add_f32(slot(j), chunk))
                },
            );
        }
        // Round 1: everyone posts its input; each rank reduces its slice in rank order.
        let me = link.rank.0 as usize;
        let (lo, hi) = slice_of(chunk.len(), world, me);
        link.round(
            Op::AllReduce,
            meta,
            started,
            &mut (&*chunk, &mut *scratch),
            |seg, mine, (input, _)| seg.write_f32(mine, input),
            |seg, slot, (_, scratch)| {
                scratch.clear();
                scratch.resize(hi - lo, 0.0);
                read_unaligned(seg, slot(0), lo, scratch)?;
                for j in 1..world {
                    add_unaligned(seg, slot(j), lo, scratch)?;
                }
                Ok(())
            },
        )?;
        // Round 2: everyone posts its reduced slice at the start of its slot; all gather.
        link.round(
            Op::AllReduce,
            meta,
            started,
            &mut (&*scratch, chunk),
            |seg, mine, (scratch, _)| seg.write_f32(mine, scratch),
            |seg, slot, (_, chunk)| {
                (0..world).try_for_each(|j| {
                    let (lo, hi) = slice_of(chunk.len(), world, j);
                    seg.read_f32(slot(j), &mut chunk[lo..hi])
                })
            },
        )
    }
}

/// Reads `dst.len()` values starting at element `first` of the slot at `slot` (which is
/// 8-aligned), for an odd `first`: the range starts in the middle of a word.
fn read_unaligned(
    seg: &ShmSegment,
    slot: usize,
    first: usize,
    dst: &mut [f32],
) -> Result<(), ShmRangeError> {
    dst.fill(0.0);
    add_unaligned(seg, slot, first, dst)
}

/// `dst[i] += slot[first + i]`, for any `first`.
fn add_unaligned(
    seg: &ShmSegment,
    slot: usize,
    first: usize,
    dst: &mut [f32],
) -> Result<(), ShmRangeError> {
    if first.is_multiple_of(2) || dst.is_empty() {
        return seg.add_f32(slot + first * 4, dst);
    }
    // The first element is the high half of a word: fetch that word as a pair.
    let mut pair = [0.0f32; 2];
    seg.read_f32(slot + (first - 1) * 4, &mut pair)?;
    dst[0] += pair[1];
    seg.add_f32(slot + (first + 1) * 4, &mut dst[1..])
}

/// Elements `[lo, hi)` of a chunk of `len` that rank `j` reduces.
fn slice_of(len: usize, world: usize, j: usize) -> (usize, usize) {
    (len * j / world, len * (j + 1) / world)
}

struct Header<'a> {
    world: u32,
    capacity: u32,
    token: &'a GroupToken,
}

fn token_words(token: &GroupToken) -> [u32; 8] {
    let mut words = [0u32; 8];
    for (w, bytes) in words.iter_mut().zip(token.0.chunks_exact(4)) {
        *w = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    words
}

fn io_error(e: std::io::Error) -> CollectiveError {
    CollectiveError::Io {
        op: Op::Connect,
        message: format!("shared-memory segment: {e}"),
    }
}

/// Rank 0: fills a segment under a private name, then renames it over `name`.
fn create(
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
fn open(
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn rank_of(r: usize) -> Rank {
    // `r < MAX_WORLD`.
    Rank(r as u32)
}

/// `x` has reached `target`, for counters that wrap.
fn reached(x: u32, target: u32) -> bool {
    // Reinterpreting the wrapped difference as signed is the point.
    (x.wrapping_sub(target) as i32) >= 0
}

fn op_code(op: Op) -> u32 {
    match op {
        Op::AllReduce => 1,
        Op::AllGather => 2,
        Op::Broadcast => 3,
        Op::Barrier => 4,
        Op::Connect => 5,
    }
}

fn op_name(code: u32) -> String {
    let op = match code & 0xff {
        1 => Op::AllReduce,
        2 => Op::AllGather,
        3 => Op::Broadcast,
        4 => Op::Barrier,
        _ => Op::Connect,
    };
    match op {
        Op::Broadcast => format!("{op} from root {}", code >> 8),
        _ => op.to_string(),
    }
}

impl Link {
    fn ctl(&self) -> &[AtomicU32] {
        self.seg.control()
    }

    fn word(&self, rank: usize, field: usize) -> &AtomicU32 {
        &self.seg.control()[RANK_BASE + rank * RANK_STRIDE + field]
    }

    fn me(&self) -> usize {
        self.rank.0 as usize
    }

    /// Publishes a change: bumps the bell and wakes sleepers, if any.
    fn ring(&self) {
        let ctl = self.ctl();
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        if ctl[H_SLEEPERS].load(Ordering::SeqCst) > 0 {
            futex_wake(&ctl[H_BELL], u32::MAX);
        }
    }

    /// The join barrier: marks this rank present and waits for all. `Ok(false)` if the
    /// segment was replaced meanwhile (a joiner that opened a stale one).
    fn meet(&mut self, started: Instant) -> Result<bool, CollectiveError> {
        let me = self.me();
        if self
            .word(me, R_PRESENT)
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(CollectiveError::Io {
                op: Op::Connect,
                message: format!("rank {me} joined the segment twice"),
            });
        }
        self.ring();
        let deadline = started + self.config.deadline;
        loop {
            let missing =
                (0..self.world).find(|&j| self.word(j, R_PRESENT).load(Ordering::SeqCst) == 0);
            let Some(missing) = missing else {
                return Ok(true);
            };
            if me != 0 && self.seg.is_unlinked().map_err(io_error)? {
                return Ok(false);
            }
            if Instant::now() >= deadline {
                let error = CollectiveError::Timeout {
                    op: Op::Connect,
                    missing: rank_of(missing),
                    waited_ms: millis(started.elapsed()),
                };
                return Err(self.fail(error, ABORT_TIMEOUT, missing));
            }
            std::thread::sleep(JOIN_POLL);
        }
    }

    /// The group's abort, as this rank reports it, if any.
    fn aborted(&self, op: Op) -> Option<CollectiveError> {
        let word = self.ctl()[H_ABORT].load(Ordering::SeqCst);
        if word == 0 {
            return None;
        }
        let (kind, by, missing) = ((word >> 24) & 0x7f, (word >> 12) & 0xfff, word & 0xfff);
        let reason = match kind {
            ABORT_TIMEOUT => format!("rank {missing} did not arrive in time"),
            ABORT_CLOSED => format!("rank {missing} closed its communicator"),
            _ => format!("ranks {by} and {missing} made different calls"),
        };
        Some(CollectiveError::Aborted {
            op,
            by: Rank(by),
            missing: Rank(missing),
            reason,
        })
    }

    /// Aborts the group on behalf of this rank (unless another rank already did) and
    /// returns `error`, which this rank reports itself.
    fn fail(&self, error: CollectiveError, kind: u32, missing: usize) -> CollectiveError {
        let word = (1 << 31) | (kind << 24) | ((self.me() as u32) << 12) | missing as u32;
        let ctl = self.ctl();
        let _ = ctl[H_ABORT].compare_exchange(0, word, Ordering::SeqCst, Ordering::SeqCst);
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        futex_wake(&ctl[H_BELL], u32::MAX);
        error
    }

    /// Waits until every rank's `field` has reached `target`.
    fn wait_all(
        &self,
        field: usize,
        target: u32,
        op: Op,
        started: Instant,
    ) -> Result<(), CollectiveError> {
        let deadline = started + self.config.deadline;
        let spin_until = Instant::now() + self.config.spin;
        let ctl = self.ctl();
        loop {
            // Read the bell before the condition: a publication after this read changes
            // the bell, so the futex below returns at once instead of missing it.
            let bell = ctl[H_BELL].load(Ordering::SeqCst);
            if let Some(error) = self.aborted(op) {
                return Err(error);
            }
            let missing = (0..self.world)
                .find(|&j| !reached(self.word(j, field).load(Ordering::Acquire), target));
            let Some(missing) = missing else {
                return Ok(());
            };
            if self.word(missing, R_CLOSED).load(Ordering::SeqCst) != 0 {
                let peer = rank_of(missing);
                let error = CollectiveError::PeerClosed { op, peer };
                return Err(self.fail(error, ABORT_CLOSED, missing));
            }
            let now = Instant::now();
            if now >= deadline {
                let error = CollectiveError::Timeout {
                    op,
                    missing: rank_of(missing),
                    waited_ms: millis(started.elapsed()),
                };
                return Err(self.fail(error, ABORT_TIMEOUT, missing));
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            ctl[H_SLEEPERS].fetch_add(1, Ordering::SeqCst);
            // Every outcome (woken, changed, timed out, interrupted) means "look again".
            let _: FutexWait = futex_wait(&ctl[H_BELL], bell, SLEEP_SLICE.min(deadline - now));
            ctl[H_SLEEPERS].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Runs one round: `write(segment, offset of this rank's slot, state)` fills this
    /// rank's slot; once every rank has posted, `read(segment, slot offset by rank, state)`
    /// consumes them. `state` is the caller's buffer, lent to one closure at a time.
    fn round<S: ?Sized>(
        &mut self,
        op: Op,
        meta: Meta,
        started: Instant,
        state: &mut S,
        write: impl FnOnce(&ShmSegment, usize, &S) -> Result<(), ShmRangeError>,
        read: impl FnOnce(&ShmSegment, &dyn Fn(usize) -> usize, &mut S) -> Result<(), ShmRangeError>,
    ) -> Result<(), CollectiveError> {
        if let Some(error) = self.aborted(op) {
            return Err(error);
        }
        let round = self.rounds.wrapping_add(1);
        let buffer = (round % 2) as usize;
        let me = self.me();
        // The buffer's previous round (round - 2) must be read by everyone.
        self.wait_all(R_DONE, round.wrapping_sub(2), op, started)?;
        let slot_bytes = self.slot_bytes;
        let world = self.world;
        let slot = move |j: usize| (buffer * world + j) * slot_bytes;
        write(&self.seg, slot(me), state).map_err(|e| self.range_error(op, meta, e))?;
        let meta_base = R_META + 3 * buffer;
        self.word(me, meta_base).store(meta.code, Ordering::Relaxed);
        self.word(me, meta_base + 1)
            .store(meta.chunk_len, Ordering::Relaxed);
        self.word(me, meta_base + 2)
            .store(meta.total_len, Ordering::Relaxed);
        self.word(me, R_ARRIVE).store(round, Ordering::Release);
        self.ring();

        self.wait_all(R_ARRIVE, round, op, started)?;
        for j in 0..world {
            let theirs = Meta {
                code: self.word(j, meta_base).load(Ordering::Relaxed),
                chunk_len: self.word(j, meta_base + 1).load(Ordering::Relaxed),
                total_len: self.word(j, meta_base + 2).load(Ordering::Relaxed),
            };
            if theirs != meta {
                let error = CollectiveError::BadLength {
                    op,
                    len: meta.total_len as usize,
                    detail: format!(
                        "rank {me} called {} with {} elements, rank {j} called {} with {}",
                        op_name(meta.code),
                        meta.total_len,
                        op_name(theirs.code),
                        theirs.total_len
                    ),
                };
                return Err(self.fail(error, ABORT_MISMATCH, j));
            }
        }
        read(&self.seg, &slot, state).map_err(|e| self.range_error(op, meta, e))?;
        self.word(me, R_DONE).store(round, Ordering::Release);
        self.rounds = round;
        self.ring();
        Ok(())
    }

    fn range_error(&self, op: Op, meta: Meta, e: ShmRangeError) -> CollectiveError {
        // Chunks never exceed the slot, so this is a bug; report it rather than panic.
        CollectiveError::BadLength {
            op,
            len: meta.chunk_len as usize,
            detail: e.to_string(),
        }
    }

    /// The metas of a call of `total_len` elements in chunks of at most the capacity:
    /// (offset, chunk length, meta) per round; one empty round for an empty call.
    fn chunks(&self, code: u32, total_len: usize) -> impl Iterator<Item = (usize, usize, Meta)> {
        let cap = self.capacity_elems;
        let rounds = total_len.div_ceil(cap).max(1);
        (0..rounds).map(move |i| {
            let offset = i * cap;
            let len = cap.min(total_len - offset.min(total_len));
            let meta = Meta {
                code,
                chunk_len: len as u32,
                // Only the low 32 bits take part in the cross-rank check.
                total_len: total_len as u32,
            };
            (offset, len, meta)
        })
    }
}

impl Collective for ShmCollective {
    fn rank(&self) -> Rank {
        self.link.rank
    }

    fn world_size(&self) -> usize {
        self.link.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let chunks: Vec<_> = self
            .link
            .chunks(op_code(Op::AllReduce), data.len())
            .collect();
        for (offset, len, meta) in chunks {
            self.all_reduce_chunk(&mut data[offset..offset + len], meta, started)?;
        }
        self.finish(started, data.len() * 4);
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let (world, m) = (self.link.world, input.len());
        if output.len() != m * world {
            return Err(CollectiveError::BadLength {
                op: Op::AllGather,
                len: output.len(),
                detail: format!(
                    "output must hold {} elements ({m} × {world} ranks)",
                    m * world
                ),
            });
        }
        let chunks: Vec<_> = self.link.chunks(op_code(Op::AllGather), m).collect();
        for (offset, len, meta) in chunks {
            let part = &input[offset..offset + len];
            self.link.round(
                Op::AllGather,
                meta,
                started,
                &mut (part, &mut *output),
                |seg, mine, (part, _)| seg.write_f32(mine, part),
                |seg, slot, (_, output)| {
                    (0..world).try_for_each(|j| {
                        let at = j * m + offset;
                        seg.read_f32(slot(j), &mut output[at..at + len])
                    })
                },
            )?;
        }
        self.finish(started, m * 4);
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [u8], root: Rank) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let world = self.link.world;
        if root.0 as usize >= world {
            return Err(CollectiveError::BadLength {
                op: Op::Broadcast,
                len: data.len(),
                detail: format!("root {root} is not a rank of a group of {world}"),
            });
        }
        let is_root = root == self.link.rank;
        let code = op_code(Op::Broadcast) | (root.0 << 8);
        // A slot holds `capacity_elems` f32s, so 4× as many bytes; chunk in those units.
        let cap_bytes = self.link.capacity_elems * 4;
        let rounds = data.len().div_ceil(cap_bytes).max(1);
        for i in 0..rounds {
            let offset = i * cap_bytes;
            let len = cap_bytes.min(data.len() - offset.min(data.len()));
            let meta = Meta {
                code,
                chunk_len: len as u32,
                total_len: data.len() as u32,
            };
            let part = &mut data[offset..offset + len];
            let root_slot = root.0 as usize;
            self.link.round(
                Op::Broadcast,
                meta,
                started,
                part,
                |seg, mine, part| {
                    if is_root {
                        seg.write_bytes(mine, part)
                    } else {
                        Ok(())
                    }
                },
                |seg, slot, part| {
                    if is_root {
                        Ok(())
                    } else {
                        seg.read_bytes(slot(root_slot), part)
                    }
                },
            )?;
        }
        self.finish(started, if is_root { data.len() } else { 0 });
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let meta = Meta {
            code: op_code(Op::Barrier),
            chunk_len: 0,
            total_len: 0,
        };
        self.link.round(
            Op::Barrier,
            meta,
            started,
            &mut (),
            |_, _, _| Ok(()),
            |_, _, _| Ok(()),
        )?;
        self.finish(started, 0);
        Ok(())
    }

    fn stats(&self) -> CollectiveStats {
        self.stats
    }
}

impl Drop for Link {
    /// A rank that goes away fails the ranks waiting for it with `PeerClosed` instead of
    /// leaving them to the deadline.
    fn drop(&mut self) {
        self.word(self.me(), R_CLOSED).store(1, Ordering::SeqCst);
        let ctl = self.ctl();
        ctl[H_BELL].fetch_add(1, Ordering::SeqCst);
        futex_wake(&ctl[H_BELL], u32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_counters_compare_by_distance() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(0, u32::MAX - 1), "round 1 needs done >= round -1");
        assert!(reached(2, u32::MAX));
        assert!(!reached(u32::MAX, 2));
    }

    #[test]
    fn slices_cover_a_chunk_exactly() {
        for (len, world) in [(10, 3), (1, 4), (7, 2), (1000, 4)] {
            let mut next = 0;
            for j in 0..world {
                let (lo, hi) = slice_of(len, world, j);
                assert_eq!(lo, next);
                next = hi;
            }
            assert_eq!(next, len);
        }
    }
}
