//! The Raft log, hard state and latest snapshot of one coordinator peer, on disk.
//!
//! The store is [redb]: a pure-Rust, single-file, ACID embedded database with copy-on-write
//! B-trees. Each write transaction is made durable at commit (fsync, its default
//! `Durability::Immediate`), so what [`LogStore::persist`] returns from survives a crash or
//! a power cut, and a torn write can never be read back as a half-appended log. It needs no
//! C toolchain (unlike RocksDB), keeps one file per peer, and is actively maintained;
//! TiKV's raft-engine is tuned for thousands of Raft groups per process, where Tessera has
//! one small group.
//!
//! Layout: table `entries` maps a log index to its protobuf-encoded [`Entry`]; table `meta`
//! holds the [`HardState`], the [`ConfState`] and the latest [`Snapshot`] (metadata and the
//! state machine's bytes). Entries before the snapshot are deleted by [`LogStore::compact`].
//!
//! [`Storage`] reads go to a small in-memory mirror of the metadata and to redb for entries;
//! writes go to redb first and to the mirror after the commit.

use std::path::Path;
use std::sync::{Arc, RwLock};

use protobuf::Message as _;
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

const ENTRIES: TableDefinition<'static, u64, &[u8]> = TableDefinition::new("entries");
const META: TableDefinition<'static, &str, &[u8]> = TableDefinition::new("meta");
const HARD_STATE: &str = "hard_state";
const CONF_STATE: &str = "conf_state";
const SNAPSHOT: &str = "snapshot";

/// Why the store failed: the disk, or bytes on it that do not decode.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("raft store {path}: {source}")]
    Db {
        path: String,
        #[source]
        source: Box<redb::Error>,
    },
    /// The disk refused a write (full, say).
    #[error("raft store {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("raft store {path}: a stored {what} does not decode: {source}")]
    Corrupt {
        path: String,
        what: &'static str,
        #[source]
        source: protobuf::ProtobufError,
    },
}

/// What the metadata reads answer from memory.
#[derive(Clone, Debug, Default)]
struct Mirror {
    hard_state: HardState,
    conf_state: ConfState,
    /// Index and term of the latest snapshot (0 and 0 before the first).
    snapshot: SnapshotMetadata,
    /// The last index of the log (the snapshot's index when the log is empty).
    last_index: u64,
}

/// A peer's Raft storage; clones share it.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
    path: Arc<str>,
    mirror: Arc<RwLock<Mirror>>,
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("path", &self.path)
            .field("mirror", &*self.mirror.read().expect("mirror lock"))
            .finish()
    }
}

impl LogStore {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<LogStore, StoreError> {
        let name: Arc<str> = path.display().to_string().into();
        let db = Database::create(path).map_err(|e| StoreError::Db {
            path: name.to_string(),
            source: Box::new(e.into()),
        })?;
        LogStore::with_database(db, name)
    }

    /// A store in memory, named `name` in errors: what a simulated peer keeps across its
    /// simulated crashes (the same code as on disk, without the disk).
    pub fn in_memory(name: &str) -> Result<LogStore, StoreError> {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|e| StoreError::Db {
                path: name.to_owned(),
                source: Box::new(e.into()),
            })?;
        LogStore::with_database(db, name.into())
    }

    fn with_database(db: Database, name: Arc<str>) -> Result<LogStore, StoreError> {
        let db_err = |e: redb::Error| StoreError::Db {
            path: name.to_string(),
            source: Box::new(e),
        };
        // Create both tables, so that reads never meet a missing one.
        let txn = db.begin_write().map_err(|e| db_err(e.into()))?;
        txn.open_table(ENTRIES).map_err(|e| db_err(e.into()))?;
        txn.open_table(META).map_err(|e| db_err(e.into()))?;
        txn.commit().map_err(|e| db_err(e.into()))?;
        let store = LogStore {
            db: Arc::new(db),
            path: name,
            mirror: Arc::default(),
        };
        let mirror = store.load()?;
        *store.mirror.write().expect("mirror lock") = mirror;
        Ok(store)
    }

    fn db_error(&self, error: impl Into<redb::Error>) -> StoreError {
        StoreError::Db {
            path: self.path.to_string(),
            source: Box::new(error.into()),
        }
    }

    fn corrupt(&self, what: &'static str, source: protobuf::ProtobufError) -> StoreError {
        StoreError::Corrupt {
            path: self.path.to_string(),
            what,
            source,
        }
    }

    /// Reads the metadata from disk.
    fn load(&self) -> Result<Mirror, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.db_error(e))?;
        let meta = txn.open_table(META).map_err(|e| self.db_error(e))?;
        let mut mirror = Mirror::default();
        if let Some(bytes) = meta.get(HARD_STATE).map_err(|e| self.db_error(e))? {
            mirror.hard_state = HardState::parse_from_bytes(bytes.value())
                .map_err(|e| self.corrupt("hard state", e))?;
        }
        if let Some(bytes) = meta.get(CONF_STATE).map_err(|e| self.db_error(e))? {
            mirror.conf_state = ConfState::parse_from_bytes(bytes.value())
                .map_err(|e| self.corrupt("configuration", e))?;
        }
        if let Some(bytes) = meta.get(SNAPSHOT).map_err(|e| self.db_error(e))? {
            let snapshot = Snapshot::parse_from_bytes(bytes.value())
                .map_err(|e| self.corrupt("snapshot", e))?;
            mirror.snapshot = snapshot.get_metadata().clone();
        }
        let entries = txn.open_table(ENTRIES).map_err(|e| self.db_error(e))?;
        let last = entries.last().map_err(|e| self.db_error(e))?;
        mirror.last_index = last.map_or(mirror.snapshot.index, |(k, _)| k.value());
        Ok(mirror)
    }
}

