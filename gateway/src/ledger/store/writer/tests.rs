//! Tests of the group-commit writer: batches, cancellation at any
//! point, time limits, a stalled connection.

use std::time::Duration;

use super::*;
use crate::config::StorageSpec;
use crate::ledger::LedgerError;
use crate::ledger::command::{ClaimLease, Lease, OpRef};
use crate::ledger::dialect::{LedgerRow, sql};
use crate::ledger::sqlite::SqliteDialect;
use crate::ledger::store::Store;
use crate::ledger::{LedgerClock, NewOperation, Reservation, SystemClock};

fn new_op(id: &str) -> NewOperation {
    NewOperation {
        tenant_id: "t".into(),
        operation_id: id.into(),
        route: "pay".into(),
        method: "POST".into(),
        path: "v1/charges".into(),
        query: None,
        fingerprint: "fp".into(),
        provider_key: format!("pk-{id}"),
        effect_class: None,
        request_content_type: None,
        request_body: b"{}".to_vec(),
        request_headers: Vec::new(),
        trace_context: None,
        principal: "client".into(),
        retention_ms: 86_400_000,
        awaiting_approval: false,
        decisions: Vec::new(),
        approval: None,
    }
}

async fn store(dir: &std::path::Path) -> Store<SqliteDialect> {
    let storage = StorageSpec {
        path: dir.join("ledger.db"),
        ..StorageSpec::default()
    };
    Store::<SqliteDialect>::open(&storage, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger")
}

/// Waits (bounded) until `n` writes queue for the connection.
async fn until_queued<D: Dialect>(store: &Store<D>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.writer.queued() < n {
        assert!(Instant::now() < deadline, "{n} writes never queued");
        tokio::task::yield_now().await;
    }
}

/// A write that fails half-way: one statement (a `meta` row named
/// `half-way`), then it is dropped before its commit, as an error
/// return drops it.
async fn half_way<D: Dialect>(store: Store<D>) {
    let mut tx = store.writer.begin(0).await.unwrap();
    sql::<D>("INSERT INTO meta (name, value) VALUES ('half-way', ?)")
        .bind(&b"\0"[..])
        .execute(&mut tx)
        .await
        .unwrap();
    drop(tx);
}

/// Rows [`half_way`] writes that a fresh read of `store` sees.
async fn half_way_rows<D: Dialect>(store: &Store<D>) -> i64 {
    let mut conn = D::acquire(&store.read).await.unwrap();
    sql::<D>("SELECT COUNT(*) AS n FROM meta WHERE name = 'half-way'")
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .get::<i64>("n")
        .unwrap()
}

fn claim_of<'a>(id: &'a str, version: i64) -> ClaimLease<'a> {
    ClaimLease {
        op: OpRef::new("t", id),
        from: crate::ledger::State::Reserved,
        version,
        lease: Lease {
            owner: "gw-1",
            ms: 60_000,
        },
        reason: "test",
    }
}

/// One batch holds a write that commits, a write that loses its
/// compare-and-swap, a write that fails half-way (dropped after a
/// statement) and another that commits: one COMMIT, the good writes
/// are durable, the loser changed nothing and the failed write's
/// statement is gone. Each write's savepoint is its own (SQLite releases
/// it when the write ends): the failed write's rollback reaches only its
/// own, not the claim of `a` before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_compare_and_swap_or_a_failed_write_never_aborts_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_owned();
    never_aborts_the_batch(store(dir.path()).await, || store(&path)).await;
}

/// A PostgreSQL store on a fresh schema of `TEST_POSTGRES_URL`, one write
/// lane; with the same `schema`, a second store on the same tables.
async fn pg_store(url: &str, schema: &str) -> Store<crate::ledger::postgres::PgDialect> {
    use crate::ledger::postgres::{PgDialect, PgSettings};
    let settings = PgSettings::for_tests(url, schema, None);
    Store::<PgDialect>::open(&settings, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger")
}

/// On PostgreSQL a batch's writes share its transaction without
/// savepoints: a write that fails half-way undoes the batch it was in, and
/// the writes waiting for that batch's commit are told so
/// ([`LedgerError::BatchUndone`]) with nothing of them kept; a write that
/// lost its compare-and-swap changed nothing and leaves the batch alone,
/// and the write after the failed one commits in a batch of its own.
/// Skipped, with one line, without `TEST_POSTGRES_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_undoes_its_postgres_batch_and_a_lost_compare_and_swap_does_not() {
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    let store = pg_store(&url, &schema).await;
    for id in ["a", "b", "d"] {
        let (r, _) = store.reserve(&new_op(id), None).await.unwrap();
        assert!(matches!(r, Reservation::Created(_)));
    }
    let before = store.writer.commits();
    // Hold the connection so the writes below queue up behind it.
    let holder = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let a = tokio::spawn(async move { s.claim(&claim_of("a", 1)).await });
    until_queued(&store, 1).await;
    let s = store.clone();
    let lost = tokio::spawn(async move { s.claim(&claim_of("b", 7)).await });
    until_queued(&store, 2).await;
    let failed = tokio::spawn(half_way(store.clone()));
    until_queued(&store, 3).await;
    let s = store.clone();
    let d = tokio::spawn(async move { s.claim(&claim_of("d", 1)).await });
    until_queued(&store, 4).await;

    let held = holder.commit().await;
    assert!(matches!(held, Err(LedgerError::BatchUndone(_))), "{held:?}");
    let a = a.await.unwrap();
    assert!(matches!(a, Err(LedgerError::BatchUndone(_))), "{a:?}");
    assert_eq!(lost.await.unwrap().unwrap(), None, "b lost its CAS");
    failed.await.unwrap();
    let d = d.await.unwrap().unwrap().expect("d is claimed");
    assert_eq!((d.fence, d.attempt, d.version), (1, 1, 2));
    assert_eq!(store.writer.commits(), before + 1, "one COMMIT: d's");

    // What a fresh connection reads from the database.
    let reopened = pg_store(&url, &schema).await;
    for (id, state, version, fence, steps) in [
        ("a", crate::ledger::State::Reserved, 1, 0, 1),
        ("b", crate::ledger::State::Reserved, 1, 0, 1),
        ("d", crate::ledger::State::Executing, 2, 1, 2),
    ] {
        let row = reopened.get("t", id).await.unwrap().unwrap();
        assert_eq!(
            (row.state, row.version, row.fence),
            (state, version, fence),
            "{id}"
        );
        let rows = reopened.transitions("t", id).await.unwrap();
        assert_eq!(rows.len(), steps, "{id}: {rows:?}");
    }
    assert_eq!(
        half_way_rows(&reopened).await,
        0,
        "the failed write left nothing"
    );
}

