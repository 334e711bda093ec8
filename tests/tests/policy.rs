//! Tenant policies end to end: decisions through the proxy, per-tenant
//! configs, load-time validation, limits (deadline, memory, traps), output
//! validation, classifier hooks, request contracts and hot reload.

use std::time::{Duration, Instant};

use effectgate_tests::*;
use serde_json::Value;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

fn binding(route: &str, module: &str, config: &str) -> String {
    format!(
        "[[tenants.policies]]\nroute = \"{route}\"\nmodule = \"{}\"\nconfig = {config}\n",
        policy_wasm(module).display()
    )
}

async fn threshold_app() -> TestApp {
    spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        tenant_a: binding(
            "payments",
            "amount_threshold",
            r#"{ threshold = 1000, currencies = ["eur"] }"#,
        ),
        tenant_b: binding("payments", "amount_threshold", r#"{ threshold = 100000 }"#),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn allow_deny_and_require_approval_pass_end_to_end() {
    let app = threshold_app().await;
    // Allow.
    let r = app.charge("small", BODY).await;
    assert_eq!(r.status(), 200);
    let op = app.op_json("small").await;
    assert_eq!(op["state"], "COMPLETED");
    let d = &op["policy_decisions"][0];
    assert_eq!(d["policy"], "amount_threshold");
    assert_eq!(d["decision"], "allow");
    assert_eq!(d["content_hash"].as_str().unwrap().len(), 64);

    // Deny: 403 from the policy, nothing reserved, nothing sent; the decision is kept.
    let r = app.charge("btc", r#"{"amount":5,"currency":"btc"}"#).await;
    assert_eq!(r.status(), 403);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:policy-denied");
    assert_eq!(p["policy"], "amount_threshold");
    assert_eq!(app.operation(ADMIN_A, "a", "btc").await.status(), 404);
    let decisions = app.gw.state.ledger.decisions("a", "btc").await.unwrap();
    assert_eq!(decisions[0]["decision"], "deny");

    // Require approval: 202, AWAITING_APPROVAL, nothing sent.
    let r = app
        .charge("big", r#"{"amount":5000,"currency":"eur"}"#)
        .await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "AWAITING_APPROVAL");
    let op = app.op_json("big").await;
    assert_eq!(op["state"], "AWAITING_APPROVAL");
    let to: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["to_state"].as_str().unwrap())
        .collect();
    assert_eq!(to, vec!["RESERVED", "AWAITING_APPROVAL"]);
    assert_eq!(op["policy_decisions"][0]["decision"], "require-approval");
    // A re-send while pending is still 202 and still sends nothing.
    assert_eq!(
        app.charge("big", r#"{"amount":5000,"currency":"eur"}"#)
            .await
            .status(),
        202
    );
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn each_tenant_has_its_own_config_for_the_same_module() {
    let app = threshold_app().await;
    let big = r#"{"amount":5000,"currency":"usd"}"#;
    // Tenant a: usd is off its list → denied. Tenant b: no list, higher threshold → runs.
    assert_eq!(app.charge_as(KEY_A, "x", big).await.status(), 403);
    assert_eq!(app.charge_as(KEY_B, "x", big).await.status(), 200);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn an_invalid_tenant_config_is_refused_at_start_naming_the_pointer() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml_with(
        &mock.url(),
        &dir.path().join("l.db"),
        "",
        &binding("payments", "amount_threshold", r#"{ threshold = "lots" }"#),
        "",
    );
    let settings = settings_from(&toml, dir.path());
    let err = match effectgate::Gateway::start(settings).await {
        Ok(_) => panic!("the gateway must refuse to start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("tenant \"a\""), "{err}");
    assert!(err.contains("amount_threshold"), "{err}");
    assert!(err.contains("/threshold"), "{err}");
}

async fn misbehaving(module: &str) -> TestApp {
    spawn_with(Opts {
        tenant_a: binding("payments", module, "{}"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_loop_fails_closed_within_50ms_while_others_are_served() {
    let app = misbehaving("busy_loop").await;
    let (stuck, other) = tokio::join!(app.charge("spin", BODY), app.charge_as(KEY_B, "fine", BODY));
    assert_eq!(other.status(), 200, "tenant b is served meanwhile");
    assert_eq!(stuck.status(), 503);
    let p: Value = stuck.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:policy-failed");
    assert!(p["detail"].as_str().unwrap().contains("deadline"), "{p}");
    // The policy call is bounded by the 10 ms deadline: its recorded time
    // must stay under 50 ms (the HTTP round trip around it is looser).
    let t = Instant::now();
    let again = app.charge("spin2", BODY).await;
    assert_eq!(again.status(), 503);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "fail-closed answer took {:?}",
        t.elapsed()
    );
    let d = app.gw.state.ledger.decisions("a", "spin2").await.unwrap();
    assert_eq!(d[0]["decision"], "failed-closed");
    let us = d[0]["duration_us"].as_i64().unwrap();
    assert!(us < 50_000, "the busy loop ran {us} µs");
    // Nothing was reserved or sent for the failed calls; the gateway still serves.
    assert_eq!(app.operation(ADMIN_A, "a", "spin").await.status(), 404);
    assert_eq!(app.charge_as(KEY_B, "fine-2", BODY).await.status(), 200);
    assert_eq!(app.mock.provider.effects(), 2);
}

/// A policy that sleeps (a wait in the host, where the CPU deadline
/// can't reach) fails at once: 503 `policy-failed` naming the wait, with
/// no wasm backtrace in the detail, instead of holding its permit and
/// pool slot for the minute it asked for. Nothing is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_sleeps_fails_at_once() {
    let app = spawn_with(Opts {
        tenant_a: binding("payments", "sleeper", "{ ms = 60000 }"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "nap")
        .header("Content-Type", "application/json")
        .body(BODY)
        .timeout(std::time::Duration::from_secs(30))
        .send()
        .await
        .expect("an answer before the sleep's minute");
    assert_eq!(r.status(), 503);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:policy-failed");
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("the policy tried to wait"), "{detail}");
    assert!(!detail.contains("backtrace"), "{detail}");
    assert_eq!(app.mock.provider.effects(), 0);
    assert_eq!(app.charge_as(KEY_B, "awake", BODY).await.status(), 200);
}

#[tokio::test]
async fn a_memory_hog_and_a_trap_fail_closed_and_the_gateway_goes_on() {
    for module in ["memory_hog", "trap"] {
        let app = misbehaving(module).await;
        let r = app.charge("bad", BODY).await;
        assert_eq!(r.status(), 503, "{module}");
        let p: Value = r.json().await.unwrap();
        assert_eq!(
            p["type"], "urn:effectgate:problem:policy-failed",
            "{module}"
        );
        if module == "memory_hog" {
            assert!(p["detail"].as_str().unwrap().contains("memory"), "{p}");
        }
        assert_eq!(
            app.charge_as(KEY_B, "ok", BODY).await.status(),
            200,
            "{module}: serving afterwards"
        );
        let metrics = app.metrics().await;
        assert!(
            metrics.contains("effectgate_policy_failures_total"),
            "{module}: failure counted"
        );
        assert_eq!(app.mock.provider.effects(), 1);
    }
}

#[tokio::test]
async fn a_route_can_fail_open() {
    let app = spawn_with(Opts {
        route_extra: "policy_fail_open = true".into(),
        tenant_a: binding("payments", "trap", "{}"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    assert_eq!(app.charge("open", BODY).await.status(), 200);
    let op = app.op_json("open").await;
    assert_eq!(op["policy_decisions"][0]["decision"], "failed-open");
}

#[tokio::test]
async fn policy_output_is_validated() {
    for mode in [
        "status",
        "header",
        "credential",
        "long",
        "long-name",
        "content",
        "request-id",
        "non-ascii",
    ] {
        let app = spawn_with(Opts {
            tenant_a: binding(
                "payments",
                "bad_output",
                &format!("{{ mode = \"{mode}\" }}"),
            ),
            more: "[reconcile]\nenabled = false\n".into(),
            ..Default::default()
        })
        .await;
        let r = app.charge("x", BODY).await;
        assert_eq!(r.status(), 503, "{mode}");
        let p: Value = r.json().await.unwrap();
        assert!(
            p["detail"].as_str().unwrap().contains("invalid output"),
            "{mode}: {p}"
        );
        assert_eq!(app.mock.provider.effects(), 0);
        let metrics = app.metrics().await;
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("effectgate_policy_failures_total")
                    && l.contains("kind=\"invalid-output\"")),
            "{mode}: a refused output is counted as a failure\n{metrics}"
        );
    }
}

/// A header a policy adds replaces the caller's of the same name, so a
/// caller can't send first what the policy means to pin.
#[tokio::test]
async fn a_policys_header_replaces_the_callers() {
    let app = spawn_with(Opts {
        tenant_a: binding("payments", "bad_output", "{ mode = \"pin\" }"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with(
            "pin",
            BODY,
            &[("X-Policy-Pin", "forged"), ("x-policy-pin", "again")],
        )
        .await;
    assert_eq!(r.status(), 200);
    let seen = app.mock.provider.requests();
    let pins: Vec<&str> = seen[0]
        .headers
        .iter()
        .filter(|(n, _)| n == "x-policy-pin")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(pins, ["pinned"]);
}

#[tokio::test]
async fn the_classifier_policy_turns_a_provider_api_error_into_a_retry() {
    let app = spawn_with(Opts {
        route_extra: "retry = { max_attempts = 3, base_delay_ms = 1, max_delay_ms = 2 }".into(),
        tenant_a: binding("payments", "retry_classifier", "{}"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    // 500 with {"error":{"type":"api_error"}}: the gateway alone would call it UNKNOWN.
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_status_times: 1,
        fail_status: 500,
        ..Default::default()
    });
    assert_eq!(app.charge("cls", BODY).await.status(), 200);
    let op = app.op_json("cls").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 2);
    // Tenant b has no classifier: the same failure is UNKNOWN.
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_status_times: 1,
        fail_status: 500,
        ..Default::default()
    });
    assert_eq!(app.charge_as(KEY_B, "cls", BODY).await.status(), 502);
}

#[tokio::test]
async fn a_request_contract_rejects_bad_bodies_before_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("charge.schema.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","required":["amount","currency"],"properties":{"amount":{"type":"integer","minimum":1},"currency":{"type":"string"}}}"#,
    )
    .unwrap();
    let app = spawn_with(Opts {
        route_extra: format!("request_schema = \"{}\"", schema.display()),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app.charge("bad", r#"{"amount":-5}"#).await;
    assert_eq!(r.status(), 422);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:contract-violation");
    let pointers: Vec<&str> = p["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["pointer"].as_str().unwrap())
        .collect();
    assert!(pointers.contains(&"/amount"), "{p}");
    assert!(
        pointers.contains(&""),
        "missing currency is reported at the root: {p}"
    );
    assert_eq!(
        app.operation(ADMIN_A, "a", "bad").await.status(),
        404,
        "never reached the ledger"
    );
    assert_eq!(app.charge("good", BODY).await.status(), 200);
    assert_eq!(app.mock.provider.effects(), 1);
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_reload_under_load_swaps_policies_without_failing_requests() {
    // Tenant a alternates between a low threshold (approval) and a high one (allow).
    // The deadline is generous here: this test is about swaps under load,
    // and its load shares the cores with the policy calls it times.
    let app = spawn_with(Opts {
        tenant_a: binding("payments", "amount_threshold", "{ threshold = 1000 }"),
        more: "[reconcile]\nenabled = false\n[policy]\ndeadline_ms = 250\n".into(),
        ..Default::default()
    })
    .await;
    let config_low = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&config_low).unwrap();
    let body = r#"{"amount":500,"currency":"eur"}"#;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (http, url, stop) = (app.http.clone(), app.proxy("/pay/v1/charges"), stop.clone());
        tokio::spawn(async move {
            let mut statuses = std::collections::BTreeMap::<u16, u32>::new();
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let r = http
                    .post(&url)
                    .bearer_auth(KEY_A)
                    .header("Idempotency-Key", format!("load-{n}"))
                    .header("Content-Type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                *statuses.entry(r.status().as_u16()).or_default() += 1;
            }
            statuses
        })
    };
    let mut rss = Vec::new();
    for i in 0..20 {
        let threshold = if i % 2 == 0 { 100 } else { 1000 };
        std::fs::write(
            &config_low,
            text.replace("threshold = 1000", &format!("threshold = {threshold}")),
        )
        .unwrap();
        let summary = app.gw.state.reload(None).await.expect("reload");
        assert!(summary.ends_with(", 1 policy module"), "{summary}");
        // The new decision applies right after the swap.
        let probe = app.charge(&format!("probe-{i}"), body).await;
        let want = if threshold == 100 { 202 } else { 200 };
        assert_eq!(probe.status(), want, "swap {i}");
        rss.push(rss_kib());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = load.await.unwrap();
    let failed: u32 = statuses
        .iter()
        .filter(|(s, _)| ![200u16, 202].contains(s))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(failed, 0, "requests failed during reloads: {statuses:?}");
    assert!(
        statuses.values().sum::<u32>() > 20,
        "the load generator ran: {statuses:?}"
    );
    // One module compiled once, cached by hash, old sets freed: RSS must not
    // keep climbing across swaps (allow 16 MiB of noise after the first half).
    let (first, last) = (rss[9], rss[19]);
    assert!(
        last < first + 16 * 1024,
        "RSS grew from {first} KiB to {last} KiB across reloads: {rss:?}"
    );
    assert_eq!(app.gw.state.engine.cached(), 1);
}

#[tokio::test]
async fn a_bad_reload_keeps_the_old_set() {
    let app = threshold_app().await;
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("threshold = 1000,", "threshold = \"high\","),
    )
    .unwrap();
    let r = app
        .http
        .post(app.admin("/admin/reload"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let p: Value = r.json().await.unwrap();
    assert!(p["detail"].as_str().unwrap().contains("/threshold"), "{p}");
    // Still the old set: 5000 needs approval.
    assert_eq!(
        app.charge("after", r#"{"amount":5000,"currency":"eur"}"#)
            .await
            .status(),
        202
    );
    // A client key can't reload.
    let r = app
        .http
        .post(app.admin("/admin/reload"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
}

#[tokio::test]
async fn policy_test_runs_the_example_case_files_and_fails_on_a_wrong_expectation() {
    // The case files check decisions, not speed (the bench measures that):
    // a deadline a loaded debug build can't miss.
    let engine = effectgate::policy::PolicyEngine::new(&effectgate::config::PolicyLimitsSpec {
        deadline_ms: 1000,
        ..Default::default()
    })
    .unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    for (crate_dir, module) in [
        ("amount-threshold", "amount_threshold"),
        ("replay-matrix", "replay_matrix"),
        ("retry-classifier", "retry_classifier"),
        ("allow-list", "allow_list"),
    ] {
        let cases =
            effectgate::policy::cases::load(&root.join(crate_dir).join("cases.toml")).unwrap();
        let mut out = Vec::new();
        let failed =
            effectgate::policy::cases::run(&engine, &policy_wasm(module), &cases, &mut out)
                .unwrap();
        assert_eq!(failed, 0, "{module}:\n{}", String::from_utf8_lossy(&out));
    }
    let wrong: effectgate::policy::cases::CaseFile = toml_cases(
        r#"config = { threshold = 10 }
[[cases]]
name = "wrong on purpose"
request = { body = { amount = 5000 } }
expect = { decision = "allow" }
"#,
    );
    let mut out = Vec::new();
    let failed =
        effectgate::policy::cases::run(&engine, &policy_wasm("amount_threshold"), &wrong, &mut out)
            .unwrap();
    assert_eq!(failed, 1);
    assert!(
        String::from_utf8_lossy(&out)
            .contains("FAIL  wrong on purpose: expected decision allow, got require-approval")
    );
}

fn toml_cases(text: &str) -> effectgate::policy::cases::CaseFile {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cases.toml");
    std::fs::write(&p, text).unwrap();
    effectgate::policy::cases::load(&p).unwrap()
}

#[tokio::test]
async fn a_policy_that_prints_and_panics_fails_closed_and_the_gateway_goes_on() {
    let app = spawn_with(Opts {
        route_extra: "read_back = { path = \"/v1/charges?idempotency_key={provider_key}\", found_pointer = \"/data/0\", settle_delay_ms = 0 }".into(),
        tenant_a: binding("payments", "panicker", "{}"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app.charge("p", BODY).await;
    assert_eq!(r.status(), 503);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:policy-failed");
    // Tenant b (no policy) is served, before and after.
    assert_eq!(app.charge_as(KEY_B, "fine", BODY).await.status(), 200);
    assert_eq!(app.charge("p", BODY).await.status(), 503);
    assert_eq!(app.charge_as(KEY_B, "fine-2", BODY).await.status(), 200);
    // The reconciler's scan survives a panicking classifier too.
    app.tick().await;
    assert_eq!(app.mock.provider.effects(), 2);
}

/// Waits (up to 10 s, checking every 2 ms) until `cond` holds.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_flooding_with_busy_loops_gets_busy_answers_while_another_is_served() {
    // A pool of 4 slots, 2 per tenant: without per-tenant permits tenant
    // a's flood would take every slot and tenant b's calls would fail.
    // The deadline is generous so that tenant b's fast policy never misses
    // it on a loaded machine; the breaker is off, so tenant a's policy
    // keeps running to its deadline.
    let app = spawn_with(Opts {
        tenant_a: binding("payments", "busy_loop", "{}"),
        tenant_b: binding("payments", "amount_threshold", "{ threshold = 100000 }"),
        more: "[reconcile]\nenabled = false\n[policy]\ndeadline_ms = 200\npool_instances = 4\nmax_concurrent_per_tenant = 2\npermit_wait_ms = 50\nbreaker_failures = 0\n".into(),
        ..Default::default()
    })
    .await;
    let busy_before = counter(
        &app.metrics().await,
        "effectgate_policy_failures_total",
        &["kind=\"busy\""],
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..6)
        .map(|w| {
            let (http, url, stop) = (app.http.clone(), app.proxy("/pay/v1/charges"), stop.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    let r = http
                        .post(&url)
                        .bearer_auth(KEY_A)
                        .header("Idempotency-Key", format!("flood-{w}-{n}"))
                        .header("Content-Type", "application/json")
                        .body(BODY)
                        .send()
                        .await
                        .unwrap();
                    let status = r.status().as_u16();
                    let p: Value = r.json().await.unwrap_or(Value::Null);
                    answers.push((status, p));
                }
                answers
            })
        })
        .collect();
    let engine = app.gw.state.engine.clone();
    wait_until("tenant a holds all its permits", || {
        engine.free_permits("a") == 0
    })
    .await;

    // Tenant b, two calls at a time, while tenant a's permits stay taken.
    let mut b_statuses = Vec::new();
    for i in 0..10 {
        let (kx, ky) = (format!("b-{i}-x"), format!("b-{i}-y"));
        let (x, y) = tokio::join!(
            app.charge_as(KEY_B, &kx, BODY),
            app.charge_as(KEY_B, &ky, BODY)
        );
        b_statuses.extend([x.status().as_u16(), y.status().as_u16()]);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut a_answers = Vec::new();
    for f in flood {
        a_answers.extend(f.await.unwrap());
    }

    assert!(
        b_statuses.iter().all(|s| *s == 200),
        "tenant b: {b_statuses:?}"
    );
    let d = app.gw.state.ledger.decisions("b", "b-9-y").await.unwrap();
    assert_eq!(d[0]["decision"], "allow");
    assert_eq!(d[0]["policy"], "amount_threshold");

    let detail = |p: &Value| p["detail"].as_str().unwrap_or_default().to_owned();
    for (status, p) in &a_answers {
        assert_eq!(*status, 503, "tenant a: {p}");
        assert_eq!(p["type"], "urn:effectgate:problem:policy-failed", "{p}");
    }
    let busy = a_answers
        .iter()
        .filter(|(_, p)| detail(p).contains("(busy)"))
        .count();
    let deadline = a_answers
        .iter()
        .filter(|(_, p)| detail(p).contains("deadline"))
        .count();
    assert!(busy > 0, "tenant a got no busy answer: {a_answers:?}");
    assert!(deadline > 0, "tenant a's policy ran: {a_answers:?}");
    assert_eq!(busy + deadline, a_answers.len(), "{a_answers:?}");
    let busy_after = counter(
        &app.metrics().await,
        "effectgate_policy_failures_total",
        &["kind=\"busy\""],
    );
    assert!(
        busy_after - busy_before >= busy as f64,
        "busy answers counted: {busy_before} → {busy_after}, {busy} answers"
    );
    assert_eq!(app.mock.provider.effects(), 20, "only tenant b's calls ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_policy_opens_its_circuit_until_a_trial_call_succeeds() {
    // The module sits under one name ("gate") so that a healthy one can
    // take its place on reload, behind the same circuit.
    let modules = tempfile::tempdir().unwrap();
    let module = modules.path().join("gate.wasm");
    std::fs::copy(policy_wasm("trap"), &module).unwrap();
    let app = spawn_with(Opts {
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 100000 }}\n",
            module.display()
        ),
        more: "[reconcile]\nenabled = false\n[policy]\nbreaker_failures = 3\nbreaker_cooldown_ms = 200\n"
            .into(),
        ..Default::default()
    })
    .await;
    let trips = |m: &str| {
        counter(
            m,
            "effectgate_policy_breaker_trips_total",
            &["tenant=\"a\"", "policy=\"gate\""],
        )
    };
    let open = |m: &str| {
        counter(
            m,
            "effectgate_policy_failures_total",
            &["kind=\"circuit-open\""],
        )
    };
    let before = app.metrics().await;
    let detail = |p: &Value| p["detail"].as_str().unwrap_or_default().to_owned();

    // Three traps in a row: each runs the policy and fails closed.
    let mut tripped_after = Instant::now();
    for i in 0..3 {
        tripped_after = Instant::now();
        let r = app.charge(&format!("trap-{i}"), BODY).await;
        assert_eq!(r.status(), 503);
        let p: Value = r.json().await.unwrap();
        assert!(detail(&p).contains("trapped"), "{p}");
    }

    // Now the circuit is open: answered at once, nothing instantiated.
    let engine = app.gw.state.engine.clone();
    let instances = engine.instantiations();
    for i in 0..5 {
        let r = app.charge(&format!("open-{i}"), BODY).await;
        assert_eq!(r.status(), 503);
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["type"], "urn:effectgate:problem:policy-failed", "{p}");
        assert_eq!(p["policy"], "gate", "{p}");
        assert!(detail(&p).contains("circuit open"), "{p}");
    }
    assert_eq!(
        engine.instantiations(),
        instances,
        "no instance while the circuit is open"
    );
    let d = app.gw.state.ledger.decisions("a", "open-0").await.unwrap();
    assert_eq!(d[0]["decision"], "failed-closed");
    assert!(
        d[0]["reason"].as_str().unwrap().contains("circuit open"),
        "{d:?}"
    );
    let after = app.metrics().await;
    assert_eq!(trips(&after) - trips(&before), 1.0, "one trip\n{after}");
    assert!(open(&after) - open(&before) >= 5.0, "{after}");
    // Tenant b (no policy) is not affected.
    assert_eq!(app.charge_as(KEY_B, "b", BODY).await.status(), 200);

    // A healthy module takes the failing one's place; after the cool-down
    // the first call is the trial, and its success closes the circuit.
    std::fs::copy(policy_wasm("amount_threshold"), &module).unwrap();
    app.gw.state.reload(None).await.expect("reload");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    let closed_at = loop {
        n += 1;
        let r = app.charge(&format!("after-{n}"), BODY).await;
        if r.status() == 200 {
            break Instant::now();
        }
        assert_eq!(r.status(), 503);
        let p: Value = r.json().await.unwrap();
        assert!(detail(&p).contains("circuit open"), "{p}");
        assert!(Instant::now() < deadline, "the circuit never closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        closed_at - tripped_after >= Duration::from_millis(200),
        "closed {:?} after the trip, before the cool-down ended",
        closed_at - tripped_after
    );
    let d = app
        .gw
        .state
        .ledger
        .decisions("a", &format!("after-{n}"))
        .await
        .unwrap();
    assert_eq!(d[0]["decision"], "allow");
    // Closed: calls run the policy again.
    assert_eq!(app.charge("closed", BODY).await.status(), 200);
    assert!(engine.instantiations() >= instances + 2);
    assert_eq!(trips(&app.metrics().await) - trips(&before), 1.0);
    assert_eq!(app.mock.provider.effects(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_open_route_without_a_free_permit_forwards_and_counts_the_failure() {
    // One permit per tenant and no waiting: while tenant a's busy loop
    // holds its permit, its next call finds none.
    let app = spawn_with(Opts {
        route_extra: "policy_fail_open = true".into(),
        tenant_a: binding("payments", "busy_loop", "{}"),
        more: "[reconcile]\nenabled = false\n[policy]\ndeadline_ms = 500\nmax_concurrent_per_tenant = 1\npermit_wait_ms = 0\n".into(),
        ..Default::default()
    })
    .await;
    let busy = |m: &str| counter(m, "effectgate_policy_failures_total", &["kind=\"busy\""]);
    let before = busy(&app.metrics().await);
    let engine = app.gw.state.engine.clone();
    let (held, refused) = tokio::join!(app.charge("held", BODY), async {
        wait_until("the busy loop holds tenant a's permit", || {
            engine.free_permits("a") == 0
        })
        .await;
        app.charge("refused", BODY).await
    });
    assert_eq!(refused.status(), 200, "fail open: forwarded");
    assert_eq!(held.status(), 200, "fail open after the deadline");
    let op = app.op_json("refused").await;
    let d = &op["policy_decisions"][0];
    assert_eq!(d["policy"], "busy_loop");
    assert_eq!(d["decision"], "failed-open");
    assert!(d["reason"].as_str().unwrap().contains("(busy)"), "{op}");
    let op = app.op_json("held").await;
    assert_eq!(op["policy_decisions"][0]["decision"], "failed-open");
    assert!(
        op["policy_decisions"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("deadline"),
        "{op}"
    );
    let after = busy(&app.metrics().await);
    assert!(after - before >= 1.0, "busy counted: {before} → {after}");
    assert_eq!(app.mock.provider.effects(), 2);
}
