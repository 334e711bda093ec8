//! Tests of the state machine and of the rule that keeps it in one place.

use std::path::{Path, PathBuf};

use super::*;

#[test]
fn completed_never_goes_back() {
    for to in State::ALL {
        let ok = State::Completed.can_transition_to(to);
        // COMPLETED → COMPLETED records an audited forced replay; the state never goes back.
        assert_eq!(
            ok,
            matches!(to, State::Compensated | State::Completed),
            "COMPLETED → {to}"
        );
    }
}

#[test]
fn state_names_round_trip() {
    for s in State::ALL {
        assert_eq!(s.as_str().parse::<State>().unwrap(), s);
    }
    assert!("nope".parse::<State>().is_err());
}

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the ledger's sources") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `line` holds a quoted state name, in any case.
fn spells_a_state(line: &str) -> bool {
    let upper = line.to_ascii_uppercase();
    State::ALL
        .iter()
        .any(|s| upper.contains(&format!("'{}'", s.as_str())))
}

#[test]
fn the_scan_sees_a_spelled_state() {
    let spelled = format!("WHERE state = '{}'", State::Completed.as_str());
    assert!(spells_a_state(&spelled));
    assert!(spells_a_state(&spelled.to_lowercase()));
    assert!(!spells_a_state("WHERE state = ?"));
    assert!(!spells_a_state("error_kind = 'lease-expired'"));
}

/// No SQL text in the ledger spells a state name: states are bound from
/// [`State`] ([`State::as_str`]), so a renamed or added state can't leave a
/// statement behind. Scans every source file of the ledger (string
/// literals, and comments too) for a state name in single quotes, as SQL
/// would spell it, in any case; `migrations/` is outside it.
#[test]
fn no_source_spells_a_quoted_state_name() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ledger");
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("command/executor.rs")),
        "the scan found the ledger's sources under {}",
        root.display()
    );
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a ledger source file");
        for (n, line) in text.lines().enumerate() {
            if spells_a_state(line) {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "bind states with State::as_str() instead of spelling them:\n{}",
        found.join("\n")
    );
}

/// A new operation for the replay cache tests.
fn new_op(id: &str, fingerprint: &str) -> NewOperation {
    NewOperation {
        tenant_id: "t".into(),
        operation_id: id.into(),
        route: "pay".into(),
        method: "POST".into(),
        path: "v1/charges".into(),
        query: None,
        fingerprint: fingerprint.into(),
        provider_key: format!("pk-{id}"),
        effect_class: None,
        request_content_type: None,
        request_body: b"{}".to_vec(),
        request_headers: Vec::new(),
        trace_context: None,
        principal: "client".into(),
        retention_ms: 60_000,
        awaiting_approval: false,
        decisions: Vec::new(),
        approval: None,
    }
}

/// A COMPLETED operation `id` of tenant `t` (fingerprint `fp`).
async fn completed(ledger: &Ledger, id: &str) -> Operation {
    let (_, claim) = ledger
        .reserve_and_claim(&new_op(id, "fp"), "gw", 60_000, "test")
        .await
        .unwrap();
    let claim = claim.expect("claimed");
    let mut outcome = Outcome::new(State::Completed, "provider answered 201");
    outcome.response_status = Some(201);
    outcome.response_body = Some(b"{\"id\":\"ch_1\"}".to_vec());
    assert!(
        ledger
            .record_outcome("t", id, claim.fence, State::Executing, "gw", &outcome)
            .await
            .unwrap()
    );
    ledger.get("t", id).await.unwrap().unwrap()
}

/// The compensation `<id>#compensation` of operation `id` and its link,
/// as an operator asks for it.
fn compensation_of(id: &str) -> (NewOperation, NewCompensation) {
    let mut comp = new_op(&format!("{id}#compensation"), "fp-c");
    comp.provider_key = "pk-comp".into();
    let link = NewCompensation {
        operation_id: id.into(),
        requested_by: "operator".into(),
        reason: "refund".into(),
        reference: None,
    };
    (comp, link)
}

