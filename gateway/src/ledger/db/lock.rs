//! The SQLite ledger's lock: one process (one ledger) holds a file at a
//! time.

use std::path::Path;

use super::super::LedgerError;

/// The locks of a SQLite ledger a process holds, as long as this lives:
/// the `flock` of `<file>.lock` and, once the ledger file exists, the
/// `flock` of the ledger file itself. The second one covers the names a
/// file's path can't tell apart: a hard link to the ledger has its own
/// name (and its own `<name>.lock`) but is the same file, and two
/// gateways on it would each take a duplicate for new (each with its own
/// `-wal` file, which corrupts the ledger as well). SQLite's own locks are
/// `fcntl` locks, which a `flock` does not touch.
#[derive(Debug)]
pub(super) struct LockFiles {
    _name: std::fs::File,
    file: Option<std::fs::File>,
    canonical: std::path::PathBuf,
}

impl LockFiles {
    /// Also locks the ledger file itself, if it exists and is not locked
    /// yet (a ledger created after [`lock_sqlite_file`] took the lock).
    ///
    /// Errors: as [`lock_sqlite_file`].
    pub(super) fn cover_file(&mut self, path: &Path) -> Result<(), LedgerError> {
        if self.file.is_none() {
            self.file = lock_ledger_file(path, &self.canonical)?;
        }
        Ok(())
    }
}

/// Takes the lock of the SQLite ledger at `path`: an exclusive `flock` of
/// `<file>.lock` beside the file, the file named by its canonical path
/// (so a symlink or another spelling of the path names the same lock),
/// and one of the ledger file itself when it exists (so a hard link names
/// it too: [`LockFiles`]). The locks last as long as the returned value.
///
/// Errors: [`LedgerError::InUse`] when another open file holds either
/// (another process, or another ledger of this process);
/// [`LedgerError::LockFile`] when one can't be opened or locked.
pub(super) fn lock_sqlite_file(path: &Path) -> Result<LockFiles, LedgerError> {
    let canonical = match std::fs::canonicalize(path) {
        Ok(p) => p,
        // Not created yet: its folder's canonical path and its name.
        Err(_) => match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) => {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                std::fs::canonicalize(dir)
                    .map(|d| d.join(name))
                    .unwrap_or_else(|_| path.to_path_buf())
            }
            _ => path.to_path_buf(),
        },
    };
    let mut name = canonical.clone().into_os_string();
    name.push(".lock");
    let lock_path = std::path::PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| LedgerError::LockFile(format!("cannot open {}: {e}", lock_path.display())))?;
    try_flock(&file, &lock_path, &canonical)?;
    let ledger = lock_ledger_file(path, &canonical)?;
    Ok(LockFiles {
        _name: file,
        file: ledger,
        canonical,
    })
}

/// The ledger file at `path`, locked; `None` when there is no file yet.
fn lock_ledger_file(path: &Path, canonical: &Path) -> Result<Option<std::fs::File>, LedgerError> {
    match std::fs::File::open(path) {
        Ok(f) => {
            try_flock(&f, path, canonical)?;
            Ok(Some(f))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LedgerError::LockFile(format!(
            "cannot open {}: {e}",
            path.display()
        ))),
    }
}

/// An exclusive `flock` of `file` (at `path`), without waiting; held by
/// another open file: [`LedgerError::InUse`] naming `ledger`.
fn try_flock(file: &std::fs::File, path: &Path, ledger: &Path) -> Result<(), LedgerError> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(LedgerError::InUse(ledger.display().to_string()))
        }
        Err(std::fs::TryLockError::Error(e)) => {
            Err(LedgerError::LockFile(format!("{}: {e}", path.display())))
        }
    }
}

/// The SQLite ledger's lock file, while held.
#[derive(Debug, Default)]
pub(super) struct Exclusive {
    file: std::sync::Mutex<Option<LockFiles>>,
    held: std::sync::atomic::AtomicBool,
}

impl Exclusive {
    pub(super) fn held(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The held lock file, if any.
    pub(super) fn slot(&self) -> std::sync::MutexGuard<'_, Option<LockFiles>> {
        self.file.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `file`, the lock [`lock_sqlite_file`] took, in `slot`.
    pub(super) fn hold(&self, slot: &mut Option<LockFiles>, file: LockFiles) {
        *slot = Some(file);
        self.held.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Lets go of the lock: not held from now on, and closing the file
    /// releases it.
    pub(super) fn release(&self) {
        let mut slot = self.slot();
        self.held.store(false, std::sync::atomic::Ordering::Release);
        slot.take();
    }
}
