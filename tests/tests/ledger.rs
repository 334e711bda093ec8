//! Ledger conformance: one suite for the ledger interface, run against
//! both backends. It covers the state machine, compare-and-swap, fencing,
//! lease expiry, transition history, approvals, the outbox, scan claims,
//! key retention and the retention sweeper. Time moves by
//! [`Ledger::shift_clock`] (the database clock on PostgreSQL).
//!
//! Every test runs twice: `<name>::sqlite` on a temporary file, and
//! `<name>::postgres` in a fresh schema of the database named by
//! `TEST_POSTGRES_URL` (skipped, with one line saying so, when
//! it is unset).

use std::sync::Arc;

use effectgate::ledger::{
    ApprovalDecision, Claim, CompensationReservation, Ledger, ManualClock, NewApproval,
    NewCompensation, NewOperation, Outcome, Reservation, State,
};
use effectgate_tests::pg;

/// Runs each named test body on SQLite and on PostgreSQL.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let dir = tempfile::tempdir().unwrap();
                let clock = super::ManualClock::new(1_000_000);
                let l = super::Ledger::open(&dir.path().join("l.db"), 4, 5000, clock)
                    .await
                    .unwrap();
                super::$name(l).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let Some(url) = super::pg::url() else { return };
                let l = super::Ledger::open_storage(
                    &super::pg::storage(&url),
                    super::Arc::new(effectgate::ledger::SystemClock),
                )
                .await
                .unwrap();
                assert_eq!(l.backend_name(), "postgres");
                super::$name(l).await;
            }
        }
    )*};
}

fn new_op(id: &str) -> NewOperation {
    NewOperation {
        tenant_id: "t".into(),
        operation_id: id.into(),
        route: "r".into(),
        method: "POST".into(),
        path: "/x".into(),
        query: None,
        fingerprint: "fp".into(),
        provider_key: "pk".into(),
        effect_class: None,
        request_content_type: None,
        request_body: b"{}".to_vec(),
        request_headers: vec![],
        trace_context: None,
        principal: "p".into(),
        retention_ms: 100_000,
        awaiting_approval: false,
        decisions: vec![],
        approval: None,
    }
}

fn outcome(state: State, reason: &str) -> Outcome {
    let mut o = Outcome::new(state, reason);
    o.response_status = Some(200);
    o.response_body = Some(b"ok".to_vec());
    o.attempt_outcome = Some("status-200".into());
    o
}

async fn reserved(l: &Ledger, id: &str) -> i64 {
    match l.reserve(&new_op(id)).await.unwrap() {
        Reservation::Created(op) => op.version,
        Reservation::Existing(_) => panic!("expected a new operation"),
    }
}

async fn stale_owner_is_fenced_and_the_state_stays_the_new_owners(l: Ledger) {
    let v = reserved(&l, "op").await;
    let a: Claim = l
        .claim(("t", "op"), State::Reserved, v, "A", 60_000, "first")
        .await
        .unwrap()
        .unwrap();
    // B can't take a live lease.
    let op = l.get("t", "op").await.unwrap().unwrap();
    assert!(
        l.claim(
            ("t", "op"),
            State::Executing,
            op.version,
            "B",
            60_000,
            "steal"
        )
        .await
        .unwrap()
        .is_none()
    );
    // A pauses past its lease; B reclaims with a larger token.
    l.shift_clock(60_001).await.unwrap();
    let b = l
        .claim(
            ("t", "op"),
            State::Executing,
            op.version,
            "B",
            60_000,
            "reclaim",
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(b.fence, a.fence + 1);
    assert!(
        l.record_outcome(
            "t",
            "op",
            b.fence,
            State::Executing,
            "B",
            &outcome(State::Completed, "B done")
        )
        .await
        .unwrap()
    );
    // A resumes: its write is rejected and counted.
    let before = l.stale_fence_rejections();
    assert!(
        !l.record_outcome(
            "t",
            "op",
            a.fence,
            State::Executing,
            "A",
            &outcome(State::Failed, "A late")
        )
        .await
        .unwrap()
    );
    assert!(!l.extend_lease("t", "op", a.fence, 1000).await.unwrap());
    assert_eq!(l.stale_fence_rejections(), before + 2);
    let op = l.get("t", "op").await.unwrap().unwrap();
    assert_eq!(op.state, State::Completed);
    assert_eq!(op.fence, b.fence);
    assert_eq!(op.attempts, 2);
    let hist: Vec<(Option<State>, State, String)> = l
        .transitions("t", "op")
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.from_state, t.to_state, t.actor))
        .collect();
    assert_eq!(
        hist,
        vec![
            (None, State::Reserved, "p".into()),
            (Some(State::Reserved), State::Executing, "A".into()),
            (Some(State::Executing), State::Executing, "B".into()),
            (Some(State::Executing), State::Completed, "B".into()),
        ]
    );
}

