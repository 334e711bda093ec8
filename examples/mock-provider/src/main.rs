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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mock = mock_provider::spawn(SocketAddr::new(args.host, args.port)).await?;
    println!("mock-provider listening on http://{}", mock.addr);
    tokio::signal::ctrl_c().await?;
    Ok(())
}