/// Through the ledger, a write whose PostgreSQL batch was undone for
/// another write runs again and commits: the caller sees its claim, not
/// the undoing. Skipped, with one line, without `TEST_POSTGRES_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_undone_for_another_runs_again_through_the_ledger() {
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let storage = StorageSpec {
        url: Some(url),
        schema: Some(format!("eg_{}", uuid::Uuid::new_v4().simple())),
        // One lane, so the writes below queue behind the holder.
        write_connections: 1,
        ..StorageSpec::default()
    };
    let ledger = crate::ledger::Ledger::open_storage(&storage, Arc::new(SystemClock))
        .await
        .expect("open the ledger");
    let store = ledger
        .postgres_store()
        .expect("a PostgreSQL ledger")
        .clone();
    store.reserve(&new_op("a"), None).await.unwrap();
    let holder = store.writer.begin(0).await.unwrap();
    let l = ledger.clone();
    let a = tokio::spawn(async move {
        l.claim(
            ("t", "a"),
            crate::ledger::State::Reserved,
            1,
            "gw-1",
            60_000,
            "test",
        )
        .await
    });
    until_queued(&store, 1).await;
    let failed = tokio::spawn(half_way(store.clone()));
    until_queued(&store, 2).await;
    let held = holder.commit().await;
    assert!(matches!(held, Err(LedgerError::BatchUndone(_))), "{held:?}");
    failed.await.unwrap();
    let a = a
        .await
        .unwrap()
        .unwrap()
        .expect("claimed when it ran again");
    assert_eq!((a.fence, a.attempt, a.version), (1, 1, 2));
    let row = ledger.get("t", "a").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.version, row.fence),
        (crate::ledger::State::Executing, 2, 1)
    );
}

async fn never_aborts_the_batch<D: Dialect, F: std::future::Future<Output = Store<D>>>(
    store: Store<D>,
    reopen: impl FnOnce() -> F,
) {
    for id in ["a", "b", "c"] {
        let (r, _) = store.reserve(&new_op(id), None).await.unwrap();
        assert!(matches!(r, Reservation::Created(_)));
    }
    let before = store.writer.commits();
    // Hold the connection so the writes below queue up behind it.
    let holder = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let a = tokio::spawn(async move { s.claim(&claim_of("a", 1)).await });
    until_queued(&store, 1).await;
    let s = store.clone();
    let lost = tokio::spawn(async move { s.claim(&claim_of("b", 7)).await });
    until_queued(&store, 2).await;
    let s = store.clone();
    let failed = tokio::spawn(half_way(s));
    until_queued(&store, 3).await;
    let s = store.clone();
    let c = tokio::spawn(async move { s.claim(&claim_of("c", 1)).await });
    until_queued(&store, 4).await;
    // The holder, a and c wait for the commit; the loser and the failed
    // write are answered without one (they wrote nothing).
    assert_eq!(holder.commit().await.unwrap(), 3, "one batch");

    let a = a.await.unwrap().unwrap().expect("a is claimed");
    assert_eq!((a.fence, a.attempt, a.version), (1, 1, 2));
    assert_eq!(lost.await.unwrap().unwrap(), None, "b lost its CAS");
    failed.await.unwrap();
    assert!(c.await.unwrap().unwrap().is_some(), "c is claimed");
    assert_eq!(store.writer.commits(), before + 1, "one COMMIT");

    // What a fresh connection reads from the database.
    let reopened = reopen().await;
    let state = |id: &'static str| {
        let r = reopened.clone();
        async move { r.get("t", id).await.unwrap().unwrap() }
    };
    let (a, b, c) = (state("a").await, state("b").await, state("c").await);
    assert_eq!(
        (a.state, a.version, a.fence),
        (crate::ledger::State::Executing, 2, 1)
    );
    assert_eq!(
        (b.state, b.version, b.fence),
        (crate::ledger::State::Reserved, 1, 0)
    );
    assert_eq!(
        (c.state, c.version, c.fence),
        (crate::ledger::State::Executing, 2, 1)
    );
    // Each claim appended its transition row with the claim (in the
    // same round trip); the lost one appended none.
    for (id, steps) in [("a", 2), ("b", 1), ("c", 2)] {
        let rows = reopened.transitions("t", id).await.unwrap();
        assert_eq!(rows.len(), steps, "{id}: {rows:?}");
        let last = rows.last().unwrap();
        let row = reopened.get("t", id).await.unwrap().unwrap();
        assert_eq!((last.version, last.fence), (row.version, row.fence), "{id}");
    }
    assert_eq!(
        half_way_rows(&reopened).await,
        0,
        "the failed write left nothing"
    );
}

