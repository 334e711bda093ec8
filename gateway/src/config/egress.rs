//! Converting the `tls`, `proxy` and `proxy_credentials_env` settings of a
//! route or webhook into its outbound client, and checking the listeners'
//! `*_tls` files.

use super::*;
use crate::egress::{ClientOptions, HttpClient, Proxy};
use crate::tls::ClientTlsFiles;

/// Where an outbound client's settings live in the config, for messages.
pub(super) struct ClientSpec<'a> {
    /// Field path of the table, e.g. `routes[2]` or `tenants[0].webhook`.
    pub path: &'a str,
    /// Its `tls` table.
    pub tls: Option<&'a UpstreamTlsSpec>,
    /// Its `proxy`.
    pub proxy: Option<&'a str>,
    /// Its `proxy_credentials_env`.
    pub proxy_credentials_env: Option<&'a str>,
    /// TCP connect timeout, ms.
    pub connect_timeout_ms: u64,
    /// How long an idle provider connection is kept, ms.
    pub idle_timeout_ms: u64,
    /// Whether it talks to an `https://` URL (so it needs trusted roots).
    pub https: bool,
}

/// Builds the client of one route or webhook.
///
/// Errors: a TLS file that can't be used (`<path>.tls.ca_file`, …), a
/// `server_name` that is no DNS name or IP address, a `proxy` that is not
/// `http://host:port` or `direct`, credentials whose variable is unset or
/// not `user:password`.
pub(super) fn outbound_client(
    spec: ClientSpec<'_>,
    base_dir: &Path,
) -> Result<HttpClient, ConfigError> {
    let path = spec.path;
    let tls = spec.tls.cloned().unwrap_or_default();
    let files = ClientTlsFiles {
        ca_file: tls.ca_file.as_ref().map(|p| base_dir.join(p)),
        client_cert_file: tls.client_cert_file.as_ref().map(|p| base_dir.join(p)),
        client_key_file: tls.client_key_file.as_ref().map(|p| base_dir.join(p)),
    };
    let config = crate::tls::client_config(&files, spec.https)
        .map_err(|e| ConfigError::new(format!("{path}.tls.{}", e.field), e.message))?;
    let server_name = match &tls.server_name {
        None => None,
        Some(n) => Some(
            rustls_pki_types::ServerName::try_from(n.clone()).map_err(|_| {
                ConfigError::new(
                    format!("{path}.tls.server_name"),
                    format!("{n:?} is neither a DNS name nor an IP address"),
                )
            })?,
        ),
    };
    let proxy = proxy(path, spec.proxy, spec.proxy_credentials_env)?;
    Ok(crate::egress::build_client(ClientOptions {
        connect_timeout_ms: spec.connect_timeout_ms,
        idle_timeout_ms: spec.idle_timeout_ms,
        tls: config,
        server_name,
        proxy,
    }))
}

fn proxy(
    path: &str,
    proxy: Option<&str>,
    credentials_env: Option<&str>,
) -> Result<Proxy, ConfigError> {
    let field = format!("{path}.proxy");
    let text = match proxy.map(str::trim) {
        None | Some("") => {
            if credentials_env.is_some() {
                return Err(ConfigError::new(
                    format!("{path}.proxy_credentials_env"),
                    "is set, but the route names no proxy (proxy = \"http://host:port\"); \
                     proxies from HTTPS_PROXY take credentials in their URL",
                ));
            }
            return Ok(Proxy::Environment);
        }
        Some("direct") => return Ok(Proxy::Direct),
        Some(t) => t,
    };
    let bad = || {
        ConfigError::new(
            &field,
            format!("{text:?} is not an HTTP proxy: write \"http://host:port\" (or \"direct\")"),
        )
    };
    let url = url::Url::parse(text).map_err(|_| bad())?;
    if url.scheme() != "http"
        || url.host_str().is_none()
        || url.port_or_known_default().is_none()
        || text
            .trim_end_matches('/')
            .rsplit_once(':')
            .is_none_or(|(_, p)| p.parse::<u16>().is_err())
        || !matches!(url.path(), "" | "/")
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(bad());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(ConfigError::new(
            &field,
            "must not hold credentials; put user:password in the variable named by proxy_credentials_env",
        ));
    }
    let uri: http::Uri = text.parse().map_err(|_| bad())?;
    let auth = match credentials_env {
        None => None,
        Some(var) => {
            let f = format!("{path}.proxy_credentials_env");
            let value = std::env::var(var).map_err(|_| {
                ConfigError::new(&f, format!("environment variable {var} is not set"))
            })?;
            if !value.contains(':') {
                return Err(ConfigError::new(
                    &f,
                    format!("environment variable {var} must hold user:password"),
                ));
            }
            use base64::Engine as _;
            let encoded = base64::engine::general_purpose::STANDARD.encode(value.as_bytes());
            let mut v = HeaderValue::from_str(&format!("Basic {encoded}")).map_err(|_| {
                ConfigError::new(
                    &f,
                    format!("environment variable {var} is not a valid header value"),
                )
            })?;
            v.set_sensitive(true);
            Some(v)
        }
    };
    Ok(Proxy::Via { uri, auth })
}

/// Resolves and checks a listener's TLS files (`listen.proxy_tls`,
/// `listen.admin_tls`): both must be readable PEM and the key must fit the
/// certificate.
pub(super) fn listener_tls(
    path: &str,
    spec: Option<&ListenerTlsSpec>,
    base_dir: &Path,
) -> Result<Option<ListenerTlsSpec>, ConfigError> {
    let Some(spec) = spec else { return Ok(None) };
    let resolved = ListenerTlsSpec {
        cert_file: base_dir.join(&spec.cert_file),
        key_file: base_dir.join(&spec.key_file),
    };
    crate::tls::ListenerCert::load(&resolved.cert_file, &resolved.key_file)
        .map_err(|e| ConfigError::new(format!("{path}.{}", e.field), e.message))?;
    Ok(Some(resolved))
}
