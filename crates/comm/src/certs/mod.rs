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
//!
//! This module holds the directory's file names and [`Credentials`]; the identities and
//! their names are in `identity`, creating the CA and the certificates in `issue`.

use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::CommError;

mod identity;
mod issue;
#[cfg(test)]
mod tests;

pub use identity::{Identity, identity_of_cert};
pub use issue::{CertsSummary, IssuedCert, VALIDITY_DAYS, init_cluster, issue_one};

/// File names inside a certificates directory.
pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca.key";

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
