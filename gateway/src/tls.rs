//! TLS in both directions, with rustls and its `ring` crypto provider:
//!
//! - toward providers: a [`rustls::ClientConfig`] per route (or tenant
//!   webhook) that trusts the system's roots (`rustls-native-certs`; on
//!   Debian `/etc/ssl/certs`, or `SSL_CERT_FILE`) or, with `ca_file`, only
//!   that PEM bundle, and that presents a client certificate for mutual TLS
//!   when one is configured. There is no way to skip verification.
//! - on the gateway's own listeners: a [`ListenerCert`] that serves the
//!   configured certificate and key and re-reads both files on reload, so a
//!   renewed certificate takes effect without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A TLS file that can't be used, with the config field it came from
/// (`ca_file`, `client_cert_file`, `client_key_file`, `cert_file`,
/// `key_file`), so that the config error names it.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TlsFileError {
    /// The field, relative to its table (`ca_file`, …).
    pub field: &'static str,
    /// What is wrong, with the resolved path.
    pub message: String,
}

fn file_error(field: &'static str, message: String) -> TlsFileError {
    TlsFileError { field, message }
}

/// The process-wide crypto provider: rustls' `ring` backend.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// The TLS files of one outbound client (`[routes.tls]`,
/// `tenants[].webhook.tls`), with paths already resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// PEM bundle that replaces the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain presented to the provider (mutual TLS).
    pub client_cert_file: Option<PathBuf>,
    /// PEM private key of `client_cert_file` (PKCS#8, PKCS#1 or SEC1).
    pub client_key_file: Option<PathBuf>,
}

/// Reads every certificate of a PEM file.
///
/// Errors: unreadable, not PEM, or no `CERTIFICATE` block in it.
fn read_certs(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let bytes = std::fs::read(path)
        .map_err(|e| file_error(field, format!("cannot read {}: {e}", path.display())))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(field, format!("{} is not a PEM file: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(file_error(
            field,
            format!("{} holds no PEM CERTIFICATE block", path.display()),
        ));
    }
    Ok(certs)
}

/// Reads the first private key of a PEM file.
fn read_key(field: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    let bytes = std::fs::read(path)
        .map_err(|e| file_error(field, format!("cannot read {}: {e}", path.display())))?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        file_error(
            field,
            format!(
                "{} holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
                path.display()
            ),
        )
    })
}

/// The system's trusted roots, loaded once per process.
fn system_roots() -> Result<Arc<RootCertStore>, String> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let loaded = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _ignored) = store.add_parsable_certificates(loaded.certs);
            if added == 0 {
                let why = loaded
                    .errors
                    .first()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default();
                return Err(format!(
                    "no trusted root certificates in the system store{why}; \
                     install ca-certificates, set SSL_CERT_FILE, or name a ca_file"
                ));
            }
            Ok(Arc::new(store))
        })
        .clone()
}

/// Builds the rustls client config of one route or webhook.
///
/// `needs_roots`: whether any of its URLs is `https://`; without it the
/// system store isn't required (a plain-HTTP route works on a machine with
/// no CA bundle).
///
/// Errors: a file that can't be read or parsed, a client certificate without
/// its key (or the reverse), a key that doesn't match its certificate, or no
/// system roots when they are needed. Each names its field.
pub fn client_config(
    files: &ClientTlsFiles,
    needs_roots: bool,
) -> Result<ClientConfig, TlsFileError> {
    let roots = match &files.ca_file {
        Some(p) => {
            let mut store = RootCertStore::empty();
            for cert in read_certs("ca_file", p)? {
                store.add(cert).map_err(|e| {
                    file_error(
                        "ca_file",
                        format!(
                            "{} holds a certificate rustls can't use as a root: {e}",
                            p.display()
                        ),
                    )
                })?;
            }
            Arc::new(store)
        }
        None if needs_roots => system_roots().map_err(|m| file_error("ca_file", m))?,
        None => Arc::new(RootCertStore::empty()),
    };
    let builder = ClientConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| file_error("ca_file", format!("TLS setup failed: {e}")))?
        .with_root_certificates(roots);
    match (&files.client_cert_file, &files.client_key_file) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(_), None) => Err(file_error(
            "client_key_file",
            "client_cert_file is set, so client_key_file must be too".into(),
        )),
        (None, Some(_)) => Err(file_error(
            "client_cert_file",
            "client_key_file is set, so client_cert_file must be too".into(),
        )),
        (Some(c), Some(k)) => {
            let certs = read_certs("client_cert_file", c)?;
            let key = read_key("client_key_file", k)?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                file_error(
                    "client_key_file",
                    format!(
                        "{} does not fit {}: {}",
                        k.display(),
                        c.display(),
                        misfit(&e)
                    ),
                )
            })
        }
    }
}

