//! CUDA graphs for decode steps: the whole pass of a decode batch (one token per
//! sequence, every sequence sampling) captured once per batch size and replayed, so a step
//! costs one graph launch instead of a few hundred kernel launches.
//!
//! A graph bakes in its buffers' addresses and its launches' shapes, so each batch size
//! (rounded up to [`GRAPH_BATCHES`]) has buffers of its own, its block tables have room
//! for [`GRAPH_MAX_CONTEXT`] positions, and its attention launches every partition of
//! that length (partitions past a sequence's context return at once; the grouped kernel
//! spreads each context over the partitions it was captured with). Padding rows run
//! token 0 at position 0 with no KV write and are dropped (their logits rows come after
//! the batch's, and nothing reads them). Graphs apply with tp = 1 (a
//! collective through the host cannot be captured); a batch they do not fit, or a capture
//! that fails, runs eagerly.

use tessera_comm::Collective;
use tessera_comm::Solo;

use crate::slice::SliceComm;
use tessera_kernels::cuda::{AttentionIndex, CudaSlice, Graph, Ops, Slots};
use tracing::{info, warn};

use super::CudaLlama;
use super::kv::{DeviceKv, Scratch};
use super::layer::PassBatch;
use super::weights::Input;
use crate::batch::BatchIndex;
use crate::error::ModelError;

/// Batch sizes that get a graph; a batch runs in the smallest that holds it.
pub const GRAPH_BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The longest context a graph's block tables and attention partitions cover (or the
/// model's, if shorter); a batch with a longer sequence runs eagerly. It bounds what a
/// graph's buffers take (tables, partition scratch: batch × heads × 32 partitions).
pub const GRAPH_MAX_CONTEXT: usize = 8192;

/// One captured decode pass and the buffers it reads and writes.
pub(crate) struct DecodeGraph {
    batch: usize,
    scratch: Box<Scratch>,
    slots: Slots,
    index: AttentionIndex,
    logits: CudaSlice<f32>,
    graph: Graph,
}

/// The decode graphs of one KV cache (they bake in its addresses).
#[derive(Default)]
pub(crate) struct DecodeGraphs {
    pub(crate) disabled: bool,
    graphs: Vec<DecodeGraph>,
    /// Batch sizes whose capture failed: they run eagerly.
    failed: Vec<usize>,
    /// Kernels in the graph the last pass replayed (0: the last pass ran eagerly).
    pub(crate) last_kernels: u64,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraphs")
            .field("disabled", &self.disabled)
            .field(
                "batches",
                &self.graphs.iter().map(|g| g.batch).collect::<Vec<_>>(),
            )
            .field("failed", &self.failed)
            .finish()
    }
}

impl DecodeGraphs {
    /// No graph yet; on unless `TESSERA_CUDA_GRAPHS=0`.
    pub(crate) fn from_env() -> DecodeGraphs {
        DecodeGraphs {
            disabled: std::env::var("TESSERA_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            ..DecodeGraphs::default()
        }
    }
}

/// The host inputs of a decode batch padded to a graph's batch size.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PaddedDecode {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<u32>,
    pub(crate) slots: Vec<i64>,
    pub(crate) tables: Vec<u32>,
    pub(crate) contexts: Vec<u32>,
}

/// `ix` padded to `batch` rows of `max_blocks`-long tables, or `None` when it is not a
/// decode batch (one token per sequence, each wanting logits) or does not fit.
pub(crate) fn pad_decode(ix: &BatchIndex, batch: usize, max_blocks: usize) -> Option<PaddedDecode> {
    let n = ix.tokens.len();
    let decode = ix.wanted.len() == n
        && ix
            .query_seq
            .iter()
            .enumerate()
            .all(|(i, &q)| q as usize == i)
        && ix.wanted.iter().enumerate().all(|(i, &w)| w == i);
    if !decode || n > batch || ix.max_blocks > max_blocks {
        return None;
    }
    let mut tables = vec![0u32; batch * max_blocks];
    for row in 0..n {
        let from = &ix.tables[row * ix.max_blocks..(row + 1) * ix.max_blocks];
        tables[row * max_blocks..row * max_blocks + ix.max_blocks].copy_from_slice(from);
    }
    let pad = |v: &[u32], with: u32| {
        let mut v = v.to_vec();
        v.resize(batch, with);
        v
    };
    let mut slots = ix.slots.clone();
    slots.resize(batch, -1);
    Some(PaddedDecode {
        tokens: pad(&ix.tokens, 0),
        positions: pad(&ix.positions, 0),
        slots,
        tables,
        contexts: pad(&ix.contexts, 1),
    })
}

