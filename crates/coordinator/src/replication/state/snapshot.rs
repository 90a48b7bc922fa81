//! Snapshot bytes: a header naming the format's version, then the state in bincode.
//!
//! Bincode has no optional fields: a field added to the state changes the bytes of every
//! snapshot, and a peer would no longer read the snapshots it wrote before (on its disk,
//! or from a leader not yet upgraded). So each snapshot starts with [`MAGIC`] and a
//! version byte, and [`decode`] turns every version it knows into today's state.
//! Snapshots of version 1, from before the header, are the bincode of the state alone:
//! their first byte is the varint of `applied`, which is never 0xff, the magic's first.
//!
//! | version | change |
//! |---|---|
//! | 1 | the state, no header |
//! | 2 | the header; [`GroupRecord::drained`] |
//! | 3 | [`ClusterState::rollouts`] |
//! | 4 | [`ClusterState::topology`] |
//!
//! A version newer than [`VERSION`] is refused with a message saying to upgrade.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_comm::{CommError, wire};
use tessera_topology::PeerId;

use super::{ClusterState, GroupRecord, JournalUsage, Journaled, MAX_SNAPSHOT_BYTES, Member};
use super::{ModelRecord, RequestId, ShardRecord};

/// The first bytes of a snapshot since version 2.
const MAGIC: [u8; 4] = [0xff, b'T', b'S', b'S'];

/// The version [`encode`] writes.
pub const VERSION: u8 = 4;

const HEADER_BYTES: usize = MAGIC.len() + 1;

pub(super) fn encode(state: &ClusterState) -> Result<Vec<u8>, CommError> {
    let body = wire::encode_large(state, MAX_SNAPSHOT_BYTES - HEADER_BYTES)?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + body.len());
    bytes.extend_from_slice(&MAGIC);
    bytes.push(VERSION);
    bytes.extend_from_slice(&body);
    Ok(bytes)
}

pub(super) fn decode(bytes: &[u8]) -> Result<ClusterState, CommError> {
    let limit = MAX_SNAPSHOT_BYTES;
    let mut state: ClusterState = match bytes.strip_prefix(&MAGIC) {
        None => wire::decode_large::<v1::ClusterState>(bytes, limit)?.into(),
        Some([VERSION, body @ ..]) => wire::decode_large(body, limit)?,
        Some([3, body @ ..]) => wire::decode_large::<v3::ClusterState>(body, limit)?.into(),
        Some([2, body @ ..]) => wire::decode_large::<v2::ClusterState>(body, limit)?.into(),
        Some([version, ..]) => {
            return Err(CommError::Decode {
                message: format!(
                    "a snapshot of format version {version}, newer than this peer reads \
                     (1 to {VERSION}): upgrade this peer"
                ),
            });
        }
        Some([]) => {
            return Err(CommError::Decode {
                message: "a snapshot header without its version".to_string(),
            });
        }
    };
    state.usage = JournalUsage::of(&state.journal);
    Ok(state)
}

/// The state as version 3 wrote it: no applied topology.
mod v3 {
    use super::*;
    use crate::replication::state::Rollout;

    #[derive(Debug, Default, Serialize, Deserialize)]
    pub struct ClusterState {
        pub applied: u64,
        pub members: BTreeMap<PeerId, Member>,
        pub groups: BTreeMap<String, GroupRecord>,
        pub models: BTreeMap<String, ModelRecord>,
        pub rollouts: BTreeMap<String, Rollout>,
        pub journal: BTreeMap<RequestId, Journaled>,
    }
}

impl From<v3::ClusterState> for ClusterState {
    fn from(old: v3::ClusterState) -> ClusterState {
        ClusterState {
            applied: old.applied,
            members: old.members,
            groups: old.groups,
            models: old.models,
            rollouts: old.rollouts,
            topology: None,
            journal: old.journal,
            usage: JournalUsage::default(),
        }
    }
}

/// The state before version 3, with the group record of its version: no rollouts.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Before3<G> {
    applied: u64,
    members: BTreeMap<PeerId, Member>,
    groups: BTreeMap<String, G>,
    models: BTreeMap<String, ModelRecord>,
    journal: BTreeMap<RequestId, Journaled>,
}

/// The state as version 2 wrote it.
mod v2 {
    pub type ClusterState = super::Before3<super::GroupRecord>;
}

impl From<v2::ClusterState> for ClusterState {
    fn from(old: v2::ClusterState) -> ClusterState {
        v3::ClusterState {
            applied: old.applied,
            members: old.members,
            groups: old.groups,
            models: old.models,
            rollouts: BTreeMap::new(),
            journal: old.journal,
        }
        .into()
    }
}

/// The state as version 1 wrote it: groups without `drained`.
mod v1 {
    use super::*;

    pub type ClusterState = Before3<GroupRecord>;

    #[derive(Debug, Default, Serialize, Deserialize)]
    pub struct GroupRecord {
        pub epoch: u64,
        pub shards: BTreeMap<u32, ShardRecord>,
    }
}

