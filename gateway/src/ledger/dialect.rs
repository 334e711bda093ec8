//! The SQL layer under the ledger's statements, generic over the backend.
//!
//! Every statement is written once, with SQLite's `?` / `?N` placeholders,
//! and runs on both backends: [`Dialect::q`] gives SQLite the text as
//! written and PostgreSQL the same text with `$N`. Each distinct statement
//! is converted once and kept for the process's life (the set of
//! statements is fixed, so this is bounded).
//!
//! The store (`store/`) and the commands (`command/`) are generic over
//! [`Dialect`]. They bind values as [`Arg`]s through [`Stmt`] and read
//! columns through [`LedgerRow`], so they need no sqlx trait bounds of
//! their own; `sqlite/` and `postgres.rs` implement the trait: PostgreSQL
//! runs every statement through sqlx, SQLite its reads through sqlx and
//! the writer's statements on its own connection (`sqlite/conn.rs`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{LazyLock, RwLock};

use super::{LedgerClock, State};

/// A statement with its binds, as sqlx runs it on dialect `D`'s database.
pub(super) type Query<D> = sqlx::query::Query<
    'static,
    <D as Dialect>::Db,
    <<D as Dialect>::Db as sqlx::Database>::Arguments,
>;
/// One connection statements run on, of dialect `D`: a read pool's, or
/// the writer's ([`Dialect::Conn`]).
pub(super) type Conn<D> = <D as Dialect>::Conn;
/// A connection pool of dialect `D`'s database.
pub(super) type Pool<D> = sqlx::Pool<<D as Dialect>::Db>;

