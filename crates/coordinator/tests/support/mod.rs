//! What the coordinator's integration tests share beyond `common` (the API's mock engine).

// Each test binary uses part of the harness.
#[allow(dead_code)]
pub mod peers;