/// A write whose caller gives up while it cleans up after the write
/// before it or opens its savepoint (a sweep of cancellation points)
/// never undoes the write below them in the batch. The
/// write before it was dropped half-way, so giving up can fall in the
/// middle of that savepoint's rollback: a rollback that ran but was not
/// noted would run again, and with nested savepoints of one name the
/// second one reached the claim before it, whose caller was then told
/// it had committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_giving_up_during_its_begin_never_undoes_the_write_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    for k in 0..100u64 {
        let id = format!("a{k}");
        store.reserve(&new_op(&id), None).await.unwrap();
        let holder = store.writer.begin(0).await.unwrap();
        let s = store.clone();
        let claim_id = id.clone();
        let a = tokio::spawn(async move { s.claim(&claim_of(&claim_id, 1)).await });
        until_queued(&store, 1).await;
        let s = store.clone();
        let half = tokio::spawn(half_way(s));
        until_queued(&store, 2).await;
        let s = store.clone();
        let gone = tokio::spawn(async move { s.writer.begin(0).await.map(drop) });
        until_queued(&store, 3).await;
        let committed = tokio::spawn(holder.commit());
        // Once the half-way write is gone and `gone` holds the
        // connection (rolling that write's savepoint back), it is
        // cancelled 0–300 µs later: the sweep crosses each of its
        // round trips.
        half.await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.writer.queued() > 0 {
            assert!(Instant::now() < deadline, "the begin never got its turn");
            std::hint::spin_loop();
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_micros(3 * k) {
            std::hint::spin_loop();
        }
        gone.abort();
        let _ = gone.await;
        committed.await.unwrap().unwrap();
        let told = a.await.unwrap();
        let row = store.get("t", &id).await.unwrap().unwrap();
        match told {
            Ok(Some(_)) => assert_eq!(
                (row.state, row.fence),
                (crate::ledger::State::Executing, 1),
                "k = {k}: the claim was answered as committed"
            ),
            other => panic!("k = {k}: the claim failed: {other:?}"),
        }
    }
}

/// A caller that gives up while it waits for its turn leaves the queue
/// at once: under overload, writes whose callers timed out never take
/// the connection's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_giving_up_in_the_queue_leaves_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let holder = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let waiting = tokio::spawn(async move { s.writer.begin(0).await.map(drop) });
    until_queued(&store, 1).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    assert_eq!(store.writer.queued(), 0, "nothing left in the queue");
    drop(holder);
}

/// A call past its time limit is dropped while it waits for the
/// connection, but not once its write waits for the batch's `COMMIT`:
/// that write commits anyway, so its caller gets its answer, not a
/// timeout (which, for a claim, would leave it EXECUTING and unrun).
#[tokio::test(flavor = "current_thread")]
async fn a_call_is_not_timed_out_once_its_write_waits_for_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    for id in ["w", "late"] {
        store.reserve(&new_op(id), None).await.unwrap();
    }
    let limit = Duration::from_secs(60);
    // Queued for the connection in turn: w, a holder, `late` (then the
    // committer). w's commit hands the connection to the holder, which
    // keeps it.
    let first = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let w = tokio::spawn(async move { bounded(limit, s.claim(&claim_of("w", 1))).await });
    until_queued(&store, 1).await;
    let s = store.clone();
    let holder = tokio::spawn(async move { s.writer.begin(0).await.unwrap() });
    until_queued(&store, 2).await;
    let s = store.clone();
    let late = tokio::spawn(async move { bounded(limit, s.claim(&claim_of("late", 1))).await });
    until_queued(&store, 3).await;
    drop(first);
    let holder = holder.await.unwrap();
    // Now w waits for the commit, and `late` for the connection.
    assert_eq!(store.writer.queued(), 1);
    tokio::time::pause();
    tokio::time::advance(2 * limit).await;
    let late = late.await.unwrap();
    assert!(
        late.is_none(),
        "a call still waiting for the connection times out"
    );
    assert!(
        !w.is_finished(),
        "a write waiting for its commit is waited for"
    );
    tokio::time::resume();
    holder.commit().await.unwrap();
    let claim = w.await.unwrap().expect("answered").unwrap();
    assert!(claim.is_some(), "w is claimed");
    let row = store.get("t", "w").await.unwrap().unwrap();
    assert_eq!(row.state, crate::ledger::State::Executing);
    let row = store.get("t", "late").await.unwrap().unwrap();
    assert_eq!(
        row.state,
        crate::ledger::State::Reserved,
        "the call dropped wrote nothing"
    );
}

