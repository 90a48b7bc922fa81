//! End-to-end tests that start the real Tessera binaries (`tessera`, and later
//! `tessera-shard` and `tessera-coordinator`) and check what a user sees.
//!
//! The tests live in `tests/`; this library only holds what they share.
