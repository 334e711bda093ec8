//! The configs of the bench's gateways, from shared pieces: listeners on
//! ports the system picks, the bench tenant, its pass-through and
//! effectful routes; and starting a gateway of one in this process.

use std::path::Path;

/// `[listen]` on ports the system picks (the gateway reports them).
pub const LISTEN: &str = "[listen]\nproxy = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n";

/// The bench tenant, with one client key whose SHA-256 is `hash` (hex).
pub fn tenant(hash: &str) -> String {
    format!("[[tenants]]\nid = \"bench\"\nkeys = [{{ role = \"client\", sha256 = \"{hash}\" }}]\n")
}

/// The pass-through route `/pass/` in front of `up`.
pub fn pass_route(up: &str) -> String {
    format!(
        "[[routes]]\nname = \"pass\"\nprefix = \"/pass/\"\nupstream = \"{up}\"\nmode = \"pass\"\n"
    )
}

/// The effectful route `/pay/` in front of `up`: POST, with the provider's
/// `Idempotency-Key` header.
pub fn pay_route(up: &str) -> String {
    format!(
        "[[routes]]\nname = \"pay\"\nprefix = \"/pay/\"\nupstream = \"{up}\"\n\
         effectful_methods = [\"POST\"]\nprovider_idempotency_header = \"Idempotency-Key\"\n"
    )
}

/// The bench tenant (client key digest `hash`, hex) with a pass-through
/// route `/pass/` and an effectful route `/pay/` in front of `up`: the
/// config of every bench gateway but its listeners and storage.
pub fn tenant_and_routes(up: &str, hash: &str) -> String {
    format!("{}{}{}", tenant(hash), pass_route(up), pay_route(up))
}

/// Writes `toml` to `dir/file` and starts a gateway of it in this process.
///
/// Errors: the config is refused, or the gateway doesn't start.
pub async fn start(dir: &Path, file: &str, toml: &str) -> anyhow::Result<effectgate::Gateway> {
    let cfg = dir.join(file);
    std::fs::write(&cfg, toml)?;
    effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await
}
