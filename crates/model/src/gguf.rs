//! GGUF v3 reader (to be written).
