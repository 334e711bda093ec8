//! The operation state machine as a typed transition table.
//!
//! Every ledger write that changes an operation's state, or holds the
//! operation in its state under a lease or schedule, is a [`Command`]: one
//! type per transition (`executor.rs`, `recovery.rs`, `approvals.rs`). A
//! command names the states it may leave ([`Command::SOURCES`]) and enter
//! ([`Command::TARGETS`]), the source and target of this write, the guard
//! the row must still pass (expected version, fencing token, …), the other
//! columns it sets, and the transition row it appends (actor, reason):
//!
//! | command | from | to | guard | transition row |
//! | --- | --- | --- | --- | --- |
//! | [`Reserve`] | ∅ | RESERVED | new key | principal, `reserved` |
//! | [`AwaitApproval`] | RESERVED | AWAITING_APPROVAL | version 1 | principal |
//! | [`ClaimLease`] | RESERVED, AWAITING_APPROVAL, EXECUTING, UNKNOWN | EXECUTING | version (+ lease not live) | lease owner |
//! | [`RecordOutcome`] | EXECUTING, UNKNOWN | COMPLETED, FAILED, UNKNOWN | fence | actor |
//! | [`NoteRetry`] | EXECUTING | EXECUTING | fence | none |
//! | [`ExtendLease`] | EXECUTING | EXECUTING | fence | none |
//! | [`ExpireLease`] | EXECUTING | UNKNOWN | version + lease lapsed | actor, `lease expired` |
//! | [`LeaseForReconcile`] | UNKNOWN | UNKNOWN | version + lease not live | lease owner |
//! | [`Reattempt`] | UNKNOWN | EXECUTING | fence | lease owner |
//! | [`Unschedule`] | UNKNOWN | UNKNOWN | version | none |
//! | [`ReadBackNow`] | UNKNOWN | UNKNOWN | version | none |
//! | [`SelfAudit`] | any with a self-transition | the same | version | actor |
//! | [`Requeue`] | FAILED (dead letter) | UNKNOWN, RESERVED | dead letter at version | actor |
//! | [`NoteApproval`] | AWAITING_APPROVAL | AWAITING_APPROVAL | source state | decider |
//! | [`RefuseApproval`] | AWAITING_APPROVAL | FAILED | fingerprint | decider or reconciler |
//! | [`UseApproval`] | AWAITING_APPROVAL | EXECUTING | fingerprint | lease owner |
//! | [`ReserveCompensation`] | ∅ | RESERVED | new key | operator, the original and the reason |
//! | [`NoteCompensation`] | COMPLETED | COMPLETED | source state (in the reservation's transaction) | operator |
//! | [`CompleteCompensation`] | COMPLETED | COMPENSATED | source state (in the compensation's COMPLETED transaction) | operator, the compensation and the reason |
//!
//! [`apply`] is the one function that writes a command: it refuses a pair
//! outside the command's sources and targets or the state machine
//! ([`State::can_transition_to`]) before it writes anything, binds every
//! state as [`State::as_str`], runs one compare-and-swap (`UPDATE …
//! WHERE state = ? AND <guard> RETURNING …`, or the reservation's
//! `INSERT … ON CONFLICT DO NOTHING`) and, for a transition, bumps the
//! version and appends the `transitions` row, all on the caller's
//! connection (inside its transaction) and in one round trip: the
//! transition row is written by the same statement text as the
//! compare-and-swap, only when it applied (`Dialect::with_transition`). A write that keeps the state and
//! appends no row (a retry, a lease extension, unscheduling) bumps no
//! version.

mod approvals;
mod compensation;
mod executor;
mod recovery;
mod statements;

use std::borrow::Cow;

pub(super) use approvals::{NoteApproval, RefuseApproval, UseApproval};
pub(super) use compensation::{CompleteCompensation, NoteCompensation, ReserveCompensation};
pub(super) use executor::{
    AwaitApproval, ClaimLease, ExtendLease, Lease, NoteRetry, RecordOutcome, Reserve,
};
pub(super) use recovery::{
    ExpireLease, LeaseForReconcile, ReadBackNow, Reattempt, Requeue, SelfAudit, Unschedule,
};

