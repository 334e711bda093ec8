//! Compensation: the link between an operation and the compensating
//! operation that undoes it (`<id>#compensation`).

use serde::Serialize;

use super::{Operation, State};

/// What a compensation's reservation records besides the compensating
/// operation itself.
#[derive(Debug, Clone)]
pub struct NewCompensation {
    /// The operation to undo (COMPLETED).
    pub operation_id: String,
    /// The operator who asked.
    pub requested_by: String,
    /// The operator's reason.
    pub reason: String,
    /// The original's provider reference the compensation was built with.
    pub reference: Option<String>,
}

/// A recorded compensation request.
#[derive(Debug, Clone, Serialize)]
pub struct CompensationLink {
    /// The operation it undoes.
    pub operation_id: String,
    /// The compensating operation (`<id>#compensation`).
    pub compensation_id: String,
    /// The operator who asked.
    pub requested_by: String,
    /// The operator's reason.
    pub reason: String,
    /// The original's provider reference it was built with.
    pub reference: Option<String>,
    /// When it was asked for (ms since epoch).
    pub created_at: i64,
}

/// Result of [`crate::ledger::Ledger::reserve_compensation`].
#[derive(Debug)]
pub enum CompensationReservation {
    /// This call created the compensating operation (RESERVED, or
    /// AWAITING_APPROVAL with its approval).
    Created(Operation),
    /// It existed already; nothing was changed.
    Existing(Operation),
    /// The original is not COMPLETED (in this state); nothing was written.
    NotCompleted(Option<State>),
    /// The compensation that exists belongs to an earlier incarnation of
    /// the original's key (reused after its retention) and is not finished
    /// or is a dead letter, so it is neither this effect's compensation nor
    /// forgotten; nothing was written. An operator settles it first.
    EarlierIncarnation(Operation),
}