/// Claims the RESERVED operation `op` and records `outcome` for it.
async fn finish(ledger: &Ledger, op: &Operation, outcome: Outcome) {
    let claim = ledger
        .claim(
            ("t", &op.operation_id),
            State::Reserved,
            op.version,
            "gw",
            60_000,
            "test",
        )
        .await
        .unwrap()
        .expect("claimed");
    assert!(
        ledger
            .record_outcome(
                "t",
                &op.operation_id,
                claim.fence,
                State::Executing,
                "gw",
                &outcome
            )
            .await
            .unwrap()
    );
}

/// The replay cache answers a duplicate with the ledger's row as it is:
/// never another tenant's or fingerprint's entry, and never the cached
/// COMPLETED after a compensation changed it or after it expired and was
/// swept.
#[tokio::test]
async fn the_replay_cache_never_serves_a_changed_expired_or_foreign_answer() {
    never_serves_a_changed_expired_or_foreign_answer(false).await;
}

/// The same on a SQLite ledger held by this process alone, where a cached
/// answer is served without reading the ledger: every change made here
/// still reaches the next duplicate.
#[tokio::test]
async fn the_replay_cache_of_an_exclusive_ledger_never_serves_a_changed_expired_or_foreign_answer()
{
    never_serves_a_changed_expired_or_foreign_answer(true).await;
}

async fn never_serves_a_changed_expired_or_foreign_answer(exclusive: bool) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .unwrap();
    if exclusive {
        ledger.hold_exclusively().unwrap();
    }
    let op = completed(&ledger, "k").await;
    // First read fills, second is served (same row).
    let first = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    let again = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((first.version, again.version), (op.version, op.version));
    assert_eq!(again.response_body, op.response_body);
    // Another tenant: nothing. Another fingerprint: the ledger's row (its
    // own fingerprint, for the 422), never an entry cached for it.
    assert!(
        ledger
            .get_for_duplicate("u", "k", "fp")
            .await
            .unwrap()
            .is_none()
    );
    let other = ledger
        .get_for_duplicate("t", "k", "fp-b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(other.fingerprint, "fp");

    // A compensation reserved and recorded: the original is COMPENSATED.
    let (comp, link) = compensation_of("k");
    let CompensationReservation::Created(child) =
        ledger.reserve_compensation(&comp, &link).await.unwrap()
    else {
        panic!("compensation created")
    };
    let noted = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    assert!(
        noted.version > op.version,
        "the audit row is seen, not the cache"
    );
    finish(&ledger, &child, Outcome::new(State::Completed, "refunded")).await;
    let after = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(after.state, State::Compensated);

    // Expired and swept: gone, not served from memory.
    let other = completed(&ledger, "k2").await;
    assert!(
        ledger
            .get_for_duplicate("t", "k2", "fp")
            .await
            .unwrap()
            .is_some()
    );
    clock.advance(other.expires_at - clock.now_ms() + 1);
    while ledger.sweep_expired(100, 0).await.unwrap() == 100 {}
    assert!(
        ledger
            .get_for_duplicate("t", "k2", "fp")
            .await
            .unwrap()
            .is_none()
    );
}

/// A ledger `Ledger::hold_exclusively` holds, at `clock`, in `dir`.
async fn exclusive(dir: &Path, clock: Arc<ManualClock>) -> Ledger {
    let ledger = Ledger::open(&dir.join("l.db"), 2, 5000, clock)
        .await
        .unwrap();
    ledger.hold_exclusively().unwrap();
    ledger
}

/// Audits `k` (at `version`) through a second ledger on the file in
/// `dir`, one that does not hold it: a change the holder's own writes
/// don't count.
async fn audit_behind_its_back(dir: &Path, clock: Arc<ManualClock>, version: i64) {
    let behind = Ledger::open(&dir.join("l.db"), 2, 5000, clock)
        .await
        .unwrap();
    assert!(
        behind
            .audit(
                "t",
                "k",
                version,
                State::Completed,
                "operator",
                "behind its back"
            )
            .await
            .unwrap()
    );
}

/// What a duplicate of `id` (fingerprint `fp`) is answered with: state and
/// version.
async fn duplicate(ledger: &Ledger, id: &str) -> Option<(State, i64)> {
    ledger
        .get_for_duplicate("t", id, "fp")
        .await
        .unwrap()
        .map(|op| (op.state, op.version))
}