impl From<v1::ClusterState> for ClusterState {
    fn from(old: v1::ClusterState) -> ClusterState {
        let groups = old.groups.into_iter().map(|(name, g)| {
            let group = GroupRecord {
                epoch: g.epoch,
                shards: g.shards,
                drained: false,
            };
            (name, group)
        });
        v2::ClusterState {
            applied: old.applied,
            members: old.members,
            groups: groups.collect(),
            models: old.models,
            journal: old.journal,
        }
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshot that the code before the header (159f04e) wrote of [`sample_v1`]'s
    /// state, printed by that code.
    const V1_BYTES: &str = "2901010e3132372e302e302e313a383030300e3132372e302e302e313a373030304d\
                            01016703010003056c6f63616c6301016d022f6d01016700";

    fn hex(text: &str) -> Vec<u8> {
        let text: String = text.split_whitespace().collect();
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The state of [`V1_BYTES`], as version 1 held it.
    fn sample_v1() -> v1::ClusterState {
        let mut state = v1::ClusterState {
            applied: 41,
            ..v1::ClusterState::default()
        };
        let member = Member {
            http: "127.0.0.1:8000".into(),
            quic: "127.0.0.1:7000".into(),
            pid: 77,
        };
        state.members.insert(PeerId(1), member);
        let shard = ShardRecord {
            epoch: 3,
            host: "local".into(),
            pid: 99,
        };
        let group = v1::GroupRecord {
            epoch: 3,
            shards: BTreeMap::from([(0, shard)]),
        };
        state.groups.insert("g".into(), group);
        let model = ModelRecord {
            path: "/m".into(),
            groups: vec!["g".into()],
        };
        state.models.insert("m".into(), model);
        state
    }

    #[test]
    fn a_version_1_snapshot_restores_with_no_group_drained() {
        let bytes = hex(V1_BYTES);
        assert_eq!(
            wire::encode_large(&sample_v1(), MAX_SNAPSHOT_BYTES).unwrap(),
            bytes,
            "the version 1 layout here is the one that code wrote"
        );
        assert_ne!(bytes[0], MAGIC[0], "a version 1 snapshot has no header");
        let state = decode(&bytes).expect("a version 1 snapshot restores");
        assert_eq!(state.applied, 41);
        assert_eq!(state.members[&PeerId(1)].pid, 77);
        assert_eq!(state.groups["g"].epoch, 3);
        assert_eq!(state.groups["g"].shards[&0].pid, 99);
        assert!(!state.groups["g"].drained);
        assert_eq!(state.models["m"].groups, ["g"]);
        // Written again, it is a snapshot of today's version of the same state.
        let again = encode(&state).unwrap();
        assert_eq!(&again[..HEADER_BYTES], &[0xff, b'T', b'S', b'S', VERSION]);
        assert_eq!(decode(&again).unwrap(), state);
    }

    #[test]
    fn a_drained_group_survives_a_snapshot() {
        let mut state: ClusterState = sample_v1().into();
        state.groups.get_mut("g").unwrap().drained = true;
        let restored = decode(&encode(&state).unwrap()).unwrap();
        assert_eq!(restored, state);
        assert!(restored.groups["g"].drained);
    }

    #[test]
    fn a_version_2_snapshot_restores_without_rollouts_and_rollouts_survive_a_snapshot() {
        let old: ClusterState = sample_v1().into();
        let v2 = v2::ClusterState {
            applied: old.applied,
            members: old.members.clone(),
            groups: old.groups.clone(),
            models: old.models.clone(),
            journal: old.journal.clone(),
        };
        let mut bytes = MAGIC.to_vec();
        bytes.push(2);
        bytes.extend(wire::encode_large(&v2, MAX_SNAPSHOT_BYTES).unwrap());
        let mut state = decode(&bytes).expect("a version 2 snapshot restores");
        assert_eq!(state, old);
        assert!(state.rollouts.is_empty());
        let deploy = super::super::RolloutCommand::Deploy {
            model: "m".into(),
            path: "/m2".into(),
            canary: None,
            at_ms: 1,
        };
        let outcome = state.apply(42, &super::super::Command::Rollout(deploy));
        assert_eq!(outcome, super::super::Outcome::Applied);
        let restored = decode(&encode(&state).unwrap()).unwrap();
        assert_eq!(restored.rollouts["m"].stable, 2);
        assert_eq!(restored, state);
    }

    #[test]
    fn a_version_3_snapshot_restores_without_a_topology_and_one_applied_survives() {
        let old: ClusterState = sample_v1().into();
        let v3 = v3::ClusterState {
            applied: old.applied,
            members: old.members.clone(),
            groups: old.groups.clone(),
            models: old.models.clone(),
            rollouts: old.rollouts.clone(),
            journal: old.journal.clone(),
        };
        let mut bytes = MAGIC.to_vec();
        bytes.push(3);
        bytes.extend(wire::encode_large(&v3, MAX_SNAPSHOT_BYTES).unwrap());
        let mut state = decode(&bytes).expect("a version 3 snapshot restores");
        assert_eq!(state, old);
        assert!(state.topology.is_none());
        let apply = super::super::Command::Topology {
            generation: 1,
            path: "/t/topology.toml".into(),
            text: "# the text".into(),
            models: old.models.clone(),
        };
        assert_eq!(state.apply(42, &apply), super::super::Outcome::Applied);
        let restored = decode(&encode(&state).unwrap()).unwrap();
        assert_eq!(restored.topology.as_ref().unwrap().generation, 1);
        assert_eq!(restored, state);
    }

    #[test]
    fn a_newer_version_or_a_bare_header_is_refused_with_what_to_do() {
        let mut bytes = encode(&ClusterState::default()).unwrap();
        bytes[MAGIC.len()] = VERSION + 1;
        let error = decode(&bytes).unwrap_err().to_string();
        assert!(
            error.contains(&format!("version {}", VERSION + 1)) && error.contains("upgrade"),
            "{error}"
        );
        assert!(decode(&MAGIC).is_err());
    }
}