impl LogStore {
    /// The voters of the configuration this store holds (none before the first).
    pub fn voters(&self) -> Vec<tessera_topology::PeerId> {
        let mirror = self.mirror.read().expect("mirror lock");
        let voters = mirror.conf_state.voters.iter();
        voters.map(|&v| tessera_topology::PeerId(v)).collect()
    }

    /// Appends `entries` (replacing any entries from the first one's index on, which a new
    /// leader overwrote) and records `hard_state`, in one durable transaction.
    pub fn persist(
        &self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), StoreError> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        // A full disk, for the tests of what a peer does then (feature `failpoints`).
        fail::fail_point!("store::persist", |_| Err(StoreError::Io {
            path: self.path.to_string(),
            source: std::io::Error::from_raw_os_error(28),
        }));
        let txn = self.db.begin_write().map_err(|e| self.db_error(e))?;
        {
            let mut table = txn.open_table(ENTRIES).map_err(|e| self.db_error(e))?;
            if let Some(first) = entries.first() {
                // Everything from the first new index on is replaced.
                table
                    .retain_in(first.index.., |_, _| false)
                    .map_err(|e| self.db_error(e))?;
            }
            for entry in entries {
                let bytes = entry
                    .write_to_bytes()
                    .map_err(|e| self.corrupt("entry", e))?;
                table
                    .insert(entry.index, bytes.as_slice())
                    .map_err(|e| self.db_error(e))?;
            }
            if let Some(hs) = hard_state {
                let mut meta = txn.open_table(META).map_err(|e| self.db_error(e))?;
                let bytes = hs
                    .write_to_bytes()
                    .map_err(|e| self.corrupt("hard state", e))?;
                meta.insert(HARD_STATE, bytes.as_slice())
                    .map_err(|e| self.db_error(e))?;
            }
        }
        txn.commit().map_err(|e| self.db_error(e))?;
        let mut mirror = self.mirror.write().expect("mirror lock");
        if let Some(last) = entries.last() {
            mirror.last_index = last.index;
        }
        if let Some(hs) = hard_state {
            mirror.hard_state = hs.clone();
        }
        Ok(())
    }

    /// Records the commit index alone (a `LightReady`'s) in memory; it reaches the disk
    /// with the next write. Nothing is lost when a crash comes first: the committed
    /// entries are on disk, and a restarted peer learns the commit index from the leader
    /// (or, alone, commits them again in its next term).
    pub fn set_commit(&self, commit: u64) {
        let mut mirror = self.mirror.write().expect("mirror lock");
        mirror.hard_state.commit = mirror.hard_state.commit.max(commit);
    }

    /// Records a membership change.
    pub fn set_conf_state(&self, conf_state: &ConfState) -> Result<(), StoreError> {
        let bytes = conf_state
            .write_to_bytes()
            .map_err(|e| self.corrupt("configuration", e))?;
        let txn = self.db.begin_write().map_err(|e| self.db_error(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.db_error(e))?;
            meta.insert(CONF_STATE, bytes.as_slice())
                .map_err(|e| self.db_error(e))?;
        }
        txn.commit().map_err(|e| self.db_error(e))?;
        self.mirror.write().expect("mirror lock").conf_state = conf_state.clone();
        Ok(())
    }

    /// Installs a snapshot received from the leader: the log restarts after it.
    pub fn apply_snapshot(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        let meta_of = snapshot.get_metadata();
        let mut mirror = self.mirror.read().expect("mirror lock").clone();
        mirror.hard_state.term = mirror.hard_state.term.max(meta_of.term);
        mirror.hard_state.commit = mirror.hard_state.commit.max(meta_of.index);
        mirror.conf_state = meta_of.get_conf_state().clone();
        mirror.snapshot = meta_of.clone();
        mirror.last_index = meta_of.index;
        self.write_snapshot(snapshot, &mirror, None)
    }

    /// Replaces the log up to `index` (applied by this peer) with a snapshot of the state
    /// machine, `data`.
    pub fn compact(&self, index: u64, data: Vec<u8>) -> Result<(), StoreError> {
        let mut mirror = self.mirror.read().expect("mirror lock").clone();
        if index <= mirror.snapshot.index {
            return Ok(());
        }
        let term = self.term(index).map_err(|e| StoreError::Db {
            path: self.path.to_string(),
            source: Box::new(redb::Error::Corrupted(format!(
                "no term for applied index {index}: {e}"
            ))),
        })?;
        let mut snapshot = Snapshot::default();
        snapshot.set_data(data.into());
        let meta = snapshot.mut_metadata();
        meta.index = index;
        meta.term = term;
        meta.set_conf_state(mirror.conf_state.clone());
        mirror.snapshot = meta.clone();
        self.write_snapshot(&snapshot, &mirror, Some(index))
    }

    /// Stores `snapshot` and `mirror`'s states; deletes entries up to `through` (all of
    /// them when `None`).
    fn write_snapshot(
        &self,
        snapshot: &Snapshot,
        mirror: &Mirror,
        through: Option<u64>,
    ) -> Result<(), StoreError> {
        let bytes = snapshot
            .write_to_bytes()
            .map_err(|e| self.corrupt("snapshot", e))?;
        let hs = mirror
            .hard_state
            .write_to_bytes()
            .map_err(|e| self.corrupt("hard state", e))?;
        let cs = mirror
            .conf_state
            .write_to_bytes()
            .map_err(|e| self.corrupt("configuration", e))?;
        let txn = self.db.begin_write().map_err(|e| self.db_error(e))?;
        {
            let mut entries = txn.open_table(ENTRIES).map_err(|e| self.db_error(e))?;
            match through {
                Some(index) => entries.retain_in(..=index, |_, _| false),
                None => entries.retain(|_, _| false),
            }
            .map_err(|e| self.db_error(e))?;
            let mut meta = txn.open_table(META).map_err(|e| self.db_error(e))?;
            meta.insert(SNAPSHOT, bytes.as_slice())
                .map_err(|e| self.db_error(e))?;
            meta.insert(HARD_STATE, hs.as_slice())
                .map_err(|e| self.db_error(e))?;
            meta.insert(CONF_STATE, cs.as_slice())
                .map_err(|e| self.db_error(e))?;
        }
        txn.commit().map_err(|e| self.db_error(e))?;
        *self.mirror.write().expect("mirror lock") = mirror.clone();
        Ok(())
    }
}

