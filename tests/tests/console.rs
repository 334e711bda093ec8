//! The operator console: sessions, CSRF, no editing, and the end-to-end
//! flow in a real browser (headless Chromium driven by playwright-core).

use effectgate_tests::*;
use serde_json::Value;

const BIG: &str = r#"{"amount":5000,"currency":"eur"}"#;

async fn console_app() -> TestApp {
    spawn_with(Opts {
        route_extra: "effect_class = \"payment\"\nexecute_on_approval = true".into(),
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000 }}\n",
            policy_wasm("amount_threshold").display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await
}

/// The status of the approvals page asked for with the `session` cookie
/// (200 with a live session, a redirect to the login page without).
async fn approvals_page(app: &TestApp, session: String) -> reqwest::StatusCode {
    no_redirects()
        .get(app.admin("/console/approvals"))
        .header("cookie", session)
        .send()
        .await
        .unwrap()
        .status()
}

fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The login form's token, from the page and from its cookie.
async fn login_form(app: &TestApp) -> (String, String) {
    let r = no_redirects()
        .get(app.admin("/console/login"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    let cookie = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .find(|c| c.starts_with("eg_login="))
        .expect("the login form sets its cookie");
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    let cookie_token = cookie["eg_login=".len()..]
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let html = r.text().await.unwrap();
    (cookie_token, csrf_of(&html))
}

async fn login(app: &TestApp, key: &str) -> reqwest::Response {
    let (cookie, token) = login_form(app).await;
    assert_eq!(cookie, token);
    no_redirects()
        .post(app.admin("/console/login"))
        .header("cookie", format!("eg_login={cookie}"))
        .form(&[("key", key), ("csrf", token.as_str())])
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_login_post_without_the_forms_token_is_refused() {
    let app = console_app().await;
    let post = |cookie: Option<String>, token: Option<String>| {
        let mut b = no_redirects().post(app.admin("/console/login"));
        if let Some(c) = cookie {
            b = b.header("cookie", format!("eg_login={c}"));
        }
        let mut form = vec![("key", APPROVER_A.to_owned())];
        if let Some(t) = token {
            form.push(("csrf", t));
        }
        b.form(&form).send()
    };
    let (cookie, token) = login_form(&app).await;
    // No cookie (a form posted from another site), no field, a wrong field.
    for (c, t) in [
        (None, Some(token.clone())),
        (Some(cookie.clone()), None),
        (Some(cookie.clone()), Some("0".repeat(48))),
        (Some(String::new()), Some(String::new())),
    ] {
        let r = post(c, t).await.unwrap();
        assert_eq!(r.status(), 403);
        assert!(
            r.headers()
                .get_all("set-cookie")
                .iter()
                .all(|v| !v.to_str().unwrap().starts_with("eg_session=")),
            "no session is created"
        );
    }
    // With both, equal: a session.
    let r = post(Some(cookie), Some(token)).await.unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/console");
    let cookies: Vec<String> = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert!(cookies.iter().any(|c| c.starts_with("eg_session=")));
    assert!(
        cookies
            .iter()
            .any(|c| c.starts_with("eg_login=;") && c.contains("Max-Age=0"))
    );
}

#[tokio::test]
async fn sessions_are_httponly_cookies_and_posts_need_the_csrf_token() {
    let app = console_app().await;
    let r = app.charge("k", BIG).await;
    let v: Value = r.json().await.unwrap();
    let id = v["approval_id"].as_str().unwrap().to_owned();

    // Without a session: to the login page.
    let r = no_redirects()
        .get(app.admin("/console/approvals"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/console/login");
    // A client key or a wrong key can't log in.
    assert_eq!(login(&app, KEY_A).await.status(), 403);
    assert_eq!(login(&app, "nope").await.status(), 401);

    let r = login(&app, APPROVER_A).await;
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    let page = no_redirects()
        .get(app.admin("/console/approvals"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains(&id), "the pending approval is listed");
    assert!(
        page.contains("&quot;amount&quot;: 5000") || page.contains("\"amount\": 5000"),
        "the exact body is shown"
    );
    // Its expiry in ISO 8601 (UTC) with a relative hint: the default
    // lifetime is 24 h.
    let approval = app
        .gw
        .state
        .ledger
        .approval("a", &id)
        .await
        .unwrap()
        .unwrap();
    let expires = effectgate::times::rfc3339(approval.expires_at).unwrap();
    assert!(
        page.contains(&format!(
            "expires <span class=\"expires\">{expires} (in 23 h)</span>"
        )),
        "{page}"
    );

    // A POST without the token is refused and changes nothing.
    let r = no_redirects()
        .post(app.admin(&format!("/console/approvals/{id}/decide")))
        .header("cookie", &session)
        .form(&[("decision", "approve"), ("csrf", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    // A form without its decision, or a body that is no form, is a 400
    // naming what is wrong, and changes nothing either.
    let decide = app.admin(&format!("/console/approvals/{id}/decide"));
    let r = no_redirects()
        .post(&decide)
        .header("cookie", &session)
        .form(&[("csrf", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/problem+json")
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["field"], "form:decision", "{v}");
    let r = no_redirects()
        .post(&decide)
        .header("cookie", &session)
        .json(&serde_json::json!({"decision": "approve", "csrf": "forged"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["field"], "header:content-type", "{v}");
    let a: Value = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{id}")))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["status"], "pending");
}

#[tokio::test]
async fn browser_login_approve_execute_timeline() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let node_path = std::env::var("NODE_PATH").unwrap_or_else(|_| {
        format!(
            "{}/.cache/effectgate-node/node_modules",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let have_browser = std::path::Path::new(&chromium).exists()
        && std::path::Path::new(&node_path)
            .join("playwright-core")
            .exists();
    if !have_browser {
        skips::skip(
            "Chromium and playwright-core",
            &format!(
                "no {chromium}, or no playwright-core in {node_path} (apt-get install chromium; npm install --prefix ~/.cache/effectgate-node playwright-core@1; or set CHROMIUM and NODE_PATH; .ci/run does both)"
            ),
        );
        return;
    }
    let app = console_app().await;
    assert_eq!(app.charge("browser-op", BIG).await.status(), 202);
    let artifacts =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("console-e2e.png");
    let _ = std::fs::remove_file(&shot);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console/e2e.cjs");
    let admin = format!("http://{}", app.gw.admin_addr);
    let out = tokio::process::Command::new("node")
        .arg(&script)
        .args([&admin, APPROVER_A, "browser-op"])
        .arg(&shot)
        .env("NODE_PATH", &node_path)
        .env("CHROMIUM", &chromium)
        .output()
        .await
        .expect("run node");
    assert!(
        out.status.success(),
        "browser flow failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 1000,
        "screenshot saved"
    );
    assert_eq!(
        app.mock.provider.effects(),
        1,
        "the approved operation executed once"
    );
    let op = app.op_json("browser-op").await;
    assert_eq!(op["state"], "COMPLETED");
    eprintln!("screenshot: {}", shot.display());
}

#[tokio::test]
async fn operators_see_operation_pages_and_a_revoked_key_ends_its_session() {
    let app = console_app().await;
    assert_eq!(
        app.charge("small", r#"{"amount":5,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    let r = login(&app, OPERATOR_A).await;
    let session = r.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    for path in [
        "/console",
        "/console/operations",
        "/console/operations?state=COMPLETED",
        "/console/operations/small",
    ] {
        let r = no_redirects()
            .get(app.admin(path))
            .header("cookie", &session)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let page = no_redirects()
        .get(app.admin("/console/operations/small"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("EXECUTING → COMPLETED"),
        "the timeline is shown"
    );
    assert!(
        page.contains("id=\"replay\""),
        "an operator can replay from the page"
    );

    // An id with `/` and dot segments stays one path segment in links and
    // forms, so it can't point the Replay form at another operation.
    assert_eq!(
        app.charge("zz/../small", r#"{"amount":6,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    let list = no_redirects()
        .get(app.admin("/console/operations"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        list.contains("href=\"/console/operations/zz%2F%2E%2E%2Fsmall\""),
        "{list}"
    );
    let page = no_redirects()
        .get(app.admin("/console/operations/zz%2F%2E%2E%2Fsmall"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("action=\"/console/operations/zz%2F%2E%2E%2Fsmall/replay\""),
        "{page}"
    );

    // Revoke the operator's key: its session ends at the reload.
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let revoked = text.replace(&sha(OPERATOR_A), &sha("a-new-operator-key"));
    assert_ne!(revoked, text, "the key was in the config");
    std::fs::write(&path, revoked).unwrap();
    app.gw.state.reload(None).await.unwrap();
    let r = no_redirects()
        .get(app.admin("/console/operations"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303, "back to the login page");
}

fn sha(k: &str) -> String {
    effectgate::config::key_digest(k)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The Compensate button: shown to operators on COMPLETED operations of a
/// route with a compensation, refused without the CSRF token, and once
/// pressed the page shows the compensation and the operation COMPENSATED.
#[tokio::test]
async fn operators_compensate_a_completed_operation_from_its_page() {
    let app = spawn_with(Opts {
        route_extra: r#"effect_class = "payment"
[routes.read_back]
path = "/v1/charges?idempotency_key={provider_key}"
found_pointer = "/data/0"
reference_pointer = "/id"
[routes.compensation]
path = "/v1/refunds"
body = { charge = "{reference}" }
"#
        .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    assert_eq!(app.charge("c1", r#"{"amount":100}"#).await.status(), 200);
    // An approver sees no button; an operator does.
    let approver = cookie_of(login(&app, APPROVER_A).await);
    assert!(
        !page_of(&app, &approver, "c1")
            .await
            .contains("id=\"compensate\"")
    );
    let operator = cookie_of(login(&app, OPERATOR_A).await);
    let html = page_of(&app, &operator, "c1").await;
    assert!(
        html.contains("action=\"/console/operations/c1/compensate\""),
        "{html}"
    );
    let csrf = csrf_of(&html);
    // Without the token: 403, nothing sent.
    let r = no_redirects()
        .post(app.admin("/console/operations/c1/compensate"))
        .header("cookie", &operator)
        .form(&[("reason", "wrong customer"), ("csrf", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(app.mock.provider.refunds().is_empty());
    let done = no_redirects()
        .post(app.admin("/console/operations/c1/compensate"))
        .header("cookie", &operator)
        .form(&[("reason", "wrong customer"), ("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        done.contains("href=\"/console/operations/c1%23compensation\""),
        "the page links the compensation: {done}"
    );
    assert!(
        done.contains("<span class=\"state\" id=\"state\">COMPENSATED</span>"),
        "{done}"
    );
    assert!(!done.contains("id=\"compensate\""), "no second button");
    assert_eq!(app.mock.provider.refunds().len(), 1);
    assert_eq!(app.op_json("c1").await["state"], "COMPENSATED");
    // The compensation's own page links back to what it undid.
    let child = page_of(&app, &operator, "c1%23compensation").await;
    assert!(child.contains("href=\"/console/operations/c1\""), "{child}");
}

/// The Replay button on a COMPLETED operation: refused without the CSRF
/// token and for an approver; an operator's press shows the use case's
/// report on the page (the stored result stands) and the provider is not
/// called again.
#[tokio::test]
async fn operators_replay_a_completed_operation_from_its_page() {
    let app = console_app().await;
    assert_eq!(app.charge("r1", r#"{"amount":100}"#).await.status(), 200);
    let operator = cookie_of(login(&app, OPERATOR_A).await);
    let html = page_of(&app, &operator, "r1").await;
    assert!(
        html.contains("action=\"/console/operations/r1/replay\""),
        "{html}"
    );
    let csrf = csrf_of(&html);
    let path = "/console/operations/r1/replay";
    let (status, _) = post_form(&app, &operator, path, &[("csrf", "forged")]).await;
    assert_eq!(status, 403);
    // An approver posting with its own session's token is refused by the
    // use case, and the page says so.
    let approver = cookie_of(login(&app, APPROVER_A).await);
    let approver_csrf = csrf_of(&page_of(&app, &approver, "r1").await);
    let (status, page) = post_form(
        &app,
        &approver,
        path,
        &[("csrf", approver_csrf.as_str()), ("reason", "try")],
    )
    .await;
    assert_eq!(status, 403, "the page has the refusal's status");
    assert!(page.contains("urn:effectgate:problem:forbidden"), "{page}");
    let (status, page) = post_form(
        &app,
        &operator,
        path,
        &[("csrf", csrf.as_str()), ("reason", "customer asked")],
    )
    .await;
    assert_eq!(status, 200);
    assert!(page.contains("stored result stands"), "{page}");
    assert!(
        page.contains("&quot;provider_called&quot;: false"),
        "{page}"
    );
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.mock.provider.requests().len(), 1);
    assert_eq!(app.op_json("r1").await["state"], "COMPLETED");
}

async fn page_of(app: &TestApp, cookie: &str, id: &str) -> String {
    no_redirects()
        .get(app.admin(&format!("/console/operations/{id}")))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A console session ends `limits.console_session_ms` after its login (the
/// cookie's `Max-Age` says so too), on the gateway's clock.
#[tokio::test]
async fn a_console_session_ends_after_its_configured_lifetime() {
    let clock = effectgate::ledger::ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        more: "[reconcile]\nenabled = false\n[limits]\nconsole_session_ms = 60000\n".into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let r = login(&app, APPROVER_A).await;
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("Max-Age=60"), "{cookie}");
    let session = cookie.split(';').next().unwrap().to_owned();
    let page = |session: String| approvals_page(&app, session);
    assert_eq!(page(session.clone()).await, 200);
    clock.advance(59_999);
    assert_eq!(
        page(session.clone()).await,
        200,
        "still within its lifetime"
    );
    clock.advance(2);
    assert_eq!(page(session).await, 303, "ended: back to the login page");
}

/// The session cookie a login sets.
fn cookie_of(r: reqwest::Response) -> String {
    r.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned()
}

/// The CSRF token of a console page's forms.
fn csrf_of(html: &str) -> String {
    let field = "name=\"csrf\" value=\"";
    let at = html.find(field).expect("a form with the token") + field.len();
    html[at..].split('"').next().unwrap().to_owned()
}

/// Posts a console form as `cookie` and returns the page it answers with.
async fn post_form(
    app: &TestApp,
    cookie: &str,
    path: &str,
    form: &[(&str, &str)],
) -> (u16, String) {
    let r = no_redirects()
        .post(app.admin(path))
        .header("cookie", cookie)
        .form(form)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The Resolve form: shown to operators on UNKNOWN operations only,
/// refused without the CSRF token, an unknown outcome answered (400) with
/// the problem naming `form:outcome`; "completed" ends the operation
/// COMPLETED with the reference given, by the operator, and nothing is
/// sent to the provider again.
#[tokio::test]
async fn operators_resolve_an_unknown_operation_from_its_page() {
    let app = spawn_with(Opts {
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with(
            "u1",
            r#"{"amount":100}"#,
            &[("X-Mock-Fault", "drop-after-effect")],
        )
        .await;
    assert_eq!(r.status(), 502);
    assert_eq!(app.op_json("u1").await["state"], "UNKNOWN");
    let approver = cookie_of(login(&app, APPROVER_A).await);
    let approver_page = page_of(&app, &approver, "u1").await;
    assert!(
        approver_page.contains("id=\"state\">UNKNOWN<"),
        "{approver_page}"
    );
    assert!(!approver_page.contains("id=\"resolve\""));
    // An approver posting the form anyway (with the session's own token)
    // is refused, and nothing changes.
    let (status, page) = post_form(
        &app,
        &approver,
        "/console/operations/u1/resolve",
        &[
            ("outcome", "completed"),
            ("provider_reference", "ch_1"),
            ("reason", "not mine to decide"),
            ("csrf", &csrf_of(&approver_page)),
        ],
    )
    .await;
    assert_eq!(status, 403, "the page has the refusal's status");
    assert!(page.contains("urn:effectgate:problem:forbidden"), "{page}");
    assert_eq!(app.op_json("u1").await["state"], "UNKNOWN");
    let operator = cookie_of(login(&app, OPERATOR_A).await);
    let html = page_of(&app, &operator, "u1").await;
    assert!(
        html.contains("action=\"/console/operations/u1/resolve\""),
        "{html}"
    );
    assert!(
        !html.contains("id=\"requeue\""),
        "not a dead letter: {html}"
    );
    let csrf = csrf_of(&html);
    let path = "/console/operations/u1/resolve";
    let (status, _) = post_form(
        &app,
        &operator,
        path,
        &[("outcome", "completed"), ("csrf", "forged")],
    )
    .await;
    assert_eq!(status, 403);
    let (status, page) = post_form(
        &app,
        &operator,
        path,
        &[("outcome", "maybe"), ("reason", "x"), ("csrf", &csrf)],
    )
    .await;
    assert_eq!(status, 400);
    assert!(page.contains("form:outcome"), "{page}");
    assert_eq!(app.op_json("u1").await["state"], "UNKNOWN");
    let (status, page) = post_form(
        &app,
        &operator,
        path,
        &[
            ("outcome", "completed"),
            ("provider_reference", "ch_1"),
            ("reason", "seen in the provider's dashboard"),
            ("csrf", &csrf),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        page.contains("<span class=\"state\" id=\"state\">COMPLETED</span>"),
        "{page}"
    );
    assert!(!page.contains("id=\"resolve\""), "no second form");
    let op = app.op_json("u1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], "ch_1");
    let last = op["transitions"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["from_state"], "UNKNOWN");
    assert!(
        last["actor"].as_str().unwrap().contains("operator"),
        "{last}"
    );
    assert!(
        TestApp::last_reason(&op).contains("seen in the provider's dashboard"),
        "{op}"
    );
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 1, "nothing sent again");
}

/// The Requeue button: shown to operators and admins on dead letters
/// (here of a payment route with a read-back, whose replay verdict lets a
/// dead letter run again under the same operation), as the admin API's
/// `…/requeue` allows both; not to approvers. Pressed by an admin once the
/// provider is back, the operation is read back (absent) and attempted
/// again with the same provider key, and ends COMPLETED.
#[tokio::test]
async fn operators_and_admins_requeue_a_dead_letter_from_its_page() {
    let app = spawn_with(Opts {
        route_extra: r#"effect_class = "payment"
[routes.read_back]
path = "/v1/charges?idempotency_key={provider_key}"
found_pointer = "/data/0"
reference_pointer = "/id"
"#
        .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 100,
        ..Default::default()
    });
    assert_eq!(app.charge("d1", r#"{"amount":100}"#).await.status(), 503);
    let op = app.op_json("d1").await;
    assert_eq!(
        (op["state"].as_str(), op["dead_letter"].as_bool()),
        (Some("FAILED"), Some(true))
    );
    assert_eq!(app.mock.provider.effects(), 0);
    let operator = cookie_of(login(&app, OPERATOR_A).await);
    let html = page_of(&app, &operator, "d1").await;
    assert!(
        html.contains("action=\"/console/operations/d1/requeue\""),
        "{html}"
    );
    assert!(!html.contains("id=\"resolve\""), "not UNKNOWN: {html}");
    let path = "/console/operations/d1/requeue";
    let (status, _) = post_form(
        &app,
        &operator,
        path,
        &[("reason", "provider is back"), ("csrf", "forged")],
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(app.op_json("d1").await["requeues"], 0);
    app.mock
        .provider
        .set_faults(mock_provider::Faults::default());
    // An approver posting the form (with the session's own token) is
    // refused, and nothing runs.
    let approver = cookie_of(login(&app, APPROVER_A).await);
    let approver_page = page_of(&app, &approver, "d1").await;
    assert!(
        approver_page.contains("id=\"state\">FAILED<"),
        "{approver_page}"
    );
    assert!(!approver_page.contains("id=\"requeue\""));
    let (status, page) = post_form(
        &app,
        &approver,
        path,
        &[
            ("reason", "not mine to decide"),
            ("csrf", &csrf_of(&approver_page)),
        ],
    )
    .await;
    assert_eq!(status, 403, "the page has the refusal's status");
    assert!(page.contains("urn:effectgate:problem:forbidden"), "{page}");
    let op = app.op_json("d1").await;
    assert_eq!(
        (op["requeues"].as_i64(), op["dead_letter"].as_bool()),
        (Some(0), Some(true))
    );
    assert_eq!(app.mock.provider.effects(), 0);
    // An admin of the tenant sees Requeue (not Replay, an operator's own)
    // and presses it.
    let admin = cookie_of(login(&app, ADMIN_A).await);
    let admin_page = page_of(&app, &admin, "d1").await;
    assert!(
        admin_page.contains("action=\"/console/operations/d1/requeue\""),
        "{admin_page}"
    );
    assert!(!admin_page.contains("id=\"replay\""), "{admin_page}");
    let (status, page) = post_form(
        &app,
        &admin,
        path,
        &[
            ("reason", "provider is back"),
            ("csrf", &csrf_of(&admin_page)),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        page.contains("<span class=\"state\" id=\"state\">COMPLETED</span>"),
        "{page}"
    );
    let op = app.op_json("d1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["dead_letter"], false);
    assert_eq!(op["requeues"], 1);
    let requeued = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["from_state"] == "FAILED")
        .unwrap()
        .clone();
    assert_eq!(
        (requeued["actor"].as_str(), requeued["reason"].as_str()),
        (Some("a:admin"), Some("requeued by admin: provider is back")),
        "{op}"
    );
    assert_eq!(app.mock.provider.effects(), 1);
}

/// A dead letter whose read-backs kept failing (reconciliation out of
/// bounds) tells the operator to resolve it as completed if the effect
/// exists: its page offers Resolve beside Requeue, and resolving ends it
/// COMPLETED without a provider call.
#[tokio::test]
async fn operators_resolve_a_dead_letter_past_reconciliations_bounds() {
    let clock = effectgate::ledger::ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: r#"effect_class = "payment"
[routes.read_back]
path = "/v1/charges?idempotency_key={provider_key}"
found_pointer = "/data/0"
reference_pointer = "/id"
"#
        .into(),
        more: "[reconcile]\nenabled = false\nmax_read_backs = 1\nbackoff_base_ms = 100\nbackoff_max_ms = 100\n"
            .into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with(
            "o1",
            r#"{"amount":100}"#,
            &[("X-Mock-Fault", "drop-after-effect")],
        )
        .await;
    assert_eq!(r.status(), 502);
    app.mock.provider.set_faults(mock_provider::Faults {
        readback_fail_times: 10,
        ..Default::default()
    });
    for _ in 0..4 {
        clock.advance(1000);
        app.tick().await;
    }
    let op = app.op_json("o1").await;
    assert_eq!(
        op["dead_letter_reason"], "reconciliation-out-of-bounds",
        "{op}"
    );
    let operator = cookie_of(login(&app, OPERATOR_A).await);
    let html = page_of(&app, &operator, "o1").await;
    assert!(
        html.contains("action=\"/console/operations/o1/resolve\""),
        "{html}"
    );
    assert!(
        html.contains("action=\"/console/operations/o1/requeue\""),
        "{html}"
    );
    let (status, page) = post_form(
        &app,
        &operator,
        "/console/operations/o1/resolve",
        &[
            ("outcome", "completed"),
            ("provider_reference", "ch_1"),
            ("reason", "found in the provider's dashboard"),
            ("csrf", &csrf_of(&html)),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert!(page.contains("id=\"state\">COMPLETED<"), "{page}");
    let op = app.op_json("o1").await;
    assert_eq!(
        (op["state"].as_str(), op["dead_letter"].as_bool()),
        (Some("COMPLETED"), Some(false))
    );
    assert_eq!(op["provider_reference"], "ch_1");
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 1, "nothing sent again");
}

/// A key keeps `limits.console_sessions_per_key` sessions at most: a login
/// past it ends that key's session nearest its end, and no other key's.
#[tokio::test]
async fn a_key_keeps_a_bounded_number_of_console_sessions() {
    let clock = effectgate::ledger::ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        more: "[reconcile]\nenabled = false\n[limits]\nconsole_sessions_per_key = 2\n".into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let works = |session: String| {
        let page = approvals_page(&app, session);
        async move { page.await == 200 }
    };
    let other = cookie_of(login(&app, OPERATOR_A).await);
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(cookie_of(login(&app, APPROVER_A).await));
        clock.advance(1_000);
    }
    assert!(!works(sessions[0].clone()).await, "the first ended");
    assert!(works(sessions[1].clone()).await);
    assert!(works(sessions[2].clone()).await);
    assert!(works(other).await, "another key's session stays");
}
