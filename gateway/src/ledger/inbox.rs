//! The inbox: provider webhooks received once, ordered per sequence key.
//!
//! An event is one row of `inbox`, keyed `(tenant, source, event id)`: the
//! insert is `INSERT … ON CONFLICT DO NOTHING`, so a redelivery inserts
//! nothing and is answered as a duplicate. In the same transaction the
//! event's place in its sequence is decided (`inbox_sequences` holds the
//! last applied sequence per key) and, if it is accepted, its delivery is
//! queued in the outbox. States:
//!
//! - `accepted`: applied and (when the source delivers) queued for delivery;
//! - `stale`: older than, or as old as, the last applied one of its key;
//!   never delivered;
//! - `held`: after a gap, waiting up to the source's `reorder_window_ms`;
//! - `quarantined`: the gap didn't fill and the source quarantines;
//!   waits for an operator to release (deliver) or drop it;
//! - `dropped`: an operator dropped it.

use serde::Serialize;

/// The states of an inbox event, as stored.
pub const INBOX_STATES: [&str; 5] = ["accepted", "stale", "held", "quarantined", "dropped"];

/// What a received event records.
#[derive(Debug, Clone)]
pub struct NewInboxEvent<'a> {
    /// Tenant of the source.
    pub tenant: &'a str,
    /// Source name.
    pub source: &'a str,
    /// The provider's event id.
    pub event_id: &'a str,
    /// Its type, when the body names one.
    pub event_type: Option<&'a str>,
    /// The body as received (JSON text).
    pub payload: &'a str,
    /// Queue its delivery to the tenant when accepted.
    pub deliver: bool,
    /// Its ordering, when the source orders events.
    pub ordering: Option<Ordering<'a>>,
}

/// Where an event sits in its sequence.
#[derive(Debug, Clone, Copy)]
pub struct Ordering<'a> {
    /// The entity it is about.
    pub key: &'a str,
    /// Its position for that key.
    pub sequence: i64,
    /// A skipped number is a gap (counters); otherwise only older is stale.
    pub gaps: bool,
    /// The first sequence of a key never seen.
    pub start: i64,
    /// How long (ms) it is held after a gap.
    pub reorder_window_ms: i64,
}

/// What receiving an event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Stored for the first time, in this state (`accepted`, `stale`,
    /// `held`); `released` more held events of its key were accepted
    /// behind it.
    Stored {
        /// Its state.
        state: String,
        /// Held events of its key it released, in order.
        released: Vec<String>,
        /// The outbox event id its delivery was queued under, if any.
        outbox_event_id: Option<String>,
    },
    /// Seen before (within the dedupe window): nothing changed.
    Duplicate,
}

/// One stored inbox event.
#[derive(Debug, Clone, Serialize)]
pub struct InboxEvent {
    /// Tenant.
    pub tenant_id: String,
    /// Source name.
    pub source: String,
    /// The provider's event id.
    pub event_id: String,
    /// Its type.
    pub event_type: Option<String>,
    /// `accepted`, `stale`, `held`, `quarantined`, `dropped`.
    pub state: String,
    /// Sequence key, when ordered.
    pub sequence_key: Option<String>,
    /// Sequence, when ordered.
    pub sequence: Option<i64>,
    /// Delivered although an earlier event of its key never came.
    pub gap: bool,
    /// Received (ms since epoch).
    pub received_at: i64,
    /// Held until (ms since epoch), while held.
    pub held_until: Option<i64>,
    /// The outbox event its delivery went out as (the consumer's
    /// `webhook-id`).
    pub outbox_event_id: Option<String>,
    /// The operation a `resolves` rule named.
    pub operation_id: Option<String>,
    /// What the event did to it (`completed`, `read-back`, `ignored: …`).
    pub resolution: Option<String>,
    /// The operator who released or dropped it (quarantined events).
    pub decided_by: Option<String>,
    /// When (ms since epoch).
    pub decided_at: Option<i64>,
    /// The body as received.
    #[serde(skip)]
    pub payload: String,
}

/// The outbox event id of inbox event `(tenant, source, event_id)`:
/// `evt_<32 hex of sha256>`, the same on every redelivery and restart, so
/// a consumer dedupes by it (`webhook-id`).
pub fn delivery_id(tenant: &str, source: &str, event_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [tenant, source, event_id] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!("evt_{}", &hex::encode(h.finalize())[..32])
}
