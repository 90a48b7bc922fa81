//! Each CUDA kernel against its CPU twin, on a GPU (`scripts/gpu-check.sh` runs this).
//! Without a CUDA driver every test says so and passes, unless `TESSERA_REQUIRE_GPU=1`.
//! Tolerances: kernels on f32 data agree to float rounding (1e-5 relative, fast `__expf`
//! in SiLU 1e-5); bf16 inputs are rounded to bf16 for the CPU twin too, so the remaining
//! difference is summation order (1e-4; the grouped attention kernel's reasoning is at
//! `GROUPED_TOLERANCE`); sampling must pick the twin's token in every row: both compute
//! the same float operations, none fused, and sum weights as integers, so the order of
//! the sums cannot move a draw.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tessera_kernels::DType;
use tessera_kernels::attention::{AttentionParams, KvLayout, PagedKv, paged_attention};
use tessera_kernels::cpu::{RowDraw, ThresholdParams, sample_threshold};
use tessera_kernels::cuda::device::driver_present;
use tessera_kernels::cuda::ops::Ops;
use tessera_kernels::cuda::{AttentionKernel, AttentionTarget};
use tessera_kernels::cuda::{CudaDevice, PtxCache};
use tessera_kernels::quant::{dequantize_row, fp8, quantize_row_q8_0};
use tessera_kernels::rope::{Rope, RopePairing, RopeScaling};

mod common;
mod fused_case;
mod gemv_case;
mod paged_case;
use paged_case::{GROUPED_TOLERANCE, PagedCase};

fn device() -> Option<CudaDevice> {
    if !driver_present() {
        assert!(
            std::env::var("TESSERA_REQUIRE_GPU").as_deref() != Ok("1"),
            "TESSERA_REQUIRE_GPU=1 but there is no CUDA driver"
        );
        eprintln!("SKIPPED: no CUDA driver");
        return None;
    }
    let dir = std::env::temp_dir().join("tessera-gpu-test-ptx");
    Some(CudaDevice::open(0, &PtxCache::new(dir)).unwrap_or_else(|e| panic!("{e}")))
}

fn ops(device: &CudaDevice) -> Ops<'_> {
    Ops::new(device, device.context().default_stream())
}

fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    let worst = common::within(what, got, want, rel);
    eprintln!(
        "{what}: {} values, worst relative error {worst:.2e} (allowed {rel:.0e})",
        got.len()
    );
}

#[test]
fn embedding_matches_the_table_rows() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(1);
    let (hidden, rows, start) = (96, 50, 100);
    let table = random(&mut rng, rows * hidden, 1.0);
    let ids: Vec<u32> = vec![100, 149, 7, 120, 150, 100];
    let mut out = ops.alloc::<f32>(ids.len() * hidden).unwrap();
    let table_dev = ops.upload(&to_bf16(&table)).unwrap();
    let ids_dev = ops.upload(&ids).unwrap();
    ops.embedding(&mut out, &table_dev, &ids_dev, hidden, start)
        .unwrap();
    let got = ops.download(&out).unwrap();
    let table = rounded(&table);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            let r = id.wrapping_sub(start) as usize;
            if r < rows {
                table[r * hidden..(r + 1) * hidden].to_vec()
            } else {
                vec![0.0; hidden]
            }
        })
        .collect();
    close("embedding", &got, &want, 0.0);
}

#[test]
fn rmsnorm_with_residual_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(2);
    let (hidden, tokens) = (576, 5);
    let x = random(&mut rng, hidden * tokens, 2.0);
    let residual = random(&mut rng, hidden * tokens, 2.0);
    let weight = random(&mut rng, hidden, 1.5);
    let mut out = ops.alloc::<f32>(hidden * tokens).unwrap();
    let mut res_dev = ops.upload(&residual).unwrap();
    let (x_dev, w_dev) = (ops.upload(&x).unwrap(), ops.upload(&weight).unwrap());
    ops.rmsnorm_residual(&mut out, &mut res_dev, Some(&x_dev), &w_dev, 1e-5)
        .unwrap();
    let (got, got_res) = (ops.download(&out).unwrap(), ops.download(&res_dev).unwrap());
    let mut want = vec![0.0; hidden * tokens];
    let mut want_res = residual.clone();
    for t in 0..tokens {
        let r = t * hidden..(t + 1) * hidden;
        tessera_kernels::norm::add_rms_norm(
            &mut want_res[r.clone()],
            &x[r.clone()],
            &weight,
            1e-5,
            &mut want[r],
        );
    }
    close("rmsnorm residual", &got_res, &want_res, 1e-6);
    close("rmsnorm out", &got, &want, 1e-5);
}