/// What differs between the ledger's backends: the sqlx database, the
/// connections statements run on, the statement text, where time comes
/// from and how work claims lock rows.
pub(super) trait Dialect: Clone + fmt::Debug + Send + Sync + 'static {
    /// The sqlx database (reads, migrations).
    type Db: sqlx::Database;
    /// Its row type.
    type Row: LedgerRow;
    /// A connection statements run on: one of a read pool's
    /// ([`Dialect::acquire`]) or the writer's ([`Dialect::connect_writer`]).
    type Conn: Send + 'static;
    /// What the writer opens its connections from (SQLite: the file and
    /// its settings; PostgreSQL: the shared pool).
    type WriteSource: Clone + fmt::Debug + Send + Sync + 'static;
    /// `sqlite` or `postgres`.
    const NAME: &'static str;
    /// The column that orders rows of one table by insertion.
    const ROW_ORDER: &'static str;
    /// Appended to a work claim's inner `SELECT`: skips rows another
    /// instance is claiming right now (empty where one writer is all
    /// there is).
    const SKIP_LOCKED: &'static str;
    /// What opens a write batch's transaction.
    const BEGIN: &'static str;
    /// Whether each write of a batch after its first runs inside a
    /// savepoint of its own, released when the write ends, so that a write
    /// that fails or is abandoned is rolled back alone (SQLite: a
    /// savepoint there is no round trip, and an error does not end the
    /// transaction). The batch's first write has none: nothing else is in
    /// the transaction while it runs, so it is undone by rolling the batch
    /// back, and its pages are not copied to a savepoint journal. `false`
    /// (PostgreSQL): the writes of a batch share its transaction without
    /// savepoints, which saves each write a round trip; a write that fails
    /// (an error ends a PostgreSQL transaction) or is abandoned after a
    /// statement undoes the whole batch, and the writes already waiting
    /// for its commit are told so ([`crate::ledger::LedgerError::BatchUndone`])
    /// and run again.
    const SAVEPOINT_EACH_WRITE: bool;
    /// Whether reservations with a claim, and outcomes, that queue up for
    /// the writer while one is written are written together, one
    /// statement for each kind in one write of a batch
    /// (`store/grouped.rs`): PostgreSQL, where a statement's own cost on
    /// the server (its start-up, its protocol messages) is most of such a
    /// write's. SQLite: `false` (its statements run in the process and cost
    /// little each).
    const GROUPS_WRITES: bool;
    /// Follows `FROM operations` in the retention sweep's scan so that it
    /// reads the partial index of terminal rows by last change
    /// (`operations_terminal_by_change`), not every row of a state.
    /// SQLite: `INDEXED BY` it (without statistics its planner picks
    /// `operations_by_state`, and then reads every terminal row each pass;
    /// a statement that can't use the index fails instead); PostgreSQL:
    /// empty (its planner chooses by cost).
    const TERMINAL_BY_CHANGE: &'static str;

    /// Whether [`Dialect::with_transitions`]' text binds the row's tenant
    /// and operation id once more after each transition row's values, and
    /// once more after the last (SQLite: it reads the row by its key;
    /// PostgreSQL: from the compare-and-swap's `RETURNING`, binding none).
    const TRANSITION_ROW_NAMES: bool;

    /// The condition that selects one operation's `transitions` or
    /// `attempts` rows, binding tenant and operation id in that order.
    /// SQLite files them under the operation's number (`op_seq`, migration
    /// 0015: rows of callers' random keys then share the B-trees' last
    /// pages) and finds it by the key; PostgreSQL by the key itself.
    const HISTORY_OF: &'static str;

    /// Whether deleting an `operations` row deletes its `transitions` and
    /// `attempts` rows in the same statement (SQLite: trigger
    /// `operations_history_forgotten`); else they are deleted by key.
    const HISTORY_DELETED_WITH_ROW: bool;

    /// The attempts log's `INSERT … ON CONFLICT DO NOTHING` of one row
    /// ([`ATTEMPT_COLUMNS`] bound in that order): an attempt is logged
    /// once. SQLite also stores the operation's number, read by the key.
    const INSERT_ATTEMPT: &'static str;

    /// `sql` as this backend takes it (converted once, then cached).
    fn q(sql: &str) -> &'static str;

    /// One statement text (SQLite placeholders) that runs `cas` — a
    /// compare-and-swap of one `operations` row ending in `RETURNING
    /// {returning}` (a column list naming `version` and `fence`) — and,
    /// when it applied, appends `rows` (at least 1) `transitions` rows in
    /// order: the last with the row's new version and fencing token, each
    /// one before it with one version and one fencing token less than the
    /// next (a reservation and its claim, written as one row: version 1,
    /// token 0, then version 2, token 1). One round trip instead of
    /// `rows + 1`. It returns `cas`'s row with those columns (none when it
    /// did not apply) and binds `cas`'s values, then for each transition
    /// row its tenant, operation id, from, to, actor, reason and time
    /// (followed by tenant and operation id when
    /// [`Dialect::TRANSITION_ROW_NAMES`]), then tenant and operation id
    /// once more when [`Dialect::TRANSITION_ROW_NAMES`].
    fn with_transitions(cas: &str, returning: &str, rows: usize) -> String;

    /// [`Dialect::with_transitions`]' text (one transition row) that also
    /// appends the compare-and-swap's attempts-log row when it applied,
    /// numbered by the row's `attempts` (`ON CONFLICT DO NOTHING`): after
    /// the transition's values it binds tenant, operation id, fencing
    /// token, status, outcome, detail, time and request id. `None`: the
    /// attempts row is a statement of its own here (SQLite, where it costs
    /// no round trip; PostgreSQL saves one a call).
    fn with_transition_and_attempt(cas: &str, returning: &str) -> Option<String>;

    /// [`Dialect::with_transitions`] with one transition row.
    fn with_transition(cas: &str, returning: &str) -> String {
        Self::with_transitions(cas, returning, 1)
    }

    /// `version, fence` of the transition row `back` rows before the last
    /// one [`Dialect::with_transitions`] appends (0: the last).
    fn transition_version(back: usize) -> String {
        if back == 0 {
            "version, fence".to_owned()
        } else {
            format!("version - {back}, fence - {back}")
        }
    }

    /// A connection of the read pool `pool`.
    fn acquire(pool: &Pool<Self>) -> impl Future<Output = Result<Self::Conn, sqlx::Error>> + Send;

    /// What point reads (one operation by its key) take their connections
    /// from (SQLite: [`super::sqlite::PointReaders`], on the calling
    /// thread; PostgreSQL: the shared pool).
    type PointSource: Clone + fmt::Debug + Send + Sync + 'static;

    /// A connection for a point read, from `source`.
    fn acquire_point(
        source: &Self::PointSource,
    ) -> impl Future<Output = Result<Self::Conn, sqlx::Error>> + Send;

    /// A new connection for the writer, from `source`.
    fn connect_writer(
        source: &Self::WriteSource,
    ) -> impl Future<Output = Result<Self::Conn, sqlx::Error>> + Send;

    /// Drops a writer connection for good, whatever state it is in (out
    /// of its pool, if it has one).
    fn discard(conn: Self::Conn);

    /// Runs `stmt` on `conn`; returns the number of rows it changed.
    fn execute(
        stmt: Stmt<Self>,
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs `stmt` on `conn`; returns its first row, if any.
    fn fetch_optional(
        stmt: Stmt<Self>,
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<Option<Self::Row>, sqlx::Error>> + Send;

    /// Runs `stmt` on `conn`; returns all its rows (of every statement of
    /// its text, in order).
    fn fetch_all(
        stmt: Stmt<Self>,
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<Vec<Self::Row>, sqlx::Error>> + Send;

    /// Runs `text` (no binds; one or more statements) on the writer's
    /// connection where waiting for the disk is expected: `COMMIT` (its
    /// fsync) and `BEGIN` (a lock another process holds). SQLite runs it
    /// off the async runtime's threads; PostgreSQL as any statement.
    fn run_durable(
        text: &'static str,
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// A ticket for the `COMMIT` about to run on the writer's connection
    /// `conn` when that `COMMIT` does not sync the disk and the writer does
    /// so before answering its writes (SQLite with `synchronous = full`:
    /// `store::writer`'s syncer); `None` when the `COMMIT` is durable
    /// when it returns (PostgreSQL).
    fn sync_ticket(_conn: &Self::Conn) -> Option<crate::ledger::store::writer::SyncTicket> {
        None
    }

    /// Commits the writer's open transaction on the calling thread when
    /// its `COMMIT` does not wait for the disk (SQLite with a
    /// [`Dialect::sync_ticket`]); `None`: not done, the caller commits with
    /// [`Dialect::run_durable`].
    fn commit_unsynced(
        _conn: &mut Self::Conn,
    ) -> impl Future<Output = Option<Result<(), sqlx::Error>>> + Send {
        async { None }
    }

    /// Runs the batch's `COMMIT` on the calling thread, blocking it for
    /// the fsync, when this backend can (SQLite, the writer's connection):
    /// the writer does so for a batch of one write with nothing else
    /// waiting, which the hand-offs of [`Dialect::run_durable`] would
    /// otherwise slow more than the fsync. `None`: not done, the caller
    /// commits with [`Dialect::run_durable`] (PostgreSQL: always; its
    /// `COMMIT` is a round trip, not a wait on the disk here).
    fn commit_now(conn: &mut Self::Conn) -> Option<Result<(), sqlx::Error>>;

    /// Now, in ms since the Unix epoch (SQLite: the gateway's clock;
    /// PostgreSQL: the database clock, which `clock` then follows).
    fn now(
        pool: &Pool<Self>,
        clock: &LedgerClock,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Now, read on `conn` (inside a transaction, after it got its
    /// connection, so a wait for one doesn't shorten the leases it stamps).
    fn now_in(
        conn: &mut Self::Conn,
        clock: &LedgerClock,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Opens one write on the batch connection: `first`, the batch's
    /// first write, also opens its transaction (with [`Dialect::BEGIN`]).
    /// SQLite opens the savepoint of a write after the first (no round
    /// trip; [`Dialect::SAVEPOINT_EACH_WRITE`]) and returns `None` (its
    /// clock is the gateway's). PostgreSQL sends
    /// nothing for a write after the first unless `read_clock` (the
    /// ledger's clock was moved since `BEGIN`); with the first, or with
    /// `read_clock`, it reads the database clock in that round trip and
    /// returns it (ms since the Unix epoch), from which the writer times
    /// the writes of the batch that follow.
    fn open_write(
        conn: &mut Self::Conn,
        first: bool,
        read_clock: bool,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;

    /// Steps the ledger's clock by `ms`, negative: back (PostgreSQL: the
    /// database clock, for every instance sharing it).
    fn shift_clock(
        pool: &Pool<Self>,
        clock: &LedgerClock,
        ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// One bound value. The variant fixes the SQL type, so a NULL is typed
/// too (PostgreSQL infers parameter types from it).
#[derive(Debug, Clone)]
pub(super) enum Arg<'a> {
    /// `INTEGER` / `BIGINT`.
    Int(Option<i64>),
    /// `BOOLEAN` (an integer on SQLite).
    Bool(bool),
    /// `TEXT`.
    Text(Option<Cow<'a, str>>),
    /// `BLOB` / `BYTEA`.
    Bytes(Option<Cow<'a, [u8]>>),
}

impl Arg<'_> {
    /// The same value, owning its text or bytes.
    pub(super) fn into_owned(self) -> Arg<'static> {
        match self {
            Arg::Int(v) => Arg::Int(v),
            Arg::Bool(v) => Arg::Bool(v),
            Arg::Text(v) => Arg::Text(v.map(|t| Cow::Owned(t.into_owned()))),
            Arg::Bytes(v) => Arg::Bytes(v.map(|b| Cow::Owned(b.into_owned()))),
        }
    }
}

impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::Int(Some(v))
    }
}
impl From<Option<i64>> for Arg<'_> {
    fn from(v: Option<i64>) -> Self {
        Arg::Int(v)
    }
}
impl From<bool> for Arg<'_> {
    fn from(v: bool) -> Self {
        Arg::Bool(v)
    }
}
impl<'a> From<&'a str> for Arg<'a> {
    fn from(v: &'a str) -> Self {
        Arg::Text(Some(Cow::Borrowed(v)))
    }
}
impl<'a> From<Option<&'a str>> for Arg<'a> {
    fn from(v: Option<&'a str>) -> Self {
        Arg::Text(v.map(Cow::Borrowed))
    }
}
impl<'a> From<&'a String> for Arg<'a> {
    fn from(v: &'a String) -> Self {
        Arg::Text(Some(Cow::Borrowed(v)))
    }
}
impl<'a> From<&'a Option<String>> for Arg<'a> {
    fn from(v: &'a Option<String>) -> Self {
        Arg::Text(v.as_deref().map(Cow::Borrowed))
    }
}
impl From<String> for Arg<'_> {
    fn from(v: String) -> Self {
        Arg::Text(Some(Cow::Owned(v)))
    }
}
impl<'a> From<Cow<'a, str>> for Arg<'a> {
    fn from(v: Cow<'a, str>) -> Self {
        Arg::Text(Some(v))
    }
}
impl<'a> From<Option<Cow<'a, str>>> for Arg<'a> {
    fn from(v: Option<Cow<'a, str>>) -> Self {
        Arg::Text(v)
    }
}
impl<'a> From<&'a [u8]> for Arg<'a> {
    fn from(v: &'a [u8]) -> Self {
        Arg::Bytes(Some(Cow::Borrowed(v)))
    }
}
impl<'a> From<&'a Vec<u8>> for Arg<'a> {
    fn from(v: &'a Vec<u8>) -> Self {
        Arg::Bytes(Some(Cow::Borrowed(v)))
    }
}
impl<'a> From<&'a Option<Vec<u8>>> for Arg<'a> {
    fn from(v: &'a Option<Vec<u8>>) -> Self {
        Arg::Bytes(v.as_deref().map(Cow::Borrowed))
    }
}
/// A state binds as its stored name ([`State::as_str`]).
impl From<State> for Arg<'_> {
    fn from(s: State) -> Self {
        Arg::Text(Some(Cow::Borrowed(s.as_str())))
    }
}
impl From<Option<State>> for Arg<'_> {
    fn from(s: Option<State>) -> Self {
        Arg::Text(s.map(|s| Cow::Borrowed(s.as_str())))
    }
}

