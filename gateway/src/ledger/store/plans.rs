//! The query plans of the ledger's periodic scans, on both backends: each
//! reads an index that holds only the rows it wants (terminal rows by last
//! change, dead letters, decisions of refused calls, operations in flight),
//! never a pass over every operation, so a scan's cost does not grow with
//! the rows kept (explained over a ledger of 5,000 operations; SQLite's
//! without statistics, as a ledger file has them). On PostgreSQL the
//! reconciler's scan reads an index of the operations in flight alone, not
//! one that also keeps the dead entries of their finished versions until a
//! vacuum.
//! The retention sweep runs on the write connection once a reconciler
//! interval: a pass over 100,000 terminal rows held every write for about
//! 80 ms.

use std::sync::Arc;

use super::reads::{
    COUNT_DEAD_LETTERS, COUNT_UNKNOWN, SWEEP_UNRESERVED_DECISIONS, due_scan, sweep_mark,
    terminal_rows,
};
use super::{Store, TERMINAL};
use crate::config::StorageSpec;
use crate::ledger::dialect::{Dialect, LedgerRow, sql};
use crate::ledger::postgres::{PgDialect, PgSettings};
use crate::ledger::sqlite::SqliteDialect;
use crate::ledger::{LedgerClock, State, SystemClock};

/// The index each statement must read, with values to explain it with.
fn statements<D: Dialect>() -> Vec<(&'static str, String, Vec<i64>, &'static str)> {
    vec![
        (
            "the retention sweep's scan",
            sweep_mark::<D>(),
            vec![1, 2, 500],
            "operations_terminal_by_change",
        ),
        (
            "the sweep of refused calls' decisions",
            SWEEP_UNRESERVED_DECISIONS.to_owned(),
            vec![1, 500],
            "policy_decisions_unreserved",
        ),
        (
            "the dead-letter count",
            COUNT_DEAD_LETTERS.to_owned(),
            vec![],
            "operations_dead_letters",
        ),
        (
            "the reconciler's scan",
            due_scan::<D>(),
            vec![1, 1, 64, 2],
            // SQLite keeps no dead row versions: the state index holds
            // only what the scan may want.
            if D::NAME == "postgres" {
                "operations_unsettled"
            } else {
                "operations_by_state"
            },
        ),
    ]
}

/// A ledger that has kept what it did: 5,000 COMPLETED operations, each
/// with a decision, and 5 decisions of refused calls (one statement each,
/// the same on both backends).
fn fill() -> [String; 2] {
    let rows = "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 5000)";
    [
        format!(
            "{rows} INSERT INTO operations (tenant_id, operation_id, route, method, path, fingerprint, \
             provider_key, state, version, request_body, principal, created_at, updated_at, expires_at) \
             SELECT 't', 'k' || n, 'r', 'POST', '/', 'fp', 'pk' || n, '{}', 3, '', 'p', n, n, n + 1000 FROM g",
            State::Completed.as_str()
        ),
        format!(
            "{rows} INSERT INTO policy_decisions (tenant_id, operation_id, fingerprint, policy, content_hash, \
             decision, duration_us, at, unreserved) \
             SELECT 't', CASE WHEN n <= 5 THEN 'refused' || n ELSE 'k' || n END, 'fp', 'p', 'h', 'allow', 1, n, \
             n <= 5 FROM g"
        ),
    ]
}

/// Where a scan's owner token (a text) goes among `statements`' values:
/// first in the sweep's, fourth (`?4`) in the reconciler's.
fn owner_at(text: &str) -> Option<usize> {
    if text.starts_with("UPDATE operations SET scan_owner = ?4") {
        Some(3)
    } else if text.starts_with("UPDATE operations SET scan_owner") {
        Some(0)
    } else {
        None
    }
}

