//! Throwaway certificates for the TLS tests, generated in the test with
//! rcgen: a CA, server certificates (right name, wrong name, expired) and
//! client certificates, written as PEM files in a directory.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its key, as PEM text and as files.
#[derive(Debug, Clone)]
pub struct Pem {
    /// The certificate (PEM).
    pub cert: String,
    /// Its private key (PEM, PKCS#8).
    pub key: String,
    /// Where `cert` was written.
    pub cert_file: PathBuf,
    /// Where `key` was written.
    pub key_file: PathBuf,
}

/// A test certificate authority.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate (PEM) and where it was written.
    pub pem: Pem,
    dir: PathBuf,
}

impl Ca {
    /// A new CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let key_pem = key.serialize_pem();
        let issuer = CertifiedIssuer::self_signed(params, key).unwrap();
        let pem = write(dir, name, issuer.pem(), key_pem);
        Ca {
            issuer,
            pem,
            dir: dir.to_owned(),
        }
    }

    /// A server certificate for `names` (DNS names, or IP addresses).
    pub fn server(&self, file: &str, names: &[&str]) -> Pem {
        self.leaf(file, names, ExtendedKeyUsagePurpose::ServerAuth, false)
    }

    /// A server certificate for `names` that expired yesterday.
    pub fn expired_server(&self, file: &str, names: &[&str]) -> Pem {
        self.leaf(file, names, ExtendedKeyUsagePurpose::ServerAuth, true)
    }

    /// A client certificate (for mutual TLS) with common name `name`.
    pub fn client(&self, file: &str, name: &str) -> Pem {
        self.leaf(file, &[name], ExtendedKeyUsagePurpose::ClientAuth, false)
    }

    fn leaf(
        &self,
        file: &str,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
        expired: bool,
    ) -> Pem {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        for n in names {
            params
                .subject_alt_names
                .push(match n.parse::<std::net::IpAddr>() {
                    Ok(ip) => SanType::IpAddress(ip),
                    Err(_) => SanType::DnsName((*n).try_into().unwrap()),
                });
        }
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![usage];
        if expired {
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now - time::Duration::days(30);
            params.not_after = now - time::Duration::days(1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        write(&self.dir, file, cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, cert: String, key: String) -> Pem {
    let cert_file = dir.join(format!("{name}.crt"));
    let key_file = dir.join(format!("{name}.key"));
    std::fs::write(&cert_file, &cert).unwrap();
    std::fs::write(&key_file, &key).unwrap();
    Pem {
        cert,
        key,
        cert_file,
        key_file,
    }
}