/// The columns of an `attempts` row, in the order they are bound (as the
/// attempts log's own `INSERT` names them: [`Dialect::INSERT_ATTEMPT`]).
pub(super) const ATTEMPT_COLUMNS: &str =
    "tenant_id, operation_id, attempt, fence, status, outcome, detail, at, request_id";

/// The columns of a `transitions` row, in the order
/// [`Dialect::with_transition`] binds them (version and fence come from the
/// row).
pub(super) const TRANSITION_COLUMNS: &str =
    "tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at";

/// A statement being bound, for dialect `D`: its text (as the backend
/// takes it, [`Dialect::q`]) and its values so far, in placeholder order.
pub(super) struct Stmt<D: Dialect> {
    /// The text.
    pub(super) text: &'static str,
    /// The values.
    pub(super) args: Vec<Arg<'static>>,
    dialect: std::marker::PhantomData<D>,
}

/// The statement `text` (SQLite placeholders), for dialect `D`.
pub(super) fn sql<D: Dialect>(text: &str) -> Stmt<D> {
    Stmt {
        text: D::q(text),
        args: Vec::new(),
        dialect: std::marker::PhantomData,
    }
}

impl<D: Dialect> Stmt<D> {
    /// Binds the next placeholder.
    pub(super) fn bind<'a>(mut self, value: impl Into<Arg<'a>>) -> Self {
        self.args.push(value.into().into_owned());
        self
    }

    /// Binds the next placeholders, in order.
    pub(super) fn bind_all<'a>(mut self, values: impl IntoIterator<Item = Arg<'a>>) -> Self {
        self.args.extend(values.into_iter().map(|v| v.into_owned()));
        self
    }

    /// Binds one placeholder per state, in order (for `state IN (?, …)`).
    pub(super) fn bind_states(self, states: &[State]) -> Self {
        self.bind_all(states.iter().map(|s| Arg::from(*s)))
    }

    /// Runs it; returns the number of rows it changed.
    pub(super) async fn execute(self, conn: &mut Conn<D>) -> Result<u64, sqlx::Error> {
        D::execute(self, conn).await
    }

    /// Runs it; returns its first row, if any.
    pub(super) async fn fetch_optional(
        self,
        conn: &mut Conn<D>,
    ) -> Result<Option<D::Row>, sqlx::Error> {
        D::fetch_optional(self, conn).await
    }

    /// Runs it; returns its first row ([`sqlx::Error::RowNotFound`] if
    /// there is none).
    pub(super) async fn fetch_one(self, conn: &mut Conn<D>) -> Result<D::Row, sqlx::Error> {
        self.fetch_optional(conn)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    /// Runs it; returns all its rows.
    pub(super) async fn fetch_all(self, conn: &mut Conn<D>) -> Result<Vec<D::Row>, sqlx::Error> {
        D::fetch_all(self, conn).await
    }
}