/// A TCP relay to the database that can stop passing bytes without
/// closing anything (a server or a network that hangs), and pass them
/// on again.
struct Relay {
    url: String,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    async fn start(url: &str) -> Relay {
        let mut parsed = url::Url::parse(url).unwrap();
        let target = format!(
            "{}:{}",
            parsed.host_str().unwrap_or("127.0.0.1"),
            parsed.port().unwrap_or(5432)
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        parsed.set_host(Some("127.0.0.1")).unwrap();
        parsed
            .set_port(Some(listener.local_addr().unwrap().port()))
            .unwrap();
        let (frozen, _) = tokio::sync::watch::channel(false);
        let gate = frozen.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pass(ri, wo, gate.subscribe()));
                tokio::spawn(pass(ro, wi, gate.subscribe()));
            }
        });
        Relay {
            url: parsed.to_string(),
            frozen,
        }
    }
}

/// Copies `from` to `to`, holding what it read while the relay is
/// frozen; ends (closing `to`) when `from` ends.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// On PostgreSQL, a `COMMIT` that gets no answer (the server or the
/// network hangs) fails its batch after `stall` instead of holding the
/// lane, and every later write on it: the writes are told the commit
/// failed, with its outcome unknown, and the next write gets a fresh
/// connection. Skipped, with one line, without `TEST_POSTGRES_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_hangs_fails_its_batch_after_the_stall_limit() {
    use crate::ledger::postgres::{PgDialect, PgSettings};
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let relay = Relay::start(&url).await;
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    // Long enough that no healthy statement reaches it on a loaded
    // machine (a COMMIT's fsync queued behind other tests' migrations):
    // the lane's every statement, the next write's COMMIT among them, is
    // held to it.
    let stall = Duration::from_secs(2);
    let settings = PgSettings::for_tests(&relay.url, &schema, Some(stall));
    let store = Store::<PgDialect>::open(&settings, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger");
    let mut w = store.writer.begin(0).await.unwrap();
    sql::<PgDialect>("INSERT INTO meta (name, value) VALUES ('stalled', '\\x00')")
        .execute(&mut w)
        .await
        .unwrap();
    relay.frozen.send_replace(true);
    let started = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(30), w.commit())
        .await
        .expect("the hung COMMIT is given up");
    match answer {
        Err(LedgerError::BatchCommit(why)) => {
            assert!(why.contains("did not answer within 2000 ms"), "{why}");
            assert!(why.contains("may or may not have taken effect"), "{why}");
        }
        other => panic!("a hung COMMIT answered {other:?}"),
    }
    assert!(started.elapsed() >= stall);
    relay.frozen.send_replace(false);
    // The lane takes a fresh connection: the next write commits.
    let mut next = store.writer.begin(0).await.unwrap();
    sql::<PgDialect>("INSERT INTO meta (name, value) VALUES ('next', '\\x00')")
        .execute(&mut next)
        .await
        .unwrap();
    assert_eq!(next.commit().await.unwrap(), 1);
    let mut conn = PgDialect::acquire(&store.read).await.unwrap();
    let n = sql::<PgDialect>("SELECT COUNT(*) AS n FROM meta WHERE name = 'next'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n.get::<i64>("n").unwrap(), 1);
}

/// A write dropped half-way with no write after it does not leave the
/// batch's transaction open: the committer rolls it back (the batch's
/// first write, it has no savepoint: with the batch) and ends the
/// transaction, so another connection can write at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_abandoned_write_does_not_keep_the_transaction_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    half_way(store.clone()).await;
    // Another connection to the file takes the write lock: it waits at
    // most its busy timeout for the batch's transaction to end.
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("ledger.db"))
        .busy_timeout(Duration::from_secs(10));
    let mut other = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts)
        .await
        .unwrap();
    let n = sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM meta WHERE name = 'half-way'")
        .fetch_one(&mut other)
        .await
        .unwrap();
    assert_eq!(n, 0, "the abandoned write left nothing");
    sqlx::raw_sql(
        "BEGIN IMMEDIATE; INSERT INTO meta (name, value) VALUES ('other', x'00'); COMMIT",
    )
    .execute(&mut other)
    .await
    .expect("the write lock was free");
}

/// A reservation with a claim is one write: the operation is EXECUTING
/// under fencing token 1 after one commit, with both transitions.
#[tokio::test]
async fn reserve_and_claim_is_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    reserved_and_claimed_at_once(store(dir.path()).await).await;
}

/// [`reserve_and_claim_is_one_commit`] on PostgreSQL. Skipped, with one
/// line, without `TEST_POSTGRES_URL`.
#[tokio::test]
async fn reserve_and_claim_is_one_postgres_commit() {
    use crate::ledger::postgres::{PgDialect, PgSettings};
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    let settings = PgSettings::for_tests(&url, &schema, None);
    let store = Store::<PgDialect>::open(&settings, LedgerClock::new(Arc::new(SystemClock)))
        .await
        .expect("open the ledger");
    reserved_and_claimed_at_once(store).await;
}

