//! The SQLite ledger's lock: one process (one ledger) holds a file at a
//! time.

use std::path::Path;

use super::super::LedgerError;

/// Takes the lock of the SQLite ledger at `path`: an exclusive `flock` of
/// `<file>.lock` beside the file, the file named by its canonical path
/// (so a symlink or another spelling of the path names the same lock).
/// The lock lasts as long as the returned file is open.
///
/// A ledger file with more than one hard link is refused: each name would
/// have its own `.lock` (two gateways on one ledger, each taking a
/// duplicate for new) and its own `-wal` (which corrupts the ledger). The
/// file itself is never opened here: closing any descriptor of a file
/// drops every `fcntl` lock the process holds on it, SQLite's included.
///
/// Errors: [`LedgerError::NoFolder`] as [`require_folder`];
/// [`LedgerError::InUse`] when another open file holds it (another
/// process, or another ledger of this process); [`LedgerError::LockFile`]
/// when it can't be opened or locked, or the ledger file has other hard
/// links.
pub(super) fn lock_sqlite_file(path: &Path) -> Result<std::fs::File, LedgerError> {
    require_folder(path)?;
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
    match file.try_lock() {
        Ok(()) => {
            refuse_hard_links(&canonical)?;
            Ok(file)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(LedgerError::InUse(canonical.display().to_string()))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(LedgerError::LockFile(format!(
            "{}: {e}",
            lock_path.display()
        ))),
    }
}

/// Refuses a SQLite ledger path that doesn't exist in a folder that doesn't
/// either ([`crate::config::missing_folder`]; config loading refuses it
/// first, this covers a ledger opened without a config).
///
/// Errors: [`LedgerError::NoFolder`].
pub(super) fn require_folder(path: &Path) -> Result<(), LedgerError> {
    match crate::config::missing_folder(path) {
        None => Ok(()),
        Some(folder) => Err(LedgerError::NoFolder(crate::config::missing_folder_text(
            path, folder,
        ))),
    }
}

/// Refuses a ledger file (if it exists) that more than one name links to
/// (the link count is read on Unix only).
fn refuse_hard_links(path: &Path) -> Result<(), LedgerError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(path)
            && m.nlink() > 1
        {
            return Err(LedgerError::LockFile(format!(
                "{} has {} hard links: SQLite keeps a WAL beside each name, so two names of one \
                 ledger corrupt it, and gateways on two names would each serve it; remove the \
                 other links (find / -samefile {})",
                path.display(),
                m.nlink(),
                path.display()
            )));
        }
    }
    let _ = path;
    Ok(())
}

/// The SQLite ledger's lock file, while held.
#[derive(Debug, Default)]
pub(super) struct Exclusive {
    file: std::sync::Mutex<Option<std::fs::File>>,
    held: std::sync::atomic::AtomicBool,
}

impl Exclusive {
    pub(super) fn held(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The held lock file, if any.
    pub(super) fn slot(&self) -> std::sync::MutexGuard<'_, Option<std::fs::File>> {
        self.file.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `file`, the lock [`lock_sqlite_file`] took, in `slot`.
    pub(super) fn hold(&self, slot: &mut Option<std::fs::File>, file: std::fs::File) {
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
