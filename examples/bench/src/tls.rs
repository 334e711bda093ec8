//! Scenario (g): pass-through to the mock provider over HTTPS, with
//! HTTP/2 and with HTTP/1.1.

use crate::config;
use crate::{Args, HttpClient, Stats, run};

/// Pass-through over HTTPS: the mock provider behind TLS (a CA and
/// certificate made here), reached with HTTP/2 and, in a second gateway,
/// with HTTP/1.1 only; printed next to the plain pass-through (b) of the
/// same run, as ratios.
pub(crate) async fn https_pass_through(
    client: &HttpClient,
    hash: &str,
    args: &Args,
    plain: &Stats,
) -> anyhow::Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let dir = tempfile::tempdir()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let leaf_key = KeyPair::generate()?;
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&leaf_key, &ca)?;
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem())?;
    let mut rows = Vec::new();
    for (http2, name) in [
        (true, "(g) pass-through over HTTPS, HTTP/2"),
        (false, "(g1) pass-through over HTTPS, HTTP/1.1"),
    ] {
        let mut tls = mock_provider::TlsOptions::new(leaf.pem(), leaf_key.serialize_pem());
        tls.http2 = http2;
        let mock = mock_provider::spawn_tls("127.0.0.1:0".parse()?, &tls).await?;
        let toml = format!(
            "{LISTEN}[storage]\npath = \"{db}\"\n{tenant}{route}[routes.tls]\nca_file = \"{ca}\"\n",
            LISTEN = config::LISTEN,
            db = dir.path().join(format!("tls-{http2}.db")).display(),
            tenant = config::tenant(hash),
            route = config::pass_route(&mock.url()),
            ca = ca_file.display()
        );
        let gw = config::start(dir.path(), "bench-tls.toml", &toml).await?;
        let url = format!("http://{}/pass/v1/charges", gw.proxy_addr);
        run(
            "warmup",
            client,
            url.clone(),
            200,
            args.concurrency,
            |_| None,
            true,
        )
        .await;
        rows.push(
            run(
                name,
                client,
                url,
                args.requests,
                args.concurrency,
                |_| None,
                true,
            )
            .await,
        );
        gw.shutdown().await;
    }
    println!("pass-through to the same provider over HTTPS (keep-alive, TLS 1.3, ring):");
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in [plain, &rows[0], &rows[1]] {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
    println!(
        "ratios of throughput to (b), same run: HTTPS h2 g/b = {:.3}, HTTPS http/1.1 g1/b = {:.3}",
        rows[0].rps / plain.rps,
        rows[1].rps / plain.rps
    );
    Ok(())
}
