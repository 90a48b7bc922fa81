//! Wire protocol, control plane and collectives between Tessera processes.
//!
//! This crate will own the versioned control-message enums (bincode with explicit size
//! limits), the QUIC endpoints with mutual TLS, and the `Collective` trait with its CPU
//! (shared memory, TCP ring) and NCCL backends. It is empty until the tensor-parallel
//! work lands; see ARCHITECTURE.md, "Control protocol" and "Collectives".
