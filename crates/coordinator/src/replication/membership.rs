//! A peer's stored configuration against the topology's coordinator peers. A peer whose
//! data dir holds another configuration bootstraps nothing and elects with its old peers,
//! while the topology's new peers bootstrap the topology's list: when a majority of the one
//! can be disjoint from a majority of the other, that makes two clusters, each with a
//! leader, and no message saying so. Such a peer refuses to start instead, naming both
//! lists and how to reconcile them. Configurations one membership change apart (a peer
//! that was down while another was added) always share a member in any two majorities,
//! as Raft's one-at-a-time changes guarantee; the peer then starts and catches up.

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

/// Refuses a stored configuration (`stored`, empty for a new data dir) of which a majority
/// can be disjoint from a majority of the topology's peers (`listed`).
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
    if stored.is_empty() || !majorities_can_be_disjoint(&stored, &listed) {
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

/// Whether a majority of `a` and a majority of `b` can have no member in common: each
/// takes its members outside the other list first, and what it still needs must come
/// from the shared ones, which two disjoint majorities cannot both use.
fn majorities_can_be_disjoint(a: &[u64], b: &[u64]) -> bool {
    let shared = a.iter().filter(|x| b.contains(x)).count();
    let needs = |of: &[u64]| (of.len() / 2 + 1).saturating_sub(of.len() - shared);
    needs(a) + needs(b) <= shared
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
        // Two majorities of [1, 2, 3, 4] and [1, 2, 3] always meet: one change apart.
        assert_eq!(
            check(me, dir, &ids(&[1, 2, 3]), &ids(&[1, 2, 3, 4])),
            Ok(())
        );
        assert_eq!(
            check(me, dir, &ids(&[1, 2, 3, 4]), &ids(&[1, 2, 3])),
            Ok(())
        );
        // Two changes apart (a replacement is two), or unrelated: two clusters could each
        // elect a leader.
        assert!(check(me, dir, &ids(&[1, 2, 3]), &ids(&[1, 2, 4])).is_err());
        assert!(check(me, dir, &ids(&[1, 2, 3]), &ids(&[1, 2, 3, 4, 5])).is_err());
        assert!(check(me, dir, &ids(&[1, 2, 3]), &ids(&[4, 5, 6])).is_err());
        assert!(check(me, dir, &ids(&[1, 2]), &ids(&[1, 3, 4])).is_err());
    }
}
