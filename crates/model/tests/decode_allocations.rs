//! A decode step allocates nothing in its layers and kernels: after a few warm-up steps,
//! one step's heap allocations, counted by this binary's global allocator, are only those
//! of the step itself ([`STEP_ALLOCATIONS`]), however many layers and matmuls it runs.
//! Checked in both precisions on weight types whose kernels prepare their inputs (Q4_1's
//! block sums, Q2_K's interleaved lanes) or quantize them (`fast`).
//!
//! One test in its own binary, so that no other test allocates while it counts; the pool
//! has one thread, so that every buffer a thread keeps is warm after the first steps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tessera_comm::Solo;
use tessera_model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqCache};
use tessera_model::loader;
use tessera_topology::Precision;

/// Counts allocations (and reallocations) on every thread.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// What one decode step of one sequence allocates: the list of the batch's block tables
/// (borrowed from the caller's chunks), and the logits it returns (the outer list and the
/// one row).
const STEP_ALLOCATIONS: usize = 3;

/// Warm-up steps before the counted one.
const WARM_STEPS: usize = 3;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(path)
}

#[test]
fn a_decode_step_allocates_only_its_result() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let files = [
        "models/llama-gqa/model.Q4_1.gguf",
        "models/llama-presets/model.Q4_K_M.gguf",
        "quant/llama-kquant.new-k-types.gguf",
    ];
    for file in files {
        let mut model = loader::load(&fixture(file)).unwrap().llama;
        for precision in [Precision::Exact, Precision::Fast] {
            model.set_precision(precision);
            let layers = model.config().num_hidden_layers;
            let mut cache = KvCache::new(model.kv_layout(DEFAULT_BLOCK_SIZE), layers, 2);
            let mut seq = SeqCache::default();
            let mut solo = Solo::default();
            let counted = pool.install(|| {
                let mut step = |tokens: &[u32]| {
                    let before = ALLOCATIONS.load(Ordering::Relaxed);
                    let logits = model.forward(tokens, &mut seq, &mut cache, &mut solo);
                    let counted = ALLOCATIONS.load(Ordering::Relaxed) - before;
                    assert!(logits.unwrap().iter().all(|v| v.is_finite()));
                    counted
                };
                step(&[1, 7, 3, 9, 4, 8, 2, 6, 5, 3, 1]);
                for token in 0..WARM_STEPS as u32 {
                    step(&[token + 2]);
                }
                // Position 14: inside the first block, so the sequence's block table does
                // not grow, and inside the 16 positions that attention's scratch has held
                // since the prompt (it grows by doubling, as the context does).
                step(&[5])
            });
            assert!(
                counted <= STEP_ALLOCATIONS,
                "{file} {precision:?}: a decode step of {layers} layers allocated {counted} \
                 times (at most {STEP_ALLOCATIONS})"
            );
        }
    }
}
