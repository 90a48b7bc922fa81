//! Any bytes given to `ClusterState::restore` (a snapshot from the leader or the disk)
//! give a state or an error, never a panic; a restored state's snapshot restores to a
//! state with the same snapshot bytes (compared as bytes: a request's sampling may hold a
//! NaN) and the same journal accounting, recomputed rather than taken from the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_coordinator::replication::state::ClusterState;

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = ClusterState::restore(data) {
        let bytes = state.snapshot().expect("a restored state snapshots");
        let again = ClusterState::restore(&bytes).expect("its snapshot restores");
        assert_eq!(again.snapshot().expect("snapshots again"), bytes);
        assert_eq!(again.journal_usage(), state.journal_usage());
    }
});
