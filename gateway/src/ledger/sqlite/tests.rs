//! The SQLite connections: statements on the writer's own connection,
//! `BEGIN` and `COMMIT` on the blocking pool, and the WAL's checkpoints.

use std::time::Duration;

use super::SqliteDialect;
use super::conn::{Conn, WriterOptions};
use super::point::PointReaders;
use crate::ledger::dialect::{LedgerRow, sql};

/// The writer's options for a `ledger.db` in `dir` (a 1 MiB page cache).
fn options(
    dir: &std::path::Path,
    synchronous: &'static str,
    busy_timeout: Duration,
    checkpoint_pages: u32,
) -> WriterOptions {
    WriterOptions {
        path: dir.join("ledger.db"),
        synchronous,
        busy_timeout,
        cache_kib: 1024,
        checkpoint_pages,
        durability: Default::default(),
    }
}

fn memory() -> Conn {
    let conn = rusqlite::Connection::open_in_memory().expect("an in-memory database");
    conn.execute_batch(
        "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL, flag BOOLEAN, body BLOB)",
    )
    .expect("a table");
    Conn::Writer {
        conn: Some(conn),
        busy: Duration::from_secs(1),
        checkpointer: None,
        checkpoint_pages: 1000,
        wal: None,
        durability: Default::default(),
    }
}

/// Each statement of a text takes as many values as it has
/// placeholders, in order; the rows of all of them come back in order,
/// and the count is of the rows the writing ones changed.
#[tokio::test]
async fn a_text_of_several_statements_hands_each_its_own_values() {
    let mut conn = memory();
    let inserted = sql::<SqliteDialect>(
        "INSERT INTO t (id, name, flag, body) VALUES (?, ?, ?, ?); \
         INSERT INTO t (id, name) VALUES (?, ?)",
    )
    .bind(1_i64)
    .bind("one")
    .bind(true)
    .bind(&b"\x00\x01"[..])
    .bind(2_i64)
    .bind("two")
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(inserted, 2);
    let rows = sql::<SqliteDialect>(
        "UPDATE t SET name = ? WHERE id = ? RETURNING id, name; \
         SELECT id, name, flag, body FROM t WHERE id = ?1",
    )
    .bind("uno")
    .bind(1_i64)
    .bind(2_i64)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].int("id").unwrap(), 1);
    assert_eq!(rows[0].text("name").unwrap(), "uno");
    assert_eq!(rows[1].int("id").unwrap(), 2);
    assert_eq!(rows[1].opt_int("flag").unwrap(), None);
    assert_eq!(rows[1].opt_bytes("body").unwrap(), None);
    let one = sql::<SqliteDialect>("SELECT flag, body FROM t WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(one.flag("flag").unwrap());
    assert_eq!(one.bytes("body").unwrap(), b"\x00\x01");
}

/// Runs of one statement text share its column names, and a run after a
/// schema change names the columns the statement has now.
#[tokio::test]
async fn a_statements_column_names_are_shared_and_follow_the_schema() {
    let names = |row: &super::row::Row| match row {
        super::row::Row::Raw { names, .. } => names.clone(),
        super::row::Row::Sqlx(_) => panic!("a row of the writer's connection"),
    };
    let mut conn = memory();
    sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (1, 'one')")
        .execute(&mut conn)
        .await
        .unwrap();
    let text = "SELECT * FROM t WHERE id = 1";
    let first = sql::<SqliteDialect>(text)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let again = sql::<SqliteDialect>(text)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(
        std::sync::Arc::ptr_eq(&names(&first), &names(&again)),
        "one set of names for both runs"
    );
    assert_eq!(&*names(&first), ["id", "name", "flag", "body"]);
    sql::<SqliteDialect>("ALTER TABLE t ADD COLUMN extra TEXT NOT NULL DEFAULT 'x'")
        .execute(&mut conn)
        .await
        .unwrap();
    let after = sql::<SqliteDialect>(text)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(&*names(&after), ["id", "name", "flag", "body", "extra"]);
    assert_eq!(after.text("extra").unwrap(), "x");
    assert_eq!(after.text("name").unwrap(), "one");
}

/// Values that don't match the placeholders, a column that isn't
/// there and a value of another type are errors, not panics, and the
/// database's own errors keep their kind.
#[tokio::test]
async fn mismatches_are_errors() {
    let mut conn = memory();
    let few = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (?, ?)")
        .bind(1_i64)
        .execute(&mut conn)
        .await;
    assert!(
        matches!(&few, Err(sqlx::Error::Protocol(m)) if m.contains("too few values")),
        "{few:?}"
    );
    let many = sql::<SqliteDialect>("SELECT 1 AS one")
        .bind(1_i64)
        .fetch_all(&mut conn)
        .await;
    assert!(
        matches!(&many, Err(sqlx::Error::Protocol(m)) if m.contains("more values")),
        "{many:?}"
    );
    let row = sql::<SqliteDialect>("SELECT 'x' AS name")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(matches!(
        row.int("name"),
        Err(sqlx::Error::ColumnDecode { .. })
    ));
    assert!(matches!(
        row.text("other"),
        Err(sqlx::Error::ColumnNotFound(_))
    ));
    for _ in 0..2 {
        let _ = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (7, 'seven')")
            .execute(&mut conn)
            .await;
    }
    let dup = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (7, 'again')")
        .execute(&mut conn)
        .await;
    match dup {
        Err(sqlx::Error::Database(e)) => {
            assert!(e.is_unique_violation(), "{e}");
            assert!(e.message().contains("UNIQUE"), "{}", e.message());
        }
        other => panic!("{other:?}"),
    }
}

