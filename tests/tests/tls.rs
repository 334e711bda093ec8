//! Real providers: HTTPS and HTTP/2 upstreams with certificates made in
//! the test, mutual TLS, read-back and webhooks over HTTPS, egress through
//! a CONNECT proxy. No TLS is mocked: the mock provider and the webhook
//! receiver run rustls servers.

use std::path::Path;

use effectgate_tests::connect_proxy::spawn_connect_proxy;
use effectgate_tests::pki::{Ca, Pem};
use effectgate_tests::*;
use mock_provider::TlsOptions;
use serde_json::Value;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

fn tls_table(ca: &Ca, extra: &str) -> String {
    format!(
        "[routes.tls]\nca_file = \"{}\"\n{extra}\n",
        ca.pem.cert_file.display()
    )
}

fn server(pem: &Pem) -> TlsOptions {
    TlsOptions::new(pem.cert.clone(), pem.key.clone())
}

/// A gateway in front of a TLS mock whose certificate `leaf` issued.
async fn https_app(dir: &Path, trust: &Ca, leaf: &Pem, route_extra: &str) -> TestApp {
    let _ = dir;
    spawn_with(Opts {
        mock_tls: Some(server(leaf)),
        route_extra: format!("{route_extra}\n{}", tls_table(trust, "")),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await
}

async fn problem(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "application/problem+json"
    );
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn effectful_call_and_its_replay_over_https_use_http2() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost"]);
    let app = https_app(dir.path(), &ca, &leaf, "").await;

    let first = app.charge("k1", BODY).await;
    assert_eq!(first.status(), 200);
    let first = first.bytes().await.unwrap();
    let dup = app.charge("k1", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.bytes().await.unwrap(), first);

    assert_eq!(app.mock.provider.effects(), 1);
    let seen = app.mock.provider.requests();
    assert_eq!(seen.len(), 1, "the duplicate never reached the provider");
    assert_eq!(seen[0].version, "HTTP/2.0", "h2 was offered in ALPN");
    let op = app.op_json("k1").await;
    assert_eq!(op["state"], "COMPLETED");
    let key = op["provider_key"].as_str().unwrap();
    assert!(
        seen[0]
            .headers
            .iter()
            .any(|(n, v)| n == "idempotency-key" && v == key),
        "the provider key went over TLS"
    );
}

#[tokio::test]
async fn pass_through_get_over_https_speaks_http2_or_http1_as_offered() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost"]);
    for (http2, want) in [(true, "HTTP/2.0"), (false, "HTTP/1.1")] {
        let mut tls = server(&leaf);
        tls.http2 = http2;
        let app = spawn_with(Opts {
            mock_tls: Some(tls),
            route_extra: tls_table(&ca, ""),
            ..Default::default()
        })
        .await;
        for _ in 0..3 {
            let r = app
                .http
                .get(app.proxy("/pay/v1/charges?client_ref=nobody"))
                .bearer_auth(KEY_A)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["data"], serde_json::json!([]));
        }
        let seen = app.mock.provider.requests();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|s| s.version == want), "{want}: {seen:?}");
        assert!(
            seen.iter()
                .all(|s| s.headers.iter().any(
                    |(n, v)| n == "authorization" && v == &format!("Bearer {PROVIDER_SECRET}")
                )),
            "credentials injected over TLS"
        );
    }
}