/// A result row, read by column name. Each method fails as sqlx's
/// `try_get` does (no such column, a NULL where none is allowed, a type
/// that does not decode).
pub(super) trait LedgerRow: Send + Sync + 'static {
    /// A non-NULL integer.
    fn int(&self, col: &str) -> Result<i64, sqlx::Error>;
    /// An integer or NULL.
    fn opt_int(&self, col: &str) -> Result<Option<i64>, sqlx::Error>;
    /// A non-NULL text.
    fn text(&self, col: &str) -> Result<String, sqlx::Error>;
    /// A text or NULL.
    fn opt_text(&self, col: &str) -> Result<Option<String>, sqlx::Error>;
    /// A non-NULL boolean.
    fn flag(&self, col: &str) -> Result<bool, sqlx::Error>;
    /// A non-NULL blob.
    fn bytes(&self, col: &str) -> Result<Vec<u8>, sqlx::Error>;
    /// A blob or NULL.
    fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>, sqlx::Error>;

    /// Column `col` as `T` (one of the types above).
    fn get<T: Column>(&self, col: &str) -> Result<T, sqlx::Error>
    where
        Self: Sized,
    {
        T::read(self, col)
    }
}

/// A Rust type a [`LedgerRow`] column reads as.
pub(super) trait Column: Sized {
    /// Reads column `col` of `row`.
    fn read<R: LedgerRow>(row: &R, col: &str) -> Result<Self, sqlx::Error>;
}

