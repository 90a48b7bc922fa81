//! Models: configuration, weight loading (HuggingFace safetensors and GGUF), tokenizer and
//! chat template, the Llama-family forward pass, and generation.
//!
//! - [`config`]: validated hyper-parameters from `config.json` or GGUF metadata.
//! - [`gguf`]: the GGUF v3 container: metadata and tensor directory, read with size limits.
//! - [`weights`], [`safetensors_source`], [`gguf_source`]: tensors by role, whatever the file.
//! - [`tokenizer`], [`chat`]: text ↔ token ids, and chat templates.
//! - [`kv_cache`]: the paged KV cache of one process.
//! - [`llama`]: the forward pass; [`generate`]: one-sequence generation.
//! - `cuda` (feature `cuda`): the same forward pass on a CUDA device; [`slice`](mod@slice): either,
//!   as a shard runs it; [`rows`]: what a pass gives back for the rows that want logits
//!   (logits, or a token sampled on the device).
//! - [`launch_plan`]: the kernel launches of one decoder layer on a device, as data the
//!   CUDA pass runs and tests count without a GPU.
//! - [`loader`]: a model path → weights + tokenizer + chat template.

#![forbid(unsafe_code)]

mod batch;
pub mod chat;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod gguf_source;
pub mod kv_cache;
pub mod launch_plan;
pub mod llama;
pub mod loader;
pub mod rows;
pub mod safetensors_source;
pub mod slice;
pub mod tokenizer;
pub mod weights;

pub use config::ModelConfig;
pub use error::ModelError;