/// One process holds a SQLite ledger: a second ledger on the file can't
/// take it until the first is gone; the CLI's kind of open (no lock) still
/// works beside it.
#[tokio::test]
async fn a_sqlite_ledger_is_held_by_one_process_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let first = exclusive(dir.path(), clock.clone()).await;
    first.hold_exclusively().expect("again: a no-op");
    let second = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .expect("an open without the lock");
    let err = second.hold_exclusively().unwrap_err();
    assert!(matches!(err, LedgerError::InUse(_)), "{err}");
    assert!(err.to_string().contains("l.db.lock"), "{err}");
    // Another name of the same file (a symlink) is the same lock.
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(dir.path().join("l.db"), &link).unwrap();
    let linked = Ledger::open(&link, 2, 5000, clock.clone()).await.unwrap();
    assert!(matches!(
        linked.hold_exclusively(),
        Err(LedgerError::InUse(_))
    ));
    drop(first);
    second
        .hold_exclusively()
        .expect("free once the first is dropped");
    // A gateway's open takes the lock before it opens the file.
    let storage = crate::config::StorageSpec {
        path: link.clone(),
        ..Default::default()
    };
    let err = Ledger::open_exclusive(&storage, clock.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, LedgerError::InUse(_)), "{err}");
    drop((second, linked));
    let third = Ledger::open_exclusive(&storage, clock).await.unwrap();
    third.release_exclusive();
    third.hold_exclusively().expect("released: free again");
}

/// Served from memory: with the lock held, a duplicate of a cached
/// answer reads nothing. A change written behind the holder's back (by a
/// second ledger on the file, which no gateway can be: it would not get
/// the lock) is not seen, while the same change made through the holder
/// is seen by the very next duplicate.
#[tokio::test]
async fn an_exclusive_ledger_answers_a_cached_duplicate_without_reading() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = exclusive(dir.path(), clock.clone()).await;
    let op = completed(&ledger, "k").await;
    assert_eq!(
        duplicate(&ledger, "k").await,
        Some((State::Completed, op.version))
    );
    audit_behind_its_back(dir.path(), clock.clone(), op.version).await;
    assert_eq!(
        duplicate(&ledger, "k").await,
        Some((State::Completed, op.version)),
        "no read: the cached answer"
    );
    // The same audit through the holder: seen at once.
    assert!(
        ledger
            .audit(
                "t",
                "k",
                op.version + 1,
                State::Completed,
                "operator",
                "audited"
            )
            .await
            .unwrap()
    );
    assert_eq!(
        duplicate(&ledger, "k").await,
        Some((State::Completed, op.version + 2))
    );
}

/// Each write of the holder that changes or deletes a COMPLETED or
/// FAILED operation reaches the next duplicate: a requeued dead letter, a
/// key reused after its retention, a step of the clock past retention.
#[tokio::test]
async fn an_exclusive_ledger_sees_requeues_reused_keys_and_clock_steps() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = exclusive(dir.path(), clock.clone()).await;

    // A dead letter, cached, then requeued: UNKNOWN, not the cached FAILED.
    let (_, claim) = ledger
        .reserve_and_claim(&new_op("dl", "fp"), "gw", 60_000, "test")
        .await
        .unwrap();
    let claim = claim.expect("claimed");
    let mut failed = Outcome::new(State::Failed, "retries exhausted");
    failed.dead_letter = Some(DeadLetter {
        reason: "retries-exhausted".into(),
        operator_check: "look at the provider".into(),
    });
    assert!(
        ledger
            .record_outcome("t", "dl", claim.fence, State::Executing, "gw", &failed)
            .await
            .unwrap()
    );
    let (state, version) = duplicate(&ledger, "dl").await.unwrap();
    assert_eq!(state, State::Failed);
    assert_eq!(
        duplicate(&ledger, "dl").await,
        Some((State::Failed, version))
    );
    let requeued = ledger
        .requeue("t", "dl", version, State::Unknown, "operator", "checked")
        .await
        .unwrap();
    assert_eq!(requeued, Some(version + 1));
    assert_eq!(
        duplicate(&ledger, "dl").await,
        Some((State::Unknown, version + 1))
    );

    // A key reused after its retention: the new operation, not the old answer.
    let old = completed(&ledger, "k").await;
    assert!(duplicate(&ledger, "k").await.is_some());
    clock.advance(old.expires_at - clock.now_ms());
    let (r, _) = ledger
        .reserve_and_claim(&new_op("k", "fp"), "gw", 60_000, "test")
        .await
        .unwrap();
    assert!(
        matches!(r, Reservation::Created(_)),
        "the key is free again"
    );
    // Served as what it is now (reserved, not the old COMPLETED).
    let now = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    assert_ne!(now.state, State::Completed);

    // A clock step past retention: the cached answer is not served.
    let other = completed(&ledger, "k2").await;
    assert!(duplicate(&ledger, "k2").await.is_some());
    ledger
        .shift_clock(other.expires_at - clock.now_ms() + 1)
        .await
        .unwrap();
    while ledger.sweep_expired(100, 0).await.unwrap() == 100 {}
    assert_eq!(duplicate(&ledger, "k2").await, None);
}

