//! rustls configurations for the control plane's mutual TLS.
//!
//! Both sides trust exactly one root, the cluster CA of their [`Credentials`], and present
//! their own certificate:
//! - the server (a coordinator) requires a client certificate that chains to the CA
//!   (rustls' `WebPkiClientVerifier` with the CA as its only root). Which role and id the
//!   client has is checked after the handshake, from the certificate's identity URI
//!   ([`crate::quic::peer_identity`]), because what is allowed depends on the stream's
//!   first message and on the topology;
//! - the client checks the server's certificate against the CA and the server name it
//!   dialled ([`crate::certs::Identity::dns_name`]).
//!
//! TLS 1.3 only (QUIC requires it), ALPN [`ALPN`], and always the `ring` crypto provider
//! passed explicitly — never the process-wide default, which another crate of the process
//! might have installed differently.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;

use crate::CommError;
use crate::certs::Credentials;

/// The application protocol of the control plane, version 1. A peer that offers another
/// is refused during the handshake.
pub const ALPN: &[u8] = b"tessera/1";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(creds: &Credentials) -> Result<Arc<RootCertStore>, CommError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(creds.ca().clone())
        .map_err(|e| tls_error(creds, "the cluster CA certificate is unusable", e))?;
    Ok(Arc::new(roots))
}

fn tls_error(creds: &Credentials, what: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Tls {
        identity: creds.identity().to_string(),
        message: format!("{what}: {e}"),
    }
}

/// The server side (coordinator): requires a client certificate from the cluster CA.
pub fn server_config(creds: &Credentials) -> Result<Arc<rustls::ServerConfig>, CommError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(creds)?, provider.clone())
        .build()
        .map_err(|e| tls_error(creds, "cannot build the client verifier", e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error(creds, "tls 1.3 is not available", e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(creds.cert_chain(), creds.key())
        .map_err(|e| tls_error(creds, "the certificate and key do not work together", e))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}

/// The client side (shard, or a coordinator dialling a peer): trusts only the cluster CA
/// and presents its own certificate.
pub fn client_config(creds: &Credentials) -> Result<Arc<rustls::ClientConfig>, CommError> {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error(creds, "tls 1.3 is not available", e))?
        .with_root_certificates(roots(creds)?)
        .with_client_auth_cert(creds.cert_chain(), creds.key())
        .map_err(|e| tls_error(creds, "the certificate and key do not work together", e))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}
