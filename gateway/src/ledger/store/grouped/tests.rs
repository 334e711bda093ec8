//! Grouped writes on PostgreSQL: the rows and history each write of a
//! group leaves, exactly as alone; what the group leaves to its callers.
//! Each test holds the one write connection's turn with a write of its
//! own until every call has queued, so that they form one group. Skipped,
//! with one line, without `TEST_POSTGRES_URL`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ledger::command::{Lease, RecordOutcome};
use crate::ledger::dialect::{Dialect, LedgerRow, sql};
use crate::ledger::postgres::{PgDialect, PgSettings};
use crate::ledger::store::Store;
use crate::ledger::{
    LedgerClock, LedgerError, NewOperation, Outcome, Reservation, State, SystemClock,
};

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
        request_body: format!("{{\"id\":\"{id}\"}}").into_bytes(),
        request_headers: Vec::new(),
        trace_context: None,
        principal: format!("client-{id}"),
        retention_ms: 86_400_000,
        awaiting_approval: false,
        decisions: Vec::new(),
        approval: None,
    }
}

const LEASE: Lease<'static> = Lease {
    owner: "gw-1",
    ms: 60_000,
};

/// A store on a fresh schema of `TEST_POSTGRES_URL` (one write
/// connection), or `None`.
async fn pg_store() -> Option<Store<PgDialect>> {
    let url = crate::ledger::postgres::test_url()?;
    let schema = format!("eg_{}", uuid::Uuid::new_v4().simple());
    let settings = PgSettings::for_tests(&url, &schema, None);
    Some(
        Store::<PgDialect>::open(&settings, LedgerClock::new(Arc::new(SystemClock)))
            .await
            .expect("open the ledger"),
    )
}

/// Waits (bounded) until `n` reservations and `m` outcomes are queued,
/// their leader waiting for the connection.
async fn until_waiting(store: &Store<PgDialect>, n: usize, m: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.groups.waiting() != (n, m) || store.writer.queued() < 1 {
        assert!(
            Instant::now() < deadline,
            "never queued: {:?}",
            store.groups.waiting()
        );
        tokio::task::yield_now().await;
    }
}

