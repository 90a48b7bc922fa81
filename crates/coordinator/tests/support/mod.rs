//! What the coordinator's integration tests share beyond `common` (the API's mock engine).
pub mod peers;