/// A recorded COMPLETED outcome fills the cache: the first duplicate is
/// answered from memory (a change written behind the holder's back is not
/// seen, so nothing was read), with exactly the row `get` returns.
#[tokio::test]
async fn a_recorded_outcome_answers_the_first_duplicate_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = exclusive(dir.path(), clock.clone()).await;
    let op = completed(&ledger, "k").await;
    audit_behind_its_back(dir.path(), clock.clone(), op.version).await;
    let first = ledger
        .get_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.version, op.version, "no read: filled at record time");
    assert_eq!(
        serde_json::to_value(&first).unwrap(),
        serde_json::to_value(&op).unwrap(),
        "the row as the ledger returns it"
    );
    // Not exclusive: the first duplicate checks the ledger and sees it.
    let dir2 = tempfile::tempdir().unwrap();
    let shared = Ledger::open(&dir2.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .unwrap();
    let op2 = completed(&shared, "k").await;
    let again = Ledger::open(&dir2.path().join("l.db"), 2, 5000, clock)
        .await
        .unwrap();
    assert!(
        again
            .audit("t", "k", op2.version, State::Completed, "operator", "seen")
            .await
            .unwrap()
    );
    assert_eq!(
        duplicate(&shared, "k").await,
        Some((State::Completed, op2.version + 1))
    );
}

/// A compensation of an earlier incarnation of an operation is not the
/// compensation of the new one. Here the first compensation FAILED, so it
/// was updated after the original and outlived it: the original's key is
/// reused after its retention, the new effect completes, and asking to
/// compensate it creates a new compensation (RESERVED, its own history)
/// instead of answering with the old, failed one.
#[tokio::test]
async fn a_reused_key_gets_its_own_compensation_not_the_earlier_incarnations() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .unwrap();
    let first = completed(&ledger, "k").await;
    let (comp, link) = compensation_of("k");
    let CompensationReservation::Created(child) =
        ledger.reserve_compensation(&comp, &link).await.unwrap()
    else {
        panic!("compensation created")
    };
    // The refund fails half a retention later.
    clock.advance(30_000);
    finish(
        &ledger,
        &child,
        Outcome::new(State::Failed, "refund refused"),
    )
    .await;
    let original = ledger.get("t", "k").await.unwrap().unwrap();
    assert_eq!(original.state, State::Completed);
    // The original's retention ends; the compensation's has not.
    clock.advance(original.expires_at - clock.now_ms() + 1);
    let old_child = ledger.get("t", "k#compensation").await.unwrap().unwrap();
    assert!(old_child.expires_at > clock.now_ms());
    // The key is reused: a new effect, completed.
    let second = completed(&ledger, "k").await;
    assert!(second.created_at > first.created_at, "a new incarnation");
    match ledger.reserve_compensation(&comp, &link).await.unwrap() {
        CompensationReservation::Created(new_child) => {
            assert_eq!(new_child.state, State::Reserved);
            assert!(new_child.created_at > old_child.created_at);
            let steps = ledger.transitions("t", "k#compensation").await.unwrap();
            assert_eq!(
                steps.iter().map(|t| t.to_state).collect::<Vec<_>>(),
                vec![State::Reserved],
                "only the new compensation's history"
            );
        }
        other => panic!("the old compensation came back: {other:?}"),
    }
    // Asking again is the same (new) compensation.
    assert!(matches!(
        ledger.reserve_compensation(&comp, &link).await.unwrap(),
        CompensationReservation::Existing(_)
    ));
}

