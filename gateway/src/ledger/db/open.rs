//! Opening a [`Ledger`]: the backend its storage settings name, the
//! SQLite file's lock for a gateway that serves it, and the migrations.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::lock::lock_sqlite_file;
use super::{Db, Ledger};
use crate::config::{Backend, StorageSpec};
use crate::ledger::postgres::{PgDialect, PgSettings};
use crate::ledger::sqlite::SqliteDialect;
use crate::ledger::store::{BatchLimits, Store};
use crate::ledger::{Clock, LedgerClock, LedgerError};

impl Ledger {
    /// Opens (creating if missing) the SQLite file at `path` and applies the
    /// embedded migrations (`migrations/sqlite`).
    ///
    /// `max_read_connections` sizes the read pool; `busy_timeout_ms` is how
    /// long a statement waits for a lock held by another process.
    ///
    /// Errors: the file can't be opened or a migration fails.
    pub async fn open(
        path: &Path,
        max_read_connections: u32,
        busy_timeout_ms: u64,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let storage = StorageSpec {
            path: path.to_path_buf(),
            max_read_connections,
            busy_timeout_ms,
            ..StorageSpec::default()
        };
        Self::open_storage(&storage, clock).await
    }

    /// What [`Ledger::open_storage`] refuses of `[storage]` before it opens
    /// anything (`check-config` runs it): the URL's scheme, and a SQLite
    /// file that doesn't exist in a folder that doesn't either. It neither
    /// creates nor connects to anything.
    ///
    /// Errors: [`LedgerError::Config`] for a URL of another scheme,
    /// [`LedgerError::NoFolder`].
    pub fn check_storage(storage: &StorageSpec) -> Result<(), LedgerError> {
        match storage.backend().map_err(LedgerError::Config)? {
            Backend::Sqlite(path) => super::lock::require_folder(&path),
            Backend::Postgres(_) => Ok(()),
        }
    }

    /// Opens the ledger `[storage]` names (SQLite file or PostgreSQL URL)
    /// and applies that backend's embedded migrations (`migrations/sqlite`
    /// or `migrations/postgres`).
    ///
    /// `clock` stamps SQLite rows. PostgreSQL ignores it: time comes from
    /// the database clock, and [`Ledger::clock`] follows that.
    ///
    /// Errors: [`LedgerError::NoFolder`] for a SQLite file in a folder that
    /// doesn't exist; the URL is invalid, the database can't be reached within
    /// `acquire_timeout_ms`, or a migration fails.
    pub async fn open_storage(
        storage: &StorageSpec,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let call_timeout = Duration::from_millis(storage.call_timeout_ms.max(1));
        let mut sqlite_path = None;
        let db = match storage.backend().map_err(LedgerError::Config)? {
            Backend::Sqlite(path) => {
                super::lock::require_folder(&path)?;
                sqlite_path = Some(path.clone());
                let storage = StorageSpec {
                    path,
                    ..storage.clone()
                };
                Db::Sqlite(Store::<SqliteDialect>::open(&storage, LedgerClock::new(clock)).await?)
            }
            Backend::Postgres(url) => {
                let settings = PgSettings {
                    url: &url,
                    schema: storage.schema.as_deref(),
                    max_connections: storage.max_connections,
                    min_connections: storage.min_connections,
                    acquire_timeout_ms: storage.acquire_timeout_ms,
                    statement_timeout_ms: storage.statement_timeout_ms,
                    idle_timeout_ms: storage.idle_timeout_ms,
                    batch: BatchLimits {
                        // Leave at least one connection for reads.
                        connections: storage
                            .write_connections
                            .min(storage.max_connections.saturating_sub(1))
                            .max(1) as usize,
                        // The writer's own statements are bounded like a
                        // call, so a stalled connection never holds a
                        // lane.
                        stall: Some(call_timeout),
                        ..crate::ledger::sqlite::batch_limits(storage)
                    },
                };
                let clock = LedgerClock::new(Arc::new(crate::ledger::SystemClock));
                let open = Store::<PgDialect>::open(&settings, clock);
                let limit = call_timeout.max(Duration::from_millis(storage.acquire_timeout_ms));
                match tokio::time::timeout(limit, open).await {
                    Ok(store) => Db::Postgres(store?),
                    Err(_) => {
                        return Err(LedgerError::Unreachable {
                            url: crate::config::redact_url(&url),
                            cause: format!("no answer within {} ms", limit.as_millis()),
                        });
                    }
                }
            }
        };
        let clock: Arc<dyn Clock> = match &db {
            Db::Sqlite(s) => s.clock.clone(),
            Db::Postgres(p) => p.clock.clone(),
        };
        Ok(Self {
            db,
            clock,
            call_timeout,
            replay: Arc::new(crate::ledger::replay_cache::ReplayCache::new(
                usize::try_from(storage.replay_cache_bytes).unwrap_or(usize::MAX),
            )),
            settle: Arc::default(),
            sqlite_path,
            exclusive: Arc::default(),
        })
    }

