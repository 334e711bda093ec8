//! The inbox's statements: the deduplicating insert, the sequence
//! decision and the delivery queued in the outbox, all in one transaction
//! (see `ledger/inbox.rs` for the states). The resolving of operations
//! from events is in `resolve`, the reads and sweeps in `reads`.

use super::super::LedgerError;
use super::super::dialect::{Conn, Dialect, LedgerRow, clean, sql};
use super::super::inbox::{InboxEvent, NewInboxEvent, Ordering, Received, Resolved, delivery_id};
use super::Store;
use super::outbox::insert_event_as;

mod reads;
mod resolve;

use resolve::resolve_on;

const INBOX_COLUMNS: &str = "tenant_id, source, event_id, event_type, state, sequence_key, sequence, gap, \
     payload, received_at, held_until, outbox_event_id, operation_id, resolution, decided_by, decided_at";

fn inbox_from_row<R: LedgerRow>(r: &R) -> Result<InboxEvent, sqlx::Error> {
    Ok(InboxEvent {
        tenant_id: r.get("tenant_id")?,
        source: r.get("source")?,
        event_id: r.get("event_id")?,
        event_type: r.get("event_type")?,
        state: r.get("state")?,
        sequence_key: r.get("sequence_key")?,
        sequence: r.get("sequence")?,
        gap: r.get("gap")?,
        payload: r.get("payload")?,
        received_at: r.get("received_at")?,
        held_until: r.get("held_until")?,
        outbox_event_id: r.get("outbox_event_id")?,
        operation_id: r.get("operation_id")?,
        resolution: r.get("resolution")?,
        decided_by: r.get("decided_by")?,
        decided_at: r.get("decided_at")?,
    })
}

/// Inserts `ev` as `accepted` at `now`: `INSERT … ON CONFLICT DO NOTHING`
/// on `(tenant, source, event id)`. Returns whether it was new.
pub(super) async fn insert_inbox_row<D: Dialect>(
    conn: &mut Conn<D>,
    ev: &NewInboxEvent<'_>,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let n = sql::<D>(
        "INSERT INTO inbox (tenant_id, source, event_id, event_type, state, sequence_key, sequence, payload, received_at) \
         VALUES (?, ?, ?, ?, 'accepted', ?, ?, ?, ?) ON CONFLICT (tenant_id, source, event_id) DO NOTHING",
    )
    .bind(ev.tenant)
    .bind(ev.source)
    .bind(ev.event_id)
    .bind(ev.event_type)
    .bind(ev.ordering.map(|o| o.key))
    .bind(ev.ordering.map(|o| o.sequence))
    .bind(ev.payload)
    .bind(now)
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// Locks the sequence row of `(tenant, source, key)` (creating it at
/// `start - 1`, or below every sequence for non-counting sequences) and
/// returns its last applied sequence.
async fn lock_sequence<D: Dialect>(
    conn: &mut Conn<D>,
    (tenant, source): (&str, &str),
    o: &Ordering<'_>,
    now: i64,
) -> Result<i64, sqlx::Error> {
    let floor = if o.gaps {
        o.start.saturating_sub(1)
    } else {
        i64::MIN
    };
    sql::<D>(
        "INSERT INTO inbox_sequences (tenant_id, source, sequence_key, last_applied, updated_at) \
         VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, source, sequence_key) DO NOTHING",
    )
    .bind(tenant)
    .bind(source)
    .bind(o.key)
    .bind(floor)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    // An UPDATE takes the row lock on both backends: concurrent events of
    // one key decide one after another.
    let row = sql::<D>(
        "UPDATE inbox_sequences SET updated_at = ? WHERE tenant_id = ? AND source = ? AND sequence_key = ? \
         RETURNING last_applied",
    )
    .bind(now)
    .bind(tenant)
    .bind(source)
    .bind(o.key)
    .fetch_one(conn)
    .await?;
    row.get("last_applied")
}

