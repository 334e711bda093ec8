//! Unit tests of config loading and validation.
use super::*;

fn parse(toml: &str) -> Result<Settings, ConfigError> {
    let dir = tempfile_dir();
    let p = dir.join("c.toml");
    std::fs::write(&p, toml).unwrap();
    load(Some(&p))
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "eg-config-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn unknown_field_is_named_with_its_path() {
    let e =
        parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\nupstrem = 1\n").unwrap_err();
    assert_eq!(e.path, "routes[0].upstrem");
    assert!(e.message.contains("upstrem"), "{e}");
}

/// TOML 1.1: an inline table may span lines (the README's examples write
/// a tenant's `webhook` so); the file is read as that, not refused by a
/// second, TOML 1.0 reading with no field named.
#[test]
fn an_inline_table_may_span_lines() {
    let s = parse(
        "[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n\
         retry = { max_attempts = 7,\n          base_delay_ms = 3 }\n",
    )
    .unwrap();
    assert_eq!(s.routes[0].retry.max_attempts, 7);
    assert_eq!(s.routes[0].retry.base_delay_ms, 3);
    // A syntax error is still named by file, line and column.
    let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = = 1\n").unwrap_err();
    assert!(e.path.ends_with("c.toml:3:12"), "{e}");
    assert!(e.message.starts_with("TOML syntax error"), "{e}");
}

#[test]
fn bad_upstream_names_the_field() {
    let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"ftp://x\"\n").unwrap_err();
    assert_eq!(e.path, "routes[0].upstream");
}

#[test]
fn plaintext_key_field_is_refused() {
    let e =
        parse("[[tenants]]\nid = \"t\"\n[[tenants.keys]]\nrole = \"client\"\nkey = \"secret\"\n")
            .unwrap_err();
    assert_eq!(e.path, "tenants[0].keys[0].key");
    assert!(e.message.contains("key"), "{e}");
}

#[test]
fn default_methods_exclude_safe_ones_and_longest_prefix_wins() {
    let s = parse(
        "[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n[[routes]]\nprefix = \"/a/b/\"\nupstream = \"http://y\"\n",
    )
    .unwrap();
    let r = s.match_route("/a/b/c").unwrap();
    assert_eq!(r.prefix, "/a/b/");
    assert!(r.is_effectful(&Method::POST));
    assert!(!r.is_effectful(&Method::GET));
    assert!(!r.is_effectful(&Method::HEAD));
    assert!(!r.is_effectful(&Method::OPTIONS));
    assert!(s.match_route("/b/").is_none());
}

#[test]
fn idle_connection_timeout_has_a_default_and_zero_is_refused() {
    let route = "[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n";
    let s = parse(route).unwrap();
    let r = s.match_route("/a/b").unwrap();
    assert_eq!(r.client.idle_timeout(), std::time::Duration::from_secs(30));
    let s = parse(&format!("{route}idle_connection_timeout_ms = 1500\n")).unwrap();
    let r = s.match_route("/a/b").unwrap();
    assert_eq!(
        r.client.idle_timeout(),
        std::time::Duration::from_millis(1500)
    );
    let e = parse(&format!("{route}idle_connection_timeout_ms = 0\n")).unwrap_err();
    assert_eq!(e.path, "routes[0].idle_connection_timeout_ms");
    assert!(e.message.contains("at least 1"), "{e}");
}

#[test]
fn ledger_urls_never_show_a_password() {
    assert_eq!(
        redact_url("postgres://u:s3cret@db:5432/l"),
        "postgres://u:***@db:5432/l"
    );
    assert_eq!(
        redact_url("postgres://u@db/l?sslmode=require&password=s3cret"),
        "postgres://u@db/l?sslmode=require&password=***"
    );
    assert_eq!(redact_url("postgres://u:s3cret@[bad"), "<unparsable URL>");
}