/// The exact row and history of a reservation with its claim: written as
/// one row (one statement, one commit), read back as if reserved and then
/// claimed.
async fn reserved_and_claimed_at_once<D: Dialect>(store: Store<D>) {
    use crate::ledger::State::{Executing, Reserved};
    let before = store.writer.commits();
    let lease = Lease {
        owner: "gw-1",
        ms: 60_000,
    };
    let (r, claim) = store
        .reserve(&new_op("x"), Some((lease, "lease claimed for attempt")))
        .await
        .unwrap();
    let Reservation::Created(op) = r else {
        panic!("created")
    };
    // Returned as reserved: what the claim changed is in the claim.
    assert_eq!(
        (
            op.state,
            op.version,
            op.fence,
            op.attempts,
            op.lease_owner.as_deref()
        ),
        (Reserved, 1, 0, 0, None)
    );
    let claim = claim.expect("claimed");
    assert_eq!((claim.fence, claim.attempt, claim.version), (1, 1, 2));
    assert_eq!(claim.lease_expires_at, op.created_at + 60_000);
    assert_eq!(store.writer.commits(), before + 1);
    let row = store.get("t", "x").await.unwrap().unwrap();
    assert_eq!(
        (
            row.state,
            row.version,
            row.fence,
            row.attempts,
            row.lease_owner.as_deref(),
            row.lease_expires_at,
            row.updated_at,
        ),
        (
            Executing,
            2,
            1,
            1,
            Some("gw-1"),
            Some(claim.lease_expires_at),
            op.created_at
        )
    );
    let steps = store.transitions("t", "x").await.unwrap();
    let seen: Vec<_> = steps
        .iter()
        .map(|t| {
            (
                t.from_state,
                t.to_state,
                t.version,
                t.fence,
                t.actor.as_str(),
                t.reason.as_str(),
                t.at,
            )
        })
        .collect();
    let at = op.created_at;
    assert_eq!(
        seen,
        vec![
            (None, Reserved, 1, 0, "client", "reserved", at),
            (
                Some(Reserved),
                Executing,
                2,
                1,
                "gw-1",
                "lease claimed for attempt",
                at
            ),
        ]
    );
    assert!(
        steps[0].seq < steps[1].seq,
        "the reservation's row comes first"
    );
    // A duplicate reserves nothing and claims nothing.
    let (r, claim) = store
        .reserve(&new_op("x"), Some((lease, "lease claimed for attempt")))
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Existing(_)) && claim.is_none());
    assert_eq!(store.transitions("t", "x").await.unwrap().len(), 2);
    // The outcome's statement logs the attempt (number 1, from the row).
    let mut outcome = crate::ledger::Outcome::new(crate::ledger::State::Completed, "answered");
    outcome.response_status = Some(201);
    outcome.attempt_outcome = Some("status-201".into());
    outcome.request_id = Some("req-1".into());
    let cmd = crate::ledger::command::RecordOutcome {
        op: OpRef::new("t", "x"),
        from: Executing,
        fence: 1,
        actor: "gw-1",
        outcome: &outcome,
    };
    // A stale fencing token, the row still EXECUTING: neither the outcome
    // nor an attempt row is written.
    let stale = crate::ledger::command::RecordOutcome { fence: 0, ..cmd };
    assert!(store.record_outcome(&stale).await.unwrap().is_none());
    assert!(store.attempts("t", "x").await.unwrap().is_empty());
    assert_eq!(store.get("t", "x").await.unwrap().unwrap().version, 2);
    let done = store.record_outcome(&cmd).await.unwrap().expect("recorded");
    assert_eq!(
        (done.state, done.version),
        (crate::ledger::State::Completed, 3)
    );
    let attempts = store.attempts("t", "x").await.unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    let a = &attempts[0];
    assert_eq!(
        (
            a.attempt,
            a.fence,
            a.status,
            a.outcome.as_str(),
            a.request_id.as_deref()
        ),
        (1, 1, Some(201), "status-201", Some("req-1"))
    );
    assert_eq!(a.at, done.updated_at);
    assert_eq!(store.transitions("t", "x").await.unwrap().len(), 3);
}

/// Opens a write alone and commits it: its commit is still pending at its
/// first poll (`why` if not), and then commits a batch of one.
async fn lone_write_waits_for_the_committer(store: &Store<SqliteDialect>, why: &str) {
    let tx = store.writer.begin(0).await.unwrap();
    let mut commit = std::pin::pin!(tx.commit());
    assert!(futures_util::poll!(commit.as_mut()).is_pending(), "{why}");
    assert_eq!(commit.await.unwrap(), 1);
}

/// A lone write (nothing queued, the last batch held one write) commits
/// on the calling thread: its commit is done at its first poll, durable
/// (a fresh connection reads it), and no committer ran. With a write
/// queued behind it, it waits for the committer and shares its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_write_commits_on_its_own_thread_and_a_busy_one_joins_a_batch() {
    use futures_util::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    for id in ["a", "b"] {
        store.reserve(&new_op(id), None).await.unwrap();
    }
    let before = store.writer.commits();
    let mut tx = store.writer.begin(0).await.unwrap();
    sql::<SqliteDialect>("UPDATE operations SET route = 'alone' WHERE operation_id = 'a'")
        .execute(&mut tx)
        .await
        .unwrap();
    let size = tx
        .commit()
        .now_or_never()
        .expect("committed at its first poll")
        .unwrap();
    assert_eq!((size, store.writer.commits()), (1, before + 1));
    let reopened = self::store(dir.path()).await;
    assert_eq!(
        reopened.get("t", "a").await.unwrap().unwrap().route,
        "alone"
    );

    // With a write queued for the connection, the commit is the
    // committer's, and the queued write joins it.
    let holder = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let b = tokio::spawn(async move { s.claim(&claim_of("b", 1)).await });
    until_queued(&store, 1).await;
    // The committer takes the batch after the queued write (the lock is
    // fair), so both share its commit. Whether the commit is still pending
    // at its first poll depends on how soon the committer's thread runs,
    // so that is not asserted.
    assert_eq!(holder.commit().await.unwrap(), 2, "b shared the commit");
    assert!(b.await.unwrap().unwrap().is_some(), "b is claimed");
    assert_eq!(store.writer.commits(), before + 2);

    // The last batch held two writes: the next lone write still waits
    // for the committer (a gateway under load keeps batching); after that
    // batch of one, the next commits at once again.
    lone_write_waits_for_the_committer(&store, "after a batch of two, a lone write is batched")
        .await;
    let tx = store.writer.begin(0).await.unwrap();
    let size = tx.commit().now_or_never().expect("committed at once");
    assert_eq!(size.unwrap(), 1);
    assert_eq!(store.writer.commits(), before + 4);
}