/// A store failure as raft-rs reports it: the peer stops taking part until restarted.
fn raft_error(error: StoreError) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(error)))
}

impl Storage for LogStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let mirror = self.mirror.read().expect("mirror lock");
        Ok(RaftState::new(
            mirror.hard_state.clone(),
            mirror.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let (first, last) = {
            let mirror = self.mirror.read().expect("mirror lock");
            (mirror.snapshot.index + 1, mirror.last_index)
        };
        if low < first {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > last + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let max_size = max_size.into().unwrap_or(u64::MAX);
        let txn = self
            .db
            .begin_read()
            .map_err(|e| raft_error(self.db_error(e)))?;
        let table = txn
            .open_table(ENTRIES)
            .map_err(|e| raft_error(self.db_error(e)))?;
        let mut out = Vec::with_capacity((high - low) as usize);
        let mut size = 0u64;
        for row in table
            .range(low..high)
            .map_err(|e| raft_error(self.db_error(e)))?
        {
            let (_, bytes) = row.map_err(|e| raft_error(self.db_error(e)))?;
            let bytes = bytes.value();
            size += bytes.len() as u64;
            // At least one entry, then only while under the limit (raft-rs's rule).
            if !out.is_empty() && size > max_size {
                break;
            }
            let entry =
                Entry::parse_from_bytes(bytes).map_err(|e| raft_error(self.corrupt("entry", e)))?;
            out.push(entry);
        }
        if out.is_empty() && low < high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let (snapshot, last) = {
            let mirror = self.mirror.read().expect("mirror lock");
            (mirror.snapshot.clone(), mirror.last_index)
        };
        if idx == snapshot.index {
            return Ok(snapshot.term);
        }
        if idx < snapshot.index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > last {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let txn = self
            .db
            .begin_read()
            .map_err(|e| raft_error(self.db_error(e)))?;
        let table = txn
            .open_table(ENTRIES)
            .map_err(|e| raft_error(self.db_error(e)))?;
        let bytes = table
            .get(idx)
            .map_err(|e| raft_error(self.db_error(e)))?
            .ok_or(raft::Error::Store(StorageError::Unavailable))?;
        let entry = Entry::parse_from_bytes(bytes.value())
            .map_err(|e| raft_error(self.corrupt("entry", e)))?;
        Ok(entry.term)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.mirror.read().expect("mirror lock").snapshot.index + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.mirror.read().expect("mirror lock").last_index)
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let txn = self
            .db
            .begin_read()
            .map_err(|e| raft_error(self.db_error(e)))?;
        let meta = txn
            .open_table(META)
            .map_err(|e| raft_error(self.db_error(e)))?;
        let snapshot = match meta
            .get(SNAPSHOT)
            .map_err(|e| raft_error(self.db_error(e)))?
        {
            Some(bytes) => Snapshot::parse_from_bytes(bytes.value())
                .map_err(|e| raft_error(self.corrupt("snapshot", e)))?,
            None => Snapshot::default(),
        };
        if snapshot.get_metadata().index < request_index {
            // The driver compacts soon; raft-rs asks again later.
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(snapshot)
    }
}

#[cfg(test)]
mod tests;
