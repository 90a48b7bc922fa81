//! The fused kernels (issue 16) against their CPU twins (`tessera_kernels::fused`), part
//! of the `gpu` test binary. Tolerances: f32 outputs as their unfused kernels' (1e-5
//! relative for the norm and SiLU, 1e-4 for RoPE's sin/cos); a bf16 output is the
//! rounding of an f32 value that differs from the twin's in its last bits, so it must be
//! the twin's bf16 or one of its neighbours (a value near a rounding midpoint may round
//! the other way), never further.

use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tessera_kernels::attention::{AttentionParams, KvLayout, PagedKv, paged_attention};
use tessera_kernels::cuda::ops::Ops;
use tessera_kernels::cuda::{Append, CudaSlice, RopeKv, Slots};
use tessera_kernels::fused::{self, QkvRow};
use tessera_kernels::rope::{Rope, RopePairing, RopeScaling};

use super::common::{close_bf16, rmsnorm_bf16_twin};
use super::paged_case::PagedCase;
use super::{GROUPED_TOLERANCE, close, device, ops, random, to_bf16};

#[test]
fn rmsnorm_residual_bf16_matches_its_twin() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(21);
    // 576: the 16-byte path; 577: the scalar one (hidden not a multiple of 4). 3 and 5
    // rows: not a multiple of anything the block uses.
    for (hidden, tokens) in [(576, 5), (577, 3), (2048, 1)] {
        for (add, with_f32) in [(true, true), (true, false), (false, true)] {
            let x = random(&mut rng, hidden * tokens, 2.0);
            let residual = random(&mut rng, hidden * tokens, 2.0);
            let weight = random(&mut rng, hidden, 1.5);
            let mut out16 = ops.alloc::<u16>(hidden * tokens).unwrap();
            let mut out32 = ops.alloc::<f32>(hidden * tokens).unwrap();
            let mut res_dev = ops.upload(&residual).unwrap();
            let (x_dev, w_dev) = (ops.upload(&x).unwrap(), ops.upload(&weight).unwrap());
            ops.rmsnorm_residual_bf16(
                &mut out16,
                with_f32.then_some(&mut out32),
                &mut res_dev,
                add.then_some(&x_dev),
                &w_dev,
                1e-5,
            )
            .unwrap();
            let (want_res, want16, want32) =
                rmsnorm_bf16_twin(&residual, add.then_some(&x), &weight);
            let what = format!("rmsnorm bf16, hidden {hidden}, add {add}");
            close(&what, &ops.download(&res_dev).unwrap(), &want_res, 1e-6);
            close_bf16(&what, &ops.download(&out16).unwrap(), &want16);
            if with_f32 {
                close(&what, &ops.download(&out32).unwrap(), &want32, 1e-5);
            }
        }
    }
}

#[test]
fn silu_mul_bf16_matches_its_twin() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(22);
    // 1536: four values a thread; 1537: one.
    for (inter, tokens) in [(1536, 3), (1537, 5), (8192, 1)] {
        for with_f32 in [true, false] {
            let gate_up = random(&mut rng, 2 * inter * tokens, 6.0);
            let mut out16 = ops.alloc::<u16>(inter * tokens).unwrap();
            let mut out32 = ops.alloc::<f32>(inter * tokens).unwrap();
            let gu_dev = ops.upload(&gate_up).unwrap();
            ops.silu_mul_bf16(&mut out16, with_f32.then_some(&mut out32), &gu_dev, inter)
                .unwrap();
            let mut want16 = vec![0u16; inter * tokens];
            let mut want32 = Vec::new();
            for (row, out) in gate_up.chunks(2 * inter).zip(want16.chunks_mut(inter)) {
                want32.extend(fused::silu_mul_bf16(row, out));
            }
            let what = format!("silu_mul bf16, inter {inter}");
            close_bf16(&what, &ops.download(&out16).unwrap(), &want16);
            if with_f32 {
                close(&what, &ops.download(&out32).unwrap(), &want32, 1e-5);
            }
        }
    }
}