/// A refused certificate is an attempt where nothing was sent: 502
/// `provider-unreachable` naming the reason, no effect, never UNKNOWN.
#[tokio::test]
async fn a_refused_provider_certificate_is_502_with_the_reason_and_no_effect() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let other_ca = Ca::new(dir.path(), "other-ca");
    let cases = [
        (
            "unknown issuer",
            other_ca.server("by-other-ca", &["localhost"]),
            "unknown issuer",
        ),
        (
            "wrong name",
            ca.server("wrong-name", &["provider.example"]),
            "not valid for this name",
        ),
        (
            "expired",
            ca.expired_server("expired", &["localhost"]),
            "has expired",
        ),
    ];
    for (case, leaf, reason) in cases {
        let app = https_app(
            dir.path(),
            &ca,
            &leaf,
            "[routes.retry]\nmax_attempts = 2\nbase_delay_ms = 1\n",
        )
        .await;
        let key = format!("tls-{}", case.replace(' ', "-"));
        let (status, p) = problem(app.charge(&key, BODY).await).await;
        assert_eq!(status, 502, "{case}");
        assert_eq!(
            p["type"], "urn:effectgate:problem:provider-unreachable",
            "{case}"
        );
        let detail = p["detail"].as_str().unwrap();
        assert!(detail.contains(reason), "{case}: {detail}");
        assert_eq!(app.mock.provider.effects(), 0, "{case}");
        assert!(app.mock.provider.requests().is_empty(), "{case}");
        let op = app.op_json(&key).await;
        assert_eq!(op["state"], "FAILED", "{case}: never UNKNOWN");
        assert_eq!(op["error_kind"], "retries-exhausted", "{case}");
        assert_eq!(
            TestApp::last_reason(&op),
            "retries exhausted: provider unreachable",
            "{case}"
        );
        assert!(
            op["operator_check"]
                .as_str()
                .unwrap()
                .starts_with("Every attempt failed with a transient error (last: connect failed);"),
            "{case}: {}",
            op["operator_check"]
        );
        assert_eq!(op["attempts"], 2, "{case}: the retry policy applied");
        let attempts = op["attempts_log"].as_array().unwrap();
        assert_eq!(attempts.len(), 2, "{case}");
        assert!(
            attempts.iter().all(|a| a["outcome"] == "connect-failed"),
            "{case}: {attempts:?}"
        );
        // A pass-through call says the same.
        let r = app
            .http
            .get(app.proxy("/pay/v1/charges"))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap();
        let (status, p) = problem(r).await;
        assert_eq!(status, 502);
        assert!(
            p["detail"].as_str().unwrap().contains(reason),
            "{case}: {p}"
        );
    }
}

#[tokio::test]
async fn server_name_verifies_a_provider_addressed_by_ip() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["provider.internal"]);
    let other = mock_provider::spawn_tls("127.0.0.1:0".parse().unwrap(), &server(&leaf))
        .await
        .unwrap();
    let route = |name: &str, server_name: &str| {
        format!(
            "[[routes]]\nname = \"{name}\"\nprefix = \"/{name}/\"\nupstream = \"https://127.0.0.1:{}\"\n\
             effectful_methods = [\"POST\"]\n[routes.tls]\nca_file = \"{}\"\n{server_name}\n",
            other.addr.port(),
            ca.pem.cert_file.display()
        )
    };
    let app = spawn_with(Opts {
        more: format!(
            "{}{}",
            route("named", "server_name = \"provider.internal\""),
            route("unnamed", "")
        ),
        ..Default::default()
    })
    .await;
    let post = |prefix: &str, key: &str| {
        app.http
            .post(app.proxy(&format!("/{prefix}/v1/charges")))
            .bearer_auth(KEY_A)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(BODY)
            .send()
    };
    assert_eq!(post("named", "n1").await.unwrap().status(), 200);
    let (status, p) = problem(post("unnamed", "u1").await.unwrap()).await;
    assert_eq!(status, 502);
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("not valid for this name"),
        "{p}"
    );
    assert_eq!(other.provider.effects(), 1);
}

