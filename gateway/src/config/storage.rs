//! `[storage]`: which effect ledger the gateway uses (a SQLite file or a
//! PostgreSQL database), its pool and timeouts.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// `[storage]`: where the effect ledger lives.
///
/// SQLite (the default) is one file for one gateway process. PostgreSQL
/// is for several instances sharing one ledger: set `url =
/// "postgres://user@host:5432/db"`. The backend is chosen by the URL's
/// scheme (`sqlite://…` or `postgres://…` / `postgresql://…`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageSpec {
    /// Ledger URL: `sqlite://<path>` or `postgres://…`. When unset, the
    /// SQLite file at `path`.
    pub url: Option<String>,
    /// SQLite file path, default `effectgate.db`. A relative path in a
    /// config file is relative to that file's folder (without a file: to the
    /// working directory). Created (with its migrations) if missing.
    pub path: PathBuf,
    /// SQLite: maximum connections in the read pool (writes use one connection,
    /// which is how SQLite serialises writers anyway). Default 4.
    pub max_read_connections: u32,
    /// SQLite: how long a statement waits for a locked database, in ms. Default 5000.
    pub busy_timeout_ms: u64,
    /// SQLite only: `synchronous` mode: `full` (default) fsyncs the WAL
    /// after every batch's `COMMIT` and answers the batch's writes only
    /// then, so nothing a caller was told is lost even on power loss (the
    /// sync runs beside the next batch, not on the write connection's
    /// path); `normal` (WAL) never fsyncs a commit: it survives a crash of
    /// the gateway process but may lose the last transitions on power loss
    /// or an OS crash.
    pub synchronous: Synchronous,
    /// PostgreSQL: the schema holding the ledger's tables, created if
    /// missing. Default: the connection's `search_path` (usually `public`).
    pub schema: Option<String>,
    /// PostgreSQL: most connections this instance opens. Default 16.
    pub max_connections: u32,
    /// PostgreSQL: connections kept open when idle. Default 1.
    pub min_connections: u32,
    /// PostgreSQL: how long a ledger call waits for a free connection (or
    /// for a new one to connect), in ms. When the database is unreachable,
    /// an effectful request fails with 503 after this long. Default 2000.
    pub acquire_timeout_ms: u64,
    /// PostgreSQL: the server-side `statement_timeout` of every connection,
    /// in ms. Default 5000.
    pub statement_timeout_ms: u64,
    /// PostgreSQL: an idle connection is closed after this many ms (0:
    /// never). Default 600000.
    pub idle_timeout_ms: u64,
    /// PostgreSQL: the longest one ledger call may take end to end, in ms,
    /// including waiting for a connection; past it the call fails (503 for
    /// a request) even when the network hangs without an error. Default 10000.
    pub call_timeout_ms: u64,
    /// Most ledger writes committed together (one transaction, one
    /// fsync): the writer takes every write waiting, up to this many (on
    /// SQLite each after the first in its own savepoint; on PostgreSQL
    /// without, and a write that fails undoes the batch, whose other
    /// writes run again).
    /// Default 256; at least 1 (1: one commit per write).
    pub write_batch_max: u32,
    /// PostgreSQL: write connections, each committing its own batches
    /// (group commit per connection), out of `max_connections`; a write
    /// takes the next one in turn, or the next idle one. Default 4; at
    /// least 1; at most `max_connections - 1` are used (one is left for
    /// reads). SQLite always writes on one connection.
    pub write_connections: u32,
    /// Body bytes (request and response bodies) past which a batch of
    /// writes is committed at once, in bytes. Default 16777216 (16 MiB).
    pub write_batch_bytes: u64,
    /// Bytes of terminal answers (COMPLETED, FAILED) kept in memory to
    /// answer duplicates without reading the row and its bodies from the
    /// ledger (an LRU by tenant, operation id and fingerprint, checked
    /// against the row's version on every use). Default 67108864 (64 MiB);
    /// 0 turns it off.
    pub replay_cache_bytes: u64,
    /// SQLite: the write connection's page cache, in bytes (`PRAGMA
    /// cache_size`): the pages of the tables and indexes that writes
    /// touch. Callers' keys arrive in no order, so the key's unique index
    /// is written all over (the rows and their history are filed by
    /// operation number, in order); a page not in this cache is read from
    /// the file again.
    /// The checkpointer's connection has one of the same size. Default
    /// 2097152 (2 MiB; SQLite's own is 2,048,000), rounded down to KiB;
    /// 0: SQLite's smallest.
    pub page_cache_bytes: u64,
    /// SQLite: WAL pages (4 KiB each) that bound the WAL. Each time it has
    /// grown by another quarter of this, a `PASSIVE` checkpoint (the
    /// writer never waits for it) moves what no reader needs into the
    /// ledger file, on a thread and connection of its own; at this many
    /// the writer checkpoints inside its own commit and the WAL starts
    /// over. Default 1000 (SQLite's own); at least 1.
    pub wal_checkpoint_pages: u32,
}

