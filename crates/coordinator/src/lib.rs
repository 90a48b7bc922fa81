//! The coordinator: Raft-replicated owner of the cluster.
//!
//! It will hold the Raft log and state machine, the per-group schedulers, the router, the
//! tokenizer and the OpenAI-compatible HTTP API. It is empty until the serving work lands;
//! see ARCHITECTURE.md, "Coordinator" and "HTTP API".
