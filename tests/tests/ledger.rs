//! Ledger conformance: the state machine, compare-and-swap, fencing, lease
//! expiry, transition history and key retention, driven by a manual clock.

use std::sync::Arc;

use effectgate::ledger::{Claim, Ledger, ManualClock, NewOperation, Outcome, Reservation, State};

async fn ledger() -> (Ledger, Arc<ManualClock>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let l = Ledger::open(&dir.path().join("l.db"), 4, 5000, clock.clone())
        .await
        .unwrap();
    (l, clock, dir)
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
        principal: "p".into(),
        retention_ms: 10_000,
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

#[tokio::test]
async fn stale_owner_is_fenced_and_the_state_stays_the_new_owners() {
    let (l, clock, _d) = ledger().await;
    let v = reserved(&l, "op").await;
    let a: Claim = l
        .claim("t", "op", State::Reserved, v, "A", 100, "first")
        .await
        .unwrap()
        .unwrap();
    // B can't take a live lease.
    let op = l.get("t", "op").await.unwrap().unwrap();
    assert!(
        l.claim("t", "op", State::Executing, op.version, "B", 100, "steal")
            .await
            .unwrap()
            .is_none()
    );
    // A pauses past its lease; B reclaims with a larger token.
    clock.advance(101);
    let b = l
        .claim("t", "op", State::Executing, op.version, "B", 100, "reclaim")
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

#[tokio::test]
async fn a_zero_length_lease_still_expires() {
    let (l, _clock, _d) = ledger().await;
    let v = reserved(&l, "z").await;
    let a = l
        .claim("t", "z", State::Reserved, v, "A", 0, "zero")
        .await
        .unwrap()
        .unwrap();
    let b = l
        .claim("t", "z", State::Executing, a.version, "B", 0, "reclaim")
        .await
        .unwrap();
    assert!(b.is_some(), "a lease of zero length must be reclaimable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_one_version_have_one_winner() {
    let (l, _clock, _d) = ledger().await;
    let v = reserved(&l, "race").await;
    let claims = (0..20).map(|i| {
        let l = l.clone();
        tokio::spawn(async move {
            l.claim(
                "t",
                "race",
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_create_one_operation() {
    let (l, _clock, _d) = ledger().await;
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

#[tokio::test]
async fn the_state_machine_refuses_illegal_transitions() {
    let (l, _clock, _d) = ledger().await;
    let v = reserved(&l, "m").await;
    assert!(
        l.claim("t", "m", State::Completed, v, "A", 10, "x")
            .await
            .is_err()
    );
    let c = l
        .claim("t", "m", State::Reserved, v, "A", 10, "x")
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
        l.claim("t", "m", State::Unknown, op.version, "B", 10, "x")
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

#[tokio::test]
async fn a_stale_version_loses_the_compare_and_swap() {
    let (l, _clock, _d) = ledger().await;
    let v = reserved(&l, "v").await;
    let c = l
        .claim("t", "v", State::Reserved, v, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    l.record_outcome(
        "t",
        "v",
        c.fence,
        State::Executing,
        "A",
        &outcome(State::Unknown, "lost"),
    )
    .await
    .unwrap();
    // A claim computed from the old version does nothing.
    assert!(
        l.claim("t", "v", State::Unknown, v, "B", 10, "x")
            .await
            .unwrap()
            .is_none()
    );
    let op = l.get("t", "v").await.unwrap().unwrap();
    assert!(
        l.claim("t", "v", State::Unknown, op.version, "B", 10, "x")
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn key_retention_frees_terminal_keys_only() {
    let (l, clock, _d) = ledger().await;
    let v = reserved(&l, "done").await;
    let c = l
        .claim("t", "done", State::Reserved, v, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    l.record_outcome(
        "t",
        "done",
        c.fence,
        State::Executing,
        "A",
        &outcome(State::Completed, "ok"),
    )
    .await
    .unwrap();
    let v2 = reserved(&l, "stuck").await;
    let c2 = l
        .claim("t", "stuck", State::Reserved, v2, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    l.record_outcome(
        "t",
        "stuck",
        c2.fence,
        State::Executing,
        "A",
        &outcome(State::Unknown, "lost"),
    )
    .await
    .unwrap();

    clock.advance(9_999);
    assert!(matches!(
        l.reserve(&new_op("done")).await.unwrap(),
        Reservation::Existing(_)
    ));
    clock.advance(1);
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

#[tokio::test]
async fn retention_runs_from_the_terminal_transition_and_never_drops_dead_letters() {
    let (l, clock, _d) = ledger().await;
    // An operation that sat UNKNOWN far past the retention window, then resolved.
    let v = reserved(&l, "late").await;
    let c = l
        .claim("t", "late", State::Reserved, v, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    l.record_outcome(
        "t",
        "late",
        c.fence,
        State::Executing,
        "A",
        &outcome(State::Unknown, "lost"),
    )
    .await
    .unwrap();
    clock.advance(50_000);
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
    clock.advance(9_999);
    assert!(
        matches!(
            l.reserve(&new_op("late")).await.unwrap(),
            Reservation::Existing(_)
        ),
        "the key is kept for the full window after the operation resolved"
    );
    // A dead letter is kept however old it is.
    let v = reserved(&l, "dead").await;
    let c = l
        .claim("t", "dead", State::Reserved, v, "A", 10, "x")
        .await
        .unwrap()
        .unwrap();
    let mut o = outcome(State::Failed, "exhausted");
    o.dead_letter = Some(effectgate::ledger::DeadLetter {
        reason: "retries-exhausted".into(),
        operator_check: "check".into(),
    });
    l.record_outcome("t", "dead", c.fence, State::Executing, "A", &o)
        .await
        .unwrap();
    clock.advance(1_000_000);
    match l.reserve(&new_op("dead")).await.unwrap() {
        Reservation::Existing(op) => assert!(op.dead_letter),
        Reservation::Created(_) => panic!("a dead letter must never be forgotten by retention"),
    }
}