async fn a_zero_length_lease_still_expires(l: Ledger) {
    let v = reserved(&l, "z").await;
    let a = l
        .claim(("t", "z"), State::Reserved, v, "A", 0, "zero")
        .await
        .unwrap()
        .unwrap();
    let b = l
        .claim(("t", "z"), State::Executing, a.version, "B", 0, "reclaim")
        .await
        .unwrap();
    assert!(b.is_some(), "a lease of zero length must be reclaimable");
}

async fn concurrent_claims_of_one_version_have_one_winner(l: Ledger) {
    let v = reserved(&l, "race").await;
    let claims = (0..20).map(|i| {
        let l = l.clone();
        tokio::spawn(async move {
            l.claim(
                ("t", "race"),
                State::Reserved,
                v,
                &format!("w{i}"),
                1000,
                "race",
            )
            .await
            .unwrap()
        })
    });
    let won = futures_util::future::join_all(claims)
        .await
        .into_iter()
        .filter(|r| r.as_ref().unwrap().is_some())
        .count();
    assert_eq!(won, 1);
    assert_eq!(l.get("t", "race").await.unwrap().unwrap().fence, 1);
}

async fn concurrent_reservations_create_one_operation(l: Ledger) {
    let tasks = (0..20).map(|_| {
        let l = l.clone();
        tokio::spawn(async move {
            matches!(
                l.reserve(&new_op("dup")).await.unwrap(),
                Reservation::Created(_)
            )
        })
    });
    let created = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(created, 1);
    assert_eq!(l.transitions("t", "dup").await.unwrap().len(), 1);
}

