//! [`Ledger`]'s compensation methods.

use super::super::compensation::{CompensationLink, CompensationReservation, NewCompensation};
use super::super::{LedgerError, NewOperation};
use super::{Db, Ledger};

impl Ledger {
    /// Reserves the compensating operation `new` (its id
    /// `<id>#compensation`) of COMPLETED operation `link.operation_id`, in
    /// one transaction with a COMPLETED → COMPLETED audit transition on the
    /// original (the operator and the reason) and the link the
    /// compensation's completion reads. `new.awaiting_approval` starts it
    /// AWAITING_APPROVAL with `new.approval` (kind `request`: bound to the
    /// compensation's id, method, path and fingerprint).
    ///
    /// Returns [`CompensationReservation::Existing`] unchanged when the
    /// compensation exists (asking twice never makes a second one), and
    /// [`CompensationReservation::NotCompleted`] with the original's state,
    /// writing nothing, when the original is not COMPLETED.
    ///
    /// When the compensation is later recorded COMPLETED (by its attempt,
    /// a read-back or an operator), the same transaction moves the
    /// original COMPLETED → COMPENSATED.
    pub async fn reserve_compensation(
        &self,
        new: &NewOperation,
        link: &NewCompensation,
    ) -> Result<CompensationReservation, LedgerError> {
        dispatch!(self, reserve_compensation(new, link))
    }

    /// The compensation recorded for operation `operation_id` of `tenant`,
    /// if one was asked for.
    pub async fn compensation(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<CompensationLink>, LedgerError> {
        dispatch!(self, compensation(tenant, operation_id))
    }
}
