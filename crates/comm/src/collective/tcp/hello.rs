//! What the two ends of a ring connection exchange before the ring uses it, without I/O:
//! the [`Hello`] each sends, the checks of the other's, and the proofs of the group token.
//!
//! **Proofs.** Each end sends a hello with a fresh random nonce, then proves that it holds
//! the group token with an HMAC-SHA256 keyed by the token over [`LABEL`], its role
//! (connector or acceptor), both hellos (version, ranks, world size and both nonces) and a
//! digest of the group's peer addresses. The token never crosses the wire; a proof is
//! bound to this connection's nonces, so it cannot be replayed on another; the role keeps
//! one end from reflecting the other's proof back; the peer list keeps a rank from
//! joining a ring it was not assigned to. The token is per group and epoch, so a shard of
//! another group or of an earlier epoch cannot prove it. Proofs are checked in constant
//! time ([`ring::hmac::verify`]).

use std::fmt;

use rand::TryRngCore;
use ring::{digest, hmac};

use crate::collective::{CollectiveError, GroupToken, Op};

/// "TRNG" in ASCII.
pub(super) const MAGIC: u32 = 0x5452_4e47;
/// Bumped on any change to the hello, the proofs or the frames. Version 1 sent the group
/// token itself in its hello; the hello keeps version 1's size, so either side reads the
/// other's version and says so.
pub(super) const VERSION: u32 = 2;
pub(super) const NONCE_BYTES: usize = 32;
/// Magic, version, rank, world size (4 bytes each) and the nonce.
pub const HELLO_BYTES: usize = 16 + NONCE_BYTES;
/// An HMAC-SHA256 tag.
pub(super) const PROOF_BYTES: usize = 32;
/// Domain separation: these proofs mean nothing to any other use of the token.
const LABEL: &[u8] = b"tessera tcp ring join v2";

/// One end's hello. Decoded from exactly [`HELLO_BYTES`] bytes, whatever the sender's
/// version, so a peer of another version is named rather than misread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub rank: u32,
    pub world: u32,
    pub nonce: [u8; NONCE_BYTES],
}

/// Which end of a connection a proof comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// The rank that dialed its next rank.
    Connector,
    /// The rank that accepted its previous rank.
    Acceptor,
}

/// Why one connection was refused during the join. Not an error of the join itself: the
/// acceptor drops the connection and goes on accepting, the connector dials again; the
/// last refusal becomes the reason of [`CollectiveError::Unauthenticated`] at the deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The first word is not [`MAGIC`]: not a ring peer at all.
    NotARingPeer {
        magic: u32,
    },
    Version {
        theirs: u32,
    },
    Rank {
        theirs: u32,
        expected: u32,
    },
    World {
        theirs: u32,
        ours: u32,
    },
    /// The proof does not verify: another token (group or epoch) or another peer list.
    BadProof,
    /// The connection closed before the handshake finished.
    Closed,
    /// Nothing arrived before the connection's handshake timeout.
    Stalled {
        waited_ms: u64,
    },
    Io {
        message: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotARingPeer { magic } => write!(
                f,
                "sent {magic:#010x} where a ring hello starts with {MAGIC:#010x} \
                 (not a tessera ring peer)"
            ),
            Refusal::Version { theirs } => write!(
                f,
                "speaks ring protocol version {theirs}, this rank speaks version {VERSION}: \
                 run one tessera version across the group"
            ),
            Refusal::Rank { theirs, expected } => {
                write!(f, "claims rank {theirs} where rank {expected} was expected")
            }
            Refusal::World { theirs, ours } => {
                write!(f, "has a world size of {theirs}, this rank {ours}")
            }
            Refusal::BadProof => f.write_str(
                "failed to prove the group token (a shard of another group or epoch, or \
                 one given another peer list)",
            ),
            Refusal::Closed => f.write_str(
                "closed the connection during the handshake (it refused this rank's proof, \
                 or is not a ring peer)",
            ),
            Refusal::Stalled { waited_ms } => {
                write!(f, "did not finish the handshake within {waited_ms} ms")
            }
            Refusal::Io { message } => write!(f, "handshake i/o failed: {message}"),
        }
    }
}

impl Hello {
    /// This rank's hello, with a fresh nonce from the OS.
    pub(super) fn fresh(rank: u32, world: u32) -> Result<Hello, CollectiveError> {
        let mut nonce = [0u8; NONCE_BYTES];
        rand::rngs::OsRng
            .try_fill_bytes(&mut nonce)
            .map_err(|e| CollectiveError::Io {
                op: Op::Connect,
                message: format!("no nonce from the OS random source: {e}"),
            })?;
        Ok(Hello {
            version: VERSION,
            rank,
            world,
            nonce,
        })
    }

    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut h = [0u8; HELLO_BYTES];
        h[..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&self.version.to_le_bytes());
        h[8..12].copy_from_slice(&self.rank.to_le_bytes());
        h[12..16].copy_from_slice(&self.world.to_le_bytes());
        h[16..].copy_from_slice(&self.nonce);
        h
    }

    /// Reads a hello of any version; only the magic is checked here.
    pub fn decode(h: &[u8; HELLO_BYTES]) -> Result<Hello, Refusal> {
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if word(0) != MAGIC {
            return Err(Refusal::NotARingPeer { magic: word(0) });
        }
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&h[16..]);
        Ok(Hello {
            version: word(4),
            rank: word(8),
            world: word(12),
            nonce,
        })
    }

    /// Whether this is the hello of rank `rank` of a ring of `world`, in this version.
    pub fn expect(&self, rank: u32, world: u32) -> Result<(), Refusal> {
        if self.version != VERSION {
            return Err(Refusal::Version {
                theirs: self.version,
            });
        }
        if self.world != world {
            return Err(Refusal::World {
                theirs: self.world,
                ours: world,
            });
        }
        if self.rank != rank {
            return Err(Refusal::Rank {
                theirs: self.rank,
                expected: rank,
            });
        }
        Ok(())
    }
}