#[test]
fn rope_matches_the_cpu_for_both_pairings_and_llama3_scaling() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(3);
    let (hd, qh, kh) = (64, 9, 3);
    let positions: Vec<usize> = vec![0, 1, 17, 500, 8191];
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    for (pairing, code) in [(RopePairing::Halves, 0), (RopePairing::Interleaved, 1)] {
        let rope = Rope::new(hd, 500_000.0, &scaling, pairing);
        let q = random(&mut rng, positions.len() * qh * hd, 1.0);
        let k = random(&mut rng, positions.len() * kh * hd, 1.0);
        let (mut q_dev, mut k_dev) = (ops.upload(&q).unwrap(), ops.upload(&k).unwrap());
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let pos_dev = ops.upload(&pos).unwrap();
        let freq_dev = ops.upload(rope.inv_freq()).unwrap();
        ops.rope(&mut q_dev, &mut k_dev, &pos_dev, &freq_dev, qh, kh, code)
            .unwrap();
        let tables = rope.tables(&positions);
        let (mut want_q, mut want_k) = (q.clone(), k.clone());
        for t in 0..positions.len() {
            rope.apply(&tables, t, &mut want_q[t * qh * hd..(t + 1) * qh * hd]);
            rope.apply(&tables, t, &mut want_k[t * kh * hd..(t + 1) * kh * hd]);
        }
        // Angles up to ~8000 rad: sin/cos of f32 arguments differ in the last bits.
        close("rope q", &ops.download(&q_dev).unwrap(), &want_q, 1e-4);
        close("rope k", &ops.download(&k_dev).unwrap(), &want_k, 1e-4);
    }
}

#[test]
fn silu_mul_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(4);
    let (inter, tokens) = (1536, 3);
    let gate_up = random(&mut rng, 2 * inter * tokens, 6.0);
    let mut out = ops.alloc::<f32>(inter * tokens).unwrap();
    let gu_dev = ops.upload(&gate_up).unwrap();
    ops.silu_mul(&mut out, &gu_dev, inter).unwrap();
    let mut want = Vec::new();
    for t in gate_up.chunks(2 * inter) {
        let (mut g, u) = (t[..inter].to_vec(), &t[inter..]);
        tessera_kernels::activation::silu_mul(&mut g, u);
        want.extend(g);
    }
    close("silu_mul", &ops.download(&out).unwrap(), &want, 1e-5);
}

#[test]
fn bf16_rounding_and_bias_match_the_cpu() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(9);
    let x = random(&mut rng, 5000, 100.0);
    let x_dev = ops.upload(&x).unwrap();
    let mut bits = ops.alloc::<u16>(x.len()).unwrap();
    ops.round_bf16(&mut bits, &x_dev).unwrap();
    assert_eq!(
        ops.download(&bits).unwrap(),
        to_bf16(&x),
        "round to nearest even"
    );
    let bias = random(&mut rng, 40, 1.0);
    let mut y_dev = ops.upload(&x).unwrap();
    ops.add_bias(&mut y_dev, &ops.upload(&bias).unwrap())
        .unwrap();
    let want: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % 40])
        .collect();
    close("add_bias", &ops.download(&y_dev).unwrap(), &want, 0.0);
}

#[test]
fn cublas_bf16_gemm_matches_the_cpu_matmul() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let blas = tessera_kernels::cuda::Blas::new(0, ops.stream().clone()).unwrap();
    let mut rng = StdRng::seed_from_u64(10);
    let (rows, cols) = (300, 576);
    let w = rounded(&random(&mut rng, rows * cols, 1.0));
    for tokens in [1, 7, 64] {
        let x = rounded(&random(&mut rng, tokens * cols, 1.0));
        let mut y = ops.alloc::<f32>(tokens * rows).unwrap();
        let (w_dev, x_dev) = (
            ops.upload(&to_bf16(&w)).unwrap(),
            ops.upload(&to_bf16(&x)).unwrap(),
        );
        blas.gemm_bf16(&ops, &mut y, &w_dev, &x_dev, (rows, cols))
            .unwrap();
        let mut want = vec![0.0f32; tokens * rows];
        for (t, out) in want.chunks_mut(rows).enumerate() {
            for (r, o) in out.iter_mut().enumerate() {
                let dot: f64 = (0..cols)
                    .map(|c| f64::from(w[r * cols + c]) * f64::from(x[t * cols + c]))
                    .sum();
                *o = dot as f32;
            }
        }
        close("cublas bf16 gemm", &ops.download(&y).unwrap(), &want, 1e-4);
    }
}

