//! The statements [`super::apply`] and [`super::reserve_claimed`] run: a
//! command's compare-and-swap `UPDATE` (its guard and lease conditions),
//! the reservation's `INSERT`, and the transition and attempts-log rows
//! that ride in the same statement text.

use super::{Applied, AttemptLog, Command, Guard, Lease, LeaseCheck, OpRef, Record, RecordOutcome};
use crate::ledger::dialect::{Arg, Conn, Dialect, LedgerRow, Stmt, sql};
use crate::ledger::{NewOperation, State};

/// The guard's `WHERE` condition and its value.
fn guard_sql(guard: Guard<'_>) -> (&'static str, Option<Arg<'_>>) {
    match guard {
        Guard::Version(v) => (" AND version = ?", Some(v.into())),
        Guard::DeadLetter(v) => (" AND version = ? AND dead_letter", Some(v.into())),
        Guard::Fence(f) => (" AND fence = ?", Some(f.into())),
        Guard::Fingerprint(fp) => (" AND fingerprint = ?", Some(fp.into())),
        Guard::SourceState | Guard::NewKey(_) => ("", None),
    }
}

/// The lease's `WHERE` condition (it binds now once, if not empty).
fn lease_sql(lease: LeaseCheck) -> &'static str {
    match lease {
        LeaseCheck::Any => "",
        LeaseCheck::Lapsed => " AND lease_expires_at <= ?",
        LeaseCheck::NotLive => " AND (lease_expires_at IS NULL OR lease_expires_at <= ?)",
    }
}

/// The compare-and-swap `UPDATE` of a command that has a source state;
/// with a transition and `attempt`, also its attempts-log row where the
/// backend writes it in the same text (then the `bool` is true).
pub(super) async fn update<D: Dialect, C: Command>(
    conn: &mut Conn<D>,
    cmd: &C,
    transition: Option<TransitionRow<'_>>,
    attempt: Option<&AttemptLog<'_>>,
    now: i64,
    columns: &str,
) -> Result<(Option<D::Row>, bool), sqlx::Error> {
    let op = cmd.op();
    let set = cmd.set(now);
    let lease = cmd.lease_check();
    let (guard, guard_arg) = guard_sql(cmd.guard());
    let bump = if cmd.record().is_some() {
        ", version = version + 1"
    } else {
        ""
    };
    let sep = if set.sql.is_empty() { "" } else { ", " };
    let mut text = format!(
        "UPDATE operations SET state = ?{bump}{sep}{} \
         WHERE tenant_id = ? AND operation_id = ? AND state = ?{guard}{} \
         RETURNING {columns}",
        set.sql,
        lease_sql(lease)
    );
    let mut logged = None;
    if transition.is_some() {
        text = match attempt
            .and_then(|a| Some((a, D::with_transition_and_attempt(&text, columns)?)))
        {
            Some((a, with_attempt)) => {
                logged = Some(a);
                with_attempt
            }
            None => D::with_transition(&text, columns),
        };
    }
    let mut stmt = sql::<D>(&text)
        .bind(cmd.target())
        .bind_all(set.args)
        .bind(op.tenant)
        .bind(op.operation_id)
        .bind(cmd.source());
    if let Some(arg) = guard_arg {
        stmt = stmt.bind(arg);
    }
    if lease != LeaseCheck::Any {
        stmt = stmt.bind(now);
    }
    let row = run_cas::<D>(stmt, transition.as_slice(), conn, logged.map(|a| (op, a))).await?;
    Ok((row, logged.is_some()))
}