/// On a runtime of one worker thread no write commits alone: there a
/// write runs to its commit in one poll, so none ever queues behind
/// another, and lone commits would give every write an fsync of its own
/// on the only thread. Two writes made together share one commit, and a
/// write alone waits for the committer.
#[tokio::test(flavor = "current_thread")]
async fn on_one_worker_thread_writes_made_together_share_a_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    // The first write opens the connection (on a blocking thread): after
    // it, a write runs to its commit without waiting for anything.
    store.reserve(&new_op("first"), None).await.unwrap();
    let before = store.writer.commits();
    let (a, b) = (new_op("a"), new_op("b"));
    let (a, b) = tokio::join!(store.reserve(&a, None), store.reserve(&b, None));
    for r in [a, b] {
        assert!(
            matches!(r.unwrap().0, Reservation::Created(_)),
            "both reserved"
        );
    }
    assert_eq!(store.writer.commits(), before + 1, "one commit for both");
    lone_write_waits_for_the_committer(&store, "a lone write waits for the committer").await;
    assert_eq!(store.writer.commits(), before + 2);
    for id in ["a", "b"] {
        assert_eq!(
            store.get("t", id).await.unwrap().unwrap().state,
            crate::ledger::State::Reserved
        );
    }
}

/// A PostgreSQL ledger on a fresh schema of `TEST_POSTGRES_URL` with
/// `lanes` write connections and `storage.call_timeout_ms` of
/// `call_timeout_ms`; `None` (the test skipped, with one line) without one.
async fn pg_ledger(lanes: u32, call_timeout_ms: u64) -> Option<crate::ledger::Ledger> {
    let url = crate::ledger::postgres::test_url()?;
    let storage = StorageSpec {
        url: Some(url),
        schema: Some(format!("eg_{}", uuid::Uuid::new_v4().simple())),
        write_connections: lanes,
        max_connections: 16,
        call_timeout_ms,
        ..StorageSpec::default()
    };
    Some(
        crate::ledger::Ledger::open_storage(&storage, Arc::new(SystemClock))
            .await
            .expect("open the ledger"),
    )
}

/// A call whose write joined a batch is waited for past
/// `storage.call_timeout_ms`, since it commits whether anyone waits or not;
/// once that batch is undone without it (nothing kept), the limit holds
/// again: its run again, queued behind a write that holds the lane, ends
/// at the limit as a timeout instead of waiting for the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undone_call_is_held_to_its_time_limit_again() {
    let Some(ledger) = pg_ledger(1, 300).await else {
        return;
    };
    let store = ledger.postgres_store().expect("PostgreSQL").clone();
    store.reserve(&new_op("a"), None).await.unwrap();
    let holder = store.writer.begin(0).await.unwrap();
    let l = ledger.clone();
    let started = Instant::now();
    let a = tokio::spawn(async move {
        let r = l
            .claim(
                ("t", "a"),
                crate::ledger::State::Reserved,
                1,
                "gw-1",
                60_000,
                "test",
            )
            .await;
        (r, started.elapsed())
    });
    until_queued(&store, 1).await;
    let failed = tokio::spawn(half_way(store.clone()));
    until_queued(&store, 2).await;
    // Takes the lane after the failed write, ahead of a's run again.
    let s = store.clone();
    let next = tokio::spawn(async move { s.writer.begin(0).await.unwrap() });
    until_queued(&store, 3).await;
    let held = holder.commit().await;
    assert!(matches!(held, Err(LedgerError::BatchUndone(_))), "{held:?}");
    failed.await.unwrap();
    let next = next.await.unwrap();
    // `next` holds the lane until `a` has ended (a bound, not a wait: a
    // call not held to its limit would never end here).
    let (r, took) = tokio::time::timeout(Duration::from_secs(20), a)
        .await
        .expect("the call ended while the lane was held")
        .unwrap();
    next.unchanged();
    assert!(matches!(r, Err(LedgerError::Timeout(300))), "{r:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let row = ledger.get("t", "a").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.version, row.fence),
        (crate::ledger::State::Reserved, 1, 0)
    );
}

