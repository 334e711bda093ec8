//! The PostgreSQL effect ledger: one database shared by several gateway
//! instances.
//!
//! The statements are the SQLite ledger's, with `$N` placeholders, plus
//! what PostgreSQL adds: work claims (the reconciler's scan, the outbox
//! relay, the retention sweeper) take their rows `FOR UPDATE SKIP LOCKED`,
//! so instances never wait on, or hand out, the same rows. Every
//! compare-and-swap (`INSERT … ON CONFLICT DO NOTHING`, `UPDATE … WHERE
//! version = $n` / `… WHERE fence = $n … RETURNING`) is safe under READ
//! COMMITTED: PostgreSQL re-checks the `WHERE` on the newest row version.
//!
//! Time comes from the database, never from an instance's wall clock:
//! every write reads `effectgate_now_ms()` (`clock_timestamp()` in ms) and
//! stamps leases and expiries with it. The gateway's own clock
//! ([`super::Ledger::clock`]) follows the database clock: each read of it
//! updates the measured offset.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::dialect::{Arg, Conn, Dialect, Pool, Query, Stmt, ledger_row};
use super::store::{BatchLimits, Store};
use super::{LedgerClock, LedgerError};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// Prepared statements each connection keeps (sqlx's default is 100): the
/// ledger's own, and up to 128 of the grouped writes (a text for each
/// group size of each kind, `store/grouped.rs`).
const STATEMENT_CACHE: usize = 512;

/// `stmt` as sqlx runs it.
fn query(stmt: Stmt<PgDialect>) -> Query<PgDialect> {
    let mut query = sqlx::query(stmt.text);
    for arg in stmt.args {
        query = match arg {
            Arg::Int(v) => query.bind(v),
            Arg::Bool(v) => query.bind(v),
            Arg::Text(v) => query.bind(v.map(std::borrow::Cow::into_owned)),
            Arg::Bytes(v) => query.bind(v.map(std::borrow::Cow::into_owned)),
        };
    }
    query
}

/// PostgreSQL: `$N` placeholders, time from the database clock, work
/// claims `FOR UPDATE SKIP LOCKED`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PgDialect;

ledger_row!(sqlx::postgres::PgRow);

impl Dialect for PgDialect {
    type Db = sqlx::Postgres;
    type Row = sqlx::postgres::PgRow;
    type Conn = sqlx::pool::PoolConnection<sqlx::Postgres>;
    /// The writer's connections come from the shared pool.
    type WriteSource = Pool<Self>;
    const NAME: &'static str = "postgres";
    const ROW_ORDER: &'static str = "seq";
    const SKIP_LOCKED: &'static str = " FOR UPDATE SKIP LOCKED";
    const BEGIN: &'static str = "BEGIN";
    const SAVEPOINT_EACH_WRITE: bool = false;
    const GROUPS_WRITES: bool = true;
    const TERMINAL_BY_CHANGE: &'static str = "";

    const TRANSITION_ROW_NAMES: bool = false;

    const HISTORY_OF: &'static str = "tenant_id = ? AND operation_id = ?";
    const HISTORY_DELETED_WITH_ROW: bool = false;
    const INSERT_ATTEMPT: &'static str = "INSERT INTO attempts (tenant_id, operation_id, attempt, fence, \
         status, outcome, detail, at, request_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING";

