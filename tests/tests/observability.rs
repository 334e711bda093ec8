//! Metrics that exist from start-up, and the shipped operator assets
//! (`examples/observability`) checked against what the gateway exports.
//! (No test here sends calls before the zero check: the recorder is
//! process-wide.)

use std::collections::BTreeSet;
use std::path::PathBuf;

use effectgate_tests::*;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A gateway whose config defines every kind of label: a bound policy, a
/// tenant with a stored-bytes quota, an MCP route, an inbox source.
async fn full_app() -> TestApp {
    spawn_with(Opts {
        tenant_a: format!(
            "max_stored_bytes = 1000000\n[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 100000 }}\n",
            policy_wasm("amount_threshold").display()
        ),
        more: "[[routes]]\nname = \"tools\"\nprefix = \"/tools/\"\nupstream = \"http://127.0.0.1:9\"\nmode = \"mcp\"\neffect_class = \"notification\"\n\
               [[inbox]]\nname = \"stripe\"\ntenant = \"a\"\nscheme = \"stripe\"\nsecrets = [{ env = \"MOCK_PROVIDER_SECRET\" }]\n".into(),
        ..Default::default()
    })
    .await
}

/// The text of the README's section `## <title>`, up to the next `## `.
fn readme_section(title: &str) -> String {
    let text = std::fs::read_to_string(repo().join("README.md")).unwrap();
    text.split(&format!("\n## {title}\n"))
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .unwrap_or_else(|| panic!("no README section {title:?}"))
        .to_owned()
}

/// The metric families the README's metrics table lists.
fn readme_families() -> BTreeSet<String> {
    let section = readme_section("Metrics");
    let mut out = BTreeSet::new();
    for line in section.lines().filter(|l| l.starts_with("| `effectgate_")) {
        let name = line.split('`').nth(1).unwrap();
        out.insert(name.to_owned());
    }
    assert!(out.len() >= 25, "the README's metric table: {out:?}");
    out
}

/// Family names in a Prometheus text exposition (histogram series folded
/// into their family).
fn exported_families(text: &str) -> BTreeSet<String> {
    let histograms = histogram_families(text);
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .map(|series| family(series, &histograms))
        .collect()
}

/// Families a Prometheus text exposition declares as histograms
/// (`# TYPE f histogram`).
fn histogram_families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" histogram"))
        .map(str::to_owned)
        .collect()
}

fn family(series: &str, histograms: &BTreeSet<String>) -> String {
    for suffix in ["_bucket", "_count", "_sum"] {
        if let Some(f) = series.strip_suffix(suffix)
            && (f.ends_with("_seconds") || histograms.contains(f))
        {
            return f.to_owned();
        }
    }
    series.to_owned()
}

#[tokio::test]
async fn a_fresh_gateway_exports_every_readme_family_at_zero() {
    let app = full_app().await;
    let text = app.metrics().await;
    let exported = exported_families(&text);
    let missing: Vec<_> = readme_families()
        .into_iter()
        .filter(|f| !exported.contains(f))
        .collect();
    assert!(
        missing.is_empty(),
        "missing on a fresh gateway: {missing:?}\n{text}"
    );
    for series in [
        "effectgate_stale_fence_rejections_total 0",
        "effectgate_reconciliation_drift_total 0",
        "effectgate_ledger_up 1",
        "effectgate_outbox_lag_seconds 0",
        "effectgate_unknown_operations{tenant=\"a\"} 0",
        "effectgate_unknown_oldest_age_seconds{tenant=\"b\"} 0",
        "effectgate_dead_letters{tenant=\"b\"} 0",
        "effectgate_upstream_latency_seconds_count{route=\"payments\"} 0",
        "effectgate_inbox_received_total{source=\"stripe\",outcome=\"duplicate\"} 0",
        "effectgate_inbox_rejected_total{source=\"stripe\",check=\"signature-mismatch\"} 0",
        "effectgate_inbox_quarantined_events{source=\"stripe\"} 0",
        "effectgate_inbox_delivery_lag_seconds_count{source=\"stripe\"} 0",
    ] {
        assert!(text.contains(series), "{series} in\n{text}");
    }
    for (route, outcome) in [("payments", "replayed"), ("payments", "forwarded")] {
        let line =
            format!("effectgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}} 0");
        let alt = format!("effectgate_requests_total{{outcome=\"{outcome}\",route=\"{route}\"}} 0");
        assert!(
            text.contains(&line) || text.contains(&alt),
            "{line} in\n{text}"
        );
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("effectgate_reconciliations_total{")
                && l.contains("outcome=\"found\"")
                && l.ends_with(" 0")),
        "{text}"
    );
    // The counters move from 0 with traffic.
    assert_eq!(app.charge("m1", BODY).await.status(), 200);
    assert_eq!(app.charge("m1", BODY).await.status(), 200);
    let text = app.metrics().await;
    assert!(
        text.lines()
            .any(|l| l.starts_with("effectgate_replays_total{route=\"payments\"} 1")),
        "{text}"
    );
}

/// Every metric the shipped alert rules and dashboard query exists on a
/// running gateway.
#[tokio::test]
async fn the_dashboard_and_the_alert_rules_query_only_exported_metrics() {
    let app = full_app().await;
    let text = app.metrics().await;
    let exported = exported_families(&text);
    let histograms = histogram_families(&text);
    let dir = repo().join("examples/observability");
    for file in ["alerts.yml", "dashboard.json"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let mut queried = BTreeSet::new();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("effectgate_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            queried.insert(family(&name, &histograms));
        }
        assert!(queried.len() >= 5, "{file} queries {queried:?}");
        let unknown: Vec<_> = queried.iter().filter(|q| !exported.contains(*q)).collect();
        assert!(
            unknown.is_empty(),
            "{file} queries metrics the gateway does not export: {unknown:?}"
        );
    }
}

/// The problem kinds the gateway answers with: those of `OpError::kind`
/// (`=> "kind"` in `ops/error.rs`), every literal
/// `urn:effectgate:problem:<kind>` in the gateway's source, the inbox's
/// refusals (`INBOX_CHECKS`, the kind of `OpError::InboxRejected`) and the
/// stored answers of refused approvals (their kinds are arguments of the
/// ledger's `refused_response`, not `urn:` literals).
fn sent_problem_kinds() -> BTreeSet<String> {
    let src = repo().join("gateway/src");
    let mut out: BTreeSet<String> = effectgate::metrics::INBOX_CHECKS
        .iter()
        .chain(&["approval-rejected", "approval-expired"])
        .map(|k| k.to_string())
        .collect();
    let error_rs = std::fs::read_to_string(src.join("ops/error.rs")).unwrap();
    let kind_fn = error_rs
        .split("pub fn kind(&self)")
        .nth(1)
        .and_then(|s| s.split("\n    }\n").next())
        .expect("OpError::kind");
    for l in kind_fn.lines() {
        if let Some(k) = l.split("=> \"").nth(1).and_then(|r| r.split('"').next()) {
            out.insert(k.to_owned());
        }
    }
    let mut dirs = vec![src];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for rest in text.split("urn:effectgate:problem:").skip(1) {
                    let k: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                        .collect();
                    if !k.is_empty() {
                        out.insert(k);
                    }
                }
            }
        }
    }
    out
}

#[test]
fn every_problem_kind_the_gateway_sends_is_in_the_readmes_status_table() {
    let table = readme_section("HTTP status table");
    let kinds = sent_problem_kinds();
    assert!(kinds.len() >= 25, "found only {kinds:?}");
    let missing: Vec<_> = kinds
        .iter()
        .filter(|k| !table.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in the README's status table: {missing:?}"
    );
}
