//! Creating certificates: [`init_cluster`] makes a cluster CA and one certificate per
//! identity of a topology; [`issue_one`] signs one more from an existing CA. Files are
//! written only when none of them exists yet, keys with mode 0600 from creation on.

use std::collections::HashMap;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use rand::TryRngCore as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tessera_topology::Topology;

use super::{CA_CERT_FILE, CA_KEY_FILE, Identity};
use crate::CommError;

/// How long certificates stay valid: ten years. The CA is private to one cluster and there
/// is no revocation or renewal service; a certificate that expires in the middle of a
/// deployment would stop the cluster with no warning. Rotation is explicit instead: run
/// `tessera certs init` into a new directory and restart the cluster with it.
pub const VALIDITY_DAYS: i64 = 3650;

/// Backdating of `not_before`, so a host whose clock is a little behind accepts a
/// certificate made just now on another host.
const CLOCK_SKEW: time::Duration = time::Duration::hours(1);

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
pub(super) fn check_unique_names(identities: &[Identity]) -> Result<(), CommError> {
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
