//! The cluster's identities and their certificate files.
//!
//! Every process of a cluster has an [`Identity`]: a coordinator peer (by raft id) or a
//! shard (by group and rank). `tessera certs init` ([`init_cluster`]) creates one private
//! certificate authority per cluster and, signed by it, one certificate per identity of the
//! topology. A certificate names its identity twice in its subject alternative names:
//! - a URI, `tessera://coordinator/<id>` or `tessera://shard/<group>/<rank>` — the
//!   authoritative name, read back after the handshake by [`crate::quic::peer_identity`];
//! - a DNS name, `coordinator-<id>.tessera` or `shard-<group>-<rank>.tessera` — the TLS
//!   server name a client dials, checked by rustls during the handshake.
//!
//! Layout of a certificates directory (mode 0700):
//!
//! ```text
//! ca.pem                 the cluster CA certificate (every process needs it)
//! ca.key                 the CA's private key (0600): keep it secret, off the cluster
//! coordinator-1.pem/.key one certificate and key (0600) per coordinator peer
//! shard-g0-0.pem/.key    one per shard of every group
//! ```
//!
//! [`Credentials::load`] reads what one process needs: the CA certificate and its own
//! certificate and key.

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use rand::TryRngCore as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tessera_topology::{PeerId, Rank, Topology};
use x509_parser::extensions::GeneralName;

use crate::CommError;

/// The scheme of identity URIs.
const URI_PREFIX: &str = "tessera://";
/// The DNS suffix of TLS server names. Not a real domain: names are only ever matched
/// against certificates of the cluster CA.
const DNS_SUFFIX: &str = ".tessera";
/// The longest DNS label (RFC 1035).
const MAX_DNS_LABEL: usize = 63;

/// File names inside a certificates directory.
pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca.key";

/// How long certificates stay valid: ten years. The CA is private to one cluster and there
/// is no revocation or renewal service; a certificate that expires in the middle of a
/// deployment would stop the cluster with no warning. Rotation is explicit instead: run
/// `tessera certs init` into a new directory and restart the cluster with it.
pub const VALIDITY_DAYS: i64 = 3650;

/// Backdating of `not_before`, so a host whose clock is a little behind accepts a
/// certificate made just now on another host.
const CLOCK_SKEW: time::Duration = time::Duration::hours(1);

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

/// One certificate written by [`init_cluster`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IssuedCert {
    pub identity: Identity,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What [`init_cluster`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertsSummary {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    /// The CA's private key: whoever holds it can mint identities of this cluster.
    pub ca_key: PathBuf,
    /// The CA's common name (`Tessera cluster CA <random suffix>`).
    pub ca_name: String,
    pub issued: Vec<IssuedCert>,
    pub validity_days: i64,
}

/// Creates a cluster CA and one certificate per coordinator peer and shard of `topology`
/// in `out` (created with mode 0700 if absent). Nothing is written when any file to be
/// written already exists — an existing CA is never overwritten — or when two identities
/// would share a file name or TLS name.
pub fn init_cluster(topology: &Topology, out: &Path) -> Result<CertsSummary, CommError> {
    let identities = Identity::all_of(topology);
    check_unique_names(&identities)?;

    let ca_cert_path = out.join(CA_CERT_FILE);
    let ca_key_path = out.join(CA_KEY_FILE);
    let mut files: Vec<(PathBuf, String, bool)> = Vec::new();

    let ca_name = format!("Tessera cluster CA {}", random_suffix()?);
    let ca_key = KeyPair::generate().map_err(|e| gen_error(&ca_name, e))?;
    let ca_params = ca_params(&ca_name);
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(|e| gen_error(&ca_name, e))?;
    files.push((ca_cert_path.clone(), ca_cert.pem(), false));
    files.push((ca_key_path.clone(), ca_key.serialize_pem(), true));
    let issuer = Issuer::new(ca_params, ca_key);

    let mut issued = Vec::with_capacity(identities.len());
    for identity in identities {
        let subject = identity.to_string();
        let key = KeyPair::generate().map_err(|e| gen_error(&subject, e))?;
        let cert = leaf_params(&identity)?
            .signed_by(&key, &issuer)
            .map_err(|e| gen_error(&subject, e))?;
        let stem = identity.file_stem();
        let cert_path = out.join(format!("{stem}.pem"));
        let key_path = out.join(format!("{stem}.key"));
        files.push((cert_path.clone(), cert.pem(), false));
        files.push((key_path.clone(), key.serialize_pem(), true));
        issued.push(IssuedCert {
            identity,
            cert: cert_path,
            key: key_path,
        });
    }

    // The CA first, so its message is the one a second run sees.
    for (path, _, _) in &files {
        if path.exists() {
            return Err(CommError::CertsExist { path: path.clone() });
        }
    }
    if !out.exists() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(out)
            .map_err(|e| file_error(out, "cannot create the directory", e))?;
    }
    for (path, contents, secret) in &files {
        write_new(path, contents, *secret)?;
    }
    Ok(CertsSummary {
        dir: out.to_owned(),
        ca_cert: ca_cert_path,
        ca_key: ca_key_path,
        ca_name,
        issued,
        validity_days: VALIDITY_DAYS,
    })
}