    fn q(sql: &str) -> &'static str {
        super::dialect::cached(sql, super::dialect::dollar_placeholders)
    }

    /// [`Dialect::with_transitions`]' `WITH` with one more data-modifying
    /// member: the attempts row, from the compare-and-swap's `RETURNING`.
    fn with_transition_and_attempt(cas: &str, returning: &str) -> Option<String> {
        Some(format!(
            "WITH applied AS ({cas}), appended AS (INSERT INTO transitions ({}) \
             SELECT ?, ?, ?, ?, version, fence, ?, ?, ? FROM applied), \
             attempted AS (INSERT INTO attempts ({}) \
             SELECT ?, ?, attempts, ?, ?, ?, ?, ?, ? FROM applied ON CONFLICT DO NOTHING) \
             SELECT {returning} FROM applied",
            super::dialect::TRANSITION_COLUMNS,
            super::dialect::ATTEMPT_COLUMNS,
        ))
    }

    /// A data-modifying `WITH`: the transition rows are inserted from the
    /// compare-and-swap's `RETURNING` (no row, no transition), in order
    /// (`UNION ALL` hands them to the `INSERT` one branch after the other,
    /// so their `seq` follows that order).
    fn with_transitions(cas: &str, returning: &str, rows: usize) -> String {
        let selects: Vec<String> = (0..rows.max(1))
            .rev()
            .map(|back| {
                format!(
                    "SELECT ?, ?, ?, ?, {}, ?, ?, ? FROM applied",
                    Self::transition_version(back)
                )
            })
            .collect();
        format!(
            "WITH applied AS ({cas}), appended AS (INSERT INTO transitions ({}) {}) \
             SELECT {returning} FROM applied",
            super::dialect::TRANSITION_COLUMNS,
            selects.join(" UNION ALL ")
        )
    }

    async fn acquire(pool: &Pool<Self>) -> Result<Self::Conn, sqlx::Error> {
        pool.acquire().await
    }

    type PointSource = Pool<Self>;

    async fn acquire_point(pool: &Pool<Self>) -> Result<Self::Conn, sqlx::Error> {
        pool.acquire().await
    }

    async fn connect_writer(pool: &Pool<Self>) -> Result<Self::Conn, sqlx::Error> {
        pool.acquire().await
    }

    fn discard(conn: Self::Conn) {
        drop(conn.detach());
    }

    async fn execute(stmt: Stmt<Self>, conn: &mut Self::Conn) -> Result<u64, sqlx::Error> {
        Ok(query(stmt).execute(&mut **conn).await?.rows_affected())
    }

    async fn fetch_optional(
        stmt: Stmt<Self>,
        conn: &mut Self::Conn,
    ) -> Result<Option<Self::Row>, sqlx::Error> {
        query(stmt).fetch_optional(&mut **conn).await
    }

    async fn fetch_all(
        stmt: Stmt<Self>,
        conn: &mut Self::Conn,
    ) -> Result<Vec<Self::Row>, sqlx::Error> {
        query(stmt).fetch_all(&mut **conn).await
    }

    async fn run_durable(text: &'static str, conn: &mut Self::Conn) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(text).execute(&mut **conn).await?;
        Ok(())
    }

    fn commit_now(_conn: &mut Self::Conn) -> Option<Result<(), sqlx::Error>> {
        None
    }

    /// Also re-measures the gateway clock's offset to the database clock.
    async fn now(pool: &Pool<Self>, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        let db: i64 = sqlx::query_scalar("SELECT effectgate_now_ms()")
            .fetch_one(pool)
            .await?;
        clock.follow(db);
        Ok(db)
    }

    /// Read on the transaction's own connection: a wait for a free
    /// connection can't shorten the leases the transaction stamps.
    async fn now_in(conn: &mut Conn<Self>, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        let db: i64 = sqlx::query_scalar("SELECT effectgate_now_ms()")
            .fetch_one(&mut **conn)
            .await?;
        clock.follow(db);
        Ok(db)
    }

    /// No savepoint ([`Dialect::SAVEPOINT_EACH_WRITE`]): nothing is sent
    /// but for the batch's first write (`BEGIN; SELECT
    /// effectgate_now_ms()`, one simple-query message, so the clock costs
    /// no round trip of its own) or a clock to read again.
    async fn open_write(
        conn: &mut Conn<Self>,
        first: bool,
        read_clock: bool,
    ) -> Result<Option<i64>, sqlx::Error> {
        use sqlx::Row;
        let sql = match (first, read_clock) {
            (true, _) => "BEGIN; SELECT effectgate_now_ms()",
            (false, true) => "SELECT effectgate_now_ms()",
            (false, false) => return Ok(None),
        };
        let row = sqlx::raw_sql(sql).fetch_one(&mut **conn).await?;
        Ok(Some(row.try_get::<i64, _>(0)?))
    }

    /// Moves the database clock, for every instance.
    async fn shift_clock(
        pool: &Pool<Self>,
        clock: &LedgerClock,
        ms: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE clock_shift SET shift_ms = shift_ms + $1")
            .bind(ms)
            .execute(pool)
            .await?;
        Self::now(pool, clock).await?;
        Ok(())
    }
}