/// A write dropped before it ran any statement (its caller gave up as its
/// turn came) changed nothing: on PostgreSQL it leaves its batch alone,
/// and the claim before it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_dropped_before_any_statement_leaves_its_batch_alone() {
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    let store = pg_store(&url, &schema).await;
    store.reserve(&new_op("a"), None).await.unwrap();
    let holder = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let a = tokio::spawn(async move { s.claim(&claim_of("a", 1)).await });
    until_queued(&store, 1).await;
    let s = store.clone();
    let gone = tokio::spawn(async move { drop(s.writer.begin(0).await.unwrap()) });
    until_queued(&store, 2).await;
    assert_eq!(
        holder.commit().await.unwrap(),
        2,
        "the holder and a's claim"
    );
    gone.await.unwrap();
    let a = a.await.unwrap().unwrap().expect("a is claimed");
    assert_eq!((a.fence, a.version), (1, 2));
}

/// Many concurrent duplicates of one new key, then many concurrent claims
/// of one operation, through a PostgreSQL ledger with four write lanes:
/// every call answers (none is left with an undone batch), exactly one
/// creates and claims, exactly one claim wins, and the row and its
/// history are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_and_claims_all_answer_on_postgres() {
    let Some(ledger) = pg_ledger(4, 10_000).await else {
        return;
    };
    let calls = (0..100).map(|_| {
        let l = ledger.clone();
        tokio::spawn(async move {
            l.reserve_and_claim(&new_op("dup"), "gw", 600_000, "t")
                .await
        })
    });
    let (mut created, mut claimed) = (0, 0);
    for c in calls.collect::<Vec<_>>() {
        let (r, claim) = c.await.unwrap().expect("every duplicate answers");
        created += usize::from(matches!(r, Reservation::Created(_)));
        claimed += usize::from(claim.is_some());
    }
    assert_eq!((created, claimed), (1, 1));
    ledger.reserve(&new_op("c")).await.unwrap();
    let calls = (0..100).map(|i| {
        let l = ledger.clone();
        tokio::spawn(async move {
            let owner = format!("gw{i}");
            l.claim(
                ("t", "c"),
                crate::ledger::State::Reserved,
                1,
                &owner,
                600_000,
                "t",
            )
            .await
        })
    });
    let mut won = 0;
    for c in calls.collect::<Vec<_>>() {
        won += usize::from(c.await.unwrap().expect("every claim answers").is_some());
    }
    assert_eq!(won, 1);
    let row = ledger.get("t", "c").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.version, row.fence),
        (crate::ledger::State::Executing, 2, 1)
    );
    assert_eq!(ledger.transitions("t", "c").await.unwrap().len(), 2);
}

/// On SQLite the batch's first write runs without a savepoint (nothing
/// else is in the transaction while it runs). Dropped half-way, it is
/// undone with its batch, and the write queued behind it commits in a
/// batch of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_write_has_no_savepoint_and_dropped_half_way_takes_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    store.reserve(&new_op("a"), None).await.unwrap();
    let mut first = store.writer.begin(0).await.unwrap();
    sql::<SqliteDialect>("INSERT INTO meta (name, value) VALUES ('half-way', ?)")
        .bind(&b"\0"[..])
        .execute(&mut first)
        .await
        .unwrap();
    let release = sql::<SqliteDialect>("RELEASE SAVEPOINT effectgate_write")
        .execute(&mut first)
        .await;
    assert!(
        release.is_err(),
        "the batch's first write opened no savepoint: {release:?}"
    );
    let s = store.clone();
    let a = tokio::spawn(async move { s.claim(&claim_of("a", 1)).await });
    until_queued(&store, 1).await;
    drop(first);
    let claimed = a.await.unwrap().expect("the claim behind it commits");
    assert!(claimed.is_some(), "the claim applied");
    assert_eq!(
        half_way_rows(&store).await,
        0,
        "the first write left nothing"
    );
    let row = store.get("t", "a").await.unwrap().unwrap();
    assert_eq!((row.state, row.fence), (crate::ledger::State::Executing, 1));
    // The next write after a committed one is a batch's first again.
    let mut next = store.writer.begin(0).await.unwrap();
    let release = sql::<SqliteDialect>("RELEASE SAVEPOINT effectgate_write")
        .execute(&mut next)
        .await;
    assert!(release.is_err(), "{release:?}");
    next.unchanged();
}

/// What a reservation returns is the row it inserted, as a read gives it
/// back (it is built from the new operation, not read), with and without
/// the claim that rides in its statement.
async fn reserved_as_read<D: Dialect>(store: Store<D>) {
    use crate::ledger::command::Lease;
    let mut new = new_op("as-read");
    new.query = Some("expand=1".into());
    new.effect_class = Some("payment".into());
    new.request_content_type = Some("application/json".into());
    new.request_body = br#"{"amount":100}"#.to_vec();
    new.request_headers = vec![
        ("content-type".into(), "application/json".into()),
        ("x-request-id".into(), "r-1".into()),
    ];
    new.trace_context = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    let mut claimed = new_op("as-read-claimed");
    claimed.request_headers = new.request_headers.clone();
    for (new, claim) in [
        (&new, None),
        (
            &claimed,
            Some((
                Lease {
                    owner: "gw-1",
                    ms: 60_000,
                },
                "test",
            )),
        ),
    ] {
        let (r, c) = store.reserve(new, claim).await.unwrap();
        let Reservation::Created(op) = r else {
            panic!("created: {r:?}");
        };
        assert_eq!(c.is_some(), claim.is_some());
        let mut read = store
            .get("t", &new.operation_id)
            .await
            .unwrap()
            .expect("the row");
        if let Some(c) = c {
            // Stored as claimed; returned as reserved.
            assert_eq!(
                (read.state, read.version, read.fence, read.attempts),
                (crate::ledger::State::Executing, 2, c.fence, 1)
            );
            assert_eq!(read.lease_owner.as_deref(), Some("gw-1"));
            read.state = crate::ledger::State::Reserved;
            read.version = 1;
            read.fence = 0;
            read.attempts = 0;
            read.lease_owner = None;
            read.lease_expires_at = None;
        }
        assert_eq!(
            serde_json::to_value(&op).unwrap(),
            serde_json::to_value(&read).unwrap(),
            "{}: the reservation's operation is the row as read",
            new.operation_id
        );
        assert_eq!(op.request_body, read.request_body);
        assert_eq!(op.response_body, read.response_body);
    }
}

