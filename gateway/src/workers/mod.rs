//! Background loops, each started by [`crate::server`] and stopped by its
//! shutdown signal: the reconciler (read-back of UNKNOWN operations and
//! lease expiry), the outbox relay (signed webhooks) and the retention
//! sweeper.

pub mod inbox;
pub mod outbox;
pub mod reconciler;
pub mod sweeper;

/// Why a worker's round failed (it is logged; the loop goes on).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The effect ledger failed.
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
    /// An outbound request could not be built.
    #[error("request: {0}")]
    Request(String),
}
