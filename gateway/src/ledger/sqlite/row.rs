//! What SQLite's connections give back: result rows (sqlx's, or those the
//! writer's own connection read) and the writer's errors, as sqlx reports
//! database errors.

use std::borrow::Cow;
use std::sync::Arc;

use rusqlite::types::Value;

use super::super::dialect::LedgerRow;

/// A SQLite error as the ledger reports database errors.
pub(super) fn db_error(e: rusqlite::Error) -> sqlx::Error {
    sqlx::Error::Database(Box::new(SqliteError(e)))
}

/// An error of the writer's connection, as sqlx reports database errors.
#[derive(Debug)]
struct SqliteError(rusqlite::Error);

impl std::fmt::Display for SqliteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SqliteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl sqlx::error::DatabaseError for SqliteError {
    fn message(&self) -> &str {
        match &self.0 {
            rusqlite::Error::SqliteFailure(_, Some(m)) => m,
            _ => "SQLite error",
        }
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        match &self.0 {
            rusqlite::Error::SqliteFailure(e, _) => Some(Cow::Owned(e.extended_code.to_string())),
            _ => None,
        }
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use rusqlite::ffi;
        match self.0.sqlite_error().map(|e| e.extended_code) {
            Some(ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY) => {
                sqlx::error::ErrorKind::UniqueViolation
            }
            Some(ffi::SQLITE_CONSTRAINT_FOREIGNKEY) => sqlx::error::ErrorKind::ForeignKeyViolation,
            Some(ffi::SQLITE_CONSTRAINT_NOTNULL) => sqlx::error::ErrorKind::NotNullViolation,
            Some(ffi::SQLITE_CONSTRAINT_CHECK) => sqlx::error::ErrorKind::CheckViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}

/// A result row: sqlx's (a read) or one the writer's connection read.
#[derive(Debug)]
pub(in crate::ledger) enum Row {
    /// Read through sqlx.
    Sqlx(sqlx::sqlite::SqliteRow),
    /// Read by the writer's connection: its column names and values.
    Raw {
        /// The statement's columns (shared by its rows).
        names: Arc<[String]>,
        /// This row's values, one per column.
        values: Vec<Value>,
    },
}

impl Row {
    /// Column `col`'s value (a raw row), or sqlx's `ColumnNotFound`.
    fn value(names: &[String], values: &[Value], col: &str) -> Result<Value, sqlx::Error> {
        names
            .iter()
            .position(|n| n == col)
            .and_then(|i| values.get(i))
            .cloned()
            .ok_or_else(|| sqlx::Error::ColumnNotFound(col.to_owned()))
    }

    /// Column `col` read by `by_sqlx` (a sqlx row) or by `raw` (a raw row's
    /// value; `None`: it does not decode as the type asked for).
    fn read<T>(
        &self,
        col: &str,
        by_sqlx: impl FnOnce(&sqlx::sqlite::SqliteRow) -> Result<T, sqlx::Error>,
        raw: impl FnOnce(Value) -> Option<T>,
    ) -> Result<T, sqlx::Error> {
        match self {
            Row::Sqlx(r) => by_sqlx(r),
            Row::Raw { names, values } => {
                let v = Self::value(names, values, col)?;
                let kind = v.data_type();
                raw(v).ok_or_else(|| sqlx::Error::ColumnDecode {
                    index: col.to_owned(),
                    source: format!("a {kind} value where another type was expected").into(),
                })
            }
        }
    }
}

impl LedgerRow for Row {
    fn int(&self, col: &str) -> Result<i64, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(i),
                _ => None,
            },
        )
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(Some(i)),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
    fn text(&self, col: &str) -> Result<String, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Text(t) => Some(t),
                _ => None,
            },
        )
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Text(t) => Some(Some(t)),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
    fn flag(&self, col: &str) -> Result<bool, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(i != 0),
                _ => None,
            },
        )
    }
    fn bytes(&self, col: &str) -> Result<Vec<u8>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Blob(b) => Some(b),
                Value::Text(t) => Some(t.into_bytes()),
                _ => None,
            },
        )
    }
    fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Blob(b) => Some(Some(b)),
                Value::Text(t) => Some(Some(t.into_bytes())),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
}