/// An unfinished compensation of an earlier incarnation is not forgotten
/// (it may still act) and not answered as the new effect's either: the
/// reservation says which one it is and writes nothing.
#[tokio::test]
async fn an_unfinished_compensation_of_an_earlier_incarnation_is_named_not_reused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let ledger = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .unwrap();
    completed(&ledger, "k").await;
    let (comp, link) = compensation_of("k");
    let CompensationReservation::Created(old) =
        ledger.reserve_compensation(&comp, &link).await.unwrap()
    else {
        panic!("compensation created")
    };
    // Never run: RESERVED. The original's retention ends; its key is reused.
    let original = ledger.get("t", "k").await.unwrap().unwrap();
    clock.advance(original.expires_at - clock.now_ms() + 1);
    completed(&ledger, "k").await;
    match ledger.reserve_compensation(&comp, &link).await.unwrap() {
        CompensationReservation::EarlierIncarnation(op) => {
            assert_eq!((op.state, op.created_at), (State::Reserved, old.created_at));
        }
        other => panic!("expected the earlier incarnation's, got {other:?}"),
    }
    let row = ledger.get("t", "k#compensation").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.version),
        (State::Reserved, old.version),
        "nothing written"
    );
    let again = ledger.get("t", "k").await.unwrap().unwrap();
    assert_eq!(
        again.state,
        State::Completed,
        "the new effect is not marked"
    );
}

/// A reservation that finds a COMPLETED operation under its key (a
/// duplicate that reached the reservation without a ledger read first)
/// caches it for its fingerprint: the next duplicate's cache lookup
/// answers with exactly the ledger's row. One of another fingerprint is
/// not cached, and nothing is cached before a read or a reservation.
#[tokio::test]
async fn a_reservation_that_finds_a_completed_operation_caches_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let first = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock.clone())
        .await
        .unwrap();
    let op = completed(&first, "k").await;
    let other = Ledger::open(&dir.path().join("l.db"), 2, 5000, clock)
        .await
        .unwrap();
    assert!(
        other
            .cached_for_duplicate("t", "k", "fp")
            .await
            .unwrap()
            .is_none(),
        "a fresh ledger's cache is empty"
    );
    let (r, claim) = other
        .reserve_and_claim(&new_op("k", "other-fp"), "gw", 60_000, "test")
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Existing(_)) && claim.is_none());
    assert!(
        other
            .cached_for_duplicate("t", "k", "other-fp")
            .await
            .unwrap()
            .is_none(),
        "never cached for another fingerprint"
    );
    let (r, claim) = other
        .reserve_and_claim(&new_op("k", "fp"), "gw", 60_000, "test")
        .await
        .unwrap();
    assert!(claim.is_none());
    let Reservation::Existing(found) = r else {
        panic!("the key is taken: {r:?}");
    };
    assert_eq!((found.state, found.version), (State::Completed, op.version));
    let cached = other
        .cached_for_duplicate("t", "k", "fp")
        .await
        .unwrap()
        .expect("cached by the reservation");
    assert_eq!(
        serde_json::to_value(&cached).unwrap(),
        serde_json::to_value(&op).unwrap(),
        "the row as the ledger returns it"
    );
}

/// A pool of one connection to the SQLite file at `path` (created if
/// missing), outside any [`Ledger`]: a ledger being migrated by hand.
async fn one_connection(path: &Path) -> sqlx::SqlitePool {
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true);
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .unwrap()
}

/// Inserts operation `id` of tenant `t` in `state` created at `at`, with
/// the columns every schema version since 0012 has (a ledger being
/// migrated).
async fn insert_operation(pool: &sqlx::SqlitePool, id: &str, state: &str, at: i64) {
    sqlx::query(
        "INSERT INTO operations (tenant_id, operation_id, route, method, path, fingerprint, \
         provider_key, state, version, fence, attempts, request_body, principal, created_at, \
         updated_at, expires_at) VALUES ('t', ?, 'r', 'POST', '/x', 'fp', 'pk', ?, 2, 1, 1, \
         x'7b7d', 'p', ?, ?, ?)",
    )
    .bind(id)
    .bind(state)
    .bind(at)
    .bind(at)
    .bind(at + 86_400_000)
    .execute(pool)
    .await
    .unwrap();
}

