//! `mock-provider`: the demo payments provider (see the library docs).

use std::net::SocketAddr;

use clap::Parser;

/// A payments-like demo provider with fault injection.
#[derive(Debug, Parser)]
#[command(name = "mock-provider", version, about)]
struct Args {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to bind (0 picks a free one; the bound address is printed).
    #[arg(long, default_value_t = 9090)]
    port: u16,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Require client certificates issued by this PEM CA (mutual TLS).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let addr = SocketAddr::new(args.host, args.port);
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))
    };
    let (mock, scheme) = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let mut tls = mock_provider::TlsOptions::new(read(cert)?, read(key)?);
            if let Some(ca) = &args.client_ca {
                tls.client_ca_pem = Some(read(ca)?);
            }
            (mock_provider::spawn_tls(addr, &tls).await?, "https")
        }
        _ => (mock_provider::spawn(addr).await?, "http"),
    };
    println!("mock-provider listening on {scheme}://{}", mock.addr);
    tokio::signal::ctrl_c().await?;
    Ok(())
}