/// Runs compare-and-swap `stmt` (its binds so far) and the `transitions`
/// rows it appends when it applied, in order, in the same round trip: with
/// any, `stmt`'s text is [`Dialect::with_transitions`]' for that many.
async fn run_cas<D: Dialect>(
    mut stmt: Stmt<D>,
    transitions: &[TransitionRow<'_>],
    conn: &mut Conn<D>,
    attempt: Option<(OpRef<'_>, &AttemptLog<'_>)>,
) -> Result<Option<D::Row>, sqlx::Error> {
    let Some(last) = transitions.last() else {
        return stmt.fetch_optional(conn).await;
    };
    for t in transitions {
        stmt = stmt
            .bind(t.op.tenant)
            .bind(t.op.operation_id)
            .bind(t.from)
            .bind(t.to)
            .bind(crate::ledger::dialect::clean(t.record.actor))
            .bind(crate::ledger::dialect::clean(&t.record.reason))
            .bind(t.at);
        if D::TRANSITION_ROW_NAMES {
            stmt = stmt.bind(t.op.tenant).bind(t.op.operation_id);
        }
    }
    if D::TRANSITION_ROW_NAMES {
        stmt = stmt.bind(last.op.tenant).bind(last.op.operation_id);
    }
    if let Some((op, a)) = attempt {
        stmt = stmt
            .bind(op.tenant)
            .bind(op.operation_id)
            .bind(a.fence)
            .bind(a.status)
            .bind(crate::ledger::dialect::clean(a.outcome))
            .bind(a.detail.map(crate::ledger::dialect::clean))
            .bind(a.at)
            .bind(a.request_id);
    }
    // Every statement of the text runs (a first-row fetch would stop after
    // the compare-and-swap's row).
    Ok(stmt.fetch_all(conn).await?.into_iter().next())
}

/// The reservation's `INSERT … ON CONFLICT DO NOTHING`: RESERVED at
/// version 1, or, with `claim`, EXECUTING as claimed by it at `now`
/// (version 2, fencing token 1, attempt 1, the lease's owner and expiry),
/// appending `transitions` (none, the reservation's, or the reservation's
/// and the claim's).
pub(super) async fn insert<D: Dialect>(
    conn: &mut Conn<D>,
    new: &NewOperation,
    claim: Option<Lease<'_>>,
    transitions: &[TransitionRow<'_>],
    now: i64,
    columns: &str,
) -> Result<Option<D::Row>, sqlx::Error> {
    let text = format!(
        "INSERT INTO operations ({INSERT_COLUMNS}) VALUES {INSERT_ROW} \
         ON CONFLICT (tenant_id, operation_id) DO NOTHING \
         RETURNING {columns}"
    );
    let stmt = match transitions.len() {
        0 => sql::<D>(&text),
        n => sql::<D>(&D::with_transitions(&text, columns, n)),
    };
    let stmt = bind_new(stmt, new, claim, now);
    run_cas::<D>(stmt, transitions, conn, None).await
}

/// The columns of an `operations` row a reservation inserts, in the
/// order [`insert`] and [`insert_claimed_rows`] bind them.
const INSERT_COLUMNS: &str = "tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
     effect_class, state, version, attempts, fence, lease_owner, lease_expires_at, request_content_type, \
     request_body, principal, created_at, updated_at, expires_at, request_headers, retention_ms, trace_context";

/// Placeholders for one row of [`INSERT_COLUMNS`].
const INSERT_ROW: &str = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

/// Binds one reservation's row of [`INSERT_COLUMNS`]: RESERVED at
/// version 1, or, with `claim`, EXECUTING as claimed by it at `now`.
fn bind_new<'a, D: Dialect>(
    stmt: Stmt<D>,
    new: &'a NewOperation,
    claim: Option<Lease<'a>>,
    now: i64,
) -> Stmt<D> {
    let (state, version, attempts, fence) = match claim {
        None => (State::Reserved, 1_i64, 0_i64, 0_i64),
        Some(_) => (State::Executing, 2, 1, 1),
    };
    stmt.bind(&new.tenant_id)
        .bind(&new.operation_id)
        .bind(&new.route)
        .bind(&new.method)
        .bind(&new.path)
        .bind(&new.query)
        .bind(&new.fingerprint)
        .bind(&new.provider_key)
        .bind(&new.effect_class)
        .bind(state)
        .bind(version)
        .bind(attempts)
        .bind(fence)
        .bind(claim.map(|l| l.owner))
        .bind(claim.map(|l| l.expires_at(now)))
        .bind(&new.request_content_type)
        .bind(&new.request_body)
        .bind(&new.principal)
        .bind(now)
        .bind(now)
        .bind(now.saturating_add(new.retention_ms))
        .bind(serde_json::to_string(&new.request_headers).unwrap_or_else(|_| "[]".into()))
        .bind(new.retention_ms)
        .bind(&new.trace_context)
}

/// Reservations of several new operations, each claimed by its lease at
/// `now`, in one statement (PostgreSQL's data-modifying `WITH`): the rows
/// of [`insert`] with a claim, `ON CONFLICT DO NOTHING`, and for each row
/// inserted its two transitions (the reservation's, actor its principal,
/// then the claim's, actor its lease owner, reason `claim_reason`), as
/// [`insert`] appends them. `rows` must not name one key twice. Returns
/// the `(tenant_id, operation_id, version, fence, attempts)` of each row
/// inserted; a key that was taken returns nothing.
pub(super) async fn insert_claimed_rows<D: Dialect>(
    conn: &mut Conn<D>,
    rows: &[(&NewOperation, Lease<'_>)],
    claim_reason: &str,
    now: i64,
) -> Result<Vec<D::Row>, sqlx::Error> {
    let values = vec![INSERT_ROW; rows.len()].join(", ");
    let text = format!(
        "WITH applied AS (INSERT INTO operations ({INSERT_COLUMNS}) VALUES {values} \
         ON CONFLICT (tenant_id, operation_id) DO NOTHING \
         RETURNING tenant_id, operation_id, principal, lease_owner, created_at, version, fence, attempts), \
         appended AS (INSERT INTO transitions ({}) \
         SELECT tenant_id, operation_id, ?, ?, {}, principal, ?, created_at FROM applied UNION ALL \
         SELECT tenant_id, operation_id, ?, ?, {}, lease_owner, ?, created_at FROM applied) \
         SELECT tenant_id, operation_id, version, fence, attempts FROM applied",
        crate::ledger::dialect::TRANSITION_COLUMNS,
        D::transition_version(1),
        D::transition_version(0),
    );
    let mut stmt = sql::<D>(&text);
    for (new, lease) in rows {
        stmt = bind_new(stmt, new, Some(*lease), now);
    }
    stmt.bind(None::<State>)
        .bind(State::Reserved)
        .bind("reserved")
        .bind(Some(State::Reserved))
        .bind(State::Executing)
        .bind(crate::ledger::dialect::clean(claim_reason))
        .fetch_all(conn)
        .await
}

/// Outcomes of several operations, each under its fencing token, in one
/// statement (PostgreSQL's data-modifying `WITH`): each row's
/// compare-and-swap as [`update`] runs it for one ([`RecordOutcome`]'s
/// guard and columns, its values read from a `VALUES` row of its own),
/// and for each row that applied its transition and its attempts-log row
/// (`attempts[i]` for `outcomes[i]`), at `now`. `outcomes` must not name
/// one operation twice. Returns the rows that applied, with `columns` (a
/// column list of `operations` naming `tenant_id`, `operation_id`,
/// `state`, `version`, `fence` and `attempts`); a fencing token that was
/// not current returns nothing.
pub(super) async fn update_outcome_rows<D: Dialect>(
    conn: &mut Conn<D>,
    outcomes: &[&RecordOutcome<'_>],
    attempts: &[AttemptLog<'_>],
    now: i64,
    columns: &str,
) -> Result<Vec<D::Row>, sqlx::Error> {
    let Some(first) = outcomes.first() else {
        return Ok(Vec::new());
    };
    // The one-row statement's columns, each `?` read from the row's own
    // value `v.sN` instead.
    let one = first.set(now);
    let mut set = String::with_capacity(one.sql.len() * 2);
    let mut values = 0;
    for c in one.sql.chars() {
        if c == '?' {
            set.push_str(&format!("v.s{values}"));
            values += 1;
        } else {
            set.push(c);
        }
    }
    let names: Vec<String> = ["v_tenant", "v_op", "v_from", "v_to", "v_fence"]
        .into_iter()
        .map(str::to_owned)
        .chain((0..values).map(|n| format!("s{n}")))
        .chain(
            [
                "v_actor",
                "v_reason",
                "a_status",
                "a_outcome",
                "a_detail",
                "a_request_id",
            ]
            .into_iter()
            .map(str::to_owned),
        )
        .collect();
    let row = format!("({})", vec!["?"; names.len()].join(", "));
    let text = format!(
        "WITH v ({}) AS (VALUES {}), \
         applied AS (UPDATE operations SET state = v.v_to, version = version + 1, {set} FROM v \
         WHERE tenant_id = v.v_tenant AND operation_id = v.v_op AND state = v.v_from AND fence = v.v_fence \
         RETURNING {columns}, v.v_from, v.v_actor, v.v_reason, v.v_fence, v.a_status, v.a_outcome, \
         v.a_detail, v.a_request_id), \
         appended AS (INSERT INTO transitions ({}) \
         SELECT tenant_id, operation_id, v_from, state, version, fence, v_actor, v_reason, ? FROM applied), \
         attempted AS (INSERT INTO attempts ({}) \
         SELECT tenant_id, operation_id, attempts, v_fence, a_status, a_outcome, a_detail, ?, a_request_id \
         FROM applied ON CONFLICT DO NOTHING) \
         SELECT {columns} FROM applied",
        names.join(", "),
        vec![row; outcomes.len()].join(", "),
        crate::ledger::dialect::TRANSITION_COLUMNS,
        crate::ledger::dialect::ATTEMPT_COLUMNS,
    );
    let mut stmt = sql::<D>(&text);
    for (cmd, attempt) in outcomes.iter().zip(attempts) {
        let op = cmd.op();
        let record = cmd.record();
        let (actor, reason) = record
            .as_ref()
            .map_or(("", ""), |r| (r.actor, r.reason.as_ref()));
        stmt = stmt
            .bind(op.tenant)
            .bind(op.operation_id)
            .bind(cmd.source())
            .bind(cmd.target())
            .bind(cmd.fence)
            .bind_all(cmd.set(now).args)
            .bind(crate::ledger::dialect::clean(actor))
            .bind(crate::ledger::dialect::clean(reason))
            .bind(attempt.status)
            .bind(crate::ledger::dialect::clean(attempt.outcome))
            .bind(attempt.detail.map(crate::ledger::dialect::clean))
            .bind(attempt.request_id);
    }
    stmt.bind(now).bind(now).fetch_all(conn).await
}

/// The version, fencing token and attempts of a row a compare-and-swap
/// returned.
pub(super) fn applied<R: LedgerRow>(row: &R) -> Result<Applied, sqlx::Error> {
    Ok(Applied {
        version: row.get("version")?,
        fence: row.get("fence")?,
        attempts: row.get("attempts")?,
    })
}

/// One `transitions` row; its version and fencing token are the row's
/// after the compare-and-swap.
pub(super) struct TransitionRow<'a> {
    pub(super) op: OpRef<'a>,
    pub(super) from: Option<State>,
    pub(super) to: State,
    pub(super) record: &'a Record<'a>,
    pub(super) at: i64,
}
