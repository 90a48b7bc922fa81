//! The coordinator (being written).

pub mod api;
pub mod engine;
