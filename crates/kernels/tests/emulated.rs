//! CUDA kernels run on the CPU: `tests/emu/cuda_emu.h` compiles a kernel file as C++ (g++)
//! and runs each block's threads as fibers, with the warp's collectives and the tensor
//! cores' `mma.sync` emulated (its fragment layouts written from the PTX ISA's tables), so
//! that a kernel that has not run on a GPU is still held to its CPU twin on every CI run.
//! The emulation's own test (`emu/test_mma.cpp`) runs first: the mma against a plain
//! matrix product, shuffles, barriers, and its checks of a warp or block that does not
//! meet. Then the flash prefill kernel, held to its twin's bound plus
//! `FLASH_ORDER_TOLERANCE`, and the grouped decode kernel, held to `GROUPED_TOLERANCE`
//! against the CPU's attention, plain and in its append mode (`emulated/append.rs`), and
//! the bf16 GEMV and the fused layer's norm and activation against their twins
//! (`emulated/gemv.rs`, `emulated/fused.rs`), as on the GPU (`gpu.rs`), and the legacy
//! attention over a bf16 cache and the exact path's f32 one (`emulated/legacy.rs`),
//! `rope_kv_write` (`emulated/append.rs`), the dequantizing matvecs, FP8's among them
//! (`emulated/matvec.rs`), and the embedding gather and KV write of both table types
//! (`emulated/tables.rs`). Without a C++ compiler
//! (`CXX`, else `g++`) the tests say so and pass, unless `TESSERA_REQUIRE_NVRTC=1` (CI),
//! which requires every check of the CUDA kernels that runs without a GPU.
//!
//! What the emulation does not show: the device's speed, its memory model across blocks
//! (blocks run one after another), and its `exp2f`'s last bits (libm's here).

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "emulated/append.rs"]
mod append;
mod common;
use common::within;
#[path = "emulated/fused.rs"]
mod fused;
#[path = "emulated/gemv.rs"]
mod gemv;
#[path = "emulated/legacy.rs"]
mod legacy;
#[path = "emulated/matvec.rs"]
mod matvec;
#[path = "emulated/tables.rs"]
mod tables;

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tessera_kernels::attention::{
    AttentionParams, GROUPED_TOLERANCE, KvLayout, PagedKv, flash_reference, flash_tiles,
    paged_attention,
};

fn emu_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emu")
}

/// `source` (a file of `tests/emu`) compiled into `dir`, or `None` without a compiler.
fn compiled(source: &str, dir: &Path) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let exe = dir.join(source.trim_end_matches(".cpp"));
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing"])
        .args(["-Wall", "-Wno-unknown-pragmas", "-I"])
        .arg(emu_dir())
        .arg("-I")
        .arg(&kernels)
        .arg(emu_dir().join(source))
        .arg("-o")
        .arg(&exe)
        .output();
    match out {
        Ok(out) => {
            assert!(
                out.status.success(),
                "{cxx} {source}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some(exe)
        }
        Err(e) => {
            assert!(
                std::env::var("TESSERA_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "a C++ compiler is required (TESSERA_REQUIRE_NVRTC=1) but {cxx} did not \
                 start: {e}"
            );
            eprintln!("SKIPPED: no C++ compiler ({cxx}: {e})");
            None
        }
    }
}

#[test]
fn the_emulation_passes_its_own_test() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("test_mma.cpp", dir.path()) else {
        return;
    };
    let out = Command::new(exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("ALL OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One batch of an attention kernel: a paged cache and its queries.
struct Batch {
    layout: KvLayout,
    q_heads: usize,
    window: Option<usize>,
    tables: Vec<Vec<u32>>,
    k: Vec<f32>,
    v: Vec<f32>,
    query_seq: Vec<u32>,
    contexts: Vec<u32>,
    q: Vec<f32>,
}

fn bf16_values(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)).to_f32())
        .collect()
}

impl Batch {
    /// Sequences of `lens` positions, their blocks in reverse order over the pool; each
    /// `(sequence, contexts)` of `chunks` is a run of queries.
    fn new(
        rng: &mut StdRng,
        (layout, q_heads): (KvLayout, usize),
        lens: &[usize],
        chunks: &[(u32, std::ops::Range<u32>)],
        window: Option<usize>,
    ) -> Batch {
        let per_seq: Vec<usize> = lens.iter().map(|l| l.div_ceil(layout.block_size)).collect();
        let total: usize = per_seq.iter().sum();
        let mut ids: Vec<u32> = (0..total as u32).rev().collect();
        let tables: Vec<Vec<u32>> = per_seq.iter().map(|&n| ids.drain(..n).collect()).collect();
        let pool = total * layout.block_len();
        let (mut query_seq, mut contexts) = (Vec::new(), Vec::new());
        for (seq, range) in chunks {
            query_seq.extend(std::iter::repeat_n(*seq, range.len()));
            contexts.extend(range.clone());
        }
        Batch {
            layout,
            q_heads,
            window,
            k: bf16_values(rng, pool, 2.0),
            v: bf16_values(rng, pool, 1.0),
            q: bf16_values(rng, query_seq.len() * q_heads * layout.head_dim, 1.0),
            tables,
            query_seq,
            contexts,
        }
    }