/// A decode batch over a paged cache, for `rope_kv_write` and the attention's append:
/// q|k|v rows, a bias, each query's position (its context − 1) and cache slot.
struct DecodeCase {
    case: PagedCase,
    q_heads: usize,
    contexts: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<i64>,
    qkv: Vec<f32>,
    bias: Vec<f32>,
    rope: Rope,
}

impl DecodeCase {
    fn new(rng: &mut StdRng, layout: KvLayout, group: usize, pairing: RopePairing) -> DecodeCase {
        // Contexts on both sides of the block edges (16) and of the partitions' (64).
        let contexts: Vec<u32> = vec![1, 15, 16, 17, 64, 65, 300, 701];
        let lens: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
        let case = PagedCase::new(rng, layout, &lens);
        let q_heads = group * layout.kv_heads;
        let positions: Vec<u32> = contexts.iter().map(|c| c - 1).collect();
        let bs = layout.block_size;
        let mut slots: Vec<i64> = positions
            .iter()
            .enumerate()
            .map(|(s, &p)| {
                let block = case.tables[s * case.max_blocks + p as usize / bs];
                (block as usize * bs + p as usize % bs) as i64
            })
            .collect();
        // The first query is padding: nothing of it reaches the cache.
        slots[0] = -1;
        let row = (q_heads + 2 * layout.kv_heads) * layout.head_dim;
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        DecodeCase {
            qkv: random(rng, contexts.len() * row, 1.0),
            bias: random(rng, row, 0.5),
            rope: Rope::new(layout.head_dim, 500_000.0, &scaling, pairing),
            case,
            q_heads,
            contexts,
            positions,
            slots,
        }
    }

    fn row(&self) -> usize {
        (self.q_heads + 2 * self.case.layout.kv_heads) * self.case.layout.head_dim
    }

    /// The twin: the rotated queries, and the cache (bf16 bits) with every query's K and V
    /// written.
    fn twin(&self, bias: bool) -> (Vec<f32>, Vec<u16>, Vec<u16>) {
        let layout = self.case.layout;
        let kv_width = layout.kv_heads * layout.head_dim;
        let (mut k, mut v) = (to_bf16(&self.case.k), to_bf16(&self.case.v));
        let positions: Vec<usize> = self.positions.iter().map(|&p| p as usize).collect();
        let tables = self.rope.tables(&positions);
        let mut q = Vec::new();
        for (t, row) in self.qkv.chunks(self.row()).enumerate() {
            let (mut k_slot, mut v_slot) = (vec![0u16; kv_width], vec![0u16; kv_width]);
            let qkv_row = QkvRow {
                qkv: row,
                bias: bias.then_some(&self.bias[..]),
            };
            q.extend(fused::rope_kv_write(
                qkv_row,
                &self.rope,
                &tables,
                t,
                &mut k_slot,
                &mut v_slot,
            ));
            if let Ok(slot) = usize::try_from(self.slots[t]) {
                k[slot * kv_width..(slot + 1) * kv_width].copy_from_slice(&k_slot);
                v[slot * kv_width..(slot + 1) * kv_width].copy_from_slice(&v_slot);
            }
        }
        (q, k, v)
    }

    /// The CPU attention of `q` over a cache of bf16 bits.
    fn attend(&self, q: &[f32], k: &[u16], v: &[u16]) -> Vec<f32> {
        let f = |b: &[u16]| -> Vec<f32> {
            b.iter()
                .map(|&x| half::bf16::from_bits(x).to_f32())
                .collect()
        };
        let (k, v) = (f(k), f(v));
        let m = self.case.max_blocks;
        let rows: Vec<&[u32]> = (0..self.contexts.len())
            .map(|s| &self.case.tables[s * m..(s + 1) * m])
            .collect();
        let visible: Vec<usize> = self.contexts.iter().map(|&c| c as usize).collect();
        let kv = PagedKv {
            layout: self.case.layout,
            k: &k,
            v: &v,
        };
        let mut out = vec![0.0; q.len()];
        let params = AttentionParams::causal(self.case.layout.head_dim);
        paged_attention(q, &kv, &rows, &visible, self.q_heads, &params, &mut out);
        out
    }
}

