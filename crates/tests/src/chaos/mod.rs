//! A chaos and soak harness (crates/tests/tests/chaos.rs, `scripts/chaos.sh`): a seeded
//! fault schedule, the mixed load of clients that retry and resume, and the ledger of how
//! every request ended.

pub mod client;
pub mod ledger;
pub mod schedule;