/// `EXPLAIN QUERY PLAN` of `text` with `ints` bound (the sweep's owner
/// token is a text; any value explains the same).
async fn sqlite_plan(store: &Store<SqliteDialect>, text: &str, ints: &[i64]) -> String {
    let mut conn = SqliteDialect::acquire(&store.read).await.unwrap();
    let mut stmt = sql::<SqliteDialect>(&format!("EXPLAIN QUERY PLAN {text}"));
    let owner = owner_at(text);
    for (n, i) in ints.iter().enumerate() {
        if owner == Some(n) {
            stmt = stmt.bind("scan:plan");
        }
        stmt = stmt.bind(*i);
    }
    if text.contains("WHERE state = ?") {
        stmt = stmt.bind(State::Unknown);
    }
    let rows = stmt.fetch_all(&mut conn).await.unwrap();
    rows.iter()
        .map(|r| r.text("detail").unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A SQLite ledger in `dir`, migrated.
async fn sqlite_store(dir: &std::path::Path) -> Store<SqliteDialect> {
    let storage = StorageSpec {
        path: dir.join("ledger.db"),
        ..StorageSpec::default()
    };
    Store::<SqliteDialect>::open(&storage, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger")
}

#[tokio::test]
async fn the_periodic_scans_read_their_own_indexes_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path()).await;
    let mut w = store.writer.begin(0).await.unwrap();
    for text in fill() {
        sql::<SqliteDialect>(&text).execute(&mut w).await.unwrap();
    }
    w.commit().await.unwrap();
    for (what, text, ints, index) in statements::<SqliteDialect>() {
        let plan = sqlite_plan(&store, &text, &ints).await;
        // `SCAN t` alone is a pass over every row of t.
        let full_scan = plan
            .lines()
            .any(|l| l.starts_with("SCAN ") && !l.contains(" USING "));
        assert!(
            plan.contains(index) && !full_scan,
            "{what} reads {index}, not every row: {plan}"
        );
    }
    let plan = sqlite_plan(&store, COUNT_UNKNOWN, &[]).await;
    assert!(
        plan.contains("COVERING INDEX operations_by_state (state=?)"),
        "the UNKNOWN count reads the state index alone: {plan}"
    );
}

/// Writing an operation (its reservation, a change of its state) builds
/// no temporary b-tree on SQLite: the conditions of the partial indexes it
/// keeps up, checked on every such write, are plain comparisons.
#[tokio::test]
async fn writes_of_an_operation_build_no_temporary_btree_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path()).await;
    let mut conn = SqliteDialect::acquire(&store.read).await.unwrap();
    for text in [
        "INSERT INTO operations (tenant_id, operation_id, route, method, path, fingerprint, \
         provider_key, state, version, request_body, principal, created_at, updated_at, expires_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        "UPDATE operations SET state = ?, version = version + 1, updated_at = ? \
         WHERE tenant_id = ? AND operation_id = ? AND state = ?",
    ] {
        let rows = sql::<SqliteDialect>(&format!("EXPLAIN {text}"))
            .fetch_all(&mut conn)
            .await
            .unwrap();
        let opcodes: Vec<String> = rows.iter().map(|r| r.text("opcode").unwrap()).collect();
        assert!(
            opcodes.iter().any(|o| o == "IdxInsert"),
            "the program keeps indexes up: {opcodes:?}"
        );
        assert!(
            !opcodes.iter().any(|o| o == "OpenEphemeral"),
            "{text} opens a temporary b-tree: {opcodes:?}"
        );
    }
}

/// The partial index's condition in the query is the one SQLite's
/// migration created, state for state, and PostgreSQL's index holds the
/// same states: otherwise neither planner could use it (the plans above
/// show both do).
#[test]
fn the_sweep_names_the_partial_index_condition_of_both_migrations() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let one_line = |file: &str| {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    for file in [
        "sqlite/0014_terminal_index_without_in.sql",
        "sqlite/0015_history_by_operation_number.sql",
    ] {
        assert!(
            one_line(file).contains(&format!(
                "operations_terminal_by_change ON operations (updated_at) WHERE {};",
                terminal_rows()
            )),
            "SQLite's {file} creates the index the sweep names ({})",
            terminal_rows()
        );
    }
    assert!(!terminal_rows().contains(" IN "), "{}", terminal_rows());
    let states: Vec<String> = TERMINAL
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    assert!(
        one_line("postgres/0001_effect_ledger.sql").contains(&format!(
            "operations_terminal_by_change ON operations (updated_at) WHERE state IN ({}) AND NOT dead_letter;",
            states.join(", ")
        )),
        "PostgreSQL's index holds the same states"
    );
    assert_eq!(TERMINAL.len(), 3);
}

