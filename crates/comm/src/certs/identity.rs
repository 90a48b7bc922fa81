//! [`Identity`]: who a process of the cluster is, and the names it goes by — its identity
//! URI (`tessera://…`), its TLS server name (`….tessera`) and the stem of its files in a
//! certificates directory — and [`identity_of_cert`], which reads the identity back out of
//! a certificate.

use std::fmt;

use tessera_topology::{PeerId, Rank, Topology};
use x509_parser::extensions::GeneralName;

use crate::CommError;

/// The scheme of identity URIs.
const URI_PREFIX: &str = "tessera://";
/// The DNS suffix of TLS server names. Not a real domain: names are only ever matched
/// against certificates of the cluster CA.
pub(super) const DNS_SUFFIX: &str = ".tessera";
/// The longest DNS label (RFC 1035).
pub(super) const MAX_DNS_LABEL: usize = 63;

/// Who a process of the cluster is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A coordinator peer, by raft id.
    Coordinator(PeerId),
    /// The shard of one rank of a tensor-parallel group.
    Shard { group: String, rank: Rank },
}

impl Identity {
    /// The identity URI in certificates: `tessera://coordinator/<id>` or
    /// `tessera://shard/<group>/<rank>`, the group percent-encoded (RFC 3986: every byte
    /// but letters, digits and `-._~`).
    pub fn uri(&self) -> String {
        match self {
            Identity::Coordinator(id) => format!("{URI_PREFIX}coordinator/{id}"),
            Identity::Shard { group, rank } => {
                format!("{URI_PREFIX}shard/{}/{rank}", percent_encode(group))
            }
        }
    }

    /// Parses an identity URI written by [`Identity::uri`]; only its exact form is accepted.
    pub fn parse_uri(uri: &str) -> Result<Identity, CommError> {
        let bad = |reason| CommError::BadIdentityUri {
            uri: uri.to_owned(),
            reason,
        };
        let rest = uri
            .strip_prefix(URI_PREFIX)
            .ok_or_else(|| bad("it does not start with tessera://"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let identity = match parts.as_slice() {
            ["coordinator", id] => {
                Identity::Coordinator(PeerId(parse_decimal(id).ok_or_else(|| bad("bad peer id"))?))
            }
            ["shard", group, rank] => {
                let group = percent_decode(group).ok_or_else(|| bad("bad group name"))?;
                let rank = parse_decimal(rank)
                    .and_then(|r| u32::try_from(r).ok())
                    .ok_or_else(|| bad("bad rank"))?;
                Identity::Shard {
                    group,
                    rank: Rank(rank),
                }
            }
            _ => return Err(bad("expected coordinator/<id> or shard/<group>/<rank>")),
        };
        if identity.uri() != uri {
            return Err(bad("it is not in canonical form"));
        }
        Ok(identity)
    }

    /// The TLS server name: `coordinator-<id>.tessera`, or `shard-<group>-<rank>.tessera`
    /// with the group lower-cased, every character other than a letter or digit written as
    /// `-`, and shortened to fit one DNS label.
    pub fn dns_name(&self) -> String {
        let label = match self {
            Identity::Coordinator(id) => format!("coordinator-{id}"),
            Identity::Shard { group, rank } => {
                let rank = format!("-{rank}");
                let room = MAX_DNS_LABEL - "shard-".len() - rank.len();
                let group: String = group
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() {
                            c.to_ascii_lowercase()
                        } else {
                            '-'
                        }
                    })
                    .take(room)
                    .collect();
                format!("shard-{group}{rank}")
            }
        };
        format!("{label}{DNS_SUFFIX}")
    }

    /// The name of its files in a certificates directory, without extension:
    /// `coordinator-<id>` or `shard-<group>-<rank>`, with every character of the group other
    /// than a letter, digit, `-`, `_` or `.` written as `_`.
    pub fn file_stem(&self) -> String {
        match self {
            Identity::Coordinator(id) => format!("coordinator-{id}"),
            Identity::Shard { group, rank } => {
                let group: String = group
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
                format!("shard-{group}-{rank}")
            }
        }
    }

    /// `coordinator` or `shard`.
    pub fn role(&self) -> &'static str {
        match self {
            Identity::Coordinator(_) => "coordinator",
            Identity::Shard { .. } => "shard",
        }
    }

    /// Every identity of a topology: its coordinator peers, then each rank of each group.
    pub fn all_of(topology: &Topology) -> Vec<Identity> {
        let coordinators = topology
            .coordinators
            .iter()
            .map(|peer| Identity::Coordinator(peer.id));
        let shards = topology.groups.iter().flat_map(|group| {
            group.shards.iter().map(|shard| Identity::Shard {
                group: group.name.clone(),
                rank: shard.rank,
            })
        });
        coordinators.chain(shards).collect()
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Coordinator(id) => write!(f, "coordinator {id}"),
            Identity::Shard { group, rank } => write!(f, "shard {group}/{rank}"),
        }
    }
}

/// Digits only (no sign, no spaces), as `u64`.
fn parse_decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Inverse of [`percent_encode`]; `None` for an empty or malformed name.
fn percent_decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(first);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok().filter(|s| !s.is_empty())
}

/// The identity named by a certificate's URI subject alternative name; exactly one
/// `tessera://` URI must be present.
pub fn identity_of_cert(der: &[u8]) -> Result<Identity, CommError> {
    let no_identity = |message: String| CommError::NoIdentity { message };
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| no_identity(format!("cannot parse the certificate: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| no_identity(format!("bad subject alternative names: {e}")))?
        .ok_or_else(|| no_identity("it has no subject alternative names".into()))?;
    let mut uris = san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) if uri.starts_with(URI_PREFIX) => Some(*uri),
            _ => None,
        });
    match (uris.next(), uris.next()) {
        (Some(uri), None) => Identity::parse_uri(uri),
        (None, _) => Err(no_identity("it has no tessera:// uri".into())),
        (Some(_), Some(_)) => Err(no_identity("it has more than one tessera:// uri".into())),
    }
}