async fn set_sequence<D: Dialect>(
    conn: &mut Conn<D>,
    (tenant, source, key): (&str, &str, &str),
    last: i64,
    now: i64,
) -> Result<(), sqlx::Error> {
    sql::<D>(
        "UPDATE inbox_sequences SET last_applied = ?, updated_at = ? \
         WHERE tenant_id = ? AND source = ? AND sequence_key = ? AND last_applied < ?",
    )
    .bind(last)
    .bind(now)
    .bind(tenant)
    .bind(source)
    .bind(key)
    .bind(last)
    .execute(conn)
    .await?;
    Ok(())
}

/// Queues the delivery of stored event `ev` (accepted now) in the outbox
/// under its stable id, ordered behind the earlier ones of its sequence
/// key, and notes the id on the row. Returns the id.
async fn queue_delivery<D: Dialect>(
    conn: &mut Conn<D>,
    ev: &InboxEvent,
    gap: bool,
    now: i64,
) -> Result<String, sqlx::Error> {
    let id = delivery_id(&ev.tenant_id, &ev.source, &ev.event_id);
    let event: serde_json::Value =
        serde_json::from_str(&ev.payload).unwrap_or(serde_json::Value::Null);
    let data = serde_json::json!({
        "source": ev.source,
        "provider_event_id": ev.event_id,
        "provider_event_type": ev.event_type,
        "received_at": ev.received_at,
        "sequence_key": ev.sequence_key,
        "sequence": ev.sequence,
        "gap": gap,
        "event": event,
    });
    let ordering = ev
        .sequence_key
        .as_ref()
        .map(|k| format!("inbox:{}:{}:{k}", ev.tenant_id, ev.source));
    insert_event_as::<D>(
        &mut *conn,
        &id,
        &ev.tenant_id,
        "inbox.event",
        data,
        now,
        ordering.as_deref(),
    )
    .await?;
    sql::<D>(
        "UPDATE inbox SET outbox_event_id = ? WHERE tenant_id = ? AND source = ? AND event_id = ?",
    )
    .bind(&id)
    .bind(&ev.tenant_id)
    .bind(&ev.source)
    .bind(&ev.event_id)
    .execute(conn)
    .await?;
    Ok(id)
}

async fn fetch_inbox<D: Dialect>(
    conn: &mut Conn<D>,
    (tenant, source, event_id): (&str, &str, &str),
) -> Result<Option<InboxEvent>, sqlx::Error> {
    sql::<D>(&format!(
        "SELECT {INBOX_COLUMNS} FROM inbox WHERE tenant_id = ? AND source = ? AND event_id = ?"
    ))
    .bind(tenant)
    .bind(source)
    .bind(event_id)
    .fetch_optional(conn)
    .await?
    .as_ref()
    .map(inbox_from_row)
    .transpose()
}

/// Sets the state of a stored event (and whether it was accepted after a
/// gap), clearing its hold.
async fn set_state<D: Dialect>(
    conn: &mut Conn<D>,
    (tenant, source, event_id): (&str, &str, &str),
    state: &str,
    held_until: Option<i64>,
    gap: bool,
) -> Result<(), sqlx::Error> {
    sql::<D>(
        "UPDATE inbox SET state = ?, held_until = ?, gap = ? WHERE tenant_id = ? AND source = ? AND event_id = ?",
    )
    .bind(state)
    .bind(held_until)
    .bind(gap)
    .bind(tenant)
    .bind(source)
    .bind(event_id)
    .execute(conn)
    .await?;
    Ok(())
}

/// Accepts the held events of `(tenant, source, key)` that follow `last`
/// without a gap, in order, queueing each delivery when `deliver`.
/// Returns their event ids and the new last applied sequence.
async fn release_held<D: Dialect>(
    conn: &mut Conn<D>,
    (tenant, source, key): (&str, &str, &str),
    mut last: i64,
    deliver: bool,
    now: i64,
) -> Result<(Vec<String>, i64), sqlx::Error> {
    let mut released = Vec::new();
    while let Some(next) = last.checked_add(1) {
        let row = sql::<D>(&format!(
            "SELECT {INBOX_COLUMNS} FROM inbox WHERE tenant_id = ? AND source = ? AND sequence_key = ? \
             AND state = 'held' AND sequence = ? LIMIT 1"
        ))
        .bind(tenant)
        .bind(source)
        .bind(key)
        .bind(next)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(ev) = row.as_ref().map(inbox_from_row).transpose()? else {
            break;
        };
        set_state::<D>(
            &mut *conn,
            (tenant, source, &ev.event_id),
            "accepted",
            None,
            false,
        )
        .await?;
        if deliver {
            queue_delivery::<D>(&mut *conn, &ev, false, now).await?;
        }
        released.push(ev.event_id);
        last = next;
    }
    set_sequence::<D>(conn, (tenant, source, key), last, now).await?;
    Ok((released, last))
}

