//! GGML block-quantized formats.