macro_rules! column {
    ($t:ty, $m:ident) => {
        impl Column for $t {
            fn read<R: LedgerRow>(row: &R, col: &str) -> Result<Self, sqlx::Error> {
                row.$m(col)
            }
        }
    };
}
column!(i64, int);
column!(Option<i64>, opt_int);
column!(String, text);
column!(Option<String>, opt_text);
column!(bool, flag);
column!(Vec<u8>, bytes);
column!(Option<Vec<u8>>, opt_bytes);

/// Implements [`LedgerRow`] for a sqlx row type with `sqlx::Row::try_get`.
macro_rules! ledger_row {
    ($row:ty) => {
        impl $crate::ledger::dialect::LedgerRow for $row {
            fn int(&self, col: &str) -> Result<i64, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn opt_int(&self, col: &str) -> Result<Option<i64>, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn text(&self, col: &str) -> Result<String, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn opt_text(&self, col: &str) -> Result<Option<String>, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn flag(&self, col: &str) -> Result<bool, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn bytes(&self, col: &str) -> Result<Vec<u8>, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
            fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
                sqlx::Row::try_get(self, col)
            }
        }
    };
}
pub(super) use ledger_row;

static CACHE: LazyLock<RwLock<HashMap<(usize, String), &'static str>>> =
    LazyLock::new(Default::default);

