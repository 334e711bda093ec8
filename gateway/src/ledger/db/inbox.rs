//! [`Ledger`]'s inbox methods.

use super::super::LedgerError;
use super::super::inbox::{InboxEvent, NewInboxEvent, Received};
use super::super::store::{QuarantineAction, QuarantineDecision};
use super::{Db, Ledger};

impl Ledger {
    /// Sets the operation events each tenant receives: every transition
    /// of a subscribed type (see [`super::super::operation_event_type`])
    /// writes its event to the outbox in the transition's transaction.
    pub fn set_event_subscriptions(&self, subs: super::super::Subscriptions) {
        match &self.db {
            Db::Sqlite(s) => s.set_subscriptions(subs),
            Db::Postgres(p) => p.set_subscriptions(subs),
        }
    }

    /// Receives one verified webhook event, in one transaction: the
    /// deduplicating insert on `(tenant, source, event id)` (a redelivery
    /// inserts nothing: [`Received::Duplicate`]); with an ordering, the
    /// decision against the last applied sequence of its key (older or
    /// equal: `stale`; after a gap: `held` until now + the reorder
    /// window; else `accepted`, releasing the held events that follow it);
    /// for each accepted event (when `ev.deliver`), its delivery in the
    /// outbox under [`super::super::delivery_id`]; and, for any event
    /// stored (accepted, stale or held) with `ev.resolve`, what it says of
    /// the operation the first matching rule names (see
    /// [`super::super::Resolving`]), noted on its row. Returns
    /// [`Received::Stored`] with that resolution.
    pub async fn receive_inbox(&self, ev: &NewInboxEvent<'_>) -> Result<Received, LedgerError> {
        dispatch!(self, receive_inbox(ev))
    }

    /// Held events whose reorder window has ended, oldest hold first, at
    /// most `limit`.
    pub async fn held_due(&self, limit: u32) -> Result<Vec<InboxEvent>, LedgerError> {
        dispatch!(self, held_due(limit))
    }

    /// Declares the gap before the lowest held event of sequence key
    /// `(tenant, source, key)` permanent, if that event's window has
    /// ended: it is quarantined (`quarantine`), or accepted with the gap
    /// flag and delivered (when `deliver`), releasing the held events
    /// behind it. Returns the event ids it changed, in order.
    pub async fn close_gap(
        &self,
        id: (&str, &str, &str),
        quarantine: bool,
        deliver: bool,
    ) -> Result<Vec<String>, LedgerError> {
        dispatch!(self, close_gap(id, quarantine, deliver))
    }

    /// An operator's decision on quarantined event `(tenant, source,
    /// event_id)`: release (accepted with the gap flag, delivered when
    /// `deliver`) or drop; either way its key goes on past it, releasing
    /// the held events behind it. The row keeps `actor` and the time.
    /// Returns the event ids changed, or, with nothing changed, the state
    /// the event is in, or that there is none ([`QuarantineDecision`]).
    pub async fn decide_quarantined(
        &self,
        id: (&str, &str, &str),
        action: QuarantineAction,
        deliver: bool,
        actor: &str,
    ) -> Result<QuarantineDecision, LedgerError> {
        dispatch!(self, decide_quarantined(id, action, deliver, actor))
    }

    /// Inbox events of `tenant`, newest first, optionally of one source
    /// and state, at most `limit`.
    pub async fn inbox_events(
        &self,
        tenant: &str,
        source: Option<&str>,
        state: Option<&str>,
        limit: u32,
    ) -> Result<Vec<InboxEvent>, LedgerError> {
        dispatch!(self, inbox_events(tenant, source, state, limit))
    }

    /// Inbox events that named operation `operation_id` of `tenant`, in
    /// the order received.
    pub async fn inbox_for_operation(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<InboxEvent>, LedgerError> {
        dispatch!(self, inbox_for_operation(tenant, operation_id))
    }

    /// `(source, state, count, oldest received_at)` of the held and
    /// quarantined events, for the gauges.
    pub async fn inbox_gauges(
        &self,
    ) -> Result<Vec<(String, String, i64, Option<i64>)>, LedgerError> {
        dispatch!(self, inbox_gauges())
    }

    /// Deletes at most `batch` events of `(tenant, source)` received more
    /// than `window_ms` ago (never held or quarantined ones). Returns how
    /// many.
    pub async fn sweep_inbox(
        &self,
        id: (&str, &str),
        window_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        dispatch!(self, sweep_inbox(id, window_ms, batch))
    }

    /// Deletes at most `batch` ordering rows ("last applied" sequence per
    /// key) of `(tenant, source)` whose key saw no event for more than
    /// `window_ms` (never a key with a held or quarantined event). A key
    /// swept starts over: its next event is compared with the source's
    /// `sequence_start`. Returns how many.
    pub async fn sweep_inbox_sequences(
        &self,
        id: (&str, &str),
        window_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        dispatch!(self, sweep_inbox_sequences(id, window_ms, batch))
    }

    /// The last applied sequence of sequence key `(tenant, source, key)`
    /// (`sequence_start - 1` while none was), or `None` for a key never
    /// seen or swept.
    pub async fn inbox_sequence(&self, id: (&str, &str, &str)) -> Result<Option<i64>, LedgerError> {
        dispatch!(self, inbox_sequence(id))
    }
}