#[tokio::test]
async fn a_reservation_returns_its_row_as_a_read_gives_it() {
    let dir = tempfile::tempdir().unwrap();
    reserved_as_read(store(dir.path()).await).await;
}

/// [`a_reservation_returns_its_row_as_a_read_gives_it`] on PostgreSQL.
/// Skipped, with one line, without `TEST_POSTGRES_URL`.
#[tokio::test]
async fn a_postgres_reservation_returns_its_row_as_a_read_gives_it() {
    let Some(url) = crate::ledger::postgres::test_url() else {
        return;
    };
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    reserved_as_read(pg_store(&url, &schema).await).await;
}

/// Opens a batch of two writes (a holder and a reservation of `id` queued
/// behind it) and commits it through the committer; returns the holder's
/// commit and the reservation, both running.
async fn batch_of_two(
    store: &Store<SqliteDialect>,
    id: &str,
) -> (
    tokio::task::JoinHandle<Result<usize, LedgerError>>,
    tokio::task::JoinHandle<Result<Reservation, LedgerError>>,
) {
    let holder = store.writer.begin(0).await.unwrap();
    let (s, op) = (store.clone(), new_op(id));
    let queued = tokio::spawn(async move { s.reserve(&op, None).await.map(|r| r.0) });
    until_queued(store, 1).await;
    (tokio::spawn(holder.commit()), queued)
}

/// Waits (bounded) until `n` commits wait for their sync.
async fn until_unsynced(durability: &Durability, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while durability.pending() < n {
        assert!(
            Instant::now() < deadline,
            "{n} commits never waited for a sync"
        );
        tokio::task::yield_now().await;
    }
}

/// With `synchronous = full` a batch's `COMMIT` leaves the WAL's sync to
/// the syncer: its writes are answered only once the sync ran, while the
/// connection goes on to the next write meanwhile, and a point read that
/// finds a row of the unsynced batch waits for the sync too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_answered_after_its_wal_sync_and_the_connection_goes_on_meanwhile() {
    use futures_util::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    store.reserve(&new_op("first"), None).await.unwrap();
    // A point reader's connection is open and idle: a read runs at once.
    assert!(store.get("t", "first").await.unwrap().is_some());
    let durability = store.point.durability().clone();
    let held = durability.hold.write().await;
    let (holder, a) = batch_of_two(&store, "a").await;
    until_unsynced(&durability, 1).await;
    // Committed, not synced: nobody is answered, but the connection is
    // free for the next write.
    let next = tokio::time::timeout(Duration::from_secs(10), store.writer.begin(0))
        .await
        .expect("the connection waits for no sync")
        .unwrap();
    assert!(
        !holder.is_finished() && !a.is_finished(),
        "answered before the sync"
    );
    let mut read = std::pin::pin!(store.get("t", "a"));
    assert!(
        read.as_mut().now_or_never().is_none(),
        "a point read found a row of a batch not yet synced and did not wait"
    );
    let next = tokio::spawn(next.commit());
    drop(held);
    assert_eq!(holder.await.unwrap().unwrap(), 2);
    assert!(matches!(a.await.unwrap().unwrap(), Reservation::Created(_)));
    assert!(next.await.unwrap().is_ok());
    assert_eq!(read.await.unwrap().unwrap().operation_id, "a");
    assert_eq!(durability.pending(), 0);
    // A read that finds nothing does not wait.
    let _held = durability.hold.write().await;
    let (holder, b) = batch_of_two(&store, "b").await;
    until_unsynced(&durability, 1).await;
    assert!(
        store.get("t", "none").now_or_never().is_some(),
        "a read that found nothing waited"
    );
    drop(_held);
    assert_eq!(holder.await.unwrap().unwrap(), 2);
    assert!(b.await.unwrap().is_ok());
}

/// A sync of the WAL that fails fails every write of its batch
/// (`ledger-unavailable` for a request), saying the outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_wal_sync_fails_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    store.reserve(&new_op("first"), None).await.unwrap();
    let durability = store.point.durability().clone();
    durability
        .fail_next
        .store(true, std::sync::atomic::Ordering::Release);
    let (holder, a) = batch_of_two(&store, "a").await;
    for r in [holder.await.unwrap().map(drop), a.await.unwrap().map(drop)] {
        match r {
            Err(LedgerError::BatchCommit(why)) => {
                assert!(why.contains("may or may not be durable"), "{why}");
            }
            other => panic!("expected a failed commit, got {other:?}"),
        }
    }
    // The next batch syncs again.
    let (holder, b) = batch_of_two(&store, "b").await;
    assert_eq!(holder.await.unwrap().unwrap(), 2);
    assert!(b.await.unwrap().is_ok());
}
