//! Models: configuration, weight loading (HuggingFace safetensors and GGUF), tokenizer and
//! chat template, the Llama-family forward pass, and generation.
//!
//! - [`gguf`]: the GGUF v3 container: metadata and tensor directory, read with size limits.
pub mod gguf;