    /// Takes a SQLite ledger for this process alone: an exclusive lock on
    /// the file `<ledger file>.lock` beside it, held until the last clone
    /// of this ledger is dropped (or the process ends, however it ends).
    /// `effectgate serve` takes it at start, so a second gateway on the
    /// same file fails at once instead of sharing a ledger made for one
    /// writer; the CLI's read commands (`ledger show`, `ledger list`, …)
    /// don't take it. While it is held, a duplicate of a cached COMPLETED or
    /// FAILED operation is answered without reading the ledger (see the
    /// replay cache: every commit of this process that changes or deletes
    /// such a row is counted). Calling it again is a no-op; on PostgreSQL
    /// it does nothing (several instances share that ledger).
    ///
    /// Errors: [`LedgerError::InUse`] when another process (or another
    /// ledger of this process) holds the lock; [`LedgerError::LockFile`]
    /// when the lock file can't be opened or locked.
    pub fn hold_exclusively(&self) -> Result<(), LedgerError> {
        let Some(path) = &self.sqlite_path else {
            return Ok(());
        };
        let mut slot = self.exclusive.slot();
        if slot.is_none() {
            self.exclusive.hold(&mut slot, lock_sqlite_file(path)?);
        }
        Ok(())
    }

    /// [`Ledger::open_storage`] for a gateway that serves the ledger: a
    /// SQLite file's lock ([`Ledger::hold_exclusively`]) is taken before
    /// the file is opened or migrated, so a second gateway stops before it
    /// touches a ledger another one serves. PostgreSQL: the same as
    /// [`Ledger::open_storage`].
    ///
    /// Errors: as [`Ledger::open_storage`] and [`Ledger::hold_exclusively`].
    pub async fn open_exclusive(
        storage: &StorageSpec,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let lock = match storage.backend().map_err(LedgerError::Config)? {
            Backend::Sqlite(path) => Some(lock_sqlite_file(&path)?),
            Backend::Postgres(_) => None,
        };
        let ledger = Self::open_storage(storage, clock).await?;
        if let Some(file) = lock {
            let mut slot = ledger.exclusive.slot();
            ledger.exclusive.hold(&mut slot, file);
        }
        Ok(ledger)
    }

    /// Lets go of the lock [`Ledger::hold_exclusively`] took (a gateway
    /// that shut down, before another one starts on the file in the same
    /// process); the replay cache checks the ledger again from then on.
    pub fn release_exclusive(&self) {
        self.exclusive.release();
    }

    /// Applies the embedded migrations only (`effectgate migrate`), on
    /// either backend.
    ///
    /// Errors: as [`Ledger::open_storage`].
    pub async fn migrate(storage: &StorageSpec) -> Result<(), LedgerError> {
        Self::open_storage(storage, Arc::new(crate::ledger::SystemClock))
            .await
            .map(|_| ())
    }
}