/// The rows of `SELECT columns FROM rest` as text, one line a row,
/// columns `|`-separated, NULL as `NULL`.
async fn rows(store: &Store<PgDialect>, columns: &[&str], rest: &str) -> Vec<String> {
    let mut conn = PgDialect::acquire(&store.read).await.unwrap();
    sql::<PgDialect>(&format!("SELECT {} FROM {rest}", columns.join(", ")))
        .fetch_all(&mut conn)
        .await
        .unwrap()
        .iter()
        .map(|r| {
            columns
                .iter()
                .map(|c| {
                    r.opt_text(c)
                        .ok()
                        .flatten()
                        .or_else(|| {
                            r.get::<Option<i64>>(c)
                                .ok()
                                .flatten()
                                .map(|i| i.to_string())
                        })
                        .unwrap_or_else(|| "NULL".into())
                })
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect()
}

/// Ten reservations that queued behind another write are taken as one
/// group: each is created and claimed (fencing token 1, attempt 1,
/// version 2), with its own row and its two transitions, in order, as a
/// reservation alone leaves them. A second call with a key already in the
/// group waits for the next group and finds the operation there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_queued_together_are_written_as_one_group() {
    let Some(store) = pg_store().await else {
        return;
    };
    let held = store.writer.begin(0).await.unwrap();
    let mut calls = Vec::new();
    for n in 0..11 {
        let s = store.clone();
        // The eleventh is the first's key again.
        let id = format!("op-{}", if n == 10 { 0 } else { n });
        calls.push(tokio::spawn(async move {
            let r = s
                .reserve(&new_op(&id), Some((LEASE, "lease claimed for attempt")))
                .await;
            (id, r)
        }));
        // In order: the duplicate queues last.
        until_waiting(&store, n + 1, 0).await;
    }
    held.unchanged();
    let mut created = 0;
    let mut existing = 0;
    for call in calls {
        let (id, r) = call.await.unwrap();
        match r.unwrap() {
            (Reservation::Created(op), Some(claim)) => {
                created += 1;
                assert_eq!(
                    (op.operation_id.as_str(), op.state),
                    (id.as_str(), State::Reserved)
                );
                assert_eq!((claim.fence, claim.attempt, claim.version), (1, 1, 2));
                assert_eq!(claim.lease_expires_at, op.created_at + 60_000);
            }
            (Reservation::Existing(op), None) => {
                existing += 1;
                assert_eq!(
                    (id.as_str(), op.state, op.fence),
                    ("op-0", State::Executing, 1)
                );
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!((created, existing), (10, 1));
    assert_eq!(store.groups.shared(), (10, 0), "the ten were one group");
    let ops = rows(
        &store,
        &[
            "operation_id",
            "state",
            "version",
            "fence",
            "attempts",
            "lease_owner",
            "principal",
        ],
        "operations ORDER BY operation_id",
    )
    .await;
    let expected: Vec<String> = (0..10)
        .map(|n| format!("op-{n}|EXECUTING|2|1|1|gw-1|client-op-{n}"))
        .collect();
    assert_eq!(ops, expected);
    let history = rows(
        &store,
        &[
            "operation_id",
            "from_state",
            "to_state",
            "version",
            "fence",
            "actor",
            "reason",
        ],
        "transitions ORDER BY operation_id, seq",
    )
    .await;
    let expected: Vec<String> = (0..10)
        .flat_map(|n| {
            [
                format!("op-{n}|NULL|RESERVED|1|0|client-op-{n}|reserved"),
                format!("op-{n}|RESERVED|EXECUTING|2|1|gw-1|lease claimed for attempt"),
            ]
        })
        .collect();
    assert_eq!(history, expected);
}

/// An outcome for `id` under `fence`: COMPLETED with a 201 and its body,
/// its attempt logged.
fn completed(id: &str) -> Outcome {
    let mut o = Outcome::new(State::Completed, "status-201");
    o.response_status = Some(201);
    o.response_headers = vec![("content-type".into(), "application/json".into())];
    o.response_body = Some(format!("{{\"charge\":\"ch_{id}\"}}").into_bytes());
    o.attempt_outcome = Some("status-201".into());
    o.request_id = Some(format!("req-{id}"));
    o.provider_reference = Some(format!("ch_{id}"));
    o
}

/// Eight outcomes that queued behind another write are taken as one
/// group: each is recorded (COMPLETED at version 3, its response and
/// reference stored, the lease released), with its transition and its
/// attempt; the operation each call gets back is the row as committed.
/// One more, under a fencing token that is not current, is in the group
/// too: it writes nothing, and its call is answered as alone (`false`,
/// one stale-fence rejection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_queued_together_are_written_as_one_group() {
    let Some(store) = pg_store().await else {
        return;
    };
    for n in 0..9 {
        let (r, claim) = store
            .reserve(
                &new_op(&format!("op-{n}")),
                Some((LEASE, "lease claimed for attempt")),
            )
            .await
            .unwrap();
        assert!(matches!(r, Reservation::Created(_)) && claim.is_some());
    }
    let rejected = store.stale_fence_rejections();
    let held = store.writer.begin(0).await.unwrap();
    let mut calls = Vec::new();
    for n in 0..9 {
        let s = store.clone();
        calls.push(tokio::spawn(async move {
            let id = format!("op-{n}");
            let outcome = completed(&id);
            // The ninth writes under a token that was never current.
            let fence = if n == 8 { 7 } else { 1 };
            let cmd = RecordOutcome {
                op: crate::ledger::command::OpRef::new("t", &id),
                from: State::Executing,
                fence,
                actor: "gw-1",
                outcome: &outcome,
            };
            let r = s.record_outcome(&cmd).await;
            (id, r)
        }));
        until_waiting(&store, 0, n + 1).await;
    }
    held.unchanged();
    for call in calls {
        let (id, r) = call.await.unwrap();
        match r.unwrap() {
            Some(op) => {
                assert_ne!(id, "op-8");
                assert_eq!(
                    (op.state, op.version, op.fence, op.lease_owner.as_deref()),
                    (State::Completed, 3, 1, None)
                );
                assert_eq!(op.response_status, Some(201));
                let body = format!("{{\"charge\":\"ch_{id}\"}}").into_bytes();
                assert_eq!(op.response_body.as_deref(), Some(&body[..]));
                assert_eq!(op.provider_reference, Some(format!("ch_{id}")));
            }
            None => assert_eq!(id, "op-8"),
        }
    }
    assert_eq!(store.groups.shared(), (0, 9), "the nine were one group");
    assert_eq!(store.stale_fence_rejections(), rejected + 1);
    let ops = rows(
        &store,
        &[
            "operation_id",
            "state",
            "version",
            "fence",
            "response_status",
            "response_headers",
            "provider_reference",
            "lease_owner",
        ],
        "operations ORDER BY operation_id",
    )
    .await;
    let mut expected: Vec<String> = (0..8)
        .map(|n| {
            format!(
                "op-{n}|COMPLETED|3|1|201|[[\"content-type\",\"application/json\"]]|ch_op-{n}|NULL"
            )
        })
        .collect();
    expected.push("op-8|EXECUTING|2|1|NULL|NULL|NULL|gw-1".into());
    assert_eq!(ops, expected);
    let history = rows(
        &store,
        &[
            "operation_id",
            "from_state",
            "to_state",
            "version",
            "fence",
            "actor",
            "reason",
        ],
        &format!(
            "transitions WHERE to_state = '{}' ORDER BY operation_id",
            State::Completed.as_str()
        ),
    )
    .await;
    let expected: Vec<String> = (0..8)
        .map(|n| format!("op-{n}|EXECUTING|COMPLETED|3|1|gw-1|status-201"))
        .collect();
    assert_eq!(history, expected);
    let attempts = rows(
        &store,
        &[
            "operation_id",
            "attempt",
            "fence",
            "status",
            "outcome",
            "detail",
            "request_id",
        ],
        "attempts ORDER BY operation_id",
    )
    .await;
    let expected: Vec<String> = (0..8)
        .map(|n| format!("op-{n}|1|1|201|status-201|NULL|req-op-{n}"))
        .collect();
    assert_eq!(attempts, expected);
}

/// A row the database refuses (a NUL in its tenant) fails the group's
/// statement: nothing of the group is kept, and each call writes alone
/// (run again, as the ledger runs it, when that call's failure undid the
/// batch it shared), so the others are created and only that call fails,
/// with the database's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_database_refuses_fails_alone() {
    let Some(store) = pg_store().await else {
        return;
    };
    let held = store.writer.begin(0).await.unwrap();
    let mut calls = Vec::new();
    for n in 0..5 {
        let s = store.clone();
        calls.push(tokio::spawn(async move {
            let mut new = new_op(&format!("op-{n}"));
            if n == 2 {
                new.tenant_id = "t\0".into();
            }
            // Run again when its batch was undone for another write, as
            // the ledger runs it.
            loop {
                match s
                    .reserve(&new, Some((LEASE, "lease claimed for attempt")))
                    .await
                {
                    Err(LedgerError::BatchUndone(_)) => {}
                    r => return (n, r),
                }
            }
        }));
        until_waiting(&store, n + 1, 0).await;
    }
    held.unchanged();
    for call in calls {
        match call.await.unwrap() {
            (2, Err(LedgerError::Db(e))) => {
                assert!(e.to_string().contains("0x00"), "{e}");
            }
            (n, Ok((Reservation::Created(op), Some(_)))) if n != 2 => {
                assert_eq!(op.operation_id, format!("op-{n}"));
            }
            (n, other) => panic!("{n}: {other:?}"),
        }
    }
    // The five were one group (calls run again may group again).
    assert!(store.groups.shared().0 >= 5, "{:?}", store.groups.shared());
    let ops = rows(
        &store,
        &["operation_id", "state"],
        "operations ORDER BY operation_id",
    )
    .await;
    assert_eq!(
        ops,
        [
            "op-0|EXECUTING",
            "op-1|EXECUTING",
            "op-3|EXECUTING",
            "op-4|EXECUTING"
        ]
    );
}

/// A call that gives up while its reservation waits in the queue (its
/// task dropped, as a cancelled request drops it) has nothing written,
/// and the leader, finding only that write queued when its turn came,
/// goes on: the next reservation is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_in_the_queue_is_not_written_and_the_queue_goes_on() {
    let Some(store) = pg_store().await else {
        return;
    };
    let held = store.writer.begin(0).await.unwrap();
    let s = store.clone();
    let gone = tokio::spawn(async move {
        s.reserve(&new_op("gone"), Some((LEASE, "lease claimed for attempt")))
            .await
    });
    until_waiting(&store, 1, 0).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    held.unchanged();
    let (r, claim) = tokio::time::timeout(
        Duration::from_secs(10),
        store.reserve(&new_op("next"), Some((LEASE, "lease claimed for attempt"))),
    )
    .await
    .expect("the next reservation is written")
    .unwrap();
    assert!(matches!(r, Reservation::Created(_)) && claim.is_some());
    only_next_written(&store).await;
}

/// A call past its time limit while its reservation waits in the queue
/// is dropped ([`crate::ledger::store::bounded`] gives `None`), and its
/// reservation is not made: nobody would send the call it claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_timed_out_in_the_queue_is_not_written() {
    let Some(store) = pg_store().await else {
        return;
    };
    let held = store.writer.begin(0).await.unwrap();
    // The turn is held until the call has given up: it can't be written
    // before its limit.
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        crate::ledger::store::bounded(
            Duration::from_millis(50),
            store.reserve(&new_op("late"), Some((LEASE, "lease claimed for attempt"))),
        ),
    )
    .await
    .expect("the call gives up at its limit");
    assert!(r.is_none(), "dropped at its limit");
    held.unchanged();
    let (r, _) = store
        .reserve(&new_op("next"), Some((LEASE, "lease claimed for attempt")))
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Created(_)));
    only_next_written(&store).await;
}

/// The one operation in the ledger is `next`, claimed (EXECUTING): the
/// calls before it wrote nothing.
async fn only_next_written(store: &Store<PgDialect>) {
    let ops = rows(
        store,
        &["operation_id", "state"],
        "operations ORDER BY operation_id",
    )
    .await;
    assert_eq!(ops, ["next|EXECUTING"]);
}