/// What an operator does with a quarantined event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineAction {
    /// Deliver it (flagged as after a gap) and go on past it.
    Release,
    /// Drop it and go on past it.
    Drop,
}

/// What an operator's decision on a quarantined event came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuarantineDecision {
    /// Decided: the event ids changed, the decided one first, then the
    /// held events released behind it.
    Decided(Vec<String>),
    /// The event is in another state (`accepted`, `held`, `dropped`…),
    /// named here; nothing changed.
    NotQuarantined(String),
    /// No such event; nothing changed.
    Missing,
}

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::receive_inbox`].
    pub(crate) async fn receive_inbox(
        &self,
        ev: &NewInboxEvent<'_>,
    ) -> Result<Received, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        tx.add_bytes(ev.payload.len());
        // The indexed insert a duplicate costs, and the read of the
        // stored event (its delivery) by its key.
        if !insert_inbox_row::<D>(&mut tx, ev, now).await? {
            let outbox_event_id = fetch_inbox::<D>(&mut tx, (ev.tenant, ev.source, ev.event_id))
                .await?
                .and_then(|stored| stored.outbox_event_id);
            tx.commit().await?;
            return Ok(Received::Duplicate { outbox_event_id });
        }
        let id = (ev.tenant, ev.source, ev.event_id);
        let mut released = Vec::new();
        let state = match ev.ordering {
            None => "accepted",
            Some(o) => {
                let last = lock_sequence::<D>(&mut tx, (ev.tenant, ev.source), &o, now).await?;
                if o.sequence <= last {
                    "stale"
                } else if o.gaps && o.sequence > last.saturating_add(1) {
                    "held"
                } else {
                    "accepted"
                }
            }
        };
        let mut outbox_event_id = None;
        if state == "accepted" {
            let stored = fetch_inbox::<D>(&mut tx, id)
                .await?
                .ok_or(sqlx::Error::RowNotFound)?;
            if ev.deliver {
                outbox_event_id = Some(queue_delivery::<D>(&mut tx, &stored, false, now).await?);
            }
            if let Some(o) = ev.ordering {
                released = release_held::<D>(
                    &mut tx,
                    (ev.tenant, ev.source, o.key),
                    o.sequence,
                    ev.deliver,
                    now,
                )
                .await?
                .0;
            }
        } else {
            let held = (state == "held")
                .then(|| now.saturating_add(ev.ordering.map_or(0, |o| o.reorder_window_ms)));
            set_state::<D>(&mut tx, id, state, held, false).await?;
        }
        // What the event says of the operation it names lands in this
        // commit too: a crash never leaves the event stored and its
        // resolution undone (a redelivery would be a duplicate).
        let resolution = match ev.resolve {
            Some(r) => {
                let subs = self.subscriptions.load_full();
                resolve_on::<D>(&mut tx, &subs, ev.tenant, r, now).await?
            }
            None => None,
        };
        if let Some(r) = &resolution {
            if r.resolved == Resolved::Completed
                && crate::config::compensated_id(&r.operation_id).is_some()
            {
                // A compensation completed: its original became COMPENSATED.
                tx.changes_terminal();
            }
            sql::<D>(
                "UPDATE inbox SET operation_id = ?, resolution = ? WHERE tenant_id = ? AND source = ? AND event_id = ?",
            )
            .bind(&r.operation_id)
            .bind(clean(&r.note))
            .bind(ev.tenant)
            .bind(ev.source)
            .bind(ev.event_id)
            .execute(&mut tx)
            .await?;
        }
        crate::failpoint::hit("before-inbox-commit");
        tx.commit().await?;
        Ok(Received::Stored {
            state: state.into(),
            released,
            outbox_event_id,
            resolution,
        })
    }

    /// See [`crate::ledger::Ledger::held_due`].
    pub(crate) async fn held_due(&self, limit: u32) -> Result<Vec<InboxEvent>, LedgerError> {
        let now = self.now().await?;
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT {INBOX_COLUMNS} FROM inbox WHERE state = 'held' AND held_until <= ? ORDER BY held_until LIMIT ?"
        ))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        Ok(rows.iter().map(inbox_from_row).collect::<Result<_, _>>()?)
    }

    /// See [`crate::ledger::Ledger::close_gap`].
    pub(crate) async fn close_gap(
        &self,
        (tenant, source, key): (&str, &str, &str),
        quarantine: bool,
        deliver: bool,
    ) -> Result<Vec<String>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let o = Ordering {
            key,
            sequence: 0,
            gaps: true,
            start: 1,
            reorder_window_ms: 0,
        };
        let last = lock_sequence::<D>(&mut tx, (tenant, source), &o, now).await?;
        // The lowest held event of the key: the gap is before it.
        let row = sql::<D>(&format!(
            "SELECT {INBOX_COLUMNS} FROM inbox WHERE tenant_id = ? AND source = ? AND sequence_key = ? \
             AND state = 'held' ORDER BY sequence LIMIT 1"
        ))
        .bind(tenant)
        .bind(source)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(ev) = row.as_ref().map(inbox_from_row).transpose()? else {
            tx.commit().await?;
            return Ok(Vec::new());
        };
        if ev.held_until.is_some_and(|t| t > now) {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let id = (tenant, source, ev.event_id.as_str());
        if quarantine {
            set_state::<D>(&mut tx, id, "quarantined", None, false).await?;
            tx.commit().await?;
            return Ok(vec![ev.event_id]);
        }
        set_state::<D>(&mut tx, id, "accepted", None, true).await?;
        if deliver {
            queue_delivery::<D>(&mut tx, &ev, true, now).await?;
        }
        let seq = ev.sequence.unwrap_or(last).max(last);
        let (mut done, _) =
            release_held::<D>(&mut tx, (tenant, source, key), seq, deliver, now).await?;
        tx.commit().await?;
        done.insert(0, ev.event_id);
        Ok(done)
    }

    /// See [`crate::ledger::Ledger::decide_quarantined`].
    pub(crate) async fn decide_quarantined(
        &self,
        (tenant, source, event_id): (&str, &str, &str),
        action: QuarantineAction,
        deliver: bool,
        actor: &str,
    ) -> Result<QuarantineDecision, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let n = sql::<D>(
            "UPDATE inbox SET state = ?, gap = ?, decided_by = ?, decided_at = ? \
             WHERE tenant_id = ? AND source = ? AND event_id = ? AND state = 'quarantined'",
        )
        .bind(match action {
            QuarantineAction::Release => "accepted",
            QuarantineAction::Drop => "dropped",
        })
        .bind(action == QuarantineAction::Release)
        .bind(clean(actor))
        .bind(now)
        .bind(tenant)
        .bind(source)
        .bind(event_id)
        .execute(&mut *tx)
        .await?;
        if n != 1 {
            let found = fetch_inbox::<D>(&mut tx, (tenant, source, event_id)).await?;
            tx.commit().await?;
            return Ok(match found {
                Some(ev) => QuarantineDecision::NotQuarantined(ev.state),
                None => QuarantineDecision::Missing,
            });
        }
        let ev = fetch_inbox::<D>(&mut tx, (tenant, source, event_id))
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        let mut done = vec![ev.event_id.clone()];
        if action == QuarantineAction::Release && deliver {
            queue_delivery::<D>(&mut tx, &ev, true, now).await?;
        }
        if let (Some(key), Some(seq)) = (&ev.sequence_key, ev.sequence) {
            let o = Ordering {
                key,
                sequence: seq,
                gaps: true,
                start: 1,
                reorder_window_ms: 0,
            };
            let last = lock_sequence::<D>(&mut tx, (tenant, source), &o, now).await?;
            let (more, _) =
                release_held::<D>(&mut tx, (tenant, source, key), seq.max(last), deliver, now)
                    .await?;
            done.extend(more);
        }
        tx.commit().await?;
        Ok(QuarantineDecision::Decided(done))
    }
}