#[test]
fn kv_write_and_paged_attention_match_the_cpu_over_partitions() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(5);
    let layout = KvLayout {
        block_size: 16,
        kv_heads: 3,
        head_dim: 64,
    };
    let (q_heads, blocks) = (9, 96);
    let width = layout.kv_heads * layout.head_dim;
    // Two sequences: 700 positions (three partitions) and 40; blocks shuffled.
    let lens = [700usize, 40];
    let max_blocks = 700usize.div_ceil(16);
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let mut tables = vec![0u32; 2 * max_blocks];
    let mut next = 0;
    for (s, &len) in lens.iter().enumerate() {
        for b in 0..len.div_ceil(16) {
            tables[s * max_blocks + b] = ids[next];
            next += 1;
        }
    }
    // Every position's K/V written through kv_write.
    let mut slots = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        for p in 0..len {
            let block = tables[s * max_blocks + p / 16] as i64;
            slots.push(block * 16 + (p % 16) as i64);
        }
    }
    let k = random(&mut rng, slots.len() * width, 1.0);
    let v = random(&mut rng, slots.len() * width, 1.0);
    let mut k_cache = ops.alloc::<u16>(blocks * layout.block_len()).unwrap();
    let mut v_cache = ops.alloc::<u16>(blocks * layout.block_len()).unwrap();
    let (k_dev, v_dev) = (ops.upload(&k).unwrap(), ops.upload(&v).unwrap());
    let dev_slots = ops.slots(&slots, blocks * layout.block_size).unwrap();
    ops.kv_write(
        &mut k_cache,
        &mut v_cache,
        &k_dev,
        &v_dev,
        &dev_slots,
        width,
    )
    .unwrap();
    let mut k_pool = vec![0.0f32; blocks * layout.block_len()];
    let mut v_pool = k_pool.clone();
    for (t, &slot) in slots.iter().enumerate() {
        let dst = slot as usize * width;
        k_pool[dst..dst + width].copy_from_slice(&rounded(&k[t * width..(t + 1) * width]));
        v_pool[dst..dst + width].copy_from_slice(&rounded(&v[t * width..(t + 1) * width]));
    }
    let cache_bits: Vec<u16> = ops.download(&k_cache).unwrap();
    let cache_f32: Vec<f32> = cache_bits
        .iter()
        .map(|&b| bf16::from_bits(b).to_f32())
        .collect();
    close("kv_write k", &cache_f32, &k_pool, 0.0);

    // Queries: a decode token of each sequence, and a causal chunk of sequence 0.
    let query_seq: Vec<u32> = vec![0, 1, 0, 0, 0];
    let contexts: Vec<u32> = vec![700, 40, 1, 257, 512];
    let q = random(&mut rng, query_seq.len() * q_heads * 64, 1.0);
    let q_dev = ops.upload(&q).unwrap();
    let rows: Vec<&[u32]> = query_seq
        .iter()
        .map(|&s| &tables[s as usize * max_blocks..(s as usize + 1) * max_blocks])
        .collect();
    let visible: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
    let kv = PagedKv {
        layout,
        k: &k_pool,
        v: &v_pool,
    };
    let mut want = vec![0.0; q.len()];
    paged_attention(
        &q,
        &kv,
        &rows,
        &visible,
        q_heads,
        &AttentionParams::causal(layout.head_dim),
        &mut want,
    );
    for kernel in AttentionKernel::ALL {
        let target = AttentionTarget {
            layout,
            cache_blocks: blocks,
            q_heads,
            kernel,
            partitions: None,
        };
        let mut out = ops.alloc::<f32>(q.len()).unwrap();
        let mut index = ops
            .attention_index(&tables, max_blocks, &query_seq, &contexts, target)
            .unwrap();
        ops.paged_attention(&mut out, &q_dev, (&k_cache, &v_cache), layout, &mut index)
            .unwrap();
        let what = format!("paged attention ({kernel})");
        close(&what, &ops.download(&out).unwrap(), &want, 1e-4);
    }
}

