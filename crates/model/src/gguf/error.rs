//! Errors of the GGUF reader. Every variant names the file; errors about one tensor name the
//! tensor, errors about one metadata entry name the key (or, for a key whose name could not be
//! read, its index).

use std::path::PathBuf;

use tessera_kernels::DType;

/// The names of the GGML types Tessera reads, for error messages.
pub const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS";

/// A GGUF file could not be opened, or a part of it is malformed or not supported.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file: it starts with bytes {found:02x?}, not \"GGUF\"")]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{path}: GGUF version {version} is not supported; supported: 2, 3")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: big-endian GGUF (version {version} read byte-swapped) is not supported")]
    BigEndian { path: PathBuf, version: u32 },
    #[error(
        "{path}: the file ends while reading {what}: {needed} bytes needed at offset {offset}, \
         the file has {file_bytes}"
    )]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_bytes: u64,
    },
    #[error("{path}: {what} is {value}, over the limit of {limit}")]
    LimitExceeded {
        path: PathBuf,
        what: String,
        value: u64,
        limit: u64,
    },
    #[error(
        "{path}: {what} is {count}, but the {remaining_bytes} bytes left in the file hold at \
         most {fits} of them"
    )]
    CountTooLarge {
        path: PathBuf,
        what: String,
        count: u64,
        remaining_bytes: u64,
        fits: u64,
    },
    #[error("{path}: {what} is not valid UTF-8")]
    InvalidUtf8 { path: PathBuf, what: String },
    #[error("{path}: metadata key {key} has unknown value type {type_id}")]
    UnknownValueType {
        path: PathBuf,
        key: String,
        type_id: u32,
    },
    #[error("{path}: metadata key {key} holds the bool byte {value}, expected 0 or 1")]
    InvalidBool {
        path: PathBuf,
        key: String,
        value: u8,
    },
    #[error("{path}: metadata key {key} nests arrays deeper than {max} levels")]
    NestingTooDeep {
        path: PathBuf,
        key: String,
        max: usize,
    },
    #[error("{path}: metadata key {key} appears twice")]
    DuplicateKey { path: PathBuf, key: String },
    #[error("{path}: metadata key {key} is {found}, expected {expected}")]
    WrongType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: metadata key {key} = {value} does not fit in {target}")]
    OutOfRange {
        path: PathBuf,
        key: String,
        value: String,
        target: &'static str,
    },
    #[error("{path}: metadata key general.alignment = {alignment} is not a power of two")]
    BadAlignment { path: PathBuf, alignment: u64 },
    #[error("{path}: tensor {tensor} appears twice")]
    DuplicateTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor} has {n_dims} dimensions, expected 1 to {max}")]
    TensorRank {
        path: PathBuf,
        tensor: String,
        n_dims: u32,
        max: u32,
    },
    #[error("{path}: tensor {tensor} has dimensions {dims:?}, too many elements or bytes")]
    TensorTooLarge {
        path: PathBuf,
        tensor: String,
        dims: Vec<u64>,
    },
    #[error(
        "{path}: tensor {tensor} has GGML type {type_id} ({type_name}), which Tessera does not \
         support; supported: {SUPPORTED_TYPES}"
    )]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
        type_name: &'static str,
    },
    #[error(
        "{path}: tensor {tensor} has rows of {cols} {dtype} values, not a whole number of \
         {block_elems}-value blocks"
    )]
    PartialBlock {
        path: PathBuf,
        tensor: String,
        dtype: DType,
        cols: u64,
        block_elems: usize,
    },
    #[error(
        "{path}: tensor {tensor} has data offset {offset}, not a multiple of the alignment \
         {alignment}"
    )]
    MisalignedTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "{path}: tensor {tensor} occupies bytes {start}..{end}, past the end of the file at \
         {file_bytes}"
    )]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_bytes: u64,
    },
    #[error("{path}: tensor {tensor} has {rows} rows, rows {start}..{end} were asked for")]
    RowRange {
        path: PathBuf,
        tensor: String,
        start: usize,
        end: usize,
        rows: usize,
    },
}

/// The name GGML gives type id `id`, or `"unknown"`: for error messages only.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 42] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "NVFP4",
        "Q1_0",
    ];
    usize::try_from(id)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_list_matches_dtype() {
        let names: Vec<&str> = DType::GGML.iter().map(|d| d.name()).collect();
        assert_eq!(SUPPORTED_TYPES, names.join(", "));
    }

    #[test]
    fn type_names_agree_with_dtype_ids() {
        for d in DType::GGML {
            assert_eq!(ggml_type_name(d.ggml_id().unwrap()), d.name());
        }
        assert_eq!(ggml_type_name(16), "IQ2_XXS");
        assert_eq!(ggml_type_name(1000), "unknown");
    }

    #[test]
    fn unsupported_type_message_names_everything() {
        let err = GgufError::UnsupportedType {
            path: "m.gguf".into(),
            tensor: "blk.0.ffn_up.weight".into(),
            type_id: 16,
            type_name: ggml_type_name(16),
        };
        assert_eq!(
            err.to_string(),
            "m.gguf: tensor blk.0.ffn_up.weight has GGML type 16 (IQ2_XXS), which Tessera does \
             not support; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1, \
             Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS"
        );
    }
}