/// Issues one more certificate from the cluster CA in `dir` (its `ca.pem` and `ca.key`),
/// for an identity the topology did not list when [`init_cluster`] ran: a coordinator peer
/// added with `tessera cluster add`, a shard of a new group. The files are written next to
/// the others; an existing certificate or key is never overwritten.
pub fn issue_one(dir: &Path, identity: &Identity) -> Result<IssuedCert, CommError> {
    let read = |name: &str| {
        let path = dir.join(name);
        fs::read_to_string(&path).map_err(|e| file_error(&path, "cannot read", e))
    };
    let ca_key_path = dir.join(CA_KEY_FILE);
    let ca_key = KeyPair::from_pem(&read(CA_KEY_FILE)?).map_err(|e| CommError::CertFile {
        path: ca_key_path.clone(),
        message: format!("not a private key: {e}"),
    })?;
    let ca_pem = read(CA_CERT_FILE)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| CommError::CertFile {
        path: dir.join(CA_CERT_FILE),
        message: format!("not a CA certificate: {e}"),
    })?;
    let subject = identity.to_string();
    let key = KeyPair::generate().map_err(|e| gen_error(&subject, e))?;
    let cert = leaf_params(identity)?
        .signed_by(&key, &issuer)
        .map_err(|e| gen_error(&subject, e))?;
    let stem = identity.file_stem();
    let cert_path = dir.join(format!("{stem}.pem"));
    let key_path = dir.join(format!("{stem}.key"));
    for path in [&cert_path, &key_path] {
        if path.exists() {
            return Err(CommError::CertsExist { path: path.clone() });
        }
    }
    write_new(&key_path, &key.serialize_pem(), true)?;
    write_new(&cert_path, &cert.pem(), false)?;
    Ok(IssuedCert {
        identity: identity.clone(),
        cert: cert_path,
        key: key_path,
    })
}

/// Refuses two identities with one file stem or one DNS name (group names that differ
/// only in characters that the file and DNS forms rewrite).
fn check_unique_names(identities: &[Identity]) -> Result<(), CommError> {
    let mut stems: HashMap<String, &Identity> = HashMap::new();
    let mut dns: HashMap<String, &Identity> = HashMap::new();
    for identity in identities {
        for (map, name) in [
            (&mut stems, identity.file_stem().to_ascii_lowercase()),
            (&mut dns, identity.dns_name()),
        ] {
            if let Some(first) = map.insert(name.clone(), identity) {
                return Err(CommError::NameClash {
                    first: first.to_string(),
                    second: identity.to_string(),
                    name,
                });
            }
        }
    }
    Ok(())
}

fn random_suffix() -> Result<String, CommError> {
    let mut bytes = [0u8; 4];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| CommError::CertGen {
            subject: "the cluster CA".into(),
            message: format!("the OS random source failed: {e}"),
        })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + time::Duration::days(VALIDITY_DAYS);
}

fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    // Path length 0: the CA signs leaf certificates only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params);
    params
}

fn leaf_params(identity: &Identity) -> Result<CertificateParams, CommError> {
    let subject = identity.to_string();
    let san = |text: String| text.try_into().map_err(|e| gen_error(&subject, e));
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![
        SanType::URI(san(identity.uri())?),
        SanType::DnsName(san(identity.dns_name())?),
    ];
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, identity.file_stem());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Coordinators serve shards and dial each other; shards only dial. Both purposes on
    // every certificate keep one kind of file; roles are checked by identity, not by EKU.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params);
    Ok(params)
}

fn gen_error(subject: &str, e: rcgen::Error) -> CommError {
    CommError::CertGen {
        subject: subject.to_owned(),
        message: e.to_string(),
    }
}

fn file_error(path: &Path, what: &str, e: std::io::Error) -> CommError {
    CommError::CertFile {
        path: path.to_owned(),
        message: format!("{what}: {e}"),
    }
}

/// Writes a file that must not exist yet; keys get mode 0600 from creation on.
fn write_new(path: &Path, contents: &str, secret: bool) -> Result<(), CommError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => CommError::CertsExist {
                path: path.to_owned(),
            },
            _ => file_error(path, "cannot create", e),
        })?;
    file.write_all(contents.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| file_error(path, "cannot write", e))
}

/// What one process needs for mutual TLS: the cluster CA, its own certificate and key.
pub struct Credentials {
    identity: Identity,
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Reads `ca.pem`, `<stem>.pem` and `<stem>.key` of `identity` from `dir`, and checks
    /// that the certificate names `identity`. A key file readable by other users is
    /// logged as a warning.
    pub fn load(dir: &Path, identity: &Identity) -> Result<Credentials, CommError> {
        let stem = identity.file_stem();
        let ca_path = dir.join(CA_CERT_FILE);
        let cert_path = dir.join(format!("{stem}.pem"));
        let key_path = dir.join(format!("{stem}.key"));
        let missing: Vec<String> = [&ca_path, &cert_path, &key_path]
            .into_iter()
            .filter(|p| !p.exists())
            .filter_map(|p| p.file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .collect();
        if !missing.is_empty() {
            return Err(CommError::CredentialsMissing {
                dir: dir.to_owned(),
                files: missing.join(", "),
            });
        }
        let ca = read_cert(&ca_path)?;
        let cert = read_cert(&cert_path)?;
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| CommError::CertFile {
            path: key_path.clone(),
            message: format!("cannot read a private key: {e}"),
        })?;
        warn_if_readable(&key_path);
        let named = identity_of_cert(&cert).map_err(|e| CommError::CertFile {
            path: cert_path.clone(),
            message: e.to_string(),
        })?;
        if named != *identity {
            return Err(CommError::CertFile {
                path: cert_path,
                message: format!("the certificate is for {named}, not {identity}"),
            });
        }
        Ok(Credentials {
            identity: identity.clone(),
            ca,
            cert,
            key,
        })
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The cluster CA certificate.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    /// This process's certificate chain (its own certificate; the CA is known to peers).
    pub fn cert_chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.cert.clone()]
    }

    /// A copy of this process's private key.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        self.key.clone_key()
    }
}

fn read_cert(path: &Path) -> Result<CertificateDer<'static>, CommError> {
    CertificateDer::from_pem_file(path).map_err(|e| CommError::CertFile {
        path: path.to_owned(),
        message: format!("cannot read a pem certificate: {e}"),
    })
}

fn warn_if_readable(path: &Path) {
    if let Ok(meta) = fs::metadata(path)
        && meta.mode() & 0o077 != 0
    {
        tracing::warn!(
            path = %path.display(),
            mode = format_args!("{:o}", meta.mode() & 0o777),
            "private key readable by other users; chmod 600 it"
        );
    }
}

#[cfg(test)]
mod tests {
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
}