const PAIRINGS: [(RopePairing, u32); 2] = [(RopePairing::Halves, 0), (RopePairing::Interleaved, 1)];

/// The decode tests' cases, drawn in turn from one generator seeded with `seed`: head_dim
/// 64 and 128, groups of 1, 4 and 8 query heads a KV head, both pairings; each with its
/// group, its pairing and the kernels' code for that pairing.
fn decode_cases(seed: u64) -> Vec<(DecodeCase, usize, RopePairing, u32)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = Vec::new();
    for head_dim in [64, 128] {
        for group in [1, 4, 8] {
            for (pairing, code) in PAIRINGS {
                let layout = KvLayout {
                    block_size: 16,
                    kv_heads: 2,
                    head_dim,
                };
                let d = DecodeCase::new(&mut rng, layout, group, pairing);
                cases.push((d, group, pairing, code));
            }
        }
    }
    cases
}

/// A decode case's inputs on the device.
struct DeviceDecode {
    slots: Slots,
    positions: CudaSlice<u32>,
    inv_freq: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    bias: CudaSlice<f32>,
}

impl DeviceDecode {
    /// The inputs, and a fresh copy of the case's cache (bf16 K, V).
    fn new(ops: &Ops<'_>, d: &DecodeCase) -> (DeviceDecode, CudaSlice<u16>, CudaSlice<u16>) {
        let capacity = d.case.blocks * d.case.layout.block_size;
        let slots = ops.slots(&d.slots, capacity).unwrap();
        let k = ops.upload(&to_bf16(&d.case.k)).unwrap();
        let v = ops.upload(&to_bf16(&d.case.v)).unwrap();
        let inputs = DeviceDecode {
            slots,
            positions: ops.upload(&d.positions).unwrap(),
            inv_freq: ops.upload(d.rope.inv_freq()).unwrap(),
            qkv: ops.upload(&d.qkv).unwrap(),
            bias: ops.upload(&d.bias).unwrap(),
        };
        (inputs, k, v)
    }

    /// What the kernels rotate with, for the pairing of kernel code `code`.
    fn rope(&self, d: &DecodeCase, code: u32) -> RopeKv<'_> {
        RopeKv {
            positions: &self.positions,
            inv_freq: &self.inv_freq,
            pairing: code,
            q_heads: d.q_heads,
            kv_heads: d.case.layout.kv_heads,
        }
    }
}

#[test]
fn rope_kv_write_matches_its_twin_for_gqa_head_dims_and_biases() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    for (d, group, pairing, code) in decode_cases(23) {
        let head_dim = d.case.layout.head_dim;
        for bias in [false, true] {
            let (want_q, want_k, want_v) = d.twin(bias);
            let (dd, mut k, mut v) = DeviceDecode::new(&ops, &d);
            let mut q = ops
                .alloc::<f32>(d.contexts.len() * d.q_heads * head_dim)
                .unwrap();
            ops.rope_kv_write(
                &mut q,
                (&mut k, &mut v),
                &dd.qkv,
                bias.then_some(&dd.bias),
                &dd.slots,
                dd.rope(&d, code),
            )
            .unwrap();
            let what = format!(
                "rope_kv_write, head_dim {head_dim}, group {group}, {pairing:?}, bias {bias}"
            );
            close(&what, &ops.download(&q).unwrap(), &want_q, 1e-4);
            // The whole cache: the written slots as the twin's, every other position (the
            // padding query's slot included) untouched.
            close_bf16(&what, &ops.download(&k).unwrap(), &want_k);
            close_bf16(&what, &ops.download(&v).unwrap(), &want_v);
        }
    }
}