/// `COMMIT` and `BEGIN` run on a blocking thread and give the
/// connection back.
#[tokio::test]
async fn a_durable_statement_gives_the_connection_back() {
    let mut conn = memory();
    conn.run_durable("BEGIN IMMEDIATE").await.unwrap();
    sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (1, 'one')")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.run_durable("COMMIT").await.unwrap();
    let n = sql::<SqliteDialect>("SELECT COUNT(*) AS n FROM t")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n.int("n").unwrap(), 1);
    let Conn::Writer { conn: Some(c), .. } = &conn else {
        panic!("the connection was not given back: {conn:?}");
    };
    assert!(c.is_autocommit());
}

/// `BEGIN IMMEDIATE` while another connection holds the file's write
/// lock waits for it on a blocking thread, up to the busy timeout, and
/// fails with the database's error; the connection stays usable and
/// begins once the lock is free.
#[tokio::test]
async fn a_begin_behind_another_writer_waits_then_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path(), "FULL", Duration::from_millis(50), 1000);
    let mut conn = Conn::writer(&options).await.unwrap();
    let other = rusqlite::Connection::open(&options.path).unwrap();
    other
        .execute_batch("CREATE TABLE t (id INTEGER); BEGIN IMMEDIATE; INSERT INTO t VALUES (1)")
        .unwrap();
    let busy = conn.begin("BEGIN IMMEDIATE; SAVEPOINT s").await;
    match busy {
        Err(sqlx::Error::Database(e)) => assert!(e.message().contains("locked"), "{e}"),
        other => panic!("{other:?}"),
    }
    other.execute_batch("COMMIT").unwrap();
    conn.begin("BEGIN IMMEDIATE; SAVEPOINT s").await.unwrap();
    let n = sql::<SqliteDialect>("SELECT COUNT(*) AS n FROM t")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n.int("n").unwrap(), 1);
    conn.run_durable("COMMIT").await.unwrap();
}

/// Past a quarter of `checkpoint_pages` the checkpointer moves the
/// WAL into the file (the writer's commits don't).
#[tokio::test]
async fn the_checkpointer_moves_the_wal_into_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path(), "FULL", Duration::from_secs(1), 1000);
    let mut conn = Conn::writer(&options).await.unwrap();
    conn.begin("BEGIN IMMEDIATE; CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
        .await
        .unwrap();
    conn.run_durable("COMMIT").await.unwrap();
    // 16 KiB a commit, until the WAL is past 250 pages: one commit
    // wakes the checkpointer, once.
    let wal = dir.path().join("ledger.db-wal");
    let mut id = 0_i64;
    // A WAL file is a 32-byte header, then frames of a 24-byte header
    // and a 4 KiB page.
    let frames = |wal: &std::path::Path| {
        (std::fs::metadata(wal).unwrap().len().saturating_sub(32)) / (24 + 4096)
    };
    while frames(&wal) < 250 {
        conn.begin("BEGIN IMMEDIATE").await.unwrap();
        sql::<SqliteDialect>("INSERT INTO t (id, body) VALUES (?, zeroblob(16384))")
            .bind(id)
            .execute(&mut conn)
            .await
            .unwrap();
        conn.run_durable("COMMIT").await.unwrap();
        id += 1;
    }
    let Conn::Writer {
        checkpointer: Some(c),
        ..
    } = &conn
    else {
        panic!("no checkpointer: {conn:?}");
    };
    assert!(c.wait_for(1, Duration::from_secs(10)), "no checkpoint ran");
    // What the WAL held is in the file now: a copy of the file alone,
    // without its WAL, has the table and every row.
    let copy = dir.path().join("copy.db");
    std::fs::copy(&options.path, &copy).unwrap();
    let probe = rusqlite::Connection::open(&copy).unwrap();
    let n: i64 = probe
        .query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, id);
}

/// Writes 100 rows of `row_kib` KiB, one commit each, on a writer whose
/// limit is 40 pages; after each commit waits for the checkpointer's pass,
/// if one was started. Returns the largest the WAL file was (it keeps its
/// size when the WAL starts over), in pages.
async fn largest_wal(row_kib: u32) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path(), "NORMAL", Duration::from_secs(1), 40);
    let mut conn = Conn::writer(&options).await.unwrap();
    conn.begin("BEGIN IMMEDIATE; CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
        .await
        .unwrap();
    conn.run_durable("COMMIT").await.unwrap();
    let mut largest = 0;
    for id in 0..100_i64 {
        conn.begin("BEGIN IMMEDIATE").await.unwrap();
        sql::<SqliteDialect>("INSERT INTO t (id, body) VALUES (?, zeroblob(?))")
            .bind(id)
            .bind(i64::from(row_kib) * 1024)
            .execute(&mut conn)
            .await
            .unwrap();
        conn.run_durable("COMMIT").await.unwrap();
        let Conn::Writer {
            checkpointer: Some(k),
            ..
        } = &conn
        else {
            panic!("no checkpointer: {conn:?}");
        };
        assert!(
            k.wait_idle(Duration::from_secs(10)),
            "a checkpoint pass never ended"
        );
        let wal = std::fs::metadata(dir.path().join("ledger.db-wal"))
            .unwrap()
            .len();
        largest = largest.max(wal / 4_096);
    }
    largest
}

