//! The shard process: one rank of a tensor-parallel group.
//!
//! A shard will register with the coordinator, load only its slice of the weights, join its
//! group's collective, own its paged KV cache and execute step plans. It is empty until the
//! tensor-parallel work lands; see ARCHITECTURE.md, "Shard: step loop and block allocator".
