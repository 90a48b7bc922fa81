//! Errors of the control plane: framing and encoding ([`crate::wire`]), certificate files
//! ([`crate::certs`]), TLS configuration ([`crate::tls`]), QUIC endpoints and connections
//! and peer identities ([`crate::quic`]).
//!
//! Each error has a [`CommError::class`], decided here once, and crosses a process boundary
//! as a [`WireError`] ([`CommError::to_wire`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::proto::{ErrorClass, WireError};

/// Errors of the control plane.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A frame's length prefix (or an encoded message) is over the limit.
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge { len: u64, limit: usize },
    /// The stream ended inside a frame.
    #[error("stream ended after {got} of {expected} bytes of a frame")]
    Truncated { expected: usize, got: usize },
    #[error("cannot decode message: {message}")]
    Decode { message: String },
    #[error("cannot encode message: {message}")]
    Encode { message: String },
    #[error("{count} trailing bytes after the message")]
    TrailingBytes { count: usize },
    #[error("i/o error on the control stream: {}", with_causes(source))]
    Io {
        #[from]
        source: std::io::Error,
    },

    /// A certificate or key file cannot be read, written or parsed.
    #[error("{}: {message}", path.display())]
    CertFile { path: PathBuf, message: String },
    /// Credentials are missing from a certificates directory.
    #[error(
        "missing {files} in {}: create the cluster's certificates with \
         `tessera certs init --topology FILE --out {}`",
        dir.display(),
        dir.display()
    )]
    CredentialsMissing { dir: PathBuf, files: String },
    /// `tessera certs init` would overwrite an existing CA or certificate.
    #[error(
        "{} already exists: a cluster CA is never overwritten; delete the directory \
         or choose another --out",
        path.display()
    )]
    CertsExist { path: PathBuf },
    /// Two identities would share a certificate file or TLS name.
    #[error("{first} and {second} would both use the name {name:?}: rename one of the groups")]
    NameClash {
        first: String,
        second: String,
        name: String,
    },
    /// Generating a key or certificate failed.
    #[error("cannot generate the certificate of {subject}: {message}")]
    CertGen { subject: String, message: String },
    /// A rustls configuration cannot be built from the credentials.
    #[error("cannot build the tls configuration of {identity}: {message}")]
    Tls { identity: String, message: String },

    #[error("cannot open a quic endpoint on {addr}: {source}")]
    Endpoint {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: SocketAddr, message: String },
    #[error("quic connection to {addr} lost: {source}")]
    Connection {
        addr: SocketAddr,
        source: quinn::ConnectionError,
    },

    /// The peer presented no certificate (never after a completed mutual-TLS handshake).
    #[error("peer {addr} presented no certificate")]
    NoPeerCertificate { addr: SocketAddr },
    /// The certificate does not name exactly one Tessera identity.
    #[error("certificate does not name a tessera identity: {message}")]
    NoIdentity { message: String },
    /// A `tessera://` URI that does not name a coordinator peer or a shard.
    #[error("bad identity uri {uri:?}: {reason}")]
    BadIdentityUri { uri: String, reason: &'static str },
    /// The peer has the wrong role for this connection.
    #[error("peer {identity} is not a {expected}")]
    WrongRole {
        identity: String,
        expected: &'static str,
    },
    /// The peer is not the one that was dialled, or not the one a message claims.
    #[error("peer is {found}, expected {expected}")]
    WrongPeer { expected: String, found: String },
    /// The peer's identity is not in the topology.
    #[error("peer {identity} is not in the topology")]
    UnknownPeer { identity: String },
}

/// `error: cause: cause …` — an i/o error from a quinn stream says only "connection lost";
/// the reason (a TLS alert, a timeout) is in its causes.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let next = e.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = e.source();
    }
    text
}

impl CommError {
    /// The class of this error (see [`ErrorClass`]).
    pub fn class(&self) -> ErrorClass {
        match self {
            // A peer of this cluster sent something this build does not accept: a bug or
            // a version mismatch, not a client's fault.
            CommError::FrameTooLarge { .. }
            | CommError::Decode { .. }
            | CommError::Encode { .. }
            | CommError::TrailingBytes { .. } => ErrorClass::Internal,
            CommError::Truncated { .. }
            | CommError::Io { .. }
            | CommError::Endpoint { .. }
            | CommError::Connect { .. }
            | CommError::Connection { .. } => ErrorClass::Unavailable,
            CommError::CertFile { .. }
            | CommError::CredentialsMissing { .. }
            | CommError::CertsExist { .. }
            | CommError::NameClash { .. }
            | CommError::CertGen { .. }
            | CommError::Tls { .. } => ErrorClass::Internal,
            // The peer asked for something it may not have: refused, as an invalid request.
            CommError::NoPeerCertificate { .. }
            | CommError::NoIdentity { .. }
            | CommError::BadIdentityUri { .. }
            | CommError::WrongRole { .. }
            | CommError::WrongPeer { .. }
            | CommError::UnknownPeer { .. } => ErrorClass::InvalidRequest,
        }
    }

    /// This error as it crosses a process boundary.
    pub fn to_wire(&self) -> WireError {
        WireError {
            class: self.class(),
            message: self.to_string(),
            rank: None,
        }
    }
}