#[test]
fn a_read_back_must_end_within_the_reconciliation_lease() {
    let toml = r#"
[reconcile]
lease_ms = 3000
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "http://127.0.0.1:9"
[routes.read_back]
path = "/v1/charges?client_ref={body:/ref}"
found_pointer = "/data/0"
timeout_ms = 3000
"#;
    let err = parse(toml).unwrap_err().to_string();
    assert!(err.contains("routes[0].read_back.timeout_ms"), "{err}");
}

#[test]
fn a_malformed_postgres_url_names_storage_url_without_its_password() {
    let err = parse("[storage]\nurl = \"postgres://u:s3cret@127.0.0.1:notaport/x\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("storage.url"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// A SQLite ledger in a folder that doesn't exist is refused at load, and
/// the error names the field the path was given in.
#[test]
fn a_ledger_in_a_missing_folder_names_the_field_it_came_from() {
    let dir = tempfile_dir();
    let file = dir.join("gone").join("x.db");
    for (toml, field) in [
        (
            format!("[storage]\nurl = \"sqlite://{}\"\n", file.display()),
            "storage.url",
        ),
        (
            format!("[storage]\npath = \"{}\"\n", file.display()),
            "storage.path",
        ),
        (
            "[storage]\npath = \"gone/x.db\"\n".to_owned(),
            "storage.path",
        ),
    ] {
        let e = parse(&toml).unwrap_err();
        assert_eq!(e.path, field, "{toml}: {e}");
        assert!(e.message.contains("x.db: the folder"), "{e}");
        assert!(e.message.contains("gone does not exist"), "{e}");
    }
    // With the folder there, the same settings load.
    std::fs::create_dir_all(dir.join("gone")).unwrap();
    let s = parse(&format!(
        "[storage]\nurl = \"sqlite://{}\"\n",
        file.display()
    ))
    .unwrap();
    assert_eq!(s.storage.path, file);
}

#[test]
fn an_outbox_lease_too_short_to_deliver_in_is_refused() {
    let err = parse("[reconcile]\noutbox_lease_ms = 10\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("reconcile.outbox_lease_ms"), "{err}");
}

#[test]
fn policy_cache_dir_resolves_next_to_the_file_and_bad_values_name_the_field() {
    let dir = tempfile_dir();
    let p = dir.join("c.toml");
    std::fs::write(&p, "[policy]\ncache_dir = \"compiled\"\n").unwrap();
    let s = load(Some(&p)).unwrap();
    assert_eq!(s.policy_limits.cache_dir, Some(dir.join("compiled")));
    assert_eq!(
        parse("").unwrap().policy_limits.cache_dir,
        None,
        "unset by default"
    );

    let e = parse("[policy]\ncache_dir = \"\"\n").unwrap_err();
    assert_eq!(e.path, "policy.cache_dir");
    assert!(e.message.contains("empty"), "{e}");

    std::fs::write(dir.join("a-file"), "x").unwrap();
    std::fs::write(&p, "[policy]\ncache_dir = \"a-file\"\n").unwrap();
    let e = load(Some(&p)).unwrap_err();
    assert_eq!(e.path, "policy.cache_dir");
    assert!(e.message.contains("not a directory"), "{e}");
}

#[test]
fn policy_permits_and_breaker_have_defaults_and_bad_values_name_the_field() {
    let p = parse("").unwrap().policy_limits;
    assert_eq!(
        (
            p.max_concurrent_per_tenant,
            p.permit_wait_ms,
            p.breaker_failures,
            p.breaker_cooldown_ms
        ),
        (32, 100, 5, 30_000)
    );
    let p = parse(
        "[policy]\nmax_concurrent_per_tenant = 4\npermit_wait_ms = 0\nbreaker_failures = 0\nbreaker_cooldown_ms = 0\n",
    )
    .unwrap()
    .policy_limits;
    assert_eq!(p.max_concurrent_per_tenant, 4);
    assert_eq!(p.permit_wait_ms, 0, "0: a call never waits for a permit");
    assert_eq!(p.breaker_failures, 0, "0: no breaker, so no cool-down");

    let e = parse("[policy]\nmax_concurrent_per_tenant = 0\n").unwrap_err();
    assert_eq!(e.path, "policy.max_concurrent_per_tenant");
    assert!(e.message.contains("at least 1"), "{e}");
    let e = parse("[policy]\npool_instances = 0\n").unwrap_err();
    assert_eq!(e.path, "policy.pool_instances");
    let e = parse("[policy]\nbreaker_cooldown_ms = 0\n").unwrap_err();
    assert_eq!(e.path, "policy.breaker_cooldown_ms");
}

#[test]
fn a_key_that_is_not_bare_is_named_quoted() {
    // `"up.stream"` is one key: the path must not read as `up` → `stream`.
    let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n\"up.stream\" = 1\n")
        .unwrap_err();
    assert_eq!(e.path, "routes[0].\"up.stream\"", "{e}");
    let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n\"\" = 1\n").unwrap_err();
    assert_eq!(e.path, "routes[0].\"\"", "{e}");
    let e = parse("\"a b\" = 1\n").unwrap_err();
    assert_eq!(e.path, "\"a b\"", "{e}");
}

fn inbox_config(source: &str) -> String {
    let dir = tempfile_dir();
    std::fs::write(dir.join("whsec"), "whsec_from_file\n").unwrap();
    format!(
        "[[tenants]]\nid = \"t\"\n\
         [[routes]]\nname = \"pay\"\nprefix = \"/pay/\"\nupstream = \"http://x\"\n\
         [[inbox]]\nname = \"stripe\"\ntenant = \"t\"\nscheme = \"stripe\"\n\
         secrets = [{{ file = \"{}\" }}]\n{source}",
        dir.join("whsec").display()
    )
}

#[test]
fn an_inbox_source_is_checked_field_by_field() {
    let s = parse(&inbox_config("")).unwrap();
    let src = &s.inbox["stripe"];
    assert_eq!(src.secrets, vec![b"whsec_from_file".to_vec()]);
    assert_eq!(src.tolerance_ms, DEFAULT_TOLERANCE_MS);
    assert_eq!(src.event_id, EventIdAt::Pointer("/id".into()));
    for (extra, path) in [
        ("header = \"X-Sig\"\n", "inbox[0].header"),
        ("tolerance_ms = 0\n", "inbox[0].tolerance_ms"),
        ("event_id = \"id\"\n", "inbox[0].event_id"),
        ("sequence_key = \"/k\"\n", "inbox[0].sequence"),
        ("dedupe_window_ms = 1000\n", "inbox[0].dedupe_window_ms"),
        ("sequence_window_ms = 1000\n", "inbox[0].sequence_window_ms"),
        (
            "[[inbox.resolves]]\nprovider_key = \"/k\"\n",
            "inbox[0].resolves[0].succeeded",
        ),
        (
            "[[inbox.resolves]]\nsucceeded = [\"x\"]\n",
            "inbox[0].resolves[0].provider_key",
        ),
        (
            "[[inbox.resolves]]\nsucceeded = [\"x\"]\nroute = \"nope\"\nmatch = { \"/a\" = \"{body:/a}\" }\n",
            "inbox[0].resolves[0].route",
        ),
    ] {
        let e = parse(&inbox_config(extra)).unwrap_err();
        assert_eq!(e.path, path, "{extra}: {e}");
    }
    let e = parse(&inbox_config("tenant = \"x\"\n").replace("tenant = \"t\"\nscheme", "scheme"))
        .unwrap_err();
    assert_eq!(e.path, "inbox[0].tenant", "{e}");
}

/// `x-request-id`, which the gateway sets itself on a request without a
/// valid one, is refused as an event id: every resend would be a new
/// event.
#[test]
fn the_gateways_request_id_is_no_event_id() {
    let config = inbox_config("deliver = false\nevent_id = \"header:X-Request-Id\"\n");
    let e = parse(&config).unwrap_err();
    assert_eq!(e.path, "inbox[0].event_id", "{e}");
    assert!(
        e.message
            .contains("x-request-id is the gateway's own request id"),
        "{e}"
    );
}

/// An event id from a header the scheme doesn't sign is allowed (some
/// providers send it only there) with a warning naming the setting; the
/// `webhook-id` of `standard-webhooks`, which its signature covers, and
/// an id in the body get none.
#[test]
fn an_event_id_outside_the_signature_is_warned_of() {
    // Kept in the inbox on purpose: the tenant's missing webhook is no
    // warning.
    let kept = |extra: &str| inbox_config(&format!("deliver = false\n{extra}"));
    let s = parse(&kept("event_id = \"header:X-Delivery\"\n")).unwrap();
    assert_eq!(
        s.inbox["stripe"].event_id,
        EventIdAt::Header(http::HeaderName::from_static("x-delivery"))
    );
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    assert!(
        s.warnings[0].starts_with("inbox[0].event_id: the header x-delivery is not an event id the stripe signature of \"stripe\" covers"),
        "{:?}",
        s.warnings
    );
    // A standard-webhooks secret is base64 after `whsec_`.
    let dir = tempfile_dir();
    std::fs::write(dir.join("sw"), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let sw = |extra: &str| {
        let config = kept(extra).replace("scheme = \"stripe\"", "scheme = \"standard-webhooks\"");
        let (head, rest) = config.split_once("secrets = [").unwrap();
        let (_, tail) = rest.split_once("]\n").unwrap();
        format!(
            "{head}secrets = [{{ file = \"{}\" }}]\n{tail}",
            dir.join("sw").display()
        )
    };
    for (config, warned) in [
        (kept(""), false),
        (sw(""), false),
        (sw("event_id = \"header:webhook-id\"\n"), false),
        // Header names are read in lowercase.
        (sw("event_id = \"header:Webhook-ID\"\n"), false),
        (sw("event_id = \"header:webhook-timestamp\"\n"), true),
        (sw("event_id = \"header:x-id\"\n"), true),
        (sw("event_id = \"/id\"\n"), false),
    ] {
        let s = parse(&config).unwrap();
        assert_eq!(!s.warnings.is_empty(), warned, "{config}: {:?}", s.warnings);
    }
}

#[test]
fn a_match_rule_must_be_tied_to_the_tenant() {
    // `{body:…}` alone could match another tenant's operation: refused.
    let untied = "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nroute = \"pay\"\n\
                  match = { \"/data/object/metadata/order\" = \"{body:/order}\" }\n";
    let e = parse(&inbox_config(untied)).unwrap_err();
    assert_eq!(e.path, "inbox[0].resolves[0].match");
    assert!(e.message.contains("not tied to this tenant"), "{e}");
    // With a {provider_key} condition it is tied.
    let tied = "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nroute = \"pay\"\n\
                match = { \"/data/object/metadata/order\" = \"{body:/order}\", \
                \"/data/object/metadata/key\" = \"{provider_key}\" }\n";
    let s = parse(&inbox_config(tied)).unwrap();
    assert!(matches!(
        s.inbox["stripe"].resolves[0].by,
        ResolveBy::Match { .. }
    ));
    // `{tenant}` ties it only on a route that stamps the tenant.
    let by_tenant = "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nroute = \"pay\"\n\
                     match = { \"/data/object/metadata/tenant\" = \"{tenant}\" }\n";
    assert_eq!(
        parse(&inbox_config(by_tenant)).unwrap_err().path,
        "inbox[0].resolves[0].match"
    );
    let stamped = inbox_config(by_tenant).replace(
        "upstream = \"http://x\"\n",
        "upstream = \"http://x\"\ntenant_scoped_field = \"/metadata/tenant\"\n",
    );
    assert!(parse(&stamped).is_ok());
}

/// Timeouts the database takes as a C int of milliseconds are refused
/// past 2147483647 by name (PostgreSQL would refuse its
/// `statement_timeout` only when the gateway starts); that value itself
/// is taken.
#[test]
fn database_int_timeouts_are_bounded_by_name() {
    for field in ["busy_timeout_ms", "statement_timeout_ms"] {
        let e = parse(&format!("[storage]\n{field} = 2147483648\n")).unwrap_err();
        assert_eq!(e.path, format!("storage.{field}"));
        assert!(e.message.contains("at most 2147483647"), "{e}");
        parse(&format!("[storage]\n{field} = 2147483647\n")).unwrap();
    }
}

/// A variable naming a field inside one of the lists is refused naming
/// the variable; others (a whole list, a section's field, a longer name,
/// another prefix, a name the environment layer ignores) are not.
#[test]
fn a_list_is_not_set_from_the_environment() {
    let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    for (name, list) in [
        ("EFFECTGATE_ROUTES__0__UPSTREAM", "routes"),
        ("effectgate_tenants__1__id", "tenants"),
        ("EFFECTGATE_INBOX.0.NAME", "inbox"),
    ] {
        let e = list_from_env(names(&["HOME", "EFFECTGATE_STORAGE__PATH", name]).into_iter())
            .expect(name);
        assert_eq!(e.path, list);
        assert!(e.message.contains(name), "{e}");
    }
    assert!(
        list_from_env(
            names(&[
                "EFFECTGATE_STORAGE__PATH",
                "EFFECTGATE_ROUTES",
                "EFFECTGATE_ROUTES__",
                "EFFECTGATE_ROUTESX__0",
                "OTHER_ROUTES__0__UPSTREAM",
                "EFFECTGATE_CONFIG",
            ])
            .into_iter()
        )
        .is_none()
    );
}

/// A key's `file` is read from the config file's folder, wherever the
/// process runs.
#[test]
fn a_key_file_is_relative_to_the_config_file() {
    let dir = tempfile_dir();
    std::fs::write(dir.join("client.key"), "k-123\n").unwrap();
    let p = dir.join("c.toml");
    std::fs::write(
        &p,
        "[[tenants]]\nid = \"t\"\nkeys = [{ role = \"client\", file = \"client.key\" }]\n",
    )
    .unwrap();
    let s = load(Some(&p)).unwrap();
    let by_key = s
        .keys
        .get(&key_digest("k-123"))
        .expect("the key from the file");
    assert_eq!(by_key.tenant, "t");
}

/// `success` as a table takes exactly `pointer` and `equals`: another
/// field is named, not ignored.
#[test]
fn a_compensation_success_rule_refuses_other_fields() {
    let route = |success: &str| {
        format!(
            "[[routes]]\nname = \"pay\"\nprefix = \"/pay/\"\nupstream = \"http://x\"\n\
             [routes.compensation]\npath = \"/refunds\"\nsuccess = {success}\n"
        )
    };
    let s = parse(&route(r#"{ pointer = "/status", equals = "succeeded" }"#)).unwrap();
    assert!(
        format!("{:?}", s.routes[0].compensation).contains("succeeded"),
        "{:?}",
        s.routes[0].compensation
    );
    let e = parse(&route(
        r#"{ pointer = "/status", equals = "ok", typo = 1 }"#,
    ))
    .unwrap_err();
    assert_eq!(e.path, "routes[0].compensation.success");
    assert!(e.message.contains("`typo`"), "{e}");
    let e = parse(&route(r#"{ pointer = "/status" }"#)).unwrap_err();
    assert!(e.message.contains("equals"), "{e}");
    parse(&route(r#""2xx""#)).unwrap();
}

/// The operator's reference limit stays where PostgreSQL can index it.
#[test]
fn the_provider_reference_limit_is_bounded() {
    for bad in [0, 2049] {
        let e = parse(&format!("[limits]\nmax_provider_reference_bytes = {bad}\n")).unwrap_err();
        assert_eq!(e.path, "limits.max_provider_reference_bytes", "{bad}");
    }
    let s = parse("[limits]\nmax_provider_reference_bytes = 2048\n").unwrap();
    assert_eq!(s.limits.max_provider_reference_bytes, 2048);
    assert_eq!(parse("").unwrap().limits.max_provider_reference_bytes, 255);
    for bad in [0, 2049] {
        let e = parse(&format!("[limits]\nmax_inbox_id_bytes = {bad}\n")).unwrap_err();
        assert_eq!(e.path, "limits.max_inbox_id_bytes", "{bad}");
    }
    assert_eq!(parse("").unwrap().limits.max_inbox_id_bytes, 255);
}
