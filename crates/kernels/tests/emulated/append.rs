//! The grouped kernel's append mode (a fused decode step: each query rotated from its row
//! of the stacked q|k|v projection, its K and V written into the cache by the attention
//! launch itself) under the CPU emulation, against `fused::rope_kv_write` then the CPU's
//! attention, as `fused_case` holds it on the GPU.

use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tessera_kernels::attention::{
    AttentionParams, GROUPED_TOLERANCE, KvLayout, PagedKv, paged_attention,
};
use tessera_kernels::fused::{self, QkvRow};
use tessera_kernels::rope::{Rope, RopePairing, RopeScaling};

use super::common::close_bf16;
use super::{Batch, bf16_values, compiled, drive, f32s, rounds_to, u16s, within};

/// A decode step's append inputs for `batch` (one query a sequence, each the token at
/// position context − 1), the first query padding (slot −1: nothing of it is written).
struct Append {
    rope: Rope,
    positions: Vec<u32>,
    slots: Vec<i64>,
    qkv: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Append {
    fn new(rng: &mut StdRng, batch: &Batch, pairing: RopePairing, bias: bool) -> Append {
        let layout = batch.layout;
        let bs = layout.block_size;
        let positions: Vec<u32> = batch.contexts.iter().map(|c| c - 1).collect();
        let mut slots: Vec<i64> = (positions.iter().zip(&batch.query_seq))
            .map(|(&p, &s)| {
                let block = batch.tables[s as usize][p as usize / bs] as usize;
                (block * bs + p as usize % bs) as i64
            })
            .collect();
        slots[0] = -1;
        let row = (batch.q_heads + 2 * layout.kv_heads) * layout.head_dim;
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        Append {
            rope: Rope::new(layout.head_dim, 500_000.0, &scaling, pairing),
            qkv: bf16_values(rng, positions.len() * row, 1.0),
            bias: bias.then(|| bf16_values(rng, row, 0.5)),
            positions,
            slots,
        }
    }

    /// What `append_main.cpp` reads after the batch.
    fn bytes(&self, pairing: RopePairing) -> Vec<u8> {
        let mut out = Vec::new();
        let code = u32::from(pairing == RopePairing::Interleaved);
        out.extend(code.to_le_bytes());
        out.extend(u32::from(self.bias.is_some()).to_le_bytes());
        let floats = self.qkv.iter().chain(self.bias.iter().flatten());
        floats.for_each(|x| out.extend(x.to_le_bytes()));
        self.positions
            .iter()
            .for_each(|x| out.extend(x.to_le_bytes()));
        self.rope
            .inv_freq()
            .iter()
            .for_each(|x| out.extend(x.to_le_bytes()));
        self.slots.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out
    }

    /// The twin: the rotated queries, and the caches (bf16 bits) with every query's K and
    /// V written at its slot.
    fn twin(&self, batch: &Batch) -> (Vec<f32>, Vec<u16>, Vec<u16>) {
        let kv_width = batch.layout.kv_heads * batch.layout.head_dim;
        let bits = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect()
        };
        let (mut k, mut v) = (bits(&batch.k), bits(&batch.v));
        let positions: Vec<usize> = self.positions.iter().map(|&p| p as usize).collect();
        let tables = self.rope.tables(&positions);
        let row = self.qkv.len() / positions.len();
        let mut q = Vec::new();
        for (t, qkv) in self.qkv.chunks(row).enumerate() {
            let (mut k_slot, mut v_slot) = (vec![0u16; kv_width], vec![0u16; kv_width]);
            let qkv_row = QkvRow {
                qkv,
                bias: self.bias.as_deref(),
            };
            let rope = &self.rope;
            q.extend(fused::rope_kv_write(
                qkv_row,
                rope,
                &tables,
                t,
                &mut k_slot,
                &mut v_slot,
            ));
            if let Ok(slot) = usize::try_from(self.slots[t]) {
                k[slot * kv_width..][..kv_width].copy_from_slice(&k_slot);
                v[slot * kv_width..][..kv_width].copy_from_slice(&v_slot);
            }
        }
        (q, k, v)
    }
}

