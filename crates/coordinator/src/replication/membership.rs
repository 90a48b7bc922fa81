//! A peer's stored configuration against the topology's coordinator peers. A peer whose
//! data dir holds another configuration would bootstrap nothing and elect with its old
//! peers, while the topology's other peers elect a leader of their own: two clusters, each
//! with a leader, and no message saying so. Such a peer refuses to start instead, naming
//! both lists and how to reconcile them.

use std::path::Path;

use tessera_topology::PeerId;

/// The stored configuration and the topology's peers differ.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "coordinator peer {me}: its data dir {dir} holds a configuration of peers {stored}, but \
     the topology lists peers {listed}; starting would run two clusters side by side. \
     Reconcile them: change the running cluster's peers with `tessera cluster add` or \
     `tessera cluster remove` and list the same peers in the topology, or start this peer \
     from a fresh data dir (move {dir} away)"
)]
pub struct MembershipMismatch {
    pub me: PeerId,
    pub dir: String,
    pub stored: String,
    pub listed: String,
}

/// Refuses a stored configuration (`stored`, empty for a new data dir) that is not the
/// topology's peers (`listed`), in any order.
pub fn check(
    me: PeerId,
    dir: &Path,
    stored: &[PeerId],
    listed: &[PeerId],
) -> Result<(), MembershipMismatch> {
    let sorted = |ids: &[PeerId]| {
        let mut ids: Vec<u64> = ids.iter().map(|p| p.0).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    let (stored, listed) = (sorted(stored), sorted(listed));
    if stored.is_empty() || stored == listed {
        return Ok(());
    }
    let show = |ids: &[u64]| {
        let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
        format!("[{}]", ids.join(", "))
    };
    Err(MembershipMismatch {
        me,
        dir: dir.display().to_string(),
        stored: show(&stored),
        listed: show(&listed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(ids: &[u64]) -> Vec<PeerId> {
        ids.iter().map(|&i| PeerId(i)).collect()
    }

    #[test]
    fn a_stored_configuration_must_be_the_topologys_peers() {
        let dir = Path::new("/data/c1");
        let me = PeerId(1);
        assert_eq!(check(me, dir, &[], &ids(&[1, 2, 3])), Ok(()));
        assert_eq!(check(me, dir, &ids(&[3, 1, 2]), &ids(&[1, 2, 3])), Ok(()));
        let stale = check(me, dir, &ids(&[1]), &ids(&[1, 2, 3])).unwrap_err();
        let message = stale.to_string();
        for part in [
            "[1]",
            "[1, 2, 3]",
            "/data/c1",
            "tessera cluster add",
            "fresh data dir",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        assert!(check(me, dir, &ids(&[1, 2, 3, 4]), &ids(&[1, 2, 3])).is_err());
    }
}