/// Migration 0015 on a SQLite ledger that already has history: every
/// operation keeps its row, transitions (with their numbers) and attempts,
/// numbered in the order of their keys (new ones after them); history of
/// no operation is not carried over; the history is filed by operation
/// number (its index and the attempts' key lead with `op_seq`), and
/// deleting an operation deletes its history.
#[tokio::test]
async fn the_sqlite_history_is_filed_by_operation_number_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let pool = || one_connection(&path);
    let before = pool().await;
    super::sqlite::MIGRATOR.run_to(14, &before).await.unwrap();
    let (reserved, executing) = (State::Reserved.as_str(), State::Executing.as_str());
    insert_operation(&before, "late", executing, 20).await;
    insert_operation(&before, "early", executing, 10).await;
    for (seq, id, at) in [(1, "early", 10), (2, "late", 20), (3, "gone", 5)] {
        sqlx::query(
            "INSERT INTO transitions (seq, tenant_id, operation_id, from_state, to_state, version, \
             fence, actor, reason, at) VALUES (?, 't', ?, NULL, ?, 1, 0, 'gw', 'reservation', ?)",
        )
        .bind(seq)
        .bind(id)
        .bind(reserved)
        .bind(at)
        .execute(&before)
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO transitions (seq, tenant_id, operation_id, from_state, to_state, version, \
         fence, actor, reason, at) VALUES (4, 't', 'early', ?, ?, 2, 1, 'gw', 'claim', 11)",
    )
    .bind(reserved)
    .bind(executing)
    .execute(&before)
    .await
    .unwrap();
    for id in ["early", "late", "gone"] {
        sqlx::query(
            "INSERT INTO attempts (tenant_id, operation_id, attempt, fence, status, outcome, at) \
             VALUES ('t', ?, 1, 1, 503, 'status-503', 30)",
        )
        .bind(id)
        .execute(&before)
        .await
        .unwrap();
    }
    before.close().await;

    let ledger = Ledger::open(&path, 2, 5000, ManualClock::new(1_000_000))
        .await
        .unwrap();
    let seqs = |id: &'static str| {
        let ledger = &ledger;
        async move {
            ledger
                .transitions("t", id)
                .await
                .unwrap()
                .iter()
                .map(|t| (t.seq, t.to_state))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        seqs("early").await,
        [(1, State::Reserved), (4, State::Executing)]
    );
    assert_eq!(seqs("late").await, [(2, State::Reserved)]);
    assert!(seqs("gone").await.is_empty());
    for id in ["early", "late"] {
        let attempts = ledger.attempts("t", id).await.unwrap();
        assert_eq!(attempts.len(), 1, "{id}");
        assert_eq!(
            (attempts[0].attempt, attempts[0].status),
            (1, Some(503)),
            "{id}"
        );
    }
    completed(&ledger, "k").await;
    assert_eq!(seqs("k").await.len(), 3);
    drop(ledger);

    let after = pool().await;
    let numbered: Vec<(i64, String)> =
        sqlx::query_as("SELECT op_seq, operation_id FROM operations ORDER BY op_seq")
            .fetch_all(&after)
            .await
            .unwrap();
    assert_eq!(
        numbered,
        [(1, "early".into()), (2, "late".into()), (3, "k".into())],
        "numbered by key, the new one after them"
    );
    let orphans: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM transitions WHERE operation_id = 'gone') \
         + (SELECT count(*) FROM attempts WHERE operation_id = 'gone')",
    )
    .fetch_one(&after)
    .await
    .unwrap();
    assert_eq!(orphans, 0);
    let mut indexes: Vec<String> = sqlx::query_scalar(
        "SELECT sql FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL \
         AND tbl_name IN ('transitions', 'attempts')",
    )
    .fetch_all(&after)
    .await
    .unwrap();
    indexes.sort();
    assert_eq!(
        indexes,
        ["CREATE INDEX transitions_by_operation ON transitions (op_seq, seq)"]
    );
    let attempts_key: Vec<String> =
        sqlx::query_scalar("SELECT name FROM pragma_index_info('sqlite_autoindex_attempts_1')")
            .fetch_all(&after)
            .await
            .unwrap();
    assert_eq!(attempts_key, ["op_seq", "attempt"]);
    sqlx::query("DELETE FROM operations WHERE operation_id = 'early'")
        .execute(&after)
        .await
        .unwrap();
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT operation_id FROM transitions UNION ALL SELECT operation_id FROM attempts \
         ORDER BY 1",
    )
    .fetch_all(&after)
    .await
    .unwrap();
    assert_eq!(
        left,
        ["k", "k", "k", "late", "late"],
        "the trigger took early's"
    );
    after.close().await;
}

