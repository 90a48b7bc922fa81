use protobuf::Message as _;
use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, Storage, StorageError};

use super::LogStore;

fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: format!("entry {index} of term {term}").into_bytes().into(),
        ..Entry::default()
    }
}

fn hard_state(term: u64, vote: u64, commit: u64) -> HardState {
    HardState {
        term,
        vote,
        commit,
        ..HardState::default()
    }
}

fn read(store: &LogStore, low: u64, high: u64, max: Option<u64>) -> raft::Result<Vec<Entry>> {
    store.entries(low, high, max, GetEntriesContext::empty(false))
}

fn indexes_and_terms(entries: &[Entry]) -> Vec<(u64, u64)> {
    entries.iter().map(|e| (e.index, e.term)).collect()
}

fn compacted<T: std::fmt::Debug>(result: raft::Result<T>) -> bool {
    matches!(result, Err(raft::Error::Store(StorageError::Compacted)))
}

#[test]
fn a_new_store_is_empty_and_uninitialized() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(&dir.path().join("raft.redb")).unwrap();
    assert_eq!(store.first_index().unwrap(), 1);
    assert_eq!(store.last_index().unwrap(), 0);
    assert_eq!(store.term(0).unwrap(), 0);
    assert!(!store.initial_state().unwrap().initialized());
    assert!(read(&store, 1, 1, None).unwrap().is_empty());
}

#[test]
fn appended_entries_and_hard_state_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft.redb");
    {
        let store = LogStore::open(&path).unwrap();
        let entries: Vec<Entry> = [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)]
            .into_iter()
            .map(|(i, t)| entry(i, t))
            .collect();
        store.persist(&entries, Some(&hard_state(3, 2, 4))).unwrap();
        let voters = ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        };
        store.set_conf_state(&voters).unwrap();
    }
    let store = LogStore::open(&path).unwrap();
    assert_eq!(
        (store.first_index().unwrap(), store.last_index().unwrap()),
        (1, 5)
    );
    let state = store.initial_state().unwrap();
    assert_eq!(state.hard_state, hard_state(3, 2, 4));
    assert_eq!(state.conf_state.voters, [1, 2, 3]);
    let got = read(&store, 2, 5, None).unwrap();
    assert_eq!(indexes_and_terms(&got), [(2, 1), (3, 2), (4, 2)]);
    assert_eq!(got[0], entry(2, 1), "entries round-trip whole");
    assert_eq!(store.term(3).unwrap(), 2);
    // A size limit still returns at least one entry.
    assert_eq!(read(&store, 2, 5, Some(1)).unwrap().len(), 1);
    // The limit counts encoded bytes, as raft-rs does.
    let two = u64::from(got[0].compute_size() + got[1].compute_size());
    assert_eq!(read(&store, 2, 5, Some(two)).unwrap().len(), 2);
    assert!(store.term(6).is_err());
}

#[test]
fn a_conflicting_append_replaces_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(&dir.path().join("raft.redb")).unwrap();
    let first: Vec<Entry> = (1..=5).map(|i| entry(i, 1)).collect();
    store.persist(&first, None).unwrap();
    // A new leader of term 2 overwrote index 3 on: 4 and 5 are gone.
    store.persist(&[entry(3, 2)], None).unwrap();
    assert_eq!(store.last_index().unwrap(), 3);
    let got = read(&store, 1, 4, None).unwrap();
    assert_eq!(indexes_and_terms(&got), [(1, 1), (2, 1), (3, 2)]);
    assert!(
        read(&store, 1, 6, None).is_err(),
        "nothing past the new tail"
    );
    store.persist(&[entry(4, 2), entry(5, 2)], None).unwrap();
    assert_eq!(store.last_index().unwrap(), 5);
}

#[test]
fn compaction_keeps_the_snapshot_and_the_entries_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft.redb");
    {
        let store = LogStore::open(&path).unwrap();
        let entries: Vec<Entry> = (1..=6).map(|i| entry(i, 1 + i / 3)).collect();
        store.persist(&entries, Some(&hard_state(3, 1, 6))).unwrap();
        store.compact(4, b"state at 4".to_vec()).unwrap();
    }
    let store = LogStore::open(&path).unwrap();
    assert_eq!(
        (store.first_index().unwrap(), store.last_index().unwrap()),
        (5, 6)
    );
    assert_eq!(
        store.term(4).unwrap(),
        2,
        "the snapshot keeps its index's term"
    );
    assert!(compacted(store.term(3)));
    assert!(compacted(read(&store, 4, 6, None)));
    assert_eq!(
        indexes_and_terms(&read(&store, 5, 7, None).unwrap()),
        [(5, 2), (6, 3)]
    );
    let snapshot = store.snapshot(0, 2).unwrap();
    assert_eq!(snapshot.get_metadata().index, 4);
    assert_eq!(&snapshot.data[..], b"state at 4");
    assert!(store.snapshot(5, 2).is_err(), "no snapshot that new yet");
    // Compacting to an older index changes nothing.
    store.compact(2, b"older".to_vec()).unwrap();
    assert_eq!(&store.snapshot(0, 2).unwrap().data[..], b"state at 4");
}

#[test]
fn an_installed_snapshot_restarts_the_log_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft.redb");
    {
        let store = LogStore::open(&path).unwrap();
        store
            .persist(&[entry(1, 1), entry(2, 1)], Some(&hard_state(1, 1, 2)))
            .unwrap();
        let mut snapshot = Snapshot {
            data: b"leader's state".to_vec().into(),
            ..Snapshot::default()
        };
        let meta = snapshot.mut_metadata();
        meta.index = 10;
        meta.term = 5;
        meta.mut_conf_state().voters = vec![1, 2, 3];
        store.apply_snapshot(&snapshot).unwrap();
    }
    let store = LogStore::open(&path).unwrap();
    assert_eq!(
        (store.first_index().unwrap(), store.last_index().unwrap()),
        (11, 10)
    );
    assert_eq!(store.term(10).unwrap(), 5);
    let state = store.initial_state().unwrap();
    assert_eq!((state.hard_state.term, state.hard_state.commit), (5, 10));
    assert_eq!(state.conf_state.voters, [1, 2, 3]);
    store.persist(&[entry(11, 5)], None).unwrap();
    assert_eq!(
        indexes_and_terms(&read(&store, 11, 12, None).unwrap()),
        [(11, 5)]
    );
}