async fn the_state_machine_refuses_illegal_transitions(l: Ledger) {
    let v = reserved(&l, "m").await;
    assert!(
        l.claim(("t", "m"), State::Completed, v, "A", 10, "x")
            .await
            .is_err()
    );
    let c = l
        .claim(("t", "m"), State::Reserved, v, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    assert!(
        l.record_outcome(
            "t",
            "m",
            c.fence,
            State::Executing,
            "A",
            &outcome(State::Reserved, "back")
        )
        .await
        .is_err()
    );
    assert!(
        l.record_outcome(
            "t",
            "m",
            c.fence,
            State::Executing,
            "A",
            &outcome(State::Completed, "done")
        )
        .await
        .unwrap()
    );
    // COMPLETED never goes back: no claim, no second outcome.
    let op = l.get("t", "m").await.unwrap().unwrap();
    assert!(
        l.claim(("t", "m"), State::Unknown, op.version, "B", 10, "x")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        !l.record_outcome(
            "t",
            "m",
            c.fence,
            State::Executing,
            "A",
            &outcome(State::Unknown, "again")
        )
        .await
        .unwrap()
    );
    assert_eq!(
        l.get("t", "m").await.unwrap().unwrap().state,
        State::Completed
    );
}

async fn a_stale_version_loses_the_compare_and_swap(l: Ledger) {
    ended(&l, "v", outcome(State::Unknown, "lost")).await;
    // A claim computed from the old version (1, as reserved) does nothing.
    assert!(
        l.claim(("t", "v"), State::Unknown, 1, "B", 10, "x")
            .await
            .unwrap()
            .is_none()
    );
    let op = l.get("t", "v").await.unwrap().unwrap();
    assert!(
        l.claim(("t", "v"), State::Unknown, op.version, "B", 10, "x")
            .await
            .unwrap()
            .is_some()
    );
}

async fn key_retention_frees_terminal_keys_only(l: Ledger) {
    ended(&l, "done", outcome(State::Completed, "ok")).await;
    ended(&l, "stuck", outcome(State::Unknown, "lost")).await;

    l.shift_clock(90_000).await.unwrap();
    assert!(matches!(
        l.reserve(&new_op("done")).await.unwrap(),
        Reservation::Existing(_)
    ));
    l.shift_clock(10_000).await.unwrap();
    match l.reserve(&new_op("done")).await.unwrap() {
        Reservation::Created(op) => {
            assert_eq!(op.state, State::Reserved);
            assert_eq!(
                l.transitions("t", "done").await.unwrap().len(),
                1,
                "old history is gone with the key"
            );
        }
        Reservation::Existing(_) => panic!("an expired terminal key starts fresh"),
    }
    match l.reserve(&new_op("stuck")).await.unwrap() {
        Reservation::Existing(op) => assert_eq!(
            op.state,
            State::Unknown,
            "a non-terminal operation is never dropped"
        ),
        Reservation::Created(_) => panic!("UNKNOWN must survive retention"),
    }
}

async fn retention_runs_from_the_terminal_transition_and_never_drops_dead_letters(l: Ledger) {
    // An operation that sat UNKNOWN far past the retention window, then resolved.
    ended(&l, "late", outcome(State::Unknown, "lost")).await;
    l.shift_clock(500_000).await.unwrap();
    let op = l.get("t", "late").await.unwrap().unwrap();
    let lease = l
        .lease_for_reconcile("t", "late", op.version, "R", 100, "read-back")
        .await
        .unwrap()
        .unwrap();
    l.record_outcome(
        "t",
        "late",
        lease.fence,
        State::Unknown,
        "R",
        &outcome(State::Completed, "found"),
    )
    .await
    .unwrap();
    l.shift_clock(90_000).await.unwrap();
    assert!(
        matches!(
            l.reserve(&new_op("late")).await.unwrap(),
            Reservation::Existing(_)
        ),
        "the key is kept for the full window after the operation resolved"
    );
    // A dead letter is kept however old it is.
    ended(&l, "dead", dead_letter()).await;
    l.shift_clock(10_000_000).await.unwrap();
    match l.reserve(&new_op("dead")).await.unwrap() {
        Reservation::Existing(op) => assert!(op.dead_letter),
        Reservation::Created(_) => panic!("a dead letter must never be forgotten by retention"),
    }
}

/// `tenant_counts` counts each tenant's UNKNOWN operations and dead
/// letters, with the last change of the oldest of each; other states
/// and tenants with neither are left out.
async fn tenant_counts_are_unknown_operations_and_dead_letters_per_tenant(l: Ledger) {
    ended(&l, "u1", outcome(State::Unknown, "lost")).await;
    l.shift_clock(1_000).await.unwrap();
    ended(&l, "u2", outcome(State::Unknown, "lost")).await;
    ended(&l, "d1", dead_letter()).await;
    l.shift_clock(1_000).await.unwrap();
    ended(&l, "d3", dead_letter()).await;
    ended(&l, "c", outcome(State::Completed, "ok")).await;
    let other = |id: &str| NewOperation {
        tenant_id: "t2".into(),
        ..new_op(id)
    };
    for (id, o) in [
        ("d2", dead_letter()),
        ("c2", outcome(State::Completed, "ok")),
    ] {
        let Reservation::Created(op) = l.reserve(&other(id)).await.unwrap() else {
            panic!("{id} is new");
        };
        let c = l
            .claim(("t2", id), State::Reserved, op.version, "A", 60_000, "x")
            .await
            .unwrap()
            .unwrap();
        assert!(
            l.record_outcome("t2", id, c.fence, State::Executing, "A", &o)
                .await
                .unwrap()
        );
    }
    l.reserve(&NewOperation {
        tenant_id: "t3".into(),
        ..new_op("r")
    })
    .await
    .unwrap();
    let changed = |tenant: &'static str, id: &'static str| {
        let l = &l;
        async move { l.get(tenant, id).await.unwrap().unwrap().updated_at }
    };
    let counts = l.tenant_counts().await.unwrap();
    let got: Vec<_> = counts
        .iter()
        .map(|c| {
            (
                c.tenant.as_str(),
                c.unknown,
                c.oldest_unknown_at,
                c.dead_letters,
                c.oldest_dead_letter_at,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "t",
                2,
                Some(changed("t", "u1").await),
                2,
                Some(changed("t", "d1").await)
            ),
            ("t2", 0, None, 1, Some(changed("t2", "d2").await)),
        ]
    );
    assert!(changed("t", "u1").await < changed("t", "u2").await);
    assert!(changed("t", "d1").await < changed("t", "d3").await);
}

fn awaiting(id: &str, approval: &str, ttl_ms: i64) -> NewOperation {
    NewOperation {
        awaiting_approval: true,
        approval: Some(NewApproval {
            id: approval.into(),
            kind: "request".into(),
            policy: "threshold".into(),
            policy_hash: "h".into(),
            reason: "large".into(),
            ttl_ms,
        }),
        ..new_op(id)
    }
}

/// A FAILED outcome that puts the operation on the terminal route.
fn dead_letter() -> Outcome {
    let mut o = outcome(State::Failed, "exhausted");
    o.dead_letter = Some(effectgate::ledger::DeadLetter {
        reason: "retries-exhausted".into(),
        operator_check: "check".into(),
    });
    o
}

/// Ends `id` (reserved, then claimed by "A") in `outcome`.
async fn ended(l: &Ledger, id: &str, o: Outcome) {
    let v = reserved(l, id).await;
    let c = l
        .claim(("t", id), State::Reserved, v, "A", 60_000, "x")
        .await
        .unwrap()
        .unwrap();
    assert!(
        l.record_outcome("t", id, c.fence, State::Executing, "A", &o)
            .await
            .unwrap()
    );
}

async fn approvals_are_single_use_and_bound_to_their_operation(l: Ledger) {
    let op = match l.reserve(&awaiting("ap", "apr_1", 60_000)).await.unwrap() {
        Reservation::Created(op) => op,
        Reservation::Existing(_) => panic!("new"),
    };
    assert_eq!(op.state, State::AwaitingApproval);
    // Not approved yet: it can't be used.
    assert!(
        l.use_approval("t", "apr_1", "ap", "fp", "A", 60_000)
            .await
            .unwrap()
            .is_none()
    );
    let a = l
        .decide(
            "t",
            "apr_1",
            ApprovalDecision::Approve,
            "boss",
            Some("fine"),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.status, "approved");
    // A decision happens once.
    assert!(
        l.decide("t", "apr_1", ApprovalDecision::Reject, "other", None)
            .await
            .unwrap()
            .is_none()
    );
    // Another tenant, another fingerprint: refused.
    assert!(l.approval("u", "apr_1").await.unwrap().is_none());
    assert!(
        l.use_approval("t", "apr_1", "ap", "other-fp", "A", 60_000)
            .await
            .unwrap()
            .is_none()
    );
    let claim = l
        .use_approval("t", "apr_1", "ap", "fp", "A", 60_000)
        .await
        .unwrap()
        .expect("the approved request is claimed");
    assert_eq!(claim.fence, 1);
    assert!(
        l.use_approval("t", "apr_1", "ap", "fp", "B", 60_000)
            .await
            .unwrap()
            .is_none(),
        "single use"
    );
    assert_eq!(
        l.approval("t", "apr_1").await.unwrap().unwrap().status,
        "used"
    );
    let hist: Vec<(Option<State>, State)> = l
        .transitions("t", "ap")
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.from_state, t.to_state))
        .collect();
    assert_eq!(
        hist,
        vec![
            (None, State::Reserved),
            (Some(State::Reserved), State::AwaitingApproval),
            (Some(State::AwaitingApproval), State::AwaitingApproval),
            (Some(State::AwaitingApproval), State::Executing),
        ]
    );
    let events: Vec<String> = l
        .events("t")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.1)
        .collect();
    assert_eq!(events, vec!["approval.created", "approval.approved"]);
}