/// The PostgreSQL settings of `[storage]`.
pub(super) struct PgSettings<'a> {
    pub url: &'a str,
    pub schema: Option<&'a str>,
    pub max_connections: u32,
    pub min_connections: u32,
    pub acquire_timeout_ms: u64,
    pub statement_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub batch: BatchLimits,
}

#[cfg(test)]
impl<'a> PgSettings<'a> {
    /// Settings for a test ledger in `schema` of the database at `url`:
    /// three connections, one write lane, each of the writer's statements
    /// bounded by `stall`.
    pub(super) fn for_tests(url: &'a str, schema: &'a str, stall: Option<Duration>) -> Self {
        Self {
            url,
            schema: Some(schema),
            max_connections: 3,
            min_connections: 0,
            acquire_timeout_ms: 5_000,
            statement_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            batch: BatchLimits {
                max_writes: 256,
                max_bytes: 1 << 20,
                connections: 1,
                stall,
            },
        }
    }
}

/// `TEST_POSTGRES_URL`, or `None` after saying (on the real stderr and in
/// the run's summary; under CI a failure) that the test is skipped.
#[cfg(test)]
pub(super) fn test_url() -> Option<String> {
    match std::env::var("TEST_POSTGRES_URL") {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            crate::ledger::test_skips::skip(
                "PostgreSQL",
                "set TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/DB (a database the tests may create schemas in; .ci/run starts a server and sets it)",
            );
            None
        }
    }
}

impl Store<PgDialect> {
    /// Connects, creates the schema if it is named and missing, and applies
    /// `migrations/postgres` (under sqlx's advisory lock, so instances
    /// starting together migrate once).
    pub(super) async fn open(
        s: &PgSettings<'_>,
        clock: Arc<LedgerClock>,
    ) -> Result<Self, LedgerError> {
        let base: PgConnectOptions = s.url.parse()?;
        // One direct connection first: a refused connection, an unknown
        // role or database is reported as itself, not as a pool timeout.
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect_with(&base).await.map_err(|e| {
            LedgerError::Unreachable {
                url: crate::config::redact_url(s.url),
                cause: e.to_string(),
            }
        })?;
        if let Some(schema) = s.schema {
            let create = format!(
                "CREATE SCHEMA IF NOT EXISTS \"{}\"",
                schema.replace('"', "\"\"")
            );
            if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(create))
                .execute(&mut conn)
                .await
            {
                // Two instances creating it at once: one wins, the other
                // sees it. Any other failure (no CREATE privilege) is the
                // error to report.
                let exists: Option<i32> =
                    sqlx::query_scalar("SELECT 1 FROM pg_namespace WHERE nspname = $1")
                        .bind(schema)
                        .fetch_optional(&mut conn)
                        .await?;
                if exists.is_none() {
                    return Err(e.into());
                }
            }
        }
        conn.close().await?;
        let mut options: Vec<(&str, String)> =
            vec![("statement_timeout", s.statement_timeout_ms.to_string())];
        if let Some(schema) = s.schema {
            options.push((
                "search_path",
                format!("\"{}\"", schema.replace('"', "\"\"")),
            ));
        }
        // The ledger's own statements, and the grouped writes' texts (one
        // for each group size and kind: `store/grouped.rs`), stay prepared
        // on each connection: sqlx keeps 100 by default, and a statement
        // evicted is prepared again on its next use.
        let opts = base
            .options(options)
            .statement_cache_capacity(STATEMENT_CACHE);
        let pool = PgPoolOptions::new()
            .max_connections(s.max_connections)
            .min_connections(s.min_connections)
            .acquire_timeout(Duration::from_millis(s.acquire_timeout_ms))
            .idle_timeout((s.idle_timeout_ms > 0).then(|| Duration::from_millis(s.idle_timeout_ms)))
            .connect_with(opts)
            .await?;
        MIGRATOR.run(&pool).await?;
        let store = Self::new(
            pool.clone(),
            pool.clone(),
            pool.clone(),
            pool,
            clock,
            s.batch,
        );
        store.now().await?;
        Ok(store)
    }
}