use statements::{TransitionRow, applied, insert, update};

use super::dialect::{Arg, Conn, Dialect, sql};
use super::{Claim, LedgerError, NewOperation, State};

/// An operation's key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpRef<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Operation id.
    pub operation_id: &'a str,
}

impl<'a> OpRef<'a> {
    /// The operation `operation_id` of `tenant`.
    pub(crate) fn new(tenant: &'a str, operation_id: &'a str) -> Self {
        Self {
            tenant,
            operation_id,
        }
    }
}

/// What the row must still be, besides being in the source state: the
/// command's compare-and-swap condition.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Guard<'a> {
    /// No operation has the key yet (`INSERT … ON CONFLICT DO NOTHING`);
    /// the new operation's values.
    NewKey(&'a NewOperation),
    /// The row is still at this version (`version = ?`).
    Version(i64),
    /// The row is a dead letter still at this version.
    DeadLetter(i64),
    /// This fencing token is still current (`fence = ?`).
    Fence(i64),
    /// The row carries this request fingerprint (an approval is bound to
    /// it; the approval's own compare-and-swap, in the same transaction,
    /// is what runs once).
    Fingerprint(&'a str),
    /// The source state only (the compare-and-swap that ran before it in
    /// the same transaction is the guard).
    SourceState,
}

/// What the lease must be at the command's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseCheck {
    /// Anything.
    Any,
    /// Held, and expired (`lease_expires_at <= now`).
    Lapsed,
    /// Not held by anyone live (none, or expired).
    NotLive,
}

/// The transition row a command appends.
#[derive(Debug, Clone)]
pub(crate) struct Record<'a> {
    /// Who (principal or gateway instance).
    pub actor: &'a str,
    /// Why.
    pub reason: Cow<'a, str>,
}

impl<'a> Record<'a> {
    /// `actor` changed the state because of `reason`.
    pub(crate) fn new(actor: &'a str, reason: impl Into<Cow<'a, str>>) -> Self {
        Self {
            actor,
            reason: reason.into(),
        }
    }
}

/// Columns a command sets besides the state and the version: SQL
/// assignments with `?` placeholders and their values, in order.
#[derive(Debug, Clone)]
pub(crate) struct Set<'a> {
    /// e.g. `lease_owner = ?, lease_expires_at = ?` (empty: nothing else).
    pub sql: &'static str,
    /// One value per `?` of `sql`.
    pub args: Vec<Arg<'a>>,
}

impl<'a> Set<'a> {
    /// Nothing besides the state and the version.
    pub(crate) fn none() -> Self {
        Self {
            sql: "",
            args: Vec::new(),
        }
    }

    /// `sql` with its values.
    pub(crate) fn new(sql: &'static str, args: Vec<Arg<'a>>) -> Self {
        Self { sql, args }
    }
}

/// One write of the state machine.
pub(crate) trait Command {
    /// The states this command may leave (empty: it creates the
    /// operation).
    const SOURCES: &'static [State];
    /// The states it may enter.
    const TARGETS: &'static [State];

    /// The operation.
    fn op(&self) -> OpRef<'_>;
    /// The state the row must be in (`None`: no row yet).
    fn source(&self) -> Option<State>;
    /// The state it ends in.
    fn target(&self) -> State;
    /// The compare-and-swap condition.
    fn guard(&self) -> Guard<'_>;
    /// The lease condition, at `now`.
    fn lease_check(&self) -> LeaseCheck {
        LeaseCheck::Any
    }
    /// Other columns it sets, at `now` (ms since epoch).
    fn set(&self, now: i64) -> Set<'_>;
    /// The transition row it appends. `None` for a lease or schedule write
    /// that keeps the state: it bumps no version and appends no row.
    fn record(&self) -> Option<Record<'_>>;
}

