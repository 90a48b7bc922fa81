//! Unit tests of identity URIs, names and their clashes.

use tessera_topology::{PeerId, Rank};

use super::identity::{DNS_SUFFIX, MAX_DNS_LABEL};
use super::issue::check_unique_names;
use super::*;

fn shard(group: &str, rank: u32) -> Identity {
    Identity::Shard {
        group: group.into(),
        rank: Rank(rank),
    }
}

#[test]
fn uris_round_trip() {
    for identity in [
        Identity::Coordinator(PeerId(1)),
        Identity::Coordinator(PeerId(u64::MAX)),
        shard("g0", 0),
        shard("meta-llama/Llama 3 70B%", 7),
        shard("é", 1),
    ] {
        let uri = identity.uri();
        assert!(uri.is_ascii(), "{uri}");
        assert_eq!(Identity::parse_uri(&uri).unwrap(), identity);
    }
    assert_eq!(shard("a/b", 2).uri(), "tessera://shard/a%2Fb/2");
}

#[test]
fn malformed_uris_are_refused() {
    for uri in [
        "",
        "https://coordinator/1",
        "tessera://coordinator/",
        "tessera://coordinator/+1",
        "tessera://coordinator/01",
        "tessera://coordinator/1/2",
        "tessera://shard/g0",
        "tessera://shard//0",
        "tessera://shard/g0/4294967296",
        "tessera://shard/a%2fb/0",
        "tessera://shard/a%2/0",
        "tessera://shard/%FF/0",
        "tessera://worker/1",
    ] {
        assert!(Identity::parse_uri(uri).is_err(), "{uri}");
    }
}

#[test]
fn names_are_valid_dns_names_and_file_names() {
    assert_eq!(
        Identity::Coordinator(PeerId(1)).dns_name(),
        "coordinator-1.tessera"
    );
    assert_eq!(shard("G_0", 3).dns_name(), "shard-g-0-3.tessera");
    assert_eq!(shard("a/b", 3).file_stem(), "shard-a_b-3");
    let long = shard(&"x".repeat(128), u32::MAX);
    let label = long.dns_name().strip_suffix(DNS_SUFFIX).unwrap().to_owned();
    assert_eq!(label.len(), MAX_DNS_LABEL);
    assert!(label.ends_with(&format!("-{}", u32::MAX)));
}

#[test]
fn clashing_names_are_refused() {
    let err = check_unique_names(&[shard("a/b", 0), shard("a_b", 0)]).unwrap_err();
    assert!(matches!(err, CommError::NameClash { .. }), "{err}");
    let err = check_unique_names(&[shard("a_b", 0), shard("a.b", 0)]).unwrap_err();
    assert!(err.to_string().contains("shard-a-b-0.tessera"), "{err}");
    assert!(check_unique_names(&[shard("g0", 0), shard("g0", 1)]).is_ok());
}
