//! Writes of the reconciler and of operators: expire a lease, take a
//! reconciliation lease, attempt again, unschedule, audit, requeue.

use super::super::command::{
    self, ExpireLease, LeaseForReconcile, Reattempt, Requeue, SelfAudit, Unschedule,
};
use super::super::dialect::Dialect;
use super::super::{Claim, LedgerError};
use super::Store;

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::expire_lease`].
    pub(crate) async fn expire_lease(&self, cmd: &ExpireLease<'_>) -> Result<bool, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            return Ok(false);
        };
        let reported = super::events::Reported {
            op: cmd.op,
            from: Some(super::super::State::Executing),
            to: super::super::State::Unknown,
            version: applied.version,
            dead_letter: false,
            reason: "lease expired: the owner may have sent the request",
            provider_reference: None,
        };
        let subs = self.subscriptions.load_full();
        super::events::report::<D>(&mut tx, &subs, &reported, now).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// See [`crate::ledger::Ledger::lease_for_reconcile`].
    pub(crate) async fn lease_for_reconcile(
        &self,
        cmd: &LeaseForReconcile<'_>,
    ) -> Result<Option<Claim>, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            return Ok(None);
        };
        tx.commit().await?;
        Ok(Some(applied.claim(cmd.lease.expires_at(now))))
    }

    /// See [`crate::ledger::Ledger::reattempt`].
    pub(crate) async fn reattempt(
        &self,
        cmd: &Reattempt<'_>,
    ) -> Result<Option<Claim>, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            self.count_stale_fence();
            return Ok(None);
        };
        tx.commit().await?;
        Ok(Some(applied.claim(cmd.lease.expires_at(now))))
    }

    /// See [`crate::ledger::Ledger::unschedule`].
    pub(crate) async fn unschedule(&self, cmd: &Unschedule<'_>) -> Result<bool, LedgerError> {
        command::check(cmd)?;
        // No transaction: one statement, and the time is not used.
        let mut conn = self.writer.begin(0).await?;
        let applied = command::apply::<D, _>(&mut conn, cmd, 0).await?.is_some();
        conn.commit().await?;
        Ok(applied)
    }

    /// See [`crate::ledger::Ledger::audit`].
    pub(crate) async fn audit(&self, cmd: &SelfAudit<'_>) -> Result<bool, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        // Any state, terminal ones included.
        tx.changes_terminal();
        if command::apply::<D, _>(&mut tx, cmd, now).await?.is_none() {
            tx.unchanged();
            return Ok(false);
        }
        tx.commit().await?;
        Ok(true)
    }

    /// See [`crate::ledger::Ledger::requeue`]; returns the new version.
    pub(crate) async fn requeue(&self, cmd: &Requeue<'_>) -> Result<Option<i64>, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        // A FAILED dead letter leaves its terminal state.
        tx.changes_terminal();
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            return Ok(None);
        };
        // Back to UNKNOWN: `operation.unknown`, in this transaction.
        let reported = super::events::Reported {
            op: cmd.op,
            from: Some(super::super::State::Failed),
            to: cmd.to,
            version: applied.version,
            dead_letter: false,
            reason: cmd.reason,
            provider_reference: None,
        };
        let subs = self.subscriptions.load_full();
        super::events::report::<D>(&mut tx, &subs, &reported, now).await?;
        tx.commit().await?;
        Ok(Some(applied.version))
    }
}