/// The certificate of one TLS listener (`listen.proxy_tls`,
/// `listen.admin_tls`): served to every handshake, re-read from its files
/// by [`ListenerCert::reload`].
#[derive(Debug)]
pub struct ListenerCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: ArcSwap<CertifiedKey>,
}

impl ListenerCert {
    /// Reads and checks `cert_file` (PEM chain, leaf first) and `key_file`.
    ///
    /// Errors: a file can't be read or parsed, or the key doesn't match the
    /// certificate; the error names `cert_file` or `key_file`.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<Self>, TlsFileError> {
        let key = certified_key(cert_file, key_file)?;
        Ok(Arc::new(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: ArcSwap::from_pointee(key),
        }))
    }

    /// Re-reads both files; on error the certificate in use stays.
    pub fn reload(&self) -> Result<(), TlsFileError> {
        let key = certified_key(&self.cert_file, &self.key_file)?;
        self.current.store(Arc::new(key));
        Ok(())
    }

    /// A rustls server config serving this certificate, offering `h2` and
    /// `http/1.1` in ALPN (RFC 7301).
    pub fn server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut cfg = ServerConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default TLS versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(cfg)
    }
}

impl rustls::server::ResolvesServerCert for ListenerCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn certified_key(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, TlsFileError> {
    let certs = read_certs("cert_file", cert_file)?;
    let key = read_key("key_file", key_file)?;
    CertifiedKey::from_der(certs, key, &crypto_provider()).map_err(|e| {
        file_error(
            "key_file",
            format!(
                "{} does not fit {}: {}",
                key_file.display(),
                cert_file.display(),
                misfit(&e)
            ),
        )
    })
}

/// Why a private key was refused for a certificate, in words: rustls's
/// own text for a key of another certificate is its variant's name
/// (`keys may not be consistent: KeyMismatch`).
fn misfit(e: &rustls::Error) -> String {
    use rustls::InconsistentKeys as K;
    match e {
        rustls::Error::InconsistentKeys(K::KeyMismatch) => {
            "the key's public key is not the one in the certificate (the key belongs to another \
             certificate, or the files are swapped)"
                .into()
        }
        rustls::Error::InconsistentKeys(K::Unknown) => {
            "the key's public key can't be derived to check it against the certificate".into()
        }
        other => other.to_string(),
    }
}

/// A readable reason for a failed TLS handshake, when `e`'s chain holds a
/// rustls error: "the provider's certificate is not trusted (unknown
/// issuer)", "… is not valid for this name", "… has expired". `None` for
/// other errors.
pub fn handshake_reason(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(t) = rustls_error(e) {
        return Some(describe(t));
    }
    refused_in_handshake(e).then(|| {
        if chain_text(e).contains("CertificateRequired") {
            describe(&rustls::Error::AlertReceived(
                rustls::AlertDescription::CertificateRequired,
            ))
        } else {
            format!(
                "TLS handshake failed: the provider refused the handshake ({})",
                chain_text(e)
            )
        }
    })
}

/// The rustls error in `e`'s chain, looking inside `io::Error`s (the TLS
/// connector wraps it in one, sometimes in two) and HTTP/2 errors.
fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        // HTTP/2 reports a broken connection as an h2 error holding the I/O one.
        let mut io = err
            .downcast_ref::<std::io::Error>()
            .or_else(|| err.downcast_ref::<h2::Error>().and_then(h2::Error::get_io));
        while let Some(inner) = io.and_then(|i| i.get_ref()) {
            if let Some(t) = inner.downcast_ref::<rustls::Error>() {
                return Some(t);
            }
            io = inner.downcast_ref::<std::io::Error>();
        }
        cur = err.source();
    }
    None
}