    /// A driver's input file (`emu_io::PagedBatch` in `emu/io.h`): the header, whose last
    /// word is `last`, the tables, queries and contexts, K, V and q, then `extra`.
    fn input(&self, last: usize, extra: &[u8]) -> Vec<u8> {
        let max_blocks = self.tables.iter().map(Vec::len).max().unwrap_or(1);
        let blocks = self.k.len() / self.layout.block_len();
        let head = [
            self.layout.head_dim,
            self.q_heads,
            self.layout.kv_heads,
            self.layout.block_size,
            max_blocks,
            self.window.unwrap_or(0),
            self.query_seq.len(),
            self.tables.len(),
            blocks,
            last,
        ];
        let mut bytes: Vec<u8> = Vec::new();
        let mut u32s = |values: &mut dyn Iterator<Item = u32>| {
            values.for_each(|x| bytes.extend(x.to_le_bytes()));
        };
        u32s(&mut head.iter().map(|&x| x as u32));
        let scale_log2 = std::f32::consts::LOG2_E / (self.layout.head_dim as f32).sqrt();
        u32s(&mut std::iter::once(scale_log2.to_bits()));
        u32s(&mut self.tables.iter().flat_map(|t| {
            let pad = max_blocks - t.len();
            t.iter().copied().chain(std::iter::repeat_n(0, pad))
        }));
        u32s(&mut self.query_seq.iter().copied());
        u32s(&mut self.contexts.iter().copied());
        for x in self.k.iter().chain(&self.v) {
            bytes.extend(bf16::from_f32(*x).to_bits().to_le_bytes());
        }
        for x in &self.q {
            bytes.extend(x.to_le_bytes());
        }
        bytes.extend(extra);
        bytes
    }

    /// The emulated kernel's output through the driver `exe` (in `dir`) on `input`: the
    /// f32 output and its bf16 copy (and what the driver writes after them, in `rest`).
    fn run(&self, exe: &Path, dir: &Path, input: &[u8]) -> (Vec<f32>, Vec<u16>, Vec<u8>) {
        let mut bytes = drive(exe, dir, input);
        let n = self.query_seq.len() * self.q_heads * self.layout.head_dim;
        assert!(bytes.len() >= n * 6, "the emulator's output");
        let rest = bytes.split_off(n * 6);
        (f32s(&bytes[..n * 4]), u16s(&bytes[n * 4..]), rest)
    }

    /// Each query's block table, and the positions it sees.
    fn rows(&self) -> (Vec<&[u32]>, Vec<usize>) {
        let rows = self.query_seq.iter().map(|&s| &self.tables[s as usize][..]);
        (
            rows.collect(),
            self.contexts.iter().map(|&c| c as usize).collect(),
        )
    }

    fn kv(&self) -> PagedKv<'_> {
        PagedKv {
            layout: self.layout,
            k: &self.k,
            v: &self.v,
        }
    }
}

/// What the driver `exe` writes for `input` (the files in `dir`).
fn drive(exe: &Path, dir: &Path, input: &[u8]) -> Vec<u8> {
    let (at, back) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&at, input).unwrap();
    let run = Command::new(exe).arg(&at).arg(&back).output().unwrap();
    assert!(
        run.status.success(),
        "{}: {}",
        exe.display(),
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::read(&back).unwrap()
}