/// The ledger backend a [`StorageSpec`] selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL database (the URL as given).
    Postgres(String),
}

impl StorageSpec {
    /// The backend `url` (or, without one, `path`) selects.
    ///
    /// Errors: a URL whose scheme is neither `sqlite` nor `postgres` /
    /// `postgresql` (the message names `storage.url`).
    pub fn backend(&self) -> Result<Backend, String> {
        let Some(url) = self.url.as_deref() else {
            return Ok(Backend::Sqlite(self.path.clone()));
        };
        if let Some(rest) = url.strip_prefix("sqlite://") {
            return Ok(Backend::Sqlite(PathBuf::from(rest)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Backend::Postgres(url.to_owned()));
        }
        Err(format!(
            "unsupported ledger URL scheme in {:?}; expected sqlite://<path> or postgres://…",
            redact_url(url)
        ))
    }

    /// A printable name of the ledger: the SQLite path, or the PostgreSQL
    /// URL without its password.
    pub fn display_name(&self) -> String {
        match self.backend() {
            Ok(Backend::Sqlite(p)) => p.display().to_string(),
            Ok(Backend::Postgres(u)) => match &self.schema {
                Some(s) => format!("{} (schema {s})", redact_url(&u)),
                None => redact_url(&u),
            },
            Err(_) => self.url.as_deref().map(redact_url).unwrap_or_default(),
        }
    }
}

/// The folder of a SQLite ledger file `path` when neither the file nor
/// that folder exists: SQLite creates the file but not its folder, and its
/// own error ("unable to open database file") names neither. `None` when
/// the file exists, its folder does, or `path` names no folder.
pub fn missing_folder(path: &Path) -> Option<&Path> {
    let folder = path.parent().filter(|f| !f.as_os_str().is_empty())?;
    (!path.exists() && !folder.is_dir()).then_some(folder)
}

/// What is said of a ledger file `path` whose `folder` does not exist
/// (see [`missing_folder`]), after the field that named it.
pub fn missing_folder_text(path: &Path, folder: &Path) -> String {
    format!(
        "{}: the folder {} does not exist; the gateway creates the ledger file but not its \
         folder (create the folder, or name another path)",
        path.display(),
        folder.display()
    )
}

/// `url` with any password (in the user info or a `password` query
/// parameter) replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Ok(mut u) = url::Url::parse(url) else {
        return "<unparsable URL>".into();
    };
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    if u.query_pairs()
        .any(|(k, _)| k.eq_ignore_ascii_case("password"))
    {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if k.eq_ignore_ascii_case("password") {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// SQLite durability mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// fsync every commit.
    #[default]
    Full,
    /// fsync at checkpoints only.
    Normal,
}

impl Default for StorageSpec {
    fn default() -> Self {
        Self {
            url: None,
            path: PathBuf::from("effectgate.db"),
            max_read_connections: 4,
            busy_timeout_ms: 5000,
            synchronous: Synchronous::Full,
            schema: None,
            max_connections: 16,
            min_connections: 1,
            acquire_timeout_ms: 2000,
            statement_timeout_ms: 5000,
            idle_timeout_ms: 600_000,
            call_timeout_ms: 10_000,
            write_batch_max: 256,
            write_connections: 4,
            write_batch_bytes: 16 << 20,
            replay_cache_bytes: 64 << 20,
            page_cache_bytes: 2 << 20,
            wal_checkpoint_pages: 1000,
        }
    }
}
