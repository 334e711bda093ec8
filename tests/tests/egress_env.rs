//! Egress proxy from the environment (`HTTPS_PROXY`, `NO_PROXY`), in a test
//! binary of its own: the variables are process-wide.

use effectgate_tests::connect_proxy::spawn_connect_proxy;
use effectgate_tests::pki::Ca;
use effectgate_tests::*;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

#[tokio::test]
async fn https_proxy_from_the_environment_is_used_unless_no_proxy_names_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost", "127.0.0.1"]);
    let proxy = spawn_connect_proxy(Some("env-user:env-pass")).await;
    let with_auth = proxy.url.replace("http://", "http://env-user:env-pass@");
    // SAFETY: this binary's only test; set before any gateway reads them.
    unsafe {
        std::env::set_var("HTTPS_PROXY", &with_auth);
        std::env::set_var("NO_PROXY", "127.0.0.1");
    }
    let tls = format!(
        "[routes.tls]\nca_file = \"{}\"\n",
        ca.pem.cert_file.display()
    );
    let app = spawn_with(Opts {
        mock_tls: Some(mock_provider::TlsOptions::new(
            leaf.cert.clone(),
            leaf.key.clone(),
        )),
        route_extra: tls.clone(),
        ..Default::default()
    })
    .await;
    assert_eq!(app.charge("e1", BODY).await.status(), 200);
    let want = format!("localhost:{}", app.mock.addr.port());
    assert_eq!(proxy.tunnels.lock().unwrap().clone(), vec![want]);
    assert_eq!(app.mock.provider.effects(), 1);

    let direct = mock_provider::spawn_tls(
        "127.0.0.1:0".parse().unwrap(),
        &mock_provider::TlsOptions::new(leaf.cert, leaf.key),
    )
    .await
    .unwrap();
    // Point a second route at the IP address, which NO_PROXY lists.
    let settings_toml = format!(
        "[[routes]]\nname = \"by-ip\"\nprefix = \"/ip/\"\nupstream = \"https://127.0.0.1:{}\"\n\
         effectful_methods = [\"POST\"]\n{tls}",
        direct.addr.port()
    );
    let by_ip = spawn_with(Opts {
        more: settings_toml,
        ..Default::default()
    })
    .await;
    let r = by_ip
        .http
        .post(by_ip.proxy("/ip/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "e2")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(direct.provider.effects(), 1);
    assert_eq!(
        proxy.tunnels.lock().unwrap().len(),
        1,
        "NO_PROXY: the IP went direct"
    );
}