/// Whether `e`'s chain holds a TLS alert that a server sends only while it
/// verifies the handshake (a refused or missing client certificate, an
/// unknown CA, a failed handshake). In TLS 1.3 the client may already have
/// written its request when such an alert arrives, but the server refused
/// the session before reading any application data, so the request was
/// never processed: the attempt counts as "nothing sent", never UNKNOWN.
pub fn refused_in_handshake(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    const REFUSALS: [A; 9] = [
        A::CertificateRequired,
        A::BadCertificate,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::CertificateUnknown,
        A::UnknownCA,
        A::HandshakeFailure,
        A::AccessDenied,
    ];
    if let Some(rustls::Error::AlertReceived(a)) = rustls_error(e) {
        return REFUSALS.contains(a);
    }
    // HTTP/2 keeps only the text of an I/O error (the rustls error itself
    // is gone by then): rustls writes an alert as `received fatal alert: X`.
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if let Some(name) = text.split("received fatal alert: ").nth(1) {
            let name = name
                .split(|c: char| !c.is_ascii_alphanumeric())
                .next()
                .unwrap_or("");
            return REFUSALS.iter().any(|a| format!("{a:?}") == name);
        }
        cur = err.source();
    }
    false
}

fn describe(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    let what = match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => "the provider's certificate is not trusted (unknown issuer)".into(),
            C::NotValidForName | C::NotValidForNameContext { .. } => {
                format!("the provider's certificate is not valid for this name ({c})")
            }
            C::Expired | C::ExpiredContext { .. } => {
                format!("the provider's certificate has expired ({c})")
            }
            C::NotValidYet | C::NotValidYetContext { .. } => {
                format!("the provider's certificate is not valid yet ({c})")
            }
            C::Revoked => "the provider's certificate is revoked".into(),
            other => format!("the provider's certificate was refused ({other:?})"),
        },
        rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired) => {
            "the provider requires a client certificate (mutual TLS: set tls.client_cert_file and tls.client_key_file)".into()
        }
        rustls::Error::AlertReceived(a) => format!("the provider refused the handshake ({a:?})"),
        other => other.to_string(),
    };
    format!("TLS handshake failed: {what}")
}

/// `e` and its causes, `: `-separated, each in its own words (see
/// [`plain_text`]).
pub fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut cur = Some(e);
    while let Some(err) = cur {
        parts.push(plain_text(err));
        cur = err.source();
    }
    parts.join(": ")
}

/// What a peer that closed its TLS connection without `close_notify`
/// (RFC 8446 §6.1) is reported as.
const CLOSED_WITHOUT_NOTIFY: &str = "the peer closed the TLS connection without close_notify (RFC 8446 §6.1): its answer, if any, may be cut short";

/// `e`'s text; rustls's for a connection closed without `close_notify`
/// (an `io::Error` of kind `UnexpectedEof` whose text ends with a link to
/// rustls's manual) in words instead.
fn plain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let text = e.to_string();
    let eof = e
        .downcast_ref::<std::io::Error>()
        .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof);
    if eof && text.starts_with("peer closed connection without sending TLS close_notify") {
        return CLOSED_WITHOUT_NOTIFY.into();
    }
    text
}