async fn an_expired_approval_fails_its_operation_with_a_stored_403(l: Ledger) {
    l.reserve(&awaiting("late", "apr_2", 1_000)).await.unwrap();
    assert_eq!(l.expire_approvals(10).await.unwrap(), 0);
    l.shift_clock(1_001).await.unwrap();
    assert_eq!(l.expire_approvals(10).await.unwrap(), 1);
    assert_eq!(l.expire_approvals(10).await.unwrap(), 0, "once");
    let op = l.get("t", "late").await.unwrap().unwrap();
    assert_eq!(op.state, State::Failed);
    assert_eq!(op.response_status, Some(403));
    assert_eq!(op.error_kind.as_deref(), Some("approval-refused"));
    assert_eq!(
        l.approval("t", "apr_2").await.unwrap().unwrap().status,
        "expired"
    );
    let events: Vec<String> = l
        .events("t")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.1)
        .collect();
    assert_eq!(events, vec!["approval.created", "approval.expired"]);
}

async fn outbox_claims_are_fair_between_tenants(l: Ledger) {
    // Tenant t has a backlog of 20 events, tenant u one, created last.
    for i in 0..20 {
        l.reserve(&awaiting(&format!("b{i}"), &format!("apr_b{i}"), 600_000))
            .await
            .unwrap();
    }
    let mut other = awaiting("u-1", "apr_u1", 600_000);
    other.tenant_id = "u".into();
    l.reserve(&other).await.unwrap();
    let first = l.claim_events("A", 10_000, 8).await.unwrap();
    assert_eq!(first.len(), 8);
    assert!(
        first.iter().any(|e| e.tenant_id == "u"),
        "u's event is in the first round despite t's backlog"
    );
    assert_eq!(first.iter().filter(|e| e.tenant_id == "t").count(), 7);
    // The rest, oldest first, never one twice.
    let second = l.claim_events("B", 10_000, 100).await.unwrap();
    assert_eq!(second.len(), 13);
    assert!(
        second
            .iter()
            .all(|e| first.iter().all(|f| f.event_id != e.event_id))
    );
}