/// At `checkpoint_pages` the writer checkpoints inside its commit and the
/// WAL starts over at the next write. Each commit here takes the WAL from
/// empty past the limit (50 pages), so the checkpointer thread is never
/// woken (it runs below the limit): only the writer's own checkpoint keeps
/// the WAL at about one commit. Without it, 5,000 pages.
#[tokio::test]
async fn the_wal_starts_over_at_checkpoint_pages() {
    let largest = largest_wal(200).await;
    assert!(largest < 120, "the WAL grew to {largest} pages");
}

/// Below the limit, the checkpointer thread's passes copy the WAL while
/// the writer goes on, and when a pass has ended before the next write the
/// WAL starts over there: with commits of 5 pages it never reaches the 40
/// pages at which the writer would checkpoint itself.
#[tokio::test]
async fn the_checkpointer_thread_lets_the_wal_start_over_below_the_limit() {
    let largest = largest_wal(16).await;
    assert!(largest < 40, "the WAL grew to {largest} pages");
}

/// A point read (on the calling thread) sees what the writer committed,
/// not what it has not, and can't write.
#[tokio::test]
async fn a_point_read_sees_commits_only_and_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path(), "FULL", Duration::from_secs(10), 1000);
    let mut writer = Conn::writer(&options).await.unwrap();
    writer
        .begin("BEGIN IMMEDIATE; CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT)")
        .await
        .unwrap();
    writer.run_durable("COMMIT").await.unwrap();
    let readers = PointReaders::new(options.clone(), 2);
    writer.begin("BEGIN IMMEDIATE").await.unwrap();
    sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (1, 'one')")
        .execute(&mut writer)
        .await
        .unwrap();
    assert_eq!(
        point_read(&readers, 1).await.unwrap(),
        None,
        "not committed yet"
    );
    writer.run_durable("COMMIT").await.unwrap();
    assert_eq!(
        point_read(&readers, 1).await.unwrap().as_deref(),
        Some("one")
    );
    let mut conn = readers.acquire().await.unwrap();
    let refused = sql::<SqliteDialect>("DELETE FROM t")
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("readonly"), "{refused}");
}

/// `name` of row `id` of `t`, read by a point reader of `readers`.
async fn point_read(
    readers: &std::sync::Arc<PointReaders>,
    id: i64,
) -> Result<Option<String>, sqlx::Error> {
    let mut conn = readers.acquire().await?;
    sql::<SqliteDialect>("SELECT name FROM t WHERE id = ?")
        .bind(id)
        .fetch_optional(&mut conn)
        .await
        .map(|r| r.map(|r| r.text("name").unwrap()))
}

/// While another process holds the file locked (`locking_mode =
/// EXCLUSIVE`), a point read does not block the calling thread: its first
/// poll is pending (the wait went to a blocking thread), and it answers
/// once the lock is gone; its connection goes back to the readers.
#[tokio::test]
async fn a_point_read_waits_out_another_process_off_the_calling_thread() {
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path(), "FULL", Duration::from_secs(10), 1000);
    rusqlite::Connection::open(&options.path)
        .unwrap()
        .execute_batch(
            "PRAGMA journal_mode = WAL; CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT); \
             INSERT INTO t VALUES (1, 'one')",
        )
        .unwrap();
    // The lock needs the file to itself.
    let other = rusqlite::Connection::open(&options.path).unwrap();
    other
        .execute_batch(
            "PRAGMA locking_mode = EXCLUSIVE; BEGIN EXCLUSIVE; UPDATE t SET name = 'uno'; COMMIT",
        )
        .unwrap();
    let readers = PointReaders::new(options.clone(), 2);
    // One idle connection (opening one reads nothing).
    drop(readers.acquire().await.unwrap());
    let mut waiting = std::pin::pin!(point_read(&readers, 1));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(
        std::future::Future::poll(waiting.as_mut(), &mut cx).is_pending(),
        "the read waits for the lock, off the calling thread"
    );
    drop(other);
    assert_eq!(waiting.await.unwrap().as_deref(), Some("uno"));
    // The connection went back without a wait left on it: the next read
    // takes it, and it would not wait on the calling thread either.
    let mut conn = readers.acquire().await.unwrap();
    let timeout = sql::<SqliteDialect>("PRAGMA busy_timeout")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(timeout.int("timeout").unwrap(), 0);
    assert_eq!(readers.idle(), 0, "the one idle connection is in use");
    drop(conn);
    assert_eq!(readers.idle(), 1);
}