/// The group token as an HMAC key, and the digest of the ring it is used for.
#[derive(Clone)]
pub(super) struct JoinKey {
    key: hmac::Key,
    ring: digest::Digest,
}

impl fmt::Debug for JoinKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JoinKey(..)")
    }
}

impl JoinKey {
    /// The key of the ring of `peers` (rank `r` listens on `peers[r]`).
    pub(super) fn new(token: &GroupToken, peers: &[String]) -> JoinKey {
        let mut ring = digest::Context::new(&digest::SHA256);
        ring.update(&(peers.len() as u64).to_le_bytes());
        for peer in peers {
            // Length-prefixed, so that no two peer lists give the same bytes.
            ring.update(&(peer.len() as u64).to_le_bytes());
            ring.update(peer.as_bytes());
        }
        JoinKey {
            key: hmac::Key::new(hmac::HMAC_SHA256, &token.0),
            ring: ring.finish(),
        }
    }

    fn message(&self, role: Role, connector: &Hello, acceptor: &Hello) -> Vec<u8> {
        let role: &[u8] = match role {
            Role::Connector => b"connector",
            Role::Acceptor => b"acceptor",
        };
        // Every part has a fixed length but the role, which comes last.
        let mut message = Vec::with_capacity(LABEL.len() + 2 * HELLO_BYTES + 32 + role.len());
        message.extend_from_slice(LABEL);
        message.extend_from_slice(&connector.encode());
        message.extend_from_slice(&acceptor.encode());
        message.extend_from_slice(self.ring.as_ref());
        message.extend_from_slice(role);
        message
    }

    /// The proof that the end in `role` of the connection of these hellos holds the token.
    pub(super) fn prove(
        &self,
        role: Role,
        connector: &Hello,
        acceptor: &Hello,
    ) -> [u8; PROOF_BYTES] {
        let tag = hmac::sign(&self.key, &self.message(role, connector, acceptor));
        let mut proof = [0u8; PROOF_BYTES];
        proof.copy_from_slice(tag.as_ref());
        proof
    }

    /// Checks, in constant time, the proof of the end in `role`.
    pub(super) fn verify(
        &self,
        role: Role,
        connector: &Hello,
        acceptor: &Hello,
        proof: &[u8; PROOF_BYTES],
    ) -> Result<(), Refusal> {
        hmac::verify(&self.key, &self.message(role, connector, acceptor), proof)
            .map_err(|_| Refusal::BadProof)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(rank: u32, nonce: u8) -> Hello {
        Hello {
            version: VERSION,
            rank,
            world: 4,
            nonce: [nonce; NONCE_BYTES],
        }
    }

    fn peers() -> Vec<String> {
        (0..4).map(|r| format!("10.0.0.{r}:7000")).collect()
    }

    #[test]
    fn hellos_round_trip_and_check_version_rank_and_world() {
        let h = hello(2, 9);
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        assert_eq!(h.expect(2, 4), Ok(()));
        assert_eq!(
            h.expect(1, 4),
            Err(Refusal::Rank {
                theirs: 2,
                expected: 1
            })
        );
        assert_eq!(h.expect(2, 3), Err(Refusal::World { theirs: 4, ours: 3 }));
        let old = Hello { version: 1, ..h };
        assert_eq!(old.expect(2, 4), Err(Refusal::Version { theirs: 1 }));
        let mut garbage = h.encode();
        garbage[..4].copy_from_slice(b"GET ");
        assert!(matches!(
            Hello::decode(&garbage),
            Err(Refusal::NotARingPeer { .. })
        ));
    }

    #[test]
    fn fresh_hellos_have_fresh_nonces() {
        let (a, b) = (Hello::fresh(0, 2).unwrap(), Hello::fresh(0, 2).unwrap());
        assert_ne!(a.nonce, b.nonce);
        assert_eq!(a.expect(0, 2), Ok(()));
    }

    #[test]
    fn a_proof_verifies_only_for_its_token_ring_nonces_and_role() {
        let key = JoinKey::new(&GroupToken([1; 32]), &peers());
        let (c, a) = (hello(0, 1), hello(1, 2));
        let proof = key.prove(Role::Connector, &c, &a);
        assert_eq!(key.verify(Role::Connector, &c, &a, &proof), Ok(()));
        // Reflected to the other role.
        let bad = Err(Refusal::BadProof);
        assert_eq!(key.verify(Role::Acceptor, &c, &a, &proof), bad);
        // Another nonce (a replay on another connection), or the hellos swapped.
        assert_eq!(key.verify(Role::Connector, &c, &hello(1, 3), &proof), bad);
        assert_eq!(key.verify(Role::Connector, &a, &c, &proof), bad);
        // Another token, or another ring.
        let other_token = JoinKey::new(&GroupToken([2; 32]), &peers());
        assert_eq!(other_token.verify(Role::Connector, &c, &a, &proof), bad);
        let mut moved = peers();
        moved[3] = "10.0.0.9:7000".into();
        let other_ring = JoinKey::new(&GroupToken([1; 32]), &moved);
        assert_eq!(other_ring.verify(Role::Connector, &c, &a, &proof), bad);
    }
}
