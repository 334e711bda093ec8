//! The `effectgate` command line, run as a process.

use std::process::Command;

mod common;

fn effectgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_effectgate"));
    c.env_remove("EFFECTGATE_CONFIG");
    c
}

/// Asserts a listing command found nothing: exit 0, nothing on stdout (no
/// header line, no JSON line), and `word` on stderr.
fn assert_empty_listing(out: &std::process::Output, word: &str) {
    common::succeeded(out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), word);
}

/// Runs `effectgate args` on the SQLite ledger at `db` (no config file)
/// and returns what it printed and its exit status.
fn on_ledger(db: &std::path::Path, args: &[&str]) -> std::process::Output {
    effectgate()
        .args(args)
        .env("EFFECTGATE_STORAGE__PATH", db)
        .output()
        .unwrap()
}

#[test]
fn every_command_has_help() {
    for args in [
        vec!["--help"],
        vec!["serve", "--help"],
        vec!["check-config", "--help"],
        vec!["migrate", "--help"],
        vec!["ledger", "--help"],
        vec!["ledger", "show", "--help"],
        vec!["ledger", "list", "--help"],
        vec!["ledger", "dead-letters", "--help"],
        vec!["ledger", "compensate", "--help"],
        vec!["inbox", "list", "--help"],
        vec!["policy", "new", "--help"],
        vec!["policy", "wit", "--help"],
    ] {
        let out = effectgate().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage:"),
            "{args:?}"
        );
    }
}

#[test]
fn check_config_names_the_bad_field() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\nresponse_timeout_ms = \"soon\"\n",
    )
    .unwrap();
    let out = effectgate()
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[0].response_timeout_ms"), "{err}");
    // Without --config, EFFECTGATE_CONFIG names the file, as for the other
    // commands.
    let out = effectgate()
        .arg("check-config")
        .env("EFFECTGATE_CONFIG", &bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[0].response_timeout_ms"), "{err}");

    // The quickstart config binds the amount-threshold policy: fine once
    // it is built (the quickstart builds it), else the error says where it
    // was looked for and how to build it.
    let good = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/quickstart.toml");
    let out = effectgate()
        .args(["check-config", "--config", good])
        .output()
        .unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let module = root.join("policies/target/wasm32-wasip2/release/amount_threshold.wasm");
    if module.exists() {
        common::succeeded(&out);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{good}: ok (1 tenant, 1 route, 4 keys, 1 policy binding, 0 inbox sources)\n")
        );
    } else {
        assert_eq!(out.status.code(), Some(2));
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!(
                "{good}: invalid: tenants[0].policies[0].module: no policy module at {}; build the policy components with `cargo build --manifest-path policies/Cargo.toml --target wasm32-wasip2 --release --target-dir policies/target` (from the repository root; `rustup target add wasm32-wasip2` first); a relative module path is taken from the config file's folder, so a copied config keeps its folder or names the module by an absolute path\n",
                module.display()
            )
        );
    }
}

/// The README's MCP route (its `toml` block under "MCP servers") loads as
/// written: `check-config` accepts it, with the token it injects set.
#[test]
fn the_readmes_mcp_route_is_a_valid_config() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let section = &readme[readme.find("### MCP servers (streamable HTTP)").unwrap()..];
    let start = section.find("```toml\n").unwrap() + "```toml\n".len();
    let block = &section[start..start + section[start..].find("```").unwrap()];
    assert!(block.contains("mode = \"mcp\""), "{block}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("mcp.toml");
    std::fs::write(&cfg, block).unwrap();
    let out = effectgate()
        .args(["check-config", "--config"])
        .arg(&cfg)
        .env("TOOLS_TOKEN", "token-example")
        .output()
        .unwrap();
    common::succeeded(&out);
}