#[test]
fn grouped_attention_matches_the_cpu_for_each_group_head_size_and_split() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(11);
    // One batch of short and long contexts on both sides of the 16-position block edges
    // and of the partitions' (at least 64 positions, multiples of 16).
    let contexts: Vec<u32> = vec![1, 15, 16, 17, 255, 256, 257, 1000, 4097];
    let lens: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
    let query_seq: Vec<u32> = (0..contexts.len() as u32).collect();
    // 64 and 128 for real models; 16 and 32 are the fixtures' (the model's GPU tests).
    for head_dim in [16, 32, 64, 128] {
        for group in [1, 4, 8] {
            let layout = KvLayout {
                block_size: 16,
                kv_heads: 2,
                head_dim,
            };
            let q_heads = 2 * group;
            let case = PagedCase::new(&mut rng, layout, &lens);
            let q = random(&mut rng, contexts.len() * q_heads * head_dim, 1.0);
            let want = case.attend(&q, &query_seq, &contexts, q_heads);
            // Unsplit (the kernel writes the output), split as the device's multiprocessors
            // ask (18 pairs do not fill a GPU), and split 7 and 64 ways.
            for partitions in [Some(1), None, Some(7), Some(64)] {
                let target = case.target(q_heads, partitions);
                let mut index = case.index(&ops, &query_seq, &contexts, target);
                let what = format!(
                    "grouped attention, head_dim {head_dim}, {group} heads per KV head, {} \
                     partitions",
                    index.partitions()
                );
                close(
                    &what,
                    &case.run(&ops, &q, &mut index),
                    &want,
                    GROUPED_TOLERANCE,
                );
            }
        }
    }
}

#[test]
fn grouped_attention_serves_a_causal_chunk_and_a_refilled_index() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(12);
    let layout = KvLayout {
        block_size: 16,
        kv_heads: 2,
        head_dim: 128,
    };
    let q_heads = 8;
    let case = PagedCase::new(&mut rng, layout, &[1000, 300]);
    // Chunked prefill: positions 880..1000 of sequence 0, each seeing its position + 1,
    // beside a decode token of sequence 1.
    let mut query_seq: Vec<u32> = vec![0; 120];
    let mut contexts: Vec<u32> = (881..=1000).collect();
    query_seq.push(1);
    contexts.push(300);
    let q = random(&mut rng, query_seq.len() * q_heads * 128, 1.0);
    let want = case.attend(&q, &query_seq, &contexts, q_heads);
    for partitions in [None, Some(5)] {
        let target = case.target(q_heads, partitions);
        let mut index = case.index(&ops, &query_seq, &contexts, target);
        let what = format!("grouped causal chunk, {} partitions", index.partitions());
        close(
            &what,
            &case.run(&ops, &q, &mut index),
            &want,
            GROUPED_TOLERANCE,
        );
    }
    // A decode graph's index: made for the longest context, refilled with shorter ones
    // (each context picks its own partition length from the index's partitions).
    let decode_seq = [0u32, 1];
    let reach = (case.max_blocks * 16) as u32;
    let target = case.target(q_heads, None);
    let mut index = ops
        .attention_index(
            &case.tables,
            case.max_blocks,
            &decode_seq,
            &[reach; 2],
            target,
        )
        .unwrap();
    for contexts in [[1u32, 300], [999, 17], [1000, 64], [65, 299]] {
        ops.update_attention_index(&mut index, &case.tables, &contexts, 16)
            .unwrap();
        let q = random(&mut rng, 2 * q_heads * 128, 1.0);
        let want = case.attend(&q, &decode_seq, &contexts, q_heads);
        let what = format!(
            "grouped refilled {contexts:?}, {} partitions",
            index.partitions()
        );
        close(
            &what,
            &case.run(&ops, &q, &mut index),
            &want,
            GROUPED_TOLERANCE,
        );
    }
    // A shape the grouped kernel lacks is refused on the host.
    let odd = KvLayout {
        head_dim: 96,
        ..layout
    };
    let target = AttentionTarget {
        layout: odd,
        ..case.target(q_heads, None)
    };
    let err = ops
        .attention_index(&case.tables, case.max_blocks, &decode_seq, &[1, 1], target)
        .unwrap_err();
    assert!(err.to_string().contains("head_dim 96"), "{err}");
}

