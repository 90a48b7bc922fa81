//! The kernels that read or write a table of bf16 or, on the exact path, f32 values
//! (`embedding.cu`'s gather, `kv_write.cu`'s cache write; each entry of both types) under
//! the CPU emulation, against what they must produce to the bit: the rank's rows of the
//! table widened to f32 (zeros for tokens outside them), and each token's K and V at its
//! slot, rounded to nearest even for bf16 and as they are for f32, nothing written for a
//! padding token.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use super::{compiled, drive, f32s, u16s};

#[test]
fn the_bf16_and_f32_table_kernels_emulated_gather_and_write_what_they_must() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("tables_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(67);
    // A rank's 11 vocabulary rows from id 5; 300 values a row, so a block's 256 threads
    // loop. Ids below, inside and past the rank's rows.
    let (hidden, rows, vocab_start) = (300usize, 11usize, 5u32);
    let ids = [0u32, 4, 5, 15, 16, 100, 9];
    let (kv_width, cache_slots) = (40usize, 8usize);
    let slots = [3i64, -1, 0, 7, 2, 5, 6];
    let tokens = ids.len();
    for f32_table in [false, true] {
        // Values with bits below bf16's, so that the f32 entries' keeping them shows.
        let mut values =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect() };
        let table = values(rows * hidden);
        let (k, v) = (values(tokens * kv_width), values(tokens * kv_width));
        let mut input = Vec::new();
        let head = [
            u32::from(f32_table),
            hidden as u32,
            rows as u32,
            vocab_start,
            tokens as u32,
            kv_width as u32,
            cache_slots as u32,
        ];
        head.iter().for_each(|w| input.extend(w.to_le_bytes()));
        let held = |x: f32| {
            if f32_table {
                x
            } else {
                bf16::from_f32(x).to_f32()
            }
        };
        for &x in &table {
            if f32_table {
                input.extend(x.to_le_bytes());
            } else {
                input.extend(bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        ids.iter().for_each(|w| input.extend(w.to_le_bytes()));
        k.iter()
            .chain(&v)
            .for_each(|x| input.extend(x.to_le_bytes()));
        slots.iter().for_each(|s| input.extend(s.to_le_bytes()));
        let bytes = drive(&exe, dir.path(), &input);
        let what = if f32_table { "f32" } else { "bf16" };
        let value_bytes = if f32_table { 4 } else { 2 };
        let cache_bytes = cache_slots * kv_width * value_bytes;
        assert_eq!(bytes.len(), tokens * hidden * 4 + 2 * cache_bytes, "{what}");
        let (gathered, caches) = bytes.split_at(tokens * hidden * 4);
        // The gather: each token's row, widened, or zeros outside the rank's rows.
        let mut want = Vec::with_capacity(tokens * hidden);
        for &id in &ids {
            let row = id.checked_sub(vocab_start).filter(|&r| (r as usize) < rows);
            match row {
                Some(r) => want.extend(
                    table[r as usize * hidden..][..hidden]
                        .iter()
                        .map(|&x| held(x)),
                ),
                None => want.extend(std::iter::repeat_n(0.0, hidden)),
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&f32s(gathered)), bits(&want), "{what} gather");
        // The caches: each token's K and V at its slot, all ones where nothing was written.
        for (c, (cache, src)) in caches.chunks(cache_bytes).zip([&k, &v]).enumerate() {
            let got: Vec<u32> = if f32_table {
                bits(&f32s(cache))
            } else {
                u16s(cache).iter().map(|&b| u32::from(b)).collect()
            };
            let ones = if f32_table { u32::MAX } else { 0xffff };
            let mut want = vec![ones; cache_slots * kv_width];
            for (t, &slot) in slots.iter().enumerate() {
                let Ok(slot) = usize::try_from(slot) else {
                    continue;
                };
                for i in 0..kv_width {
                    let x = src[t * kv_width + i];
                    want[slot * kv_width + i] = if f32_table {
                        x.to_bits()
                    } else {
                        u32::from(bf16::from_f32(x).to_bits())
                    };
                }
            }
            assert_eq!(got, want, "{what} {} cache", ["K", "V"][c]);
        }
        eprintln!("{what} tables: {tokens} rows gathered, {tokens} K/V rows written, to the bit");
    }
}