#[test]
fn attention_with_the_kv_append_matches_rope_kv_write_then_attention() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    for (d, group, pairing, code) in decode_cases(24) {
        let layout = d.case.layout;
        let head_dim = layout.head_dim;
        let bias = group != 4; // with and without, across the cases
        let (want_q, want_k, want_v) = d.twin(bias);
        // Unsplit, split as the device asks, and 3 and 64 ways (a partition boundary next
        // to the fresh position, and partitions past short contexts).
        for partitions in [Some(1), None, Some(3), Some(64)] {
            let (dd, mut k, mut v) = DeviceDecode::new(&ops, &d);
            let n = d.contexts.len() * d.q_heads * head_dim;
            let (mut out, mut out16) = (ops.alloc::<f32>(n).unwrap(), ops.alloc::<u16>(n).unwrap());
            let query_seq: Vec<u32> = (0..d.contexts.len() as u32).collect();
            let target = d.case.target(d.q_heads, partitions);
            let mut index = ops
                .attention_index(
                    &d.case.tables,
                    d.case.max_blocks,
                    &query_seq,
                    &d.contexts,
                    target,
                )
                .unwrap();
            let append = Append {
                qkv: &dd.qkv,
                bias: bias.then_some(&dd.bias),
                rope: dd.rope(&d, code),
                slots: &dd.slots,
            };
            ops.paged_attention_append(
                &mut out,
                Some(&mut out16),
                (&mut k, &mut v),
                layout,
                &mut index,
                append,
            )
            .unwrap();
            let what = format!(
                "attention + append, head_dim {head_dim}, group {group}, {pairing:?}, \
                 bias {bias}, {} partitions",
                index.partitions()
            );
            let (got_k, got_v) = (ops.download(&k).unwrap(), ops.download(&v).unwrap());
            close_bf16(&what, &got_k, &want_k);
            close_bf16(&what, &got_v, &want_v);
            // Attention over the cache as the kernel wrote it (a k rounded to the twin's
            // neighbour moves a logit by far more than the tolerance), with the twin's
            // rotated q. The padding query attends its stale position 0 from the values it
            // rotated, not from the cache: skip its row.
            let want = d.attend(&want_q, &got_k, &got_v);
            let got = ops.download(&out).unwrap();
            let first = d.q_heads * head_dim;
            close(&what, &got[first..], &want[first..], GROUPED_TOLERANCE);
            // Rounded on the device from the same f32: the host's rounding exactly.
            assert_eq!(ops.download(&out16).unwrap(), to_bf16(&got), "{what}");
        }
    }
}

#[test]
fn the_bf16_output_of_the_grouped_attention_is_its_f32_output_rounded() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(25);
    let layout = KvLayout {
        block_size: 16,
        kv_heads: 2,
        head_dim: 64,
    };
    let (q_heads, contexts) = (8, vec![5u32, 300, 1000]);
    let lens: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
    let case = PagedCase::new(&mut rng, layout, &lens);
    let q = random(&mut rng, contexts.len() * q_heads * 64, 1.0);
    let query_seq: Vec<u32> = vec![0, 1, 2];
    let (k, v) = (
        ops.upload(&to_bf16(&case.k)).unwrap(),
        ops.upload(&to_bf16(&case.v)).unwrap(),
    );
    for partitions in [Some(1), Some(5)] {
        let target = case.target(q_heads, partitions);
        let mut index = case.index(&ops, &query_seq, &contexts, target);
        let (mut out, mut out16) = (
            ops.alloc::<f32>(q.len()).unwrap(),
            ops.alloc::<u16>(q.len()).unwrap(),
        );
        let q_dev = ops.upload(&q).unwrap();
        ops.paged_attention_with_bf16(
            &mut out,
            Some(&mut out16),
            &q_dev,
            (&k, &v),
            layout,
            &mut index,
        )
        .unwrap();
        let got = ops.download(&out).unwrap();
        close(
            "grouped attention with bf16",
            &got,
            &case.attend(&q, &query_seq, &contexts, q_heads),
            GROUPED_TOLERANCE,
        );
        // Rounded on the device from the same f32: exactly the host's rounding.
        assert_eq!(ops.download(&out16).unwrap(), to_bf16(&got));
    }
}