/// The README's "In front of a real provider" example is a valid config
/// (an `https://` upstream verified against the system roots), and a TLS
/// file that can't be read stops `check-config` with the field named.
#[test]
fn the_real_provider_example_checks_and_tls_errors_name_the_field() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/real-provider.toml"
    );
    let out = effectgate()
        .args(["check-config", "--config", example])
        .env("STRIPE_SECRET_KEY", "sk_test_example")
        .env("GATEWAY_CLIENT_KEY", "client-key-example")
        .env("GATEWAY_OPERATOR_KEY", "operator-key-example")
        .output()
        .unwrap();
    common::succeeded(&out);
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[routes]]\nprefix = \"/a/\"\nupstream = \"https://x\"\n[routes.tls]\nca_file = \"missing-ca.pem\"\n",
    )
    .unwrap();
    let out = effectgate()
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[0].tls.ca_file"), "{err}");
    assert!(err.contains("missing-ca.pem"), "{err}");
    let out = effectgate()
        .args(["serve", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve refuses to start");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("routes[0].tls.ca_file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn migrate_then_ledger_list_and_show() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("l.db");
    let run = |args: &[&str]| on_ledger(&db, args);
    let out = run(&["migrate"]);
    common::succeeded(&out);
    assert!(db.exists());
    // No rows: nothing on stdout, not even the header; a word on stderr.
    assert_empty_listing(
        &run(&["ledger", "list", "--state", "UNKNOWN"]),
        "no operations",
    );
    assert_empty_listing(&run(&["ledger", "list", "--json"]), "no operations");
    let out = run(&["ledger", "show", "t", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        "error: no operation \"nope\" for tenant \"t\"",
        "as every other error of the CLI"
    );
    let out = run(&["ledger", "list", "--state", "BOGUS"]);
    assert_eq!(out.status.code(), Some(2));
    // A limit of 0 is refused, as the admin API refuses it.
    for args in [
        &["ledger", "list", "--limit", "0"][..],
        &["ledger", "dead-letters", "--limit", "0"],
        &["inbox", "list", "t", "--limit", "0"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--limit"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A state in any case, as the admin API takes it.
    let out = run(&["ledger", "list", "--state", "unknown"]);
    common::succeeded(&out);
    // No dead letters: nothing on stdout (one JSON object a line), a word
    // on stderr.
    assert_empty_listing(&run(&["ledger", "dead-letters"]), "no dead letters");
}

/// The ledger commands check only `[storage]`: an operator can read the
/// ledger with the gateway's config but without its secrets (a key from
/// an unset variable) or its policy builds (a module not built), which
/// `check-config` (and `serve`) refuse.
#[test]
fn ledger_commands_need_only_the_storage_section() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        r#"
[storage]
path = "ledger.db"
[[tenants]]
id = "t"
keys = [{ role = "client", env = "EFFECTGATE_TEST_UNSET_CLIENT_KEY" }]
[[tenants.policies]]
route = "pay"
module = "not-built.wasm"
config = {}
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "http://127.0.0.1:9"
"#,
    )
    .unwrap();
    let run = |args: &[&str]| {
        effectgate()
            .args(args)
            .arg("--config")
            .arg(&cfg)
            .env_remove("EFFECTGATE_TEST_UNSET_CLIENT_KEY")
            .output()
            .unwrap()
    };
    let out = run(&["check-config"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("EFFECTGATE_TEST_UNSET_CLIENT_KEY"), "{err}");
    for args in [
        &["migrate"][..],
        &["ledger", "list"],
        &["ledger", "dead-letters"],
        &["inbox", "list", "t"],
    ] {
        let out = run(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The ledger file is next to the config, as `serve` would open it.
    assert!(dir.path().join("ledger.db").exists());
    let out = run(&["ledger", "show", "t", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nope"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A bad `[storage]` is still refused, naming the field.
    std::fs::write(&cfg, "[storage]\nurl = \"redis://x\"\n").unwrap();
    let out = run(&["ledger", "list"]);
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("storage.url"), "{err}");
}

/// Without a ledger file the CLI names the absolute path it looked for
/// and says how to point it at the gateway's config.
#[test]
fn a_missing_ledger_names_its_path_and_the_config_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = effectgate()
        .args(["ledger", "list"])
        .current_dir(dir.path())
        .env_remove("EFFECTGATE_CONFIG")
        .env_remove("EFFECTGATE_STORAGE__PATH")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let expected = dir.path().canonicalize().unwrap().join("effectgate.db");
    assert!(
        err.contains(&expected.display().to_string())
            || err.contains(&dir.path().join("effectgate.db").display().to_string()),
        "{err}"
    );
    assert!(err.contains("--config"), "{err}");
    assert!(err.contains("the default storage.path"), "{err}");

    // A path from the variable is named as that, and --config isn't blamed.
    let missing = dir.path().join("elsewhere.db");
    let out = on_ledger(&missing, &["ledger", "list"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(err.contains("named by EFFECTGATE_STORAGE__PATH"), "{err}");
    assert!(!err.contains("--config"), "{err}");

    // A path from a config file names the file.
    let cfg = dir.path().join("gw.toml");
    std::fs::write(&cfg, "[storage]\npath = \"gone.db\"\n").unwrap();
    let out = effectgate()
        .args(["ledger", "list", "--config"])
        .arg(&cfg)
        .env_remove("EFFECTGATE_STORAGE__PATH")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("named by [storage] in {}", cfg.display())),
        "{err}"
    );
}

#[test]
fn migrate_and_ledger_list_on_postgres() {
    let Some(url) = common::pg_url() else {
        return;
    };
    let schema = common::fresh_schema();
    let run = |args: &[&str]| {
        effectgate()
            .args(args)
            .env("EFFECTGATE_STORAGE__URL", &url)
            .env("EFFECTGATE_STORAGE__SCHEMA", &schema)
            .output()
            .unwrap()
    };
    for _ in 0..2 {
        // Migrating twice is a no-op the second time.
        let out = run(&["migrate"]);
        common::succeeded(&out);
        assert!(String::from_utf8_lossy(&out.stdout).contains("is migrated"));
    }
    // An empty ledger: no rows, no header.
    assert_empty_listing(&run(&["ledger", "list"]), "no operations");
    assert_empty_listing(&run(&["ledger", "list", "--json"]), "no operations");
    let out = run(&["ledger", "show", "t", "nope"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn an_unknown_storage_url_scheme_is_a_config_error() {
    let out = effectgate()
        .args(["migrate"])
        .env("EFFECTGATE_STORAGE__URL", "mysql://localhost/x")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(err.contains("storage.url"), "{err}");
}

#[test]
fn an_unreachable_ledger_is_named_with_its_real_cause() {
    let started = std::time::Instant::now();
    let out = effectgate()
        .args(["migrate"])
        .env(
            "EFFECTGATE_STORAGE__URL",
            "postgres://u:s3cret@127.0.0.1:1/x",
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("storage.url"), "{err}");
    assert!(
        err.contains("refused"),
        "the cause, not a pool timeout: {err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
    assert_eq!(err.matches("refused").count(), 1, "said once: {err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn storage_schema_and_empty_url_are_checked() {
    for (schema, ok) in [
        ("Mixed_Case", false),
        ("pg_temp_x", false),
        ("information_schema", false),
        ("effectgate_1", true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = effectgate()
            .args(["migrate"])
            .env("EFFECTGATE_STORAGE__SCHEMA", schema)
            // Empty means unset: the SQLite file.
            .env("EFFECTGATE_STORAGE__URL", "")
            .env("EFFECTGATE_STORAGE__PATH", dir.path().join("l.db"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{schema}: {err}");
        if !ok {
            assert!(err.contains("storage.schema"), "{err}");
        }
    }
}

#[test]
fn policy_wit_prints_the_world_the_gateway_was_built_with() {
    let out = effectgate().args(["policy", "wit"]).output().unwrap();
    assert!(out.status.success());
    let wit = String::from_utf8(out.stdout).unwrap();
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../wit/policy.wit")).unwrap();
    assert_eq!(wit, source);
    assert!(wit.contains("package effectgate:policy@0.2.0;"));
    assert!(
        wit.contains("export compensate: func(config: string, request: compensation) -> decision;")
    );
}

#[test]
fn policy_new_writes_a_project_per_language_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    for (lang, main) in [
        ("rust", "src/lib.rs"),
        ("js", "policy.js"),
        ("python", "app.py"),
    ] {
        let root = dir.path().join(lang);
        let out = effectgate()
            .args(["policy", "new", "spend-cap", "--lang", lang, "--dir"])
            .arg(&root)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{lang}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for f in ["wit/policy.wit", "cases.toml", "README.md", main] {
            assert!(root.join(f).is_file(), "{lang}: {f} missing");
        }
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
        assert!(readme.contains("spend_cap.wasm"), "{lang}: {readme}");
    }
    // Into the same folder again: refused, nothing overwritten.
    let out = effectgate()
        .args(["policy", "new", "spend-cap", "--lang", "js", "--dir"])
        .arg(dir.path().join("js"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not empty"));
    let out = effectgate()
        .args(["policy", "new", "Spend_Cap", "--dir"])
        .arg(dir.path().join("x"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid policy name"));
    let out = effectgate()
        .args(["policy", "new", "ok", "--lang", "go"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses the language");
    assert!(String::from_utf8_lossy(&out.stderr).contains("rust, js or python"));
}

#[tokio::test]
async fn inbox_list_prints_a_tenants_events_with_iso_times() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("l.db");
    let ledger = effectgate::ledger::Ledger::open(
        &db,
        1,
        5000,
        std::sync::Arc::new(effectgate::ledger::SystemClock),
    )
    .await
    .unwrap();
    for (id, key, seq) in [("evt_1", "cus_1", 1), ("evt_3", "cus_1", 3)] {
        let got = ledger
            .receive_inbox(&effectgate::ledger::NewInboxEvent {
                tenant: "t",
                source: "stripe",
                event_id: id,
                event_type: Some("customer.updated"),
                payload: "{}",
                deliver: false,
                ordering: Some(effectgate::ledger::InboxOrdering {
                    key,
                    sequence: seq,
                    gaps: true,
                    start: 1,
                    reorder_window_ms: 60_000,
                }),
                resolve: None,
            })
            .await
            .unwrap();
        assert!(matches!(got, effectgate::ledger::Received::Stored { .. }));
    }
    let run = |args: &[&str]| on_ledger(&db, args);
    let out = run(&["inbox", "list", "t"]);
    common::succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("SOURCE"), "{text}");
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        text.contains("evt_1") && text.contains("accepted"),
        "{text}"
    );
    assert!(text.contains("evt_3") && text.contains("held"), "{text}");
    assert!(text.contains("Z\n"), "ISO 8601 times: {text}");
    // Any case, as `ledger list --state`.
    for state in ["held", "HELD"] {
        let out = run(&["inbox", "list", "t", "--state", state]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.lines().count(), 2, "{state}: {text}");
        assert!(text.contains("evt_3"));
    }
    let out = run(&["inbox", "list", "t", "--state", "bogus"]);
    assert_eq!(out.status.code(), Some(2));
    assert_empty_listing(&run(&["inbox", "list", "other"]), "no inbox events");
}

/// One gateway process serves a SQLite ledger: a second `serve` on the
/// same file stops at start and says why (exit status, the lock file's
/// name), while the first keeps serving; `ledger list` (no lock) still
/// reads the file beside it; once the first has exited, the file can be
/// served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_the_same_sqlite_ledger_stops_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let config = |proxy: u16, admin: u16| {
        let p = dir.path().join(format!("gw-{proxy}.toml"));
        std::fs::write(
            &p,
            format!(
                "[listen]\nproxy = \"127.0.0.1:{proxy}\"\nadmin = \"127.0.0.1:{admin}\"\n\
                 [storage]\npath = \"{}\"\n",
                db.display()
            ),
        )
        .unwrap();
        p
    };
    let first = common::spawn_gateway(config, &[], None).await;
    let second = config(common::free_port(), common::free_port());
    let out = tokio::task::block_in_place(|| {
        effectgate()
            .args(["serve", "--config"])
            .arg(&second)
            .output()
            .unwrap()
    });
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second gateway must not serve");
    assert!(
        err.contains("served by another gateway process") && err.contains("ledger.db.lock"),
        "{err}"
    );
    // On the first one's own ports, the ledger is still what it is told.
    let same_ports = dir.path().join(format!("gw-{}.toml", first.proxy));
    let out = tokio::task::block_in_place(|| {
        effectgate()
            .args(["serve", "--config"])
            .arg(&same_ports)
            .output()
            .unwrap()
    });
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("served by another gateway process"),
        "{err}"
    );
    // A hard link is the same file under another name (and another
    // `.lock` name): a ledger file with two links is refused, before the
    // second gateway opens the file (with a `-wal` of its own).
    let link = dir.path().join("linked.db");
    std::fs::hard_link(&db, &link).unwrap();
    let linked = dir.path().join("linked.toml");
    std::fs::write(
        &linked,
        format!(
            "[listen]\nproxy = \"127.0.0.1:{}\"\nadmin = \"127.0.0.1:{}\"\n\
             [storage]\npath = \"{}\"\n",
            common::free_port(),
            common::free_port(),
            link.display()
        ),
    )
    .unwrap();
    let out = tokio::task::block_in_place(|| {
        effectgate()
            .args(["serve", "--config"])
            .arg(&linked)
            .output()
            .unwrap()
    });
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has 2 hard links"),
        "{err}"
    );
    assert!(
        !dir.path().join("linked.db-wal").exists(),
        "the linked name was never opened"
    );
    std::fs::remove_file(&link).unwrap();
    let ready = reqwest::get(format!("http://127.0.0.1:{}/readyz", first.admin))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200, "the first still serves");
    let list = tokio::task::block_in_place(|| {
        effectgate()
            .args(["ledger", "list"])
            .env("EFFECTGATE_STORAGE__PATH", &db)
            .output()
            .unwrap()
    });
    common::succeeded(&list);
    drop(first);
    let again = common::spawn_gateway(config, &[], None).await;
    drop(again);
}

/// `ledger list` prints columns as wide as their widest cell (in terminal
/// columns: a CJK character or an emoji takes two), a key with a space
/// quoted (so a line still reads as its columns), and `--json` one object
/// a line with the same fields.
#[test]
fn ledger_list_columns_fit_their_cells_and_json_has_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("l.db");
    let run = |args: &[&str]| on_ledger(&db, args);
    assert!(run(&["migrate"]).status.success());
    let long = "k".repeat(40);
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        for (key, state, at) in [
            ("order 42", "COMPLETED", 1_796_181_622_924_i64),
            (long.as_str(), "UNKNOWN", 1_796_181_622_000),
            ("pay\u{202e}gnp.exe", "FAILED", 1_796_181_621_000),
            ("-", "FAILED", 1_796_181_620_000),
            ("line\u{2028}break", "FAILED", 1_796_181_619_000),
            ("注文-42", "FAILED", 1_796_181_618_000),
            ("pay-💳", "FAILED", 1_796_181_617_000),
        ] {
            conn.execute(
                "INSERT INTO operations (tenant_id, operation_id, route, method, path, fingerprint, \
                 provider_key, state, version, attempts, request_body, principal, created_at, \
                 updated_at, expires_at) \
                 VALUES ('acme', ?1, 'payments', 'POST', '/', 'fp', ?1, ?2, 3, 12, x'', 'p', ?3, ?3, ?3)",
                rusqlite::params![key, state, at],
            )
            .unwrap();
        }
    }
    let out = run(&["ledger", "list"]);
    common::succeeded(&out);
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8, "{text}");
    // A bidirectional override is shown escaped, not obeyed; a key `-` is
    // quoted (a bare `-` is a missing value).
    assert!(lines[3].contains(r#""pay\u{202e}gnp.exe""#), "{text}");
    assert!(lines[4].starts_with(r#"acme    "-"  "#), "{text}");
    assert!(lines[5].contains(r#""line\u{2028}break""#), "{text}");
    // Newest change first; every column starts where its heading does.
    let state_at = lines[0].find("STATE").unwrap();
    let route_at = lines[0].find("ROUTE").unwrap();
    assert!(lines[1].starts_with("acme    \"order 42\"  "), "{text}");
    assert_eq!(&lines[1][state_at..state_at + 9], "COMPLETED", "{text}");
    assert_eq!(&lines[2][state_at..state_at + 7], "UNKNOWN", "{text}");
    assert!(lines[2].contains(&long), "{text}");
    // In terminal columns: the CJK and emoji keys' lines are as wide as
    // the others, though longer in characters and bytes.
    use unicode_width::UnicodeWidthStr;
    for line in &lines[1..] {
        let route = line.find("payments").unwrap();
        assert_eq!(line[..route].width(), route_at, "{text}");
    }
    for line in &lines[6..] {
        let state = line.find("FAILED").unwrap();
        assert_eq!(line[..state].width(), state_at, "{text}");
    }
    assert!(lines[6].starts_with("acme    注文-42  "), "{text}");
    assert!(lines[7].starts_with("acme    pay-💳  "), "{text}");
    assert!(
        lines[1].ends_with("12  payments  2026-12-02T03:20:22.924Z"),
        "{text}"
    );
    let out = run(&["ledger", "list", "--json"]);
    assert!(out.status.success());
    let json = String::from_utf8(out.stdout).unwrap();
    // One object a line even for a reader that splits at U+2028.
    assert!(!json.contains('\u{2028}'), "{json}");
    assert!(json.contains(r"line\u2028break"), "{json}");
    let rows: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 7);
    assert_eq!(rows[4]["operation_id"], "line\u{2028}break");
    assert_eq!(rows[0]["operation_id"], "order 42");
    assert_eq!(rows[0]["tenant"], "acme");
    assert_eq!(rows[0]["state"], "COMPLETED");
    assert_eq!(rows[0]["attempts"], 12);
    assert_eq!(rows[0]["route"], "payments");
    assert_eq!(rows[0]["updated_at"], 1_796_181_622_924_i64);
    assert_eq!(rows[0]["updated_at_rfc3339"], "2026-12-02T03:20:22.924Z");
    assert_eq!(rows[1]["operation_id"], long.as_str());
}

/// Lines of the gateway's log at `log` that contain `needle`.
fn log_lines(log: &std::path::Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// Waits (at most 20 s) until the log at `log` has `n` lines containing
/// `needle`; the gateway process writes them as it goes.
async fn until_logged(log: &std::path::Path, needle: &str, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while log_lines(log, needle).len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{n} lines with {needle:?} expected in the log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The config's warnings (as `check-config` prints them) reach the log of
/// `effectgate serve`: once at start, and again after every reload that
/// keeps them; a reload that removes the cause logs none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_warnings_are_logged_at_start_and_after_every_reload() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gw.log");
    let (d, db) = (dir.path().to_owned(), dir.path().join("ledger.db"));
    // Tenant "demo" has an inbox source and, unless `hook` is given, no
    // webhook to deliver its events to.
    let write = move |proxy: u16, admin: u16, hook: &str| {
        let p = d.join("gw.toml");
        std::fs::write(
            &p,
            format!(
                "[listen]\nproxy = \"127.0.0.1:{proxy}\"\nadmin = \"127.0.0.1:{admin}\"\n\
                 [storage]\npath = \"{}\"\n\
                 [[tenants]]\nid = \"demo\"\n{hook}\
                 keys = [{{ role = \"client\", sha256 = \"{}\" }}]\n\
                 [[routes]]\nname = \"pay\"\nprefix = \"/pay/\"\nupstream = \"http://127.0.0.1:9\"\n\
                 [[inbox]]\nname = \"stripe\"\ntenant = \"demo\"\nscheme = \"stripe\"\n\
                 secrets = [{{ env = \"CLI_TEST_WHSEC\" }}]\n",
                db.display(),
                common::sha("demo-key"),
            ),
        )
        .unwrap();
        p
    };
    let start = write.clone();
    let gw = common::spawn_gateway(
        move |proxy, admin| start(proxy, admin, ""),
        &[
            ("CLI_TEST_WHSEC", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
            ("CLI_TEST_HOOK", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
        ],
        Some(&log),
    )
    .await;
    let warning = "inbox[0].deliver: tenant";
    // Logged before the gateway serves, so before it was ready.
    let lines = log_lines(&log, warning);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("WARN"), "{}", lines[0]);
    assert!(
        lines[0].contains("has no webhook") && lines[0].contains("stripe"),
        "{}",
        lines[0]
    );
    let hup = || {
        let status = Command::new("kill")
            .args(["-HUP", &gw.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    // A reload of the same file: the warning again, after the reload's
    // line ("SIGHUP: reloaded", the handler's, comes after both).
    hup();
    until_logged(&log, "SIGHUP: reloaded", 1).await;
    assert_eq!(log_lines(&log, warning).len(), 2);
    let text = std::fs::read_to_string(&log).unwrap();
    let reloaded = text.find("configuration reloaded").unwrap();
    assert!(
        text[reloaded..].contains(warning),
        "the reload's warning comes after its line:\n{text}"
    );
    // The tenant gets its webhook: the next reload logs no warning.
    write(
        gw.proxy,
        gw.admin,
        "webhook = { url = \"http://127.0.0.1:9/hook\", secret_env = \"CLI_TEST_HOOK\" }\n",
    );
    hup();
    until_logged(&log, "SIGHUP: reloaded", 2).await;
    assert_eq!(log_lines(&log, "configuration reloaded").len(), 2);
    assert_eq!(log_lines(&log, warning).len(), 2);
}

/// The start line names the ledger on a PostgreSQL ledger that is
/// already migrated too. There the database's notice about the existing
/// migrations table (off under the default filter) came right before it,
/// and the log layer's stale filter decision dropped the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_line_is_logged_on_an_already_migrated_postgres_ledger() {
    let Some(url) = common::pg_url() else {
        return;
    };
    let schema = common::fresh_schema();
    let migrated = effectgate()
        .arg("migrate")
        .env("EFFECTGATE_STORAGE__URL", &url)
        .env("EFFECTGATE_STORAGE__SCHEMA", &schema)
        .output()
        .unwrap();
    common::succeeded(&migrated);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gw.log");
    let d = dir.path().to_owned();
    let (pg, sc) = (url.clone(), schema.clone());
    let _gw = common::spawn_gateway(
        move |proxy, admin| {
            let p = d.join("gw.toml");
            std::fs::write(
                &p,
                format!(
                    "[listen]\nproxy = \"127.0.0.1:{proxy}\"\nadmin = \"127.0.0.1:{admin}\"\n\
                     [storage]\nurl = \"{pg}\"\nschema = \"{sc}\"\n"
                ),
            )
            .unwrap();
            p
        },
        // The default filter, said explicitly: a developer's own RUST_LOG
        // must not change what this test sees.
        &[("RUST_LOG", "effectgate=info,warn")],
        Some(&log),
    )
    .await;
    until_logged(&log, "effectgate serving", 1).await;
    let line = &log_lines(&log, "effectgate serving")[0];
    assert!(line.contains("backend=\"postgres\""), "{line}");
    assert!(line.contains(&format!("(schema {schema})")), "{line}");
}

/// `policy check` of a file that isn't WebAssembly says so in one line,
/// without the parser's dump of its first bytes.
#[test]
fn policy_check_of_a_file_that_is_not_webassembly_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("notes.wasm");
    std::fs::write(&file, "hello, not a module\n").unwrap();
    let out = effectgate()
        .args(["policy", "check"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a module `policy check` rejects"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("it is not a WebAssembly binary"), "{err}");
    assert!(!err.contains("0x61"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