impl DeviceKv {
    /// Turns decode graphs on (the default, unless `TESSERA_CUDA_GRAPHS=0`) or off.
    pub fn set_graphs(&mut self, enabled: bool) {
        self.graphs.disabled = !enabled;
    }

    /// Kernels in the graph the last pass replayed; 0 when it ran eagerly.
    pub fn last_graph_kernels(&self) -> u64 {
        self.graphs.last_kernels
    }
}

impl DecodeGraphs {
    /// The logits buffer of graph `i` (as [`CudaLlama::decode_by_graph`] names it): its
    /// batch's rows, padding rows after the batch's.
    pub(crate) fn logits(&self, i: usize) -> &CudaSlice<f32> {
        &self.graphs[i].logits
    }
}

impl CudaLlama {
    /// Runs a decode batch through its graph, leaving its logits in the graph's buffer;
    /// returns which graph, or `None` when graphs do not apply (then the batch runs
    /// eagerly).
    pub(super) fn decode_by_graph(
        &self,
        ops: &Ops<'_>,
        ix: &BatchIndex,
        kv: &mut DeviceKv,
        comm: &mut dyn Collective,
    ) -> Result<Option<usize>, ModelError> {
        kv.graphs.last_kernels = 0;
        if kv.graphs.disabled || comm.world_size() != 1 {
            return Ok(None);
        }
        let n = ix.tokens.len();
        let Some(&batch) = GRAPH_BATCHES.iter().find(|&&b| b >= n) else {
            return Ok(None);
        };
        let max_blocks = self
            .config
            .max_position_embeddings
            .min(GRAPH_MAX_CONTEXT)
            .div_ceil(kv.layout().block_size)
            .min(kv.num_blocks());
        let Some(padded) = pad_decode(ix, batch, max_blocks) else {
            return Ok(None);
        };
        if kv.graphs.failed.contains(&batch) {
            return Ok(None);
        }
        let mut graphs = std::mem::take(&mut kv.graphs);
        let result = self.replay(ops, &mut graphs, kv, batch, max_blocks, &padded);
        kv.graphs = graphs;
        result
    }

    fn replay(
        &self,
        ops: &Ops<'_>,
        graphs: &mut DecodeGraphs,
        kv: &mut DeviceKv,
        batch: usize,
        max_blocks: usize,
        padded: &PaddedDecode,
    ) -> Result<Option<usize>, ModelError> {
        if !graphs.graphs.iter().any(|g| g.batch == batch) {
            match self.capture(ops, kv, batch, max_blocks) {
                Ok(g) => {
                    info!(batch, kernels = g.graph.kernels(), "decode graph captured");
                    graphs.graphs.push(g);
                }
                Err(error) => {
                    warn!(batch, %error, "decode graph capture failed: this batch size runs eagerly");
                    graphs.failed.push(batch);
                    return Ok(None);
                }
            }
        }
        let i = graphs
            .graphs
            .iter()
            .position(|g| g.batch == batch)
            .expect("captured above");
        let g = &mut graphs.graphs[i];
        let block_size = kv.layout().block_size;
        ops.copy_to_device(&padded.tokens, &mut g.scratch.ids)?;
        ops.copy_to_device(&padded.positions, &mut g.scratch.positions)?;
        ops.update_slots(&mut g.slots, &padded.slots)?;
        ops.update_attention_index(&mut g.index, &padded.tables, &padded.contexts, block_size)?;
        ops.launch_graph(&g.graph)?;
        graphs.last_kernels = g.graph.kernels();
        Ok(Some(i))
    }