#[test]
fn quantized_matvecs_match_the_cpu_dot_products() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(6);
    let (rows, cols, tokens) = (37, 512, 3);
    let x = random(&mut rng, cols * tokens, 1.0);
    // Q8_0 from real quantization; Q4_K blocks of random quants with small scales.
    let dense = random(&mut rng, rows * cols, 1.0);
    let mut q8 = vec![0u8; rows * cols / 32 * 34];
    for (r, row) in dense.chunks(cols).enumerate() {
        let bytes = cols / 32 * 34;
        quantize_row_q8_0(row, &mut q8[r * bytes..(r + 1) * bytes]).unwrap();
    }
    let mut q4k = vec![0u8; rows * cols / 256 * 144];
    for block in q4k.chunks_mut(144) {
        rng.fill(&mut block[4..]);
        block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        block[2..4].copy_from_slice(&half::f16::from_f32(0.005).to_le_bytes());
    }
    // FP8: random codes (NaN ones cleared) under a different scale per block.
    let mut f8 = vec![0u8; rows * cols / 32 * 36];
    for block in f8.chunks_mut(36) {
        rng.fill(&mut block[4..]);
        fp8::make_finite(block, rng.random_range(0.001..0.01));
    }
    // Q5_0, Q5_K and Q6_K: random blocks under moderate scales.
    let q5_0 = common::random_rows(&mut rng, DType::Q5_0, rows, cols);
    let q5k = common::random_rows(&mut rng, DType::Q5K, rows, cols);
    let q6k = common::random_rows(&mut rng, DType::Q6K, rows, cols);
    let cases = [
        (DType::Q8_0, &q8),
        (DType::Q4K, &q4k),
        (DType::F8E4M3, &f8),
        (DType::Q5_0, &q5_0),
        (DType::Q5K, &q5k),
        (DType::Q6K, &q6k),
    ];
    for (dtype, w) in cases {
        let (w_dev, x_dev) = (ops.upload(w).unwrap(), ops.upload(&x).unwrap());
        let mut out = ops.alloc::<f32>(rows * tokens).unwrap();
        ops.matvec_quantized(&mut out, &w_dev, dtype, &x_dev, rows, cols)
            .unwrap();
        let bytes = w.len() / rows;
        let mut want = Vec::new();
        for t in 0..tokens {
            for r in 0..rows {
                let mut row = vec![0.0; cols];
                dequantize_row(dtype, &w[r * bytes..(r + 1) * bytes], &mut row).unwrap();
                let xt = &x[t * cols..(t + 1) * cols];
                want.push(row.iter().zip(xt).map(|(a, b)| a * b).sum::<f32>());
            }
        }
        close(
            &format!("matvec {dtype}"),
            &ops.download(&out).unwrap(),
            &want,
            1e-4,
        );
    }
}

#[test]
fn sampling_picks_the_cpu_twins_tokens() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(7);
    let (rows, vocab) = (200, 49_152);
    let mut logits = random(&mut rng, rows * vocab, 8.0);
    // Ties the rule must break by index: a row of one value, and rows with a repeated maximum.
    logits[..vocab].fill(0.25);
    for r in (1..rows).step_by(9) {
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row[vocab / 2] = max;
        row[vocab - 1] = max;
    }
    let draws: Vec<RowDraw> = (0..rows)
        .map(|i| RowDraw {
            params: ThresholdParams {
                temperature: [0.0, 0.7, 1.0, 1.3][i % 4],
                top_k: [0, 1, 40, 1000][i / 4 % 4],
                top_p: [1.0, 0.9, 0.5][i % 3],
                min_p: [0.0, 0.05][i % 2],
            },
            uniform: rng.random_range(0.0..1.0),
        })
        .collect();
    // The buffer holds more rows than are sampled, as a step's does.
    let logits_dev = ops
        .upload(&[logits.as_slice(), &[1.0; 3]].concat())
        .unwrap();
    let mut buffers = ops.sample_buffers(rows + 8).unwrap();
    ops.sample(&mut buffers, &logits_dev, vocab, &draws)
        .unwrap();
    let mut got = vec![0u32; rows];
    ops.sampled_tokens(&buffers, &mut got).unwrap();
    // The same float operations and integer sums: every row picks the twin's token.
    for (r, d) in draws.iter().enumerate() {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let want = sample_threshold(row, d.params, d.uniform);
        assert_eq!(got[r], want, "row {r}: {d:?}");
    }
    eprintln!("sampling: all {rows} rows pick the CPU twin's token");
}