async fn outbox_claims_are_exclusive_and_redelivered_after_their_lease(l: Ledger) {
    for i in 0..3 {
        l.reserve(&awaiting(&format!("o{i}"), &format!("apr_o{i}"), 600_000))
            .await
            .unwrap();
    }
    assert_eq!(l.pending_events().await.unwrap(), 3);
    let a = l.claim_events("A", 10_000, 2).await.unwrap();
    assert_eq!(a.len(), 2);
    let b = l.claim_events("B", 10_000, 10).await.unwrap();
    assert_eq!(b.len(), 1, "B gets only what A did not claim");
    assert!(a.iter().all(|e| e.event_id != b[0].event_id));
    assert!(l.claim_events("C", 10_000, 10).await.unwrap().is_empty());
    // A delivers one; its other claim lapses (A died).
    let now = l.clock().now_ms();
    assert!(
        l.event_attempted(&a[0].event_id, "A", true, None, now)
            .await
            .unwrap()
    );
    assert!(
        !l.event_attempted(&b[0].event_id, "A", true, None, now)
            .await
            .unwrap(),
        "only the claim's owner records its attempt"
    );
    assert!(
        l.event_attempted(&b[0].event_id, "B", false, Some("503"), now)
            .await
            .unwrap()
    );
    l.shift_clock(10_001).await.unwrap();
    let again = l.claim_events("C", 10_000, 10).await.unwrap();
    let mut ids: Vec<&str> = again.iter().map(|e| e.event_id.as_str()).collect();
    ids.sort();
    let mut want = vec![a[1].event_id.as_str(), b[0].event_id.as_str()];
    want.sort();
    assert_eq!(
        ids, want,
        "undelivered events come back, the delivered one never"
    );
    let failed = again.iter().find(|e| e.event_id == b[0].event_id).unwrap();
    assert_eq!(failed.attempts, 1);
    assert_eq!(l.pending_events().await.unwrap(), 2);
    // C delivers A's lapsed event; A's late report (a timeout) must not
    // make it pending again.
    let now = l.clock().now_ms();
    assert!(
        l.event_attempted(&a[1].event_id, "C", true, None, now)
            .await
            .unwrap()
    );
    assert!(
        !l.event_attempted(&a[1].event_id, "A", false, Some("timeout"), now)
            .await
            .unwrap()
    );
    assert_eq!(l.pending_events().await.unwrap(), 1);
    l.shift_clock(10_001).await.unwrap();
    let left = l.claim_events("D", 10_000, 10).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(
        left[0].event_id, b[0].event_id,
        "the delivered event never comes back"
    );
}

async fn scans_of_two_instances_never_hand_out_the_same_operation(l: Ledger) {
    for i in 0..40 {
        let mut o = outcome(State::Unknown, "lost");
        o.next_reconcile_at = Some(0);
        ended(&l, &format!("u{i}"), o).await;
    }
    let (a, b) = tokio::join!(
        l.due_for_reconciliation("A", 60_000, 60_000, 25),
        l.due_for_reconciliation("B", 60_000, 60_000, 25),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.len() + b.len(), 40, "every due operation is handed out");
    let mut ids: Vec<String> = a.iter().chain(&b).map(|o| o.operation_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 40, "and none twice");
    assert!(
        l.due_for_reconciliation("C", 60_000, 60_000, 100)
            .await
            .unwrap()
            .is_empty(),
        "claimed rows are not handed out again while the scans run"
    );
    assert_eq!(l.release_scan("A").await.unwrap(), a.len() as u64);
    assert_eq!(
        l.due_for_reconciliation("C", 60_000, 60_000, 100)
            .await
            .unwrap()
            .len(),
        a.len(),
        "released rows are due again"
    );
    // B died without releasing: its claims lapse.
    l.shift_clock(60_001).await.unwrap();
    assert_eq!(
        l.due_for_reconciliation("D", 60_000, 60_000, 100)
            .await
            .unwrap()
            .len(),
        40
    );
}