/// `sql` converted by `convert`, from the cache when seen before.
pub(super) fn cached(sql: &str, convert: fn(&str) -> String) -> &'static str {
    let key = (convert as usize, sql.to_owned());
    if let Some(s) = CACHE.read().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return s;
    }
    let converted: &'static str = Box::leak(convert(sql).into_boxed_str());
    CACHE
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(converted)
}

/// Free text as both backends store it: PostgreSQL `TEXT` can't hold NUL
/// (U+0000), so it becomes U+FFFD on SQLite too, and a provider reference
/// or a comment that carries one is stored, not refused.
pub(super) fn clean(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// SQLite placeholders (`?` in order, or `?N`) as PostgreSQL's `$N`.
/// Statements carry no `?` inside string literals, and use one style each.
pub(super) fn dollar_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut next = 0;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '?' {
            out.push(c);
            continue;
        }
        out.push('$');
        if chars.peek().is_some_and(|d| d.is_ascii_digit()) {
            while let Some(d) = chars.peek().copied().filter(char::is_ascii_digit) {
                out.push(d);
                chars.next();
            }
        } else {
            next += 1;
            out.push_str(&next.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_numbered() {
        assert_eq!(
            dollar_placeholders("SELECT a FROM t WHERE b = ? AND c = ?"),
            "SELECT a FROM t WHERE b = $1 AND c = $2"
        );
        assert_eq!(
            dollar_placeholders("WHERE (?1 IS NULL OR x = ?1) LIMIT ?12"),
            "WHERE ($1 IS NULL OR x = $1) LIMIT $12"
        );
    }

    #[test]
    fn states_bind_as_their_names() {
        for s in State::ALL {
            match Arg::from(s) {
                Arg::Text(Some(name)) => assert_eq!(name, s.as_str()),
                other => panic!("{s} bound as {other:?}"),
            }
        }
    }
}