/// The row after an applied command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Row version.
    pub version: i64,
    /// Fencing token.
    pub fence: i64,
    /// Provider attempts so far.
    pub attempts: i64,
}

impl Applied {
    /// The claim an applied lease-taking command holds, with its lease
    /// expiry (ms since epoch).
    pub(crate) fn claim(self, lease_expires_at: i64) -> Claim {
        Claim {
            fence: self.fence,
            version: self.version,
            attempt: self.attempts,
            lease_expires_at,
        }
    }
}

/// Whether the state machine lets the operation in: `∅ → RESERVED` is the
/// only way.
fn can_enter(to: State) -> bool {
    to == State::Reserved
}

/// Refuses `cmd` unless its source and target are among the command's and
/// the state machine has that transition; a write that keeps the state and
/// appends no transition row must not name another target.
///
/// Errors: [`LedgerError::IllegalTransition`] (for a creation, `from` is
/// reported as the target).
pub(crate) fn check<C: Command>(cmd: &C) -> Result<(), LedgerError> {
    let to = cmd.target();
    let creates = matches!(cmd.guard(), Guard::NewKey(_));
    let allowed = C::TARGETS.contains(&to)
        && match cmd.source() {
            None => creates && C::SOURCES.is_empty() && can_enter(to),
            Some(from) => {
                !creates
                    && C::SOURCES.contains(&from)
                    && from.can_transition_to(to)
                    && (cmd.record().is_some() || from == to)
            }
        };
    if allowed {
        Ok(())
    } else {
        Err(LedgerError::IllegalTransition {
            from: cmd.source().unwrap_or(to),
            to,
        })
    }
}

/// Applies `cmd` at `now` (ms since epoch) on `conn`: [`check`]s it, runs
/// its compare-and-swap and, for a transition, appends its `transitions`
/// row. Returns the row after it, or `None` when the compare-and-swap lost
/// (the row is not in the source state, the guard or the lease condition
/// failed, or the key exists); then nothing was written.
///
/// Errors: [`LedgerError::IllegalTransition`] before any write, or the
/// database's.
pub(crate) async fn apply<D: Dialect, C: Command>(
    conn: &mut Conn<D>,
    cmd: &C,
    now: i64,
) -> Result<Option<Applied>, LedgerError> {
    Ok(apply_returning::<D, C>(conn, cmd, now, APPLIED_COLUMNS)
        .await?
        .map(|(applied, _)| applied))
}

/// [`apply`], also returning the row after it with `columns` (a column
/// list of `operations` that names `version`, `fence` and `attempts`), read
/// by the compare-and-swap's own `RETURNING`: no statement of its own.
///
/// Errors: as [`apply`].
pub(crate) async fn apply_returning<D: Dialect, C: Command>(
    conn: &mut Conn<D>,
    cmd: &C,
    now: i64,
    columns: &str,
) -> Result<Option<(Applied, D::Row)>, LedgerError> {
    apply_logging::<D, C>(conn, cmd, now, columns, None).await
}

/// One row of the attempts log, but its number: what an attempt ended
/// with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttemptLog<'a> {
    /// The fencing token it ran under.
    pub fence: i64,
    /// The provider's status, if a response head arrived.
    pub status: Option<i64>,
    /// Short outcome.
    pub outcome: &'a str,
    /// Detail.
    pub detail: Option<&'a str>,
    /// When (ms since epoch).
    pub at: i64,
    /// The caller's `x-request-id`, if the attempt was made for one.
    pub request_id: Option<&'a str>,
}

/// [`apply_returning`] for a command that ends an attempt (it appends a
/// transition row): when it applies, `attempt` is logged as attempt number
/// `attempts` of the row after it, in the compare-and-swap's own statement
/// text where the backend has one ([`Dialect::with_transition_and_attempt`]:
/// no round trip of its own), else as a statement of its own right after.
///
/// Errors: as [`apply`].
pub(crate) async fn apply_returning_with_attempt<D: Dialect, C: Command>(
    conn: &mut Conn<D>,
    cmd: &C,
    now: i64,
    columns: &str,
    attempt: &AttemptLog<'_>,
) -> Result<Option<(Applied, D::Row)>, LedgerError> {
    apply_logging::<D, C>(conn, cmd, now, columns, Some(attempt)).await
}