/// The plan of `EXPLAIN EXECUTE {execute}` (a prepared statement and its
/// values), one line a node.
async fn pg_explain(conn: &mut <PgDialect as Dialect>::Conn, execute: &str) -> String {
    let rows = sql::<PgDialect>(&format!("EXPLAIN EXECUTE {execute}"))
        .fetch_all(conn)
        .await
        .unwrap();
    rows.iter()
        .map(|r| r.text("QUERY PLAN").unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A ledger in a fresh schema of `TEST_POSTGRES_URL`'s database, and the
/// schema; `None` (said with one line) without it.
async fn pg_store() -> Option<(Store<PgDialect>, String)> {
    let url = crate::ledger::postgres::test_url()?;
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    let settings = PgSettings::for_tests(&url, &schema, None);
    let store = Store::<PgDialect>::open(&settings, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger");
    Some((store, schema))
}

/// On PostgreSQL the statements are prepared, and after five executions a
/// prepared statement may run a generic plan, planned without its values:
/// the plan is explained that way (`plan_cache_mode =
/// force_generic_plan`), with sequential scans priced out, so it shows
/// whether the index is usable at all. Skipped, with one line, without
/// `TEST_POSTGRES_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_scans_can_read_their_own_indexes_on_postgres() {
    let Some((store, schema)) = pg_store().await else {
        return;
    };
    let mut conn = PgDialect::acquire(&store.read).await.unwrap();
    for text in fill() {
        sql::<PgDialect>(&text).execute(&mut conn).await.unwrap();
    }
    // Only this schema's tables: a bare `ANALYZE` would also analyze the
    // tables of the tests running beside this one, in their own schemas.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(tablename::text) FROM pg_tables WHERE schemaname = current_schema()",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    sql::<PgDialect>(&format!("ANALYZE {}", tables.join(", ")))
        .execute(&mut conn)
        .await
        .unwrap();
    for setting in [
        "SET plan_cache_mode = force_generic_plan",
        "SET enable_seqscan = off",
    ] {
        sql::<PgDialect>(setting).execute(&mut conn).await.unwrap();
    }
    for (n, (what, text, ints, index)) in statements::<PgDialect>().into_iter().enumerate() {
        let mut values: Vec<String> = ints.iter().map(i64::to_string).collect();
        if let Some(n) = owner_at(&text) {
            values.insert(n, "'scan:plan'".into());
        }
        // `PREPARE` takes the text with `$n` placeholders, as sqlx sends it.
        let prepared = PgDialect::q(&text);
        sql::<PgDialect>(&format!("PREPARE plan_{n} AS {prepared}"))
            .execute(&mut conn)
            .await
            .unwrap();
        let args = if values.is_empty() {
            String::new()
        } else {
            format!("({})", values.join(", "))
        };
        let plan = pg_explain(&mut conn, &format!("plan_{n}{args}")).await;
        assert!(
            plan.contains(index),
            "{what} can read {index} in a generic plan: {plan}"
        );
    }
    sql::<PgDialect>(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut conn)
        .await
        .unwrap();
}

/// A fresh ledger's tables get their first statistics from the gateway
/// once they have changed rows (none before); once analyzed, a table is
/// autovacuum's, and the next call analyzes nothing. The compare-and-swap's
/// generic plan then reads the primary key (a check of the outcome only:
/// whether a plan without statistics reads another index depends on the
/// table). Autovacuum is off for the schema's `operations`, so that it
/// can't analyze the table first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_ledger_gets_first_statistics_and_its_cas_reads_the_key_on_postgres() {
    let Some((store, schema)) = pg_store().await else {
        return;
    };
    let mut conn = PgDialect::acquire(&store.read).await.unwrap();
    sql::<PgDialect>("ALTER TABLE operations SET (autovacuum_enabled = off)")
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(
        store.first_statistics().await.unwrap().is_empty(),
        "nothing changed yet"
    );
    sql::<PgDialect>(&fill()[0])
        .execute(&mut conn)
        .await
        .unwrap();
    // The counts reach the statistics when this backend next goes idle
    // (before it answers), unless another backend holds the database's
    // statistics entry then (other tests' backends flush too): the flush
    // is then put off for seconds. So: force a flush and go idle again,
    // then read, until the counts have arrived (bounded by a deadline).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let analyzed = loop {
        for statement in ["SELECT pg_stat_force_next_flush()", "SELECT 1"] {
            sql::<PgDialect>(statement)
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let analyzed = store.first_statistics().await.unwrap();
        if !analyzed.is_empty() || std::time::Instant::now() > deadline {
            break analyzed;
        }
        tokio::task::yield_now().await;
    };
    let row: (i64, bool, bool) = sqlx::query_as(
        "SELECT n_mod_since_analyze, last_analyze IS NOT NULL, last_autoanalyze IS NOT NULL \
         FROM pg_stat_user_tables WHERE schemaname = current_schema() AND relname = 'operations'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(
        analyzed,
        ["operations"],
        "operations' (n_mod_since_analyze, analyzed, autoanalyzed): {row:?}"
    );
    assert!(store.first_statistics().await.unwrap().is_empty());
    sql::<PgDialect>("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .unwrap();
    let cas = PgDialect::q(
        "UPDATE operations SET state = ?, version = version + 1 \
         WHERE tenant_id = ? AND operation_id = ? AND state = ? AND version = ? RETURNING version",
    );
    sql::<PgDialect>(&format!("PREPARE cas AS {cas}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let plan = pg_explain(
        &mut conn,
        &format!(
            "cas('{}', 't', 'k1', '{}', 3)",
            State::Executing.as_str(),
            State::Completed.as_str()
        ),
    )
    .await;
    assert!(plan.contains("operations_pkey"), "{plan}");
    sql::<PgDialect>(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut conn)
        .await
        .unwrap();
}
