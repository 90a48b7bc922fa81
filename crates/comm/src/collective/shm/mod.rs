//! [`ShmCollective`]: the ranks of a group on one host exchange payloads through one
//! shared-memory segment ([`tessera_kernels::shm::ShmSegment`]) under `/dev/shm`. A shard
//! whose group lives on one host builds one (through [`super::connect::connect`]) and its
//! compute thread owns it.
//!
//! - `segment`: the segment's layout (header, per-rank words, data slots) and how rank 0
//!   creates it and the other ranks open it.
//! - `link`: the round protocol over the segment: numbered rounds, waiting, aborts.
//! - [`fuzzing`]: the header check, exposed to the fuzz targets.
//! - This module: the operations (all-reduce, all-gather, broadcast, barrier), each a
//!   sequence of rounds.
//!
//! **All-reduce.** Every element is summed in rank order `((x0 + x1) + x2) + …`, so every
//! rank gets the same bits and the result does not depend on timing. Small chunks take one
//! round (every rank sums every slot); large ones take two (each rank sums a 1/world slice,
//! then all gather the slices), which reads each slot once per rank instead of world times.
//! Both paths add in the same order, so they agree bit for bit. Payloads larger than the
//! per-rank capacity are cut into chunks of at most the capacity.

use std::time::{Duration, Instant};

use tessera_kernels::shm::{ShmLayout, ShmRangeError, ShmSegment};
use tessera_topology::Rank;

use super::{Collective, CollectiveConfig, CollectiveError, CollectiveStats, GroupToken, Op};
use link::{Link, Meta};
use segment::{Header, MAX_WORLD, RANK_BASE, RANK_STRIDE, create, open};

pub mod fuzzing;
mod link;
mod segment;

/// Chunks up to this many bytes are all-reduced in one round (every rank sums all slots);
/// larger ones in two (reduce a slice, gather slices). Below this size the second round's
/// synchronisation (a few µs) costs more than reading world × the data from cache.
const ONE_ROUND_MAX_BYTES: usize = 64 * 1024;

/// One rank of a group that exchanges through a shared-memory segment. Owned by the rank's
/// compute thread.
#[derive(Debug)]
pub struct ShmCollective {
    link: Link,
    /// This rank's reduced slice between the two rounds of a large all-reduce.
    scratch: Vec<f32>,
    stats: CollectiveStats,
}

impl ShmCollective {
    /// Joins the group of `world_size` ranks that meets in segment `name`, as `rank`.
    /// `max_elems` is the payload capacity per rank and round (f32 elements; broadcasts
    /// get the same number of bytes × 4); longer payloads are cut into chunks. Every rank
    /// passes the same `name`, `world_size`, `max_elems` and `token`. Rank 0 creates the
    /// segment (replacing a stale one); the others retry until `config.deadline`. Returns
    /// once every rank has joined, the segment's name removed.
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
                if rank.0 == 0 {
                    // Every rank has it mapped: the name has served. Without it, a rank
                    // killed with -9 leaves nothing under /dev/shm; the memory goes with
                    // the last mapping.
                    ShmSegment::remove(name).map_err(segment::io_error)?;
                }
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

impl Collective for ShmCollective {
    fn rank(&self) -> Rank {
        self.link.rank
    }

    fn world_size(&self) -> usize {
        self.link.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let chunks: Vec<_> = self.link.chunks(Op::AllReduce.code(), data.len()).collect();
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
        let chunks: Vec<_> = self.link.chunks(Op::AllGather.code(), m).collect();
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
        let code = Op::Broadcast.code() | (root.0 << 8);
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
            code: Op::Barrier.code(),
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

/// Whole milliseconds of `d` for error reports, saturating (used by `segment` and `link`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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

#[cfg(test)]
mod tests {
    use super::*;

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