/// Migration 0013 on a SQLite ledger that already has history: the
/// transitions and policy decisions keep their rows and numbers, a new
/// operation's transitions are numbered above them, and recording them
/// writes no `sqlite_sequence` row (with AUTOINCREMENT every commit of a
/// transition rewrote that row's page).
#[tokio::test]
async fn the_sqlite_history_keeps_its_numbers_and_no_longer_counts_in_sqlite_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let pool = || one_connection(&path);
    let before = pool().await;
    super::sqlite::MIGRATOR.run_to(12, &before).await.unwrap();
    let (reserved, executing) = (State::Reserved.as_str(), State::Executing.as_str());
    insert_operation(&before, "old", executing, 5).await;
    sqlx::query(
        "INSERT INTO transitions (seq, tenant_id, operation_id, from_state, to_state, version, \
         fence, actor, reason, at) VALUES \
         (41, 't', 'old', NULL, ?, 1, 0, 'gw', 'reservation', 5), \
         (42, 't', 'old', ?, ?, 2, 1, 'gw', 'claim', 6)",
    )
    .bind(reserved)
    .bind(reserved)
    .bind(executing)
    .execute(&before)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO policy_decisions (seq, tenant_id, operation_id, fingerprint, policy, \
         content_hash, decision, reason, duration_us, at, unreserved) VALUES \
         (7, 't', 'old', 'fp', 'limit', 'h', 'allow', NULL, 12, 5, 0)",
    )
    .execute(&before)
    .await
    .unwrap();
    before.close().await;

    let ledger = Ledger::open(&path, 2, 5000, ManualClock::new(1_000_000))
        .await
        .unwrap();
    let old: Vec<(i64, State)> = ledger
        .transitions("t", "old")
        .await
        .unwrap()
        .iter()
        .map(|t| (t.seq, t.to_state))
        .collect();
    assert_eq!(old, [(41, State::Reserved), (42, State::Executing)]);
    completed(&ledger, "k").await;
    let new: Vec<i64> = ledger
        .transitions("t", "k")
        .await
        .unwrap()
        .iter()
        .map(|t| t.seq)
        .collect();
    assert_eq!(new, [43, 44, 45], "numbered on from the largest kept");

    let after = pool().await;
    let counters: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_sequence WHERE name IN ('transitions', 'policy_decisions')",
    )
    .fetch_one(&after)
    .await
    .unwrap();
    assert_eq!(counters, 0, "no AUTOINCREMENT counter is kept");
    let decision: (i64, String, i64) =
        sqlx::query_as("SELECT seq, decision, unreserved FROM policy_decisions")
            .fetch_one(&after)
            .await
            .unwrap();
    assert_eq!(decision, (7, "allow".to_owned(), 0));
    let mut indexes: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'index' \
         AND tbl_name IN ('transitions', 'policy_decisions') ORDER BY name",
    )
    .fetch_all(&after)
    .await
    .unwrap();
    indexes.sort();
    assert_eq!(
        indexes,
        [
            "policy_decisions_by_operation",
            "policy_decisions_unreserved",
            "transitions_by_operation"
        ]
    );
    after.close().await;
}

/// A SQLite ledger in a folder that doesn't exist is refused with both
/// named, whether it is opened to serve (with its lock) or only read; no
/// folder and no lock file are created.
#[tokio::test]
async fn a_ledger_in_a_missing_folder_names_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("not-yet");
    let storage = crate::config::StorageSpec {
        path: folder.join("l.db"),
        ..crate::config::StorageSpec::default()
    };
    for serving in [true, false] {
        let err = if serving {
            Ledger::open_exclusive(&storage, ManualClock::new(1)).await
        } else {
            Ledger::open_storage(&storage, ManualClock::new(1)).await
        }
        .expect_err("refused");
        assert!(matches!(err, LedgerError::NoFolder(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(&format!("the folder {} does not exist", folder.display())),
            "{text}"
        );
        assert!(text.contains("storage.path"), "{text}");
    }
    assert!(!folder.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
