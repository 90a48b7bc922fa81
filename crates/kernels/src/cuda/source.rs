//! The kernel families: one CUDA C file each, compiled with [`PRELUDE`] in front (shared
//! types and block reductions), so that no CUDA header is needed where they compile.

/// Shared by every family: bf16/f16 conversions, warp and block reductions.
pub const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// One `.cu` file and the `extern "C"` kernels it must define.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFamily {
    pub file: &'static str,
    pub code: &'static str,
    pub entries: &'static [&'static str],
}

impl KernelFamily {
    /// What NVRTC compiles: the prelude, then the file.
    pub fn full_source(&self) -> String {
        format!("{PRELUDE}\n// ---- {}\n{}", self.file, self.code)
    }
}

macro_rules! family {
    ($file:literal, [$($entry:literal),+ $(,)?]) => {
        family!($file, &[$($entry),+])
    };
    ($file:literal, $entries:expr) => {
        KernelFamily {
            file: $file,
            code: include_str!(concat!("../../cuda/", $file)),
            entries: $entries,
        }
    };
}

/// Every kernel family of a decoder step.
pub const FAMILIES: &[KernelFamily] = &[
    family!(
        "embedding.cu",
        ["embedding_gather_bf16", "embedding_gather_f32"]
    ),
    family!(
        "rmsnorm.cu",
        ["rmsnorm_residual_f32", "rmsnorm_residual_bf16"]
    ),
    family!("rope.cu", ["rope_f32"]),
    family!("rope_kv.cu", ["rope_kv_write"]),
    family!("activation.cu", ["silu_mul_f32", "silu_mul_bf16"]),
    family!("linear.cu", ["round_bf16", "add_bias_f32"]),
    family!("kv_write.cu", ["kv_write_bf16", "kv_write_f32"]),
    family!(
        "attention.cu",
        [
            "paged_attention_partition",
            "paged_attention_partition_f32",
            "paged_attention_reduce",
        ]
    ),
    family!(
        "attention_grouped.cu",
        [
            "attention_grouped_d16_g1",
            "attention_grouped_d16_g2",
            "attention_grouped_d16_g4",
            "attention_grouped_d16_g8",
            "attention_grouped_d32_g1",
            "attention_grouped_d32_g2",
            "attention_grouped_d32_g4",
            "attention_grouped_d32_g8",
            "attention_grouped_d64_g1",
            "attention_grouped_d64_g2",
            "attention_grouped_d64_g4",
            "attention_grouped_d64_g8",
            "attention_grouped_d128_g1",
            "attention_grouped_d128_g2",
            "attention_grouped_d128_g4",
            "attention_grouped_d128_g8",
            "attention_grouped_reduce",
        ]
    ),
    family!(
        "attention_flash.cu",
        [
            "attention_flash_d16",
            "attention_flash_d32",
            "attention_flash_d64",
            "attention_flash_d128",
        ]
    ),
    family!(
        "dequant_matmul.cu",
        [
            "matvec_q8_0",
            "matvec_q5_0",
            "matvec_q4_k",
            "matvec_q5_k",
            "matvec_q6_k",
            "matvec_f8_e4m3",
        ]
    ),
    family!("gemv.cu", &super::ops::gemv::GEMV_ENTRIES),
    family!("sampling.cu", ["sample_rows"]),
];

/// The family that defines kernel `entry`.
pub fn family_of(entry: &str) -> Option<&'static KernelFamily> {
    FAMILIES.iter().find(|f| f.entries.contains(&entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_defined_once_in_its_file() {
        let mut seen = std::collections::HashSet::new();
        for family in FAMILIES {
            for entry in family.entries {
                assert!(seen.insert(*entry), "{entry} in two families");
                let definition = format!(" void {entry}(");
                assert!(family.code.contains("__global__"), "{}", family.file);
                assert_eq!(
                    family.code.matches(&definition).count(),
                    1,
                    "{}: {entry}",
                    family.file
                );
                assert_eq!(family_of(entry), Some(family));
                assert!(
                    super::super::ops::block_threads(entry).is_some(),
                    "{entry}: no launch size"
                );
            }
        }
        // Every file of the directory is a family (none forgotten).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        files.sort();
        let mut listed: Vec<&str> = FAMILIES.iter().map(|f| f.file).collect();
        listed.sort();
        assert_eq!(files, listed);
    }

    /// `DType::cuda_matvec` (the types a cuda shard keeps quantized) names exactly the
    /// entries of `dequant_matmul.cu`.
    #[test]
    fn every_matvec_entry_is_a_types_and_every_types_is_defined() {
        let family = family_of("matvec_q8_0").expect("dequant_matmul.cu");
        let mut named: Vec<&str> = crate::DType::ALL
            .iter()
            .filter_map(|d| d.cuda_matvec())
            .collect();
        named.sort();
        let mut entries = family.entries.to_vec();
        entries.sort();
        assert_eq!(named, entries);
    }
}