#[tokio::test]
async fn mutual_tls_is_refused_without_the_client_certificate_and_accepted_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let clients = Ca::new(dir.path(), "client-ca");
    let leaf = ca.server("provider", &["localhost"]);
    let client = clients.client("gateway-client", "effectgate");
    let mut tls = server(&leaf);
    tls.client_ca_pem = Some(clients.pem.cert.clone());

    let without = spawn_with(Opts {
        mock_tls: Some(tls.clone()),
        route_extra: format!("{}\n[routes.retry]\nmax_attempts = 1\n", tls_table(&ca, "")),
        more: format!(
            "[[routes]]\nname = \"pass\"\nprefix = \"/pass/\"\nupstream = \"$MOCK_URL\"\nmode = \"pass\"\n{}\
             [reconcile]\nenabled = false\n",
            tls_table(&ca, "")
        ),
        ..Default::default()
    })
    .await;
    // On a pass-through route the same: nothing was sent (a TLS 1.3
    // provider refuses the certificate after the handshake).
    let r = without
        .http
        .get(without.proxy("/pass/v1/charges"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    let (status, p) = problem(r).await;
    assert_eq!(
        (status, &p["type"]),
        (502, &"urn:effectgate:problem:provider-unreachable".into()),
        "{p}"
    );
    assert!(
        p["detail"].as_str().unwrap().contains("client certificate"),
        "{p}"
    );
    let (status, p) = problem(without.charge("m1", BODY).await).await;
    assert_eq!(status, 502);
    assert_eq!(
        p["type"], "urn:effectgate:problem:provider-unreachable",
        "{p}"
    );
    assert!(
        p["detail"].as_str().unwrap().contains("client certificate"),
        "{p}"
    );
    assert_eq!(without.mock.provider.effects(), 0);
    assert_eq!(without.op_json("m1").await["state"], "FAILED");

    let with = spawn_with(Opts {
        mock_tls: Some(tls),
        route_extra: format!(
            "[routes.tls]\nca_file = \"{}\"\nclient_cert_file = \"{}\"\nclient_key_file = \"{}\"\n",
            ca.pem.cert_file.display(),
            client.cert_file.display(),
            client.key_file.display()
        ),
        ..Default::default()
    })
    .await;
    assert_eq!(with.charge("m1", BODY).await.status(), 200);
    assert_eq!(with.mock.provider.effects(), 1);
}

#[tokio::test]
async fn a_lost_reply_is_read_back_over_https() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost"]);
    let app = https_app(
        dir.path(),
        &ca,
        &leaf,
        "[routes.read_back]\npath = \"/v1/charges?idempotency_key={provider_key}\"\nfound_pointer = \"/data/0\"\n\
         match = { \"/idempotency_key\" = \"{provider_key}\" }\nreference_pointer = \"/id\"\nsettle_delay_ms = 0\n",
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    let (status, p) = problem(app.charge("lost", BODY).await).await;
    assert_eq!(status, 502);
    assert_eq!(
        p["type"],
        "urn:effectgate:problem:operation-outcome-unknown"
    );
    let lost = app.op_json("lost").await;
    assert_eq!(lost["state"], "UNKNOWN");
    // The provider closed its TLS connection without `close_notify`: the
    // attempt says so in words, without the manual's link rustls puts
    // in its own text.
    let detail = lost["attempts_log"][0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("closed the TLS connection without close_notify"),
        "{detail}"
    );
    assert!(!detail.contains("https://"), "{detail}");
    assert!(!p.to_string().contains("https://docs.rs"), "{p}");
    // The duplicate reads the effect back over TLS and gets it.
    let dup = app.charge("lost", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    let v: Value = dup.json().await.unwrap();
    assert_eq!(v["id"], "ch_1");
    assert_eq!(app.mock.provider.effects(), 1);
    assert!(app.mock.provider.readbacks() >= 1);
    let op = app.op_json("lost").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], "ch_1");
}

#[tokio::test]
async fn signed_webhooks_reach_an_https_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("receiver", &["localhost"]);
    let rx = effectgate_tests::receiver::spawn_receiver_tls(&server(&leaf)).await;
    // SAFETY: set before the gateway reads its config; the same value in every test.
    unsafe { std::env::set_var("TEST_WEBHOOK_SECRET", "whsec_test") };
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        tenant_a: format!(
            "webhook = {{ url = \"{}\", secret_env = \"TEST_WEBHOOK_SECRET\", tls = {{ ca_file = \"{}\" }} }}\n\
             [[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000 }}\n",
            rx.url,
            ca.pem.cert_file.display(),
            policy_wasm("amount_threshold").display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge("big", r#"{"amount":5000,"currency":"eur"}"#)
        .await;
    assert_eq!(r.status(), 202);
    assert_eq!(
        effectgate::workers::outbox::relay_once(&app.gw.state)
            .await
            .unwrap(),
        1
    );
    let got = rx.got.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].json()["type"], "approval.created");
    let sig = effectgate::workers::outbox::signature(b"whsec_test", &got[0].body);
    assert_eq!(got[0].header("effectgate-signature"), Some(sig.as_str()));
    assert_eq!(app.gw.state.ledger.pending_events().await.unwrap(), 0);
}