/// [`apply_returning`], and with `attempt`, [`apply_returning_with_attempt`].
async fn apply_logging<D: Dialect, C: Command>(
    conn: &mut Conn<D>,
    cmd: &C,
    now: i64,
    columns: &str,
    attempt: Option<&AttemptLog<'_>>,
) -> Result<Option<(Applied, D::Row)>, LedgerError> {
    check(cmd)?;
    let record = cmd.record();
    let transition = record.as_ref().map(|record| TransitionRow {
        op: cmd.op(),
        from: cmd.source(),
        to: cmd.target(),
        record,
        at: now,
    });
    let (row, logged) = match cmd.guard() {
        Guard::NewKey(new) => {
            let transitions: &[TransitionRow<'_>] = transition.as_slice();
            let row = insert::<D>(conn, new, None, transitions, now, columns).await?;
            (row, false)
        }
        _ => update::<D, C>(conn, cmd, transition, attempt, now, columns).await?,
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let applied = applied(&row)?;
    if let Some(a) = attempt
        && !logged
    {
        insert_attempt::<D>(conn, cmd.op(), applied.attempts, a).await?;
    }
    Ok(Some((applied, row)))
}

/// Appends attempt number `number` of `op` to the attempts log (`ON
/// CONFLICT DO NOTHING`: an attempt is logged once).
///
/// Errors: the database's.
pub(crate) async fn insert_attempt<D: Dialect>(
    conn: &mut Conn<D>,
    op: OpRef<'_>,
    number: i64,
    a: &AttemptLog<'_>,
) -> Result<(), sqlx::Error> {
    sql::<D>(D::INSERT_ATTEMPT)
        .bind(op.tenant)
        .bind(op.operation_id)
        .bind(number)
        .bind(a.fence)
        .bind(a.status)
        .bind(super::dialect::clean(a.outcome))
        .bind(a.detail.map(super::dialect::clean))
        .bind(a.at)
        .bind(a.request_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// What [`apply`] reads back of the row (and a reservation, which knows
/// the rest of the row it inserted).
pub(crate) const APPLIED_COLUMNS: &str = "version, fence, attempts";

/// Applies [`Reserve`] and, in the same statement, the [`ClaimLease`] of
/// the operation it creates (∅ → RESERVED → EXECUTING): the row is
/// inserted as claimed (version 2, fencing token 1, attempt 1, `claim`'s
/// lease from `now`) with both transition rows (the reservation's at
/// version 1 and token 0, then the claim's), so a new operation's first
/// durable write before the provider is called is one statement, not two
/// (and the row is written once, not inserted and then updated). `claim`
/// must be the claim of that new row: from RESERVED at version 1.
///
/// Returns the claim's [`Applied`] and the row after it with `columns`, or
/// `None` when the key was taken (nothing written).
///
/// Errors: [`LedgerError::IllegalTransition`] (before any write) for a
/// `claim` of another state or version; the database's.
pub(crate) async fn reserve_claimed<D: Dialect>(
    conn: &mut Conn<D>,
    reserve: &Reserve<'_>,
    claim: &ClaimLease<'_>,
    now: i64,
    columns: &str,
) -> Result<Option<(Applied, D::Row)>, LedgerError> {
    check(reserve)?;
    check(claim)?;
    if claim.from != State::Reserved || claim.version != 1 {
        return Err(LedgerError::IllegalTransition {
            from: claim.from,
            to: claim.target(),
        });
    }
    let (Some(reserved), Some(claimed)) = (reserve.record(), claim.record()) else {
        return Ok(None);
    };
    let transitions = [
        TransitionRow {
            op: reserve.op(),
            from: None,
            to: reserve.target(),
            record: &reserved,
            at: now,
        },
        TransitionRow {
            op: claim.op(),
            from: claim.source(),
            to: claim.target(),
            record: &claimed,
            at: now,
        },
    ];
    let row = insert::<D>(
        conn,
        reserve.new,
        Some(claim.lease),
        &transitions,
        now,
        columns,
    )
    .await?;
    Ok(match row {
        Some(row) => Some((applied(&row)?, row)),
        None => None,
    })
}

/// [`reserve_claimed`] for several new operations in one statement (see
/// [`statements::insert_claimed_rows`]): each `(new, lease)` reserved and
/// claimed from RESERVED at version 1 by its lease, the claims' transition
/// reason `reason`. `rows` must not name one key twice.
///
/// Returns `(tenant_id, operation_id, applied)` of each operation created;
/// a key that was taken is left out (nothing written for it).
///
/// Errors: the database's (the statement failed: nothing of it kept).
pub(crate) async fn reserve_claimed_rows<D: Dialect>(
    conn: &mut Conn<D>,
    rows: &[(&NewOperation, Lease<'_>)],
    reason: &str,
    now: i64,
) -> Result<Vec<(String, String, Applied)>, LedgerError> {
    if let Some((new, lease)) = rows.first() {
        // The same two commands as `reserve_claimed`'s, for the state
        // machine's check (every row makes the same moves).
        check(&Reserve { new })?;
        check(&ClaimLease {
            op: OpRef::new(&new.tenant_id, &new.operation_id),
            from: State::Reserved,
            version: 1,
            lease: *lease,
            reason,
        })?;
    } else {
        return Ok(Vec::new());
    }
    statements::insert_claimed_rows::<D>(conn, rows, reason, now)
        .await?
        .iter()
        .map(|row| {
            Ok((
                super::dialect::LedgerRow::text(row, "tenant_id")?,
                super::dialect::LedgerRow::text(row, "operation_id")?,
                applied(row)?,
            ))
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(LedgerError::from)
}

/// [`apply_returning_with_attempt`] for several outcomes in one statement
/// (see [`statements::update_outcome_rows`]): `outcomes[i]` logged as
/// `attempts[i]`. `outcomes` must not name one operation twice.
///
/// Returns the applied rows, with `columns`, and their [`Applied`]; an
/// outcome whose fencing token was not current is left out (nothing
/// written for it).
///
/// Errors: [`LedgerError::IllegalTransition`] before any write, or the
/// database's (nothing of the statement kept).
pub(crate) async fn record_outcome_rows<D: Dialect>(
    conn: &mut Conn<D>,
    outcomes: &[&RecordOutcome<'_>],
    attempts: &[AttemptLog<'_>],
    now: i64,
    columns: &str,
) -> Result<Vec<(Applied, D::Row)>, LedgerError> {
    for cmd in outcomes {
        check(*cmd)?;
    }
    statements::update_outcome_rows::<D>(conn, outcomes, attempts, now, columns)
        .await?
        .into_iter()
        .map(|row| Ok((applied(&row)?, row)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(LedgerError::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Outcome;
    use crate::ledger::sqlite::SqliteDialect;
    use State::{AwaitingApproval, Completed, Executing, Failed, Reserved, Unknown};

    fn op() -> OpRef<'static> {
        OpRef::new("tenant", "op-1")
    }

    fn lease() -> Lease<'static> {
        Lease {
            owner: "gw-1",
            ms: 1_000,
        }
    }

    fn claim(from: State) -> ClaimLease<'static> {
        ClaimLease {
            op: op(),
            from,
            version: 1,
            lease: lease(),
            reason: "test",
        }
    }

    /// Every source of `C` reaches one of its targets, and every target is
    /// reached from one of its sources (or is the way in).
    fn stays_inside<C: Command>() -> bool {
        let sources_lead_somewhere = C::SOURCES
            .iter()
            .all(|s| C::TARGETS.iter().any(|t| s.can_transition_to(*t)));
        let targets_are_reached = C::TARGETS.iter().all(|t| {
            (C::SOURCES.is_empty() && can_enter(*t))
                || C::SOURCES.iter().any(|s| s.can_transition_to(*t))
        });
        sources_lead_somewhere && targets_are_reached
    }

    #[test]
    fn every_command_stays_inside_the_state_machine() {
        assert!(stays_inside::<Reserve>());
        assert!(stays_inside::<AwaitApproval>());
        assert!(stays_inside::<ClaimLease>());
        assert!(stays_inside::<RecordOutcome>());
        assert!(stays_inside::<NoteRetry>());
        assert!(stays_inside::<ExtendLease>());
        assert!(stays_inside::<ExpireLease>());
        assert!(stays_inside::<LeaseForReconcile>());
        assert!(stays_inside::<Reattempt>());
        assert!(stays_inside::<Unschedule>());
        assert!(stays_inside::<ReadBackNow>());
        assert!(stays_inside::<Requeue>());
        assert!(stays_inside::<NoteApproval>());
        assert!(stays_inside::<RefuseApproval>());
        assert!(stays_inside::<UseApproval>());
        assert!(stays_inside::<ReserveCompensation>());
        assert!(stays_inside::<NoteCompensation>());
        assert!(stays_inside::<CompleteCompensation>());
        // SelfAudit names every state; the state machine picks the ones
        // that may stay.
        assert!(SelfAudit::SOURCES.iter().any(|s| s.can_transition_to(*s)));
    }

    #[test]
    fn claims_leave_only_claimable_states() {
        for from in State::ALL {
            let ok = matches!(from, Reserved | AwaitingApproval | Executing | Unknown);
            assert_eq!(check(&claim(from)).is_ok(), ok, "{from} → EXECUTING");
        }
    }

    #[test]
    fn outcomes_end_in_completed_failed_or_unknown() {
        for from in State::ALL {
            for to in State::ALL {
                let outcome = Outcome::new(to, "test");
                let cmd = RecordOutcome {
                    op: op(),
                    from,
                    fence: 1,
                    actor: "gw-1",
                    outcome: &outcome,
                };
                let ok = matches!(from, Executing | Unknown)
                    && matches!(to, Completed | Failed | Unknown)
                    && from.can_transition_to(to);
                assert_eq!(check(&cmd).is_ok(), ok, "{from} → {to}");
            }
        }
    }

    #[test]
    fn audits_only_where_the_state_may_stay() {
        for state in State::ALL {
            let cmd = SelfAudit {
                op: op(),
                version: 1,
                state,
                actor: "operator",
                reason: "test",
            };
            assert_eq!(
                check(&cmd).is_ok(),
                state.can_transition_to(state),
                "{state}"
            );
        }
    }

    #[test]
    fn requeues_go_to_unknown_or_reserved() {
        for to in State::ALL {
            let cmd = Requeue {
                op: op(),
                version: 1,
                to,
                actor: "operator",
                reason: "test",
            };
            let ok = matches!(to, Unknown | Reserved);
            assert_eq!(check(&cmd).is_ok(), ok, "FAILED → {to}");
        }
    }

    /// An illegal command is refused before the database sees it: on a
    /// database without the ledger's tables, it fails as illegal, while a
    /// legal one reaches the database (and fails there).
    #[tokio::test]
    async fn an_illegal_command_writes_nothing() {
        let mut conn = crate::ledger::sqlite::Conn::Writer {
            conn: Some(rusqlite::Connection::open_in_memory().expect("an in-memory database")),
            busy: std::time::Duration::from_secs(1),
            checkpointer: None,
            checkpoint_pages: 1000,
            wal: None,
            durability: Default::default(),
        };
        let refused = apply::<SqliteDialect, _>(&mut conn, &claim(Failed), 0).await;
        assert!(
            matches!(
                refused,
                Err(LedgerError::IllegalTransition {
                    from: Failed,
                    to: Executing
                })
            ),
            "{refused:?}"
        );
        let reached = apply::<SqliteDialect, _>(&mut conn, &claim(Reserved), 0).await;
        assert!(matches!(reached, Err(LedgerError::Db(_))), "{reached:?}");
    }
}