/// GQA 1, 4 and 8; head_dim 64 and 128; both pairings of RoPE, with and without the bias;
/// contexts on both sides of the blocks' (16) and the partitions' (64) edges: `f(what,
/// batch, append inputs, pairing)` for each.
fn for_each_case(mut f: impl FnMut(&str, &Batch, &Append, RopePairing)) {
    let mut rng = StdRng::seed_from_u64(47);
    let contexts = [1u32, 15, 16, 17, 64, 65, 300, 701];
    let chunks: Vec<(u32, std::ops::Range<u32>)> = (contexts.iter().enumerate())
        .map(|(s, &c)| (s as u32, c..c + 1))
        .collect();
    let lens: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
    let cases = [
        (64, 1, RopePairing::Halves, true),
        (64, 4, RopePairing::Interleaved, false),
        (128, 8, RopePairing::Halves, false),
        (128, 4, RopePairing::Interleaved, true),
    ];
    for (head_dim, group, pairing, bias) in cases {
        let layout = KvLayout {
            block_size: 16,
            kv_heads: 2,
            head_dim,
        };
        let batch = Batch::new(&mut rng, (layout, 2 * group), &lens, &chunks, None);
        let append = Append::new(&mut rng, &batch, pairing, bias);
        let what = format!("d{head_dim}, group {group}, {pairing:?}, bias {bias}");
        f(&what, &batch, &append, pairing);
    }
}

/// Every case of [`for_each_case`], unsplit and split 3 and 64 ways. The caches as the
/// twin writes them (each bf16 equal or a neighbour: the rotation's sin and cos differ in
/// their last bits), and the output within [`GROUPED_TOLERANCE`] of the CPU's attention
/// with the twin's rotated q over the caches the kernel wrote; the padding query's row is
/// not compared (it attends from values it rotated but did not write).
#[test]
fn the_grouped_kernels_append_emulated_is_rope_kv_write_then_attention() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("append_main.cpp", dir.path()) else {
        return;
    };
    for_each_case(|case, batch, append, pairing| {
        let (layout, head_dim) = (batch.layout, batch.layout.head_dim);
        let (q, want_k, want_v) = append.twin(batch);
        for partitions in [1, 3, 64] {
            let input = batch.input(partitions, &append.bytes(pairing));
            let (got, got16, rest) = batch.run(&exe, dir.path(), &input);
            let what = format!("append {case}, {partitions} partitions");
            let caches = u16s(&rest);
            let (got_k, got_v) = caches.split_at(caches.len() / 2);
            close_bf16(&what, got_k, &want_k);
            close_bf16(&what, got_v, &want_v);
            let f = |b: &[u16]| -> Vec<f32> {
                b.iter()
                    .map(|&x| half::bf16::from_bits(x).to_f32())
                    .collect()
            };
            let (k, v) = (f(got_k), f(got_v));
            let kv = PagedKv {
                layout,
                k: &k,
                v: &v,
            };
            let (rows, visible) = batch.rows();
            let mut want = vec![0.0f32; q.len()];
            let params = AttentionParams::causal(head_dim);
            paged_attention(&q, &kv, &rows, &visible, batch.q_heads, &params, &mut want);
            let first = batch.q_heads * head_dim;
            // The padding query's output (the first) is not compared.
            let worst = within(&what, &got[first..], &want[first..], GROUPED_TOLERANCE);
            rounds_to(&what, &got[first..], &got16[first..]);
            eprintln!("{what}: worst {worst:.2e} from the twin");
        }
    });
}

/// `rope_kv_write` (`rope_kv.cu`, the fused path's rotation and KV write before a prefill
/// or mixed batch's attention) on every case of [`for_each_case`]: the rotated queries,
/// the padding one's too, within 1e-5 of the twin's (relative, at least 1 in the
/// denominator: the sin and cos differ in their last bits), and the caches as the twin
/// writes them, nothing at the padding query's slot.
#[test]
fn rope_kv_write_emulated_is_its_twin() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("append_main.cpp", dir.path()) else {
        return;
    };
    for_each_case(|case, batch, append, pairing| {
        let (q, want_k, want_v) = append.twin(batch);
        let bytes = drive(&exe, dir.path(), &batch.input(0, &append.bytes(pairing)));
        let what = format!("rope_kv_write {case}");
        assert!(bytes.len() >= q.len() * 4, "{what}: the emulator's output");
        let (got_q, caches) = bytes.split_at(q.len() * 4);
        let worst = within(&what, &f32s(got_q), &q, 1e-5);
        let caches = u16s(caches);
        let (got_k, got_v) = caches.split_at(caches.len() / 2);
        close_bf16(&what, got_k, &want_k);
        close_bf16(&what, got_v, &want_v);
        eprintln!("{what}: q worst {worst:.2e} from the twin");
    });
}