#[tokio::test]
async fn egress_goes_through_a_connect_proxy_with_its_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost"]);
    let proxy = spawn_connect_proxy(Some("egress:s3cret")).await;
    // SAFETY: set before the gateway reads its config; the same value in every test.
    unsafe { std::env::set_var("TEST_EGRESS_CREDENTIALS", "egress:s3cret") };
    unsafe { std::env::set_var("TEST_EGRESS_WRONG", "egress:wrong") };
    let app = spawn_with(Opts {
        mock_tls: Some(server(&leaf)),
        route_extra: format!(
            "proxy = \"{}\"\nproxy_credentials_env = \"TEST_EGRESS_CREDENTIALS\"\n{}",
            proxy.url,
            tls_table(&ca, "")
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    assert_eq!(app.charge("p1", BODY).await.status(), 200);
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(app.mock.provider.effects(), 1);
    let tunnels = proxy.tunnels.lock().unwrap().clone();
    let want = format!("localhost:{}", app.mock.addr.port());
    assert!(
        !tunnels.is_empty() && tunnels.iter().all(|t| t == &want),
        "{tunnels:?}"
    );
    assert_eq!(*proxy.refused.lock().unwrap(), 0);

    // Wrong credentials: the proxy refuses the tunnel, nothing is sent.
    let refused = spawn_with(Opts {
        mock_tls: Some(server(&leaf)),
        route_extra: format!(
            "proxy = \"{}\"\nproxy_credentials_env = \"TEST_EGRESS_WRONG\"\n{}\n[routes.retry]\nmax_attempts = 1\n",
            proxy.url,
            tls_table(&ca, "")
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let (status, p) = problem(refused.charge("p2", BODY).await).await;
    assert_eq!(status, 502);
    assert_eq!(p["type"], "urn:effectgate:problem:provider-unreachable");
    assert_eq!(refused.mock.provider.effects(), 0);
    assert_eq!(*proxy.refused.lock().unwrap(), 1);
}

/// The proxy listener over TLS, reached with curl `--cacert`: HTTP/2 by
/// ALPN, `X-Forwarded-Proto: https` upstream, and a certificate renewed
/// on reload; the admin listener's console cookie is `Secure`.
#[tokio::test]
async fn tls_listeners_serve_http2_and_reload_their_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "gw-ca");
    let leaf = ca.server("gateway", &["localhost"]);
    let app = spawn_with(Opts {
        listen_extra: format!(
            "proxy_tls = {{ cert_file = \"{0}\", key_file = \"{1}\" }}\n\
             admin_tls = {{ cert_file = \"{0}\", key_file = \"{1}\" }}",
            leaf.cert_file.display(),
            leaf.key_file.display()
        ),
        ..Default::default()
    })
    .await;
    let port = app.gw.proxy_addr.port();
    let url = format!("https://localhost:{port}/pay/v1/charges?client_ref=x");
    let get = |cafile: String, url: String| async move {
        curl(&[
            "--cacert",
            &cafile,
            "-H",
            &format!("Authorization: Bearer {KEY_A}"),
            "-w",
            "\n%{http_version} %{http_code}",
            &url,
        ])
        .await
    };
    let ca_file = ca.pem.cert_file.display().to_string();
    let (code, out, err) = get(ca_file.clone(), url.clone()).await;
    assert_eq!(code, 0, "{err}");
    let out = String::from_utf8(out).unwrap();
    assert!(out.ends_with("\n2 200"), "HTTP/2 over TLS: {out}");
    let seen = app.mock.provider.requests();
    assert!(
        seen[0]
            .headers
            .iter()
            .any(|(n, v)| n == "x-forwarded-proto" && v == "https"),
        "{seen:?}"
    );
    // HTTP/2's :authority becomes X-Forwarded-Host, as Host does on HTTP/1.1.
    assert!(
        seen[0]
            .headers
            .iter()
            .any(|(n, v)| n == "x-forwarded-host" && *v == format!("localhost:{port}")),
        "{seen:?}"
    );
    // An effectful call over the TLS listener with HTTP/1.1.
    let (code, out, err) = curl(&[
        "--cacert",
        &ca_file,
        "--http1.1",
        "-X",
        "POST",
        "-H",
        &format!("Authorization: Bearer {KEY_A}"),
        "-H",
        "Idempotency-Key: tls-listener",
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        BODY,
        "-w",
        "\n%{http_version} %{http_code}",
        &format!("https://localhost:{port}/pay/v1/charges"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(String::from_utf8(out).unwrap().ends_with("\n1.1 200"));
    assert_eq!(app.mock.provider.effects(), 1);

    // The console's cookies are Secure on the TLS admin listener.
    let (code, out, err) = curl(&[
        "--cacert",
        &ca_file,
        "-D",
        "-",
        "-o",
        "/dev/null",
        &format!(
            "https://localhost:{}/console/login",
            app.gw.admin_addr.port()
        ),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let head = String::from_utf8(out).unwrap();
    let cookie = head
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .unwrap_or_else(|| panic!("{head}"));
    assert!(cookie.ends_with("; Secure"), "{cookie}");

    // Renewal: another CA's certificate in the same files, then a reload.
    let ca2 = Ca::new(dir.path(), "gw-ca-2");
    let renewed = ca2.server("gateway-renewed", &["localhost"]);
    std::fs::write(&leaf.cert_file, &renewed.cert).unwrap();
    std::fs::write(&leaf.key_file, &renewed.key).unwrap();
    app.gw.state.reload(None).await.unwrap();
    let ca2_file = ca2.pem.cert_file.display().to_string();
    let (code, _, err) = get(ca2_file.clone(), url.clone()).await;
    assert_eq!(code, 0, "the renewed certificate is served: {err}");
    let (code, _, _) = get(ca_file.clone(), url.clone()).await;
    assert_eq!(code, 60, "the old CA no longer verifies it");

    // A broken file: the reload is refused and the certificate in use stays.
    std::fs::write(&leaf.cert_file, "not a certificate").unwrap();
    let e = app.gw.state.reload(None).await.unwrap_err();
    assert!(e.contains("listen.proxy_tls.cert_file"), "{e}");
    let (code, _, err) = get(ca2_file, url).await;
    assert_eq!(code, 0, "{err}");
}

#[tokio::test]
async fn unusable_tls_settings_are_config_errors_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let client = ca.client("client", "effectgate");
    let other = ca.client("other", "someone-else");
    let db = dir.path().join("l.db");
    // A valid config first: it also sets the route's credential variable,
    // so each bad one below fails on its own field.
    settings_from(&config_toml("http://127.0.0.1:1", &db, ""), dir.path());
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "nothing here").unwrap();
    let cases: Vec<(String, &str, &str)> = vec![
        (
            "[routes.tls]\nca_file = \"/nonexistent/ca.pem\"".into(),
            "routes[0].tls.ca_file",
            "cannot read /nonexistent/ca.pem",
        ),
        (
            format!("[routes.tls]\nca_file = \"{}\"", garbage.display()),
            "routes[0].tls.ca_file",
            "no PEM CERTIFICATE",
        ),
        (
            format!("[routes.tls]\nclient_cert_file = \"{}\"", client.cert_file.display()),
            "routes[0].tls.client_key_file",
            "must be too",
        ),
        (
            format!(
                "[routes.tls]\nclient_cert_file = \"{}\"\nclient_key_file = \"{}\"",
                client.cert_file.display(),
                other.key_file.display()
            ),
            "routes[0].tls.client_key_file",
            "is not the one in the certificate",
        ),
        (
            "[routes.tls]\nserver_name = \"bad name!\"".into(),
            "routes[0].tls.server_name",
            "neither a DNS name",
        ),
        ("proxy = \"socks5://127.0.0.1:1080\"".into(), "routes[0].proxy", "not an HTTP proxy"),
        ("proxy = \"http://127.0.0.1\"".into(), "routes[0].proxy", "not an HTTP proxy"),
        ("proxy = \"http://u:p@127.0.0.1:3128\"".into(), "routes[0].proxy", "must not hold credentials"),
        (
            "proxy = \"http://127.0.0.1:3128\"\nproxy_credentials_env = \"EFFECTGATE_TEST_UNSET_VAR\"".into(),
            "routes[0].proxy_credentials_env",
            "is not set",
        ),
    ];
    for (extra, field, message) in cases {
        let toml = config_toml("https://localhost:1", &db, &extra);
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, &toml).unwrap();
        let e = effectgate::config::load(Some(&p)).unwrap_err();
        assert_eq!(e.path, field, "{extra}: {e}");
        assert!(e.message.contains(message), "{extra}: {e}");
    }
    // A listener's key that doesn't fit its certificate.
    let toml = config_toml("http://127.0.0.1:1", &db, "").replacen(
        "admin = \"127.0.0.1:0\"\n",
        &format!(
            "admin = \"127.0.0.1:0\"\nproxy_tls = {{ cert_file = \"{}\", key_file = \"{}\" }}\n",
            client.cert_file.display(),
            other.key_file.display()
        ),
        1,
    );
    let p = dir.path().join("bad-listener.toml");
    std::fs::write(&p, &toml).unwrap();
    let e = effectgate::config::load(Some(&p)).unwrap_err();
    assert_eq!(e.path, "listen.proxy_tls.key_file", "{e}");
}
