//! TLS termination with rustls.
//!
//! The certificate chain and private key come from PEM files. [`Certificates`]
//! keeps the loaded pair behind a lock and hands it to every new handshake,
//! so [`Certificates::reload`] (on SIGHUP in `fencegate serve`) rotates a
//! certificate without a restart and without touching open connections. A
//! reload that fails keeps the old pair in force.
//!
//! The crypto provider is rustls's `ring` build: protocol versions and cipher
//! suites are rustls's safe defaults (TLS 1.2 and 1.3), and ALPN offers
//! `http/1.1` only, since fencegate speaks HTTP/1.1. [`client_config`] is
//! the other side: the upstream client's trust (system roots plus a private
//! CA).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::crypto::{ring, CryptoProvider};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// Why a certificate, key or CA file could not be used.
#[derive(Debug)]
pub enum TlsError {
    /// A PEM file, named by its setting, could not be read or holds
    /// nothing usable.
    File {
        setting: String,
        path: PathBuf,
        why: String,
    },
    /// The private key does not belong to the certificate.
    Mismatch {
        key_file: PathBuf,
        cert_file: PathBuf,
        why: String,
    },
    /// rustls refused the configuration built from them.
    Config(tokio_rustls::rustls::Error),
}

impl TlsError {
    fn file(setting: &str, path: &Path, why: impl std::fmt::Display) -> Self {
        TlsError::File {
            setting: setting.to_owned(),
            path: path.to_owned(),
            why: why.to_string(),
        }
    }
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TlsError::File { setting, path, why } => {
                write!(f, "{setting} {}: {why}", path.display())
            }
            TlsError::Mismatch {
                key_file,
                cert_file,
                why,
            } => write!(
                f,
                "tls: the key in {} does not belong to the certificate in {}: {why}",
                key_file.display(),
                cert_file.display()
            ),
            TlsError::Config(e) => write!(f, "tls: {e}"),
        }
    }
}

impl std::error::Error for TlsError {}

/// The certificate and key of a TLS listener, reloadable in place.
#[derive(Debug)]
pub struct Certificates {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
}

impl Certificates {
    /// Loads `cert_file` (PEM, leaf first, then intermediates) and `key_file`
    /// (PEM, PKCS#8, PKCS#1 or SEC1), checking that they belong together.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Self, TlsError> {
        let provider = Arc::new(ring::default_provider());
        let current = load_pair(&provider, cert_file, key_file)?;
        Ok(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            provider,
            current: RwLock::new(current),
        })
    }

    /// Reads the files again; on any error the pair in force stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = load_pair(&self.provider, &self.cert_file, &self.key_file)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    /// An acceptor that serves whatever pair is current at each handshake.
    pub fn acceptor(self: &Arc<Self>) -> Result<TlsAcceptor, TlsError> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

fn load_pair(
    provider: &CryptoProvider,
    cert_file: &Path,
    key_file: &Path,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::file("tls.cert_file", cert_file, e))?;
    if certs.is_empty() {
        return Err(TlsError::file(
            "tls.cert_file",
            cert_file,
            "no CERTIFICATE in the file",
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| TlsError::file("tls.key_file", key_file, e))?;
    let key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::file("tls.key_file", key_file, e))?;
    let pair = CertifiedKey::new(certs, key);
    pair.keys_match().map_err(|e| TlsError::Mismatch {
        key_file: key_file.to_owned(),
        cert_file: cert_file.to_owned(),
        why: e.to_string(),
    })?;
    Ok(Arc::new(pair))
}

/// A client configuration that trusts the system's CA certificates plus
/// those (PEM) in `ca_file`, for reaching an upstream over HTTPS. Offers
/// ALPN `http/1.1` only. `what` names the setting in errors.
pub fn client_config(ca_file: Option<&Path>, what: &str) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for err in &native.errors {
        tracing::debug!(error = %err, "cannot read a system CA certificate");
    }
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = ca_file {
        let extra = CertificateDer::pem_file_iter(path)
            .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
            .map_err(|e| TlsError::file(what, path, e))?;
        if extra.is_empty() {
            return Err(TlsError::file(what, path, "no CERTIFICATE in the file"));
        }
        for cert in extra {
            roots.add(cert).map_err(|e| TlsError::file(what, path, e))?;
        }
    }
    let mut config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