async fn the_sweeper_deletes_expired_terminal_operations_in_batches_only(l: Ledger) {
    for i in 0..5 {
        ended(&l, &format!("c{i}"), outcome(State::Completed, "ok")).await;
    }
    ended(&l, "dead", dead_letter()).await;
    ended(&l, "unknown", outcome(State::Unknown, "lost")).await;
    let v = reserved(&l, "executing").await;
    l.claim(("t", "executing"), State::Reserved, v, "A", 60_000, "x")
        .await
        .unwrap()
        .unwrap();
    reserved(&l, "reserved").await;
    l.reserve(&awaiting("waiting", "apr_w", 10_000_000))
        .await
        .unwrap();
    // A refused approval ends its operation FAILED (not a dead letter),
    // with a policy decision and the approval on record.
    let mut refused = awaiting("refused", "apr_r", 10_000_000);
    refused.decisions = vec![effectgate::policy::DecisionRecord {
        policy: "threshold".into(),
        content_hash: "h".into(),
        decision: "require-approval".into(),
        reason: Some("large".into()),
        duration_us: 12,
    }];
    l.reserve(&refused).await.unwrap();
    l.decide("t", "apr_r", ApprovalDecision::Reject, "boss", None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(l.decisions("t", "refused").await.unwrap().len(), 1);
    assert_eq!(
        l.sweep_expired(2, 0).await.unwrap(),
        0,
        "nothing expired yet"
    );
    l.shift_clock(1_000_000).await.unwrap();
    let mut batches = Vec::new();
    loop {
        let n = l.sweep_expired(2, 0).await.unwrap();
        batches.push(n);
        if n < 2 {
            break;
        }
    }
    assert_eq!(batches, vec![2, 2, 2, 0], "full batches, then an empty one");
    assert!(l.get("t", "refused").await.unwrap().is_none());
    assert!(
        l.decisions("t", "refused").await.unwrap().is_empty(),
        "its decisions go with it"
    );
    assert!(
        l.approval("t", "apr_r").await.unwrap().is_none(),
        "and its approval"
    );
    for i in 0..5 {
        let id = format!("c{i}");
        assert!(l.get("t", &id).await.unwrap().is_none());
        assert!(l.transitions("t", &id).await.unwrap().is_empty());
        assert!(l.attempts("t", &id).await.unwrap().is_empty());
    }
    for (id, state) in [
        ("dead", State::Failed),
        ("unknown", State::Unknown),
        ("executing", State::Executing),
        ("reserved", State::Reserved),
        ("waiting", State::AwaitingApproval),
    ] {
        assert_eq!(
            l.get("t", id).await.unwrap().map(|o| o.state),
            Some(state),
            "{id} must survive the sweeper"
        );
    }
}

async fn free_text_with_nul_is_stored_the_same_on_both_backends(l: Ledger) {
    let mut o = outcome(State::Completed, "found\0it");
    o.provider_reference = Some("ch_\u{0}1".into());
    o.error_detail = Some("de\0tail".into());
    ended(&l, "nul", o).await;
    let op = l.get("t", "nul").await.unwrap().unwrap();
    assert_eq!(op.provider_reference.as_deref(), Some("ch_\u{FFFD}1"));
    assert_eq!(op.error_detail.as_deref(), Some("de\u{FFFD}tail"));
    let last = l.transitions("t", "nul").await.unwrap().pop().unwrap();
    assert_eq!(last.reason, "found\u{FFFD}it");
    l.reserve(&awaiting("nul-ap", "apr_nul", 60_000))
        .await
        .unwrap();
    let a = l
        .decide(
            "t",
            "apr_nul",
            ApprovalDecision::Reject,
            "boss",
            Some("no\0pe"),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.comment.as_deref(), Some("no\u{FFFD}pe"));
}

async fn a_stale_owners_writes_are_fenced_while_the_new_owner_runs(l: Ledger) {
    let v = reserved(&l, "f").await;
    let a = l
        .claim(("t", "f"), State::Reserved, v, "A", 1_000, "first")
        .await
        .unwrap()
        .unwrap();
    l.shift_clock(1_001).await.unwrap();
    let op = l.get("t", "f").await.unwrap().unwrap();
    let b = l
        .claim(
            ("t", "f"),
            State::Executing,
            op.version,
            "B",
            60_000,
            "reclaim",
        )
        .await
        .unwrap()
        .unwrap();
    // Both are EXECUTING: only the fencing token tells A's writes apart.
    assert!(!l.extend_lease("t", "f", a.fence, 60_000).await.unwrap());
    assert!(
        !l.note_retry(
            ("t", "f"),
            a.fence,
            Some(503),
            ("status-503", "late"),
            60_000,
            None
        )
        .await
        .unwrap()
    );
    assert!(
        !l.record_outcome(
            "t",
            "f",
            a.fence,
            State::Executing,
            "A",
            &outcome(State::Completed, "A late")
        )
        .await
        .unwrap()
    );
    let op = l.get("t", "f").await.unwrap().unwrap();
    assert_eq!(op.state, State::Executing);
    assert_eq!(op.fence, b.fence);
    assert_eq!(op.lease_owner.as_deref(), Some("B"));
    assert_eq!(op.attempts, 2, "A's note_retry did not count");
    assert!(l.attempts("t", "f").await.unwrap().is_empty());
    assert!(
        l.record_outcome(
            "t",
            "f",
            b.fence,
            State::Executing,
            "B",
            &outcome(State::Completed, "B done")
        )
        .await
        .unwrap()
    );
}

async fn a_live_reconciliation_lease_is_not_taken_twice(l: Ledger) {
    ended(&l, "r", outcome(State::Unknown, "lost")).await;
    let op = l.get("t", "r").await.unwrap().unwrap();
    let r1 = l
        .lease_for_reconcile("t", "r", op.version, "R1", 60_000, "read-back")
        .await
        .unwrap()
        .expect("R1 leases");
    // R2 read the row after R1's lease: same version, live lease.
    let seen = l.get("t", "r").await.unwrap().unwrap();
    assert!(
        l.lease_for_reconcile("t", "r", seen.version, "R2", 60_000, "read-back")
            .await
            .unwrap()
            .is_none(),
        "R1's lease is live"
    );
    l.shift_clock(60_001).await.unwrap();
    let r2 = l
        .lease_for_reconcile("t", "r", seen.version, "R2", 60_000, "read-back")
        .await
        .unwrap()
        .expect("after R1's lease expired");
    assert_eq!(r2.fence, r1.fence + 1);
}

/// A COMPLETED operation "o" (returns nothing; panics otherwise).
async fn completed(l: &Ledger, id: &str) {
    let v = reserved(l, id).await;
    let c = l
        .claim(("t", id), State::Reserved, v, "gw", 60_000, "attempt")
        .await
        .unwrap()
        .unwrap();
    assert!(
        l.record_outcome(
            "t",
            id,
            c.fence,
            State::Executing,
            "gw",
            &outcome(State::Completed, "2xx")
        )
        .await
        .unwrap()
    );
}

fn link(original: &str) -> NewCompensation {
    NewCompensation {
        operation_id: original.into(),
        requested_by: "t:ops".into(),
        reason: "charged twice".into(),
        reference: Some("ch_1".into()),
    }
}

async fn a_compensation_is_reserved_once_and_completes_its_original(l: Ledger) {
    completed(&l, "o").await;
    let child = NewOperation {
        principal: "t:ops".into(),
        provider_key: "pk-comp".into(),
        ..new_op("o#compensation")
    };
    // Ten at once: one compensation.
    let tries = (0..10).map(|_| {
        let (l, child) = (l.clone(), child.clone());
        tokio::spawn(async move { l.reserve_compensation(&child, &link("o")).await.unwrap() })
    });
    let mut created = 0;
    for t in tries {
        match t.await.unwrap() {
            CompensationReservation::Created(op) => {
                created += 1;
                assert_eq!(op.state, State::Reserved);
            }
            CompensationReservation::Existing(op) => assert_eq!(op.operation_id, "o#compensation"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(created, 1);
    let ts = l.transitions("t", "o").await.unwrap();
    let noted = ts.last().unwrap();
    assert_eq!(
        (noted.from_state, noted.to_state),
        (Some(State::Completed), State::Completed)
    );
    assert_eq!(noted.actor, "t:ops");
    assert!(noted.reason.contains("o#compensation"), "{}", noted.reason);
    let ct = l.transitions("t", "o#compensation").await.unwrap();
    assert_eq!(ct.len(), 1);
    assert_eq!(ct[0].actor, "t:ops");
    assert!(ct[0].reason.contains("charged twice"), "{}", ct[0].reason);
    let link_row = l.compensation("t", "o").await.unwrap().unwrap();
    assert_eq!(link_row.compensation_id, "o#compensation");
    assert_eq!(link_row.reference.as_deref(), Some("ch_1"));

    // Its attempt: a stale fencing token moves nothing; the current one
    // completes it and, in the same transaction, compensates the original.
    let op = l.get("t", "o#compensation").await.unwrap().unwrap();
    let c = l
        .claim(
            ("t", "o#compensation"),
            State::Reserved,
            op.version,
            "gw",
            60_000,
            "attempt",
        )
        .await
        .unwrap()
        .unwrap();
    let done = outcome(State::Completed, "refunded");
    assert!(
        !l.record_outcome(
            "t",
            "o#compensation",
            c.fence - 1,
            State::Executing,
            "gw",
            &done
        )
        .await
        .unwrap()
    );
    assert_eq!(
        l.get("t", "o").await.unwrap().unwrap().state,
        State::Completed
    );
    assert!(
        l.record_outcome(
            "t",
            "o#compensation",
            c.fence,
            State::Executing,
            "gw",
            &done
        )
        .await
        .unwrap()
    );
    let original = l.get("t", "o").await.unwrap().unwrap();
    assert_eq!(original.state, State::Compensated);
    let last = l.transitions("t", "o").await.unwrap().pop().unwrap();
    assert_eq!(
        (last.from_state, last.to_state),
        (Some(State::Completed), State::Compensated)
    );
    assert_eq!(last.actor, "t:ops");
    assert!(
        last.reason.contains("o#compensation") && last.reason.contains("charged twice"),
        "{}",
        last.reason
    );
    // Asking again: the same compensation, nothing written.
    let before = l.transitions("t", "o").await.unwrap().len();
    match l.reserve_compensation(&child, &link("o")).await.unwrap() {
        CompensationReservation::Existing(op) => assert_eq!(op.state, State::Completed),
        other => panic!("{other:?}"),
    }
    assert_eq!(l.transitions("t", "o").await.unwrap().len(), before);
}

async fn a_compensation_of_an_operation_not_completed_writes_nothing(l: Ledger) {
    reserved(&l, "r").await;
    let child = new_op("r#compensation");
    match l.reserve_compensation(&child, &link("r")).await.unwrap() {
        CompensationReservation::NotCompleted(s) => assert_eq!(s, Some(State::Reserved)),
        other => panic!("{other:?}"),
    }
    assert!(l.get("t", "r#compensation").await.unwrap().is_none());
    assert!(l.compensation("t", "r").await.unwrap().is_none());
    assert_eq!(l.transitions("t", "r").await.unwrap().len(), 1);
    // A compensation that fails leaves its original COMPLETED.
    completed(&l, "f").await;
    let child = new_op("f#compensation");
    let CompensationReservation::Created(op) =
        l.reserve_compensation(&child, &link("f")).await.unwrap()
    else {
        panic!("expected a new compensation");
    };
    let c = l
        .claim(
            ("t", "f#compensation"),
            State::Reserved,
            op.version,
            "gw",
            60_000,
            "attempt",
        )
        .await
        .unwrap()
        .unwrap();
    let mut refused = outcome(State::Failed, "provider refused with 400");
    refused.response_status = Some(400);
    assert!(
        l.record_outcome(
            "t",
            "f#compensation",
            c.fence,
            State::Executing,
            "gw",
            &refused
        )
        .await
        .unwrap()
    );
    assert_eq!(
        l.get("t", "f").await.unwrap().unwrap().state,
        State::Completed
    );
}

/// An operation forgotten (its key reused after retention, or swept) takes
/// its transitions and attempts with it, also when it was the newest: the
/// next operation (which on SQLite can take the same operation number, the
/// largest row id once its row is gone) starts with its own history only.
async fn a_forgotten_operations_history_never_reaches_the_next_one(l: Ledger) {
    let states = |h: Vec<effectgate::ledger::Transition>| -> Vec<State> {
        h.iter().map(|t| t.to_state).collect()
    };
    ended(&l, "old", outcome(State::Completed, "ok")).await;
    assert_eq!(
        states(l.transitions("t", "old").await.unwrap()),
        [State::Reserved, State::Executing, State::Completed]
    );
    assert_eq!(l.attempts("t", "old").await.unwrap().len(), 1);

    l.shift_clock(200_000).await.unwrap();
    let v = match l.reserve(&new_op("old")).await.unwrap() {
        Reservation::Created(op) => op.version,
        Reservation::Existing(_) => panic!("an expired terminal key starts fresh"),
    };
    assert_eq!(
        states(l.transitions("t", "old").await.unwrap()),
        [State::Reserved],
        "the reused key's history is its own"
    );
    assert!(l.attempts("t", "old").await.unwrap().is_empty());
    let c = l
        .claim(("t", "old"), State::Reserved, v, "A", 60_000, "x")
        .await
        .unwrap()
        .unwrap();
    let mut failed = outcome(State::Failed, "no");
    failed.attempt_outcome = Some("status-400".into());
    assert!(
        l.record_outcome("t", "old", c.fence, State::Executing, "A", &failed)
            .await
            .unwrap()
    );
    let attempts = l.attempts("t", "old").await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome, "status-400");

    l.shift_clock(200_000).await.unwrap();
    assert_eq!(l.sweep_expired(10, 0).await.unwrap(), 1);
    assert!(l.transitions("t", "old").await.unwrap().is_empty());
    assert!(l.attempts("t", "old").await.unwrap().is_empty());
    reserved(&l, "next").await;
    assert_eq!(
        states(l.transitions("t", "next").await.unwrap()),
        [State::Reserved]
    );
    assert!(l.attempts("t", "next").await.unwrap().is_empty());
}

conformance!(
    a_compensation_is_reserved_once_and_completes_its_original,
    a_compensation_of_an_operation_not_completed_writes_nothing,
    a_stale_owners_writes_are_fenced_while_the_new_owner_runs,
    a_live_reconciliation_lease_is_not_taken_twice,
    free_text_with_nul_is_stored_the_same_on_both_backends,
    stale_owner_is_fenced_and_the_state_stays_the_new_owners,
    a_zero_length_lease_still_expires,
    concurrent_claims_of_one_version_have_one_winner,
    concurrent_reservations_create_one_operation,
    the_state_machine_refuses_illegal_transitions,
    a_stale_version_loses_the_compare_and_swap,
    key_retention_frees_terminal_keys_only,
    retention_runs_from_the_terminal_transition_and_never_drops_dead_letters,
    approvals_are_single_use_and_bound_to_their_operation,
    an_expired_approval_fails_its_operation_with_a_stored_403,
    outbox_claims_are_exclusive_and_redelivered_after_their_lease,
    outbox_claims_are_fair_between_tenants,
    scans_of_two_instances_never_hand_out_the_same_operation,
    the_sweeper_deletes_expired_terminal_operations_in_batches_only,
    tenant_counts_are_unknown_operations_and_dead_letters_per_tenant,
    a_forgotten_operations_history_never_reaches_the_next_one,
);