    /// Builds the buffers of a `batch`-row decode graph, runs the pass once eagerly (so
    /// cuBLAS settles its kernels outside the capture), then captures it.
    fn capture(
        &self,
        ops: &Ops<'_>,
        kv: &mut DeviceKv,
        batch: usize,
        max_blocks: usize,
    ) -> Result<DecodeGraph, ModelError> {
        let layout = kv.layout();
        let mut scratch = Box::new(Scratch::new(ops, batch, self.widths())?);
        let slots = ops.slots(&vec![-1; batch], kv.num_blocks() * layout.block_size)?;
        let query_seq: Vec<u32> = (0..batch as u32).collect();
        let reach = (max_blocks * layout.block_size) as u32;
        let mut index = ops.attention_index(
            &vec![0; batch * max_blocks],
            max_blocks,
            &query_seq,
            &vec![reach; batch],
            self.attention_target(kv, true),
        )?;
        let mut logits = ops.alloc::<f32>(batch * self.head().rows)?;
        // Warm-up: every slot is −1, so nothing is written to the cache.
        self.decode_pass(ops, &mut scratch, &slots, &mut index, kv, &mut logits)?;
        ops.synchronize()?;
        let (graph, ()) = ops
            .capture(|| self.decode_pass(ops, &mut scratch, &slots, &mut index, kv, &mut logits))?;
        Ok(DecodeGraph {
            batch,
            scratch,
            slots,
            index,
            logits,
            graph,
        })
    }

    /// A decode pass into `logits`: every layer, the final norm and the LM head.
    fn decode_pass(
        &self,
        ops: &Ops<'_>,
        s: &mut Scratch,
        slots: &Slots,
        index: &mut AttentionIndex,
        kv: &mut DeviceKv,
        logits: &mut CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        // Every row of a decode graph is one sequence's one new token.
        let mut batch = PassBatch {
            slots,
            index,
            decode: true,
        };
        self.pass(
            ops,
            s,
            &mut batch,
            kv,
            &mut SliceComm::Host(&mut Solo::default()),
        )?;
        // An f32 head (the exact path) reads the f32 rows.
        if !self.head().is_f32() {
            ops.round_bf16(&mut s.h16, &s.h)?;
        }
        let h = Input {
            f32: &s.h,
            bf16: &s.h16,
        };
        let gemm = self.gemm.for_tokens(s.tokens);
        self.head().apply(ops, (&self.blas, gemm), &h, logits)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::SeqChunk;

    #[test]
    fn a_decode_batch_is_padded_to_the_graphs_rows() {
        let (a, b) = ([5u32], [6u32]);
        let batch = [
            SeqChunk {
                tokens: &a,
                start: 4,
                block_table: &[3, 9],
                logits: true,
            },
            SeqChunk {
                tokens: &b,
                start: 0,
                block_table: &[7],
                logits: true,
            },
        ];
        let ix = BatchIndex::new(&batch, 4);
        let padded = pad_decode(&ix, 4, 3).expect("a decode batch");
        assert_eq!(padded.tokens, [5, 6, 0, 0]);
        assert_eq!(padded.positions, [4, 0, 0, 0]);
        // Position 4 is offset 0 of block 9; padding rows write nothing.
        assert_eq!(padded.slots, [36, 28, -1, -1]);
        assert_eq!(padded.tables, [3, 9, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(padded.contexts, [5, 1, 1, 1]);
    }

    #[test]
    fn prefill_and_oversized_batches_run_eagerly() {
        let prompt = [1u32, 2, 3];
        let prefill = [SeqChunk {
            tokens: &prompt,
            start: 0,
            block_table: &[0],
            logits: true,
        }];
        assert_eq!(pad_decode(&BatchIndex::new(&prefill, 4), 4, 8), None);
        let one = [1u32];
        let quiet = [SeqChunk {
            tokens: &one,
            start: 0,
            block_table: &[0],
            logits: false,
        }];
        assert_eq!(pad_decode(&BatchIndex::new(&quiet, 4), 4, 8), None);
        let long = [SeqChunk {
            tokens: &one,
            start: 20,
            block_table: &[0, 1, 2, 3, 4, 5],
            logits: true,
        }];
        // Six blocks do not fit tables of four.
        assert_eq!(pad_decode(&BatchIndex::new(&long, 4), 4, 4), None);
        assert!(pad_decode(&BatchIndex::new(&long, 4), 1, 6).is_some());
        assert!(pad_decode(&BatchIndex::new(&[long[0], long[0]], 4), 1, 6).is_none());
    }
}