/// Little-endian f32s.
fn f32s(bytes: &[u8]) -> Vec<f32> {
    (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Little-endian u16s.
fn u16s(bytes: &[u8]) -> Vec<u16> {
    (bytes.chunks_exact(2))
        .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// A decode query for each context of `decode` (a sequence of that many positions each),
/// then a 5-token chunk of a 64-token prompt: the sequences' lengths and the chunks, for
/// [`Batch::new`].
fn decode_and_a_chunk(decode: &[u32]) -> (Vec<usize>, Vec<(u32, std::ops::Range<u32>)>) {
    let mut chunks: Vec<(u32, std::ops::Range<u32>)> = (decode.iter().enumerate())
        .map(|(s, &c)| (s as u32, c..c + 1))
        .collect();
    chunks.push((decode.len() as u32, 60..65));
    let mut lens: Vec<usize> = decode.iter().map(|&c| c as usize).collect();
    lens.push(64);
    (lens, chunks)
}

/// `got16` is `got` rounded to bf16, value for value.
fn rounds_to(what: &str, got: &[f32], got16: &[u16]) {
    for (j, (g, g16)) in got.iter().zip(got16).enumerate() {
        assert_eq!(*g16, bf16::from_f32(*g).to_bits(), "{what}[{j}] in bf16");
    }
}

/// GQA 1, 4 and 8; head_dim 16, 32, 64 and 128; batches that mix a chunk after cached
/// positions (its 64-query tiles crossing the key tiles' and the cache blocks' edges), a
/// decode query, a short prompt and a chunk at position 4,000; with and without a sliding
/// window. Every output the twin computes, within its bound plus the summation order,
/// and the bf16 copy the rounded output.
#[test]
fn the_flash_kernel_emulated_is_its_twin_up_to_summation_order() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("flash_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    let shapes = [(2, 2, 64), (2, 8, 128), (1, 8, 64), (2, 8, 16), (1, 4, 32)];
    for (i, (kv_heads, q_heads, head_dim)) in shapes.into_iter().enumerate() {
        let layout = KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        };
        let chunks = [(0, 38..188), (1, 201..202), (2, 1..4), (3, 4001..4071)];
        let window = [None, Some(50)][i % 2];
        let lens = [187, 201, 3, 4070];
        let case = Batch::new(&mut rng, (layout, q_heads), &lens, &chunks, window);
        let tiles = flash_tiles(&case.query_seq);
        let pairs: Vec<u8> = tiles
            .iter()
            .flatten()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let (got, got16, _) = case.run(&exe, dir.path(), &case.input(tiles.len(), &pairs));
        let (rows, visible) = case.rows();
        let twin = flash_reference(
            &case.q,
            &case.kv(),
            (&rows, &visible),
            q_heads,
            window,
            &tiles,
        );
        let what = format!("flash d{head_dim}, {q_heads}/{kv_heads} heads, window {window:?}");
        let worst = twin
            .compare(&got, q_heads, head_dim)
            .unwrap_or_else(|e| panic!("{what}{e}"));
        rounds_to(&what, &got, &got16);
        let n = got.len();
        eprintln!("{what}: {n} values, worst {worst:.2e} from the twin");
    }
}

/// The grouped decode kernel and its reduce: GQA 1, 3 (run as 4, its padding heads
/// unwritten), 4 and 8; head_dim 16, 32, 64 and 128; decode queries on both sides of the
/// cache blocks' edges and of the partitions' lengths, up to 4,097 positions, and a
/// 5-token chunk of a prompt; unsplit, split 3 ways and 64 ways; with and without a
/// sliding window. Every output within [`GROUPED_TOLERANCE`] of the CPU's attention, and
/// the bf16 copy the rounded output.
#[test]
fn the_grouped_kernel_emulated_is_its_twin() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("grouped_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(43);
    let shapes = [(2, 2, 64), (2, 6, 32), (2, 8, 128), (1, 8, 64), (4, 4, 16)];
    let (lens, chunks) = decode_and_a_chunk(&[1, 15, 17, 100, 255, 257, 1000, 4097]);
    for (i, (kv_heads, q_heads, head_dim)) in shapes.into_iter().enumerate() {
        let layout = KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        };
        let window = [None, Some(100)][i % 2];
        let case = Batch::new(&mut rng, (layout, q_heads), &lens, &chunks, window);
        let (rows, visible) = case.rows();
        let mut want = vec![0.0f32; case.q.len()];
        let params = AttentionParams {
            window,
            ..AttentionParams::causal(head_dim)
        };
        paged_attention(
            &case.q,
            &case.kv(),
            &rows,
            &visible,
            q_heads,
            &params,
            &mut want,
        );
        for partitions in [1, 3, 64] {
            let (got, got16, _) = case.run(&exe, dir.path(), &case.input(partitions, &[]));
            let what = format!(
                "grouped d{head_dim}, {q_heads}/{kv_heads} heads, window {window:?}, \
                 {partitions} partitions"
            );
            let worst = within(&what, &got, &want, GROUPED_TOLERANCE);
            rounds_to(&what, &got, &got16);
            eprintln!("{what}: worst {worst:.2e} from the twin");
        }
    }
}
