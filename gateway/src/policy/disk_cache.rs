//! The on-disk cache of compiled policies (`policy.cache_dir`).
//!
//! One file per module and engine: `<module sha256>-<engine key>.cwasm`,
//! where the engine key is a digest of wasmtime's compatibility hash (the
//! wasmtime version, the target and every compilation setting, memory
//! limits included). A file holds a header and wasmtime's serialized
//! component:
//!
//! ```text
//! "effectgate-cwasm-1\n" | module sha256 (32 bytes) | payload sha256 (32 bytes) | payload
//! ```
//!
//! An entry whose header or digest doesn't match is corrupt: it is
//! removed, never deserialized, and the module is compiled again.
//! wasmtime's own header checks then reject a payload of another engine.
//! Entries are written to a temporary file and renamed into place, so a
//! reader never sees half a file.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

const MAGIC: &[u8] = b"effectgate-cwasm-1\n";
const HEADER: usize = MAGIC.len() + 64;

/// A folder of compiled policies for one engine configuration.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    engine_key: String,
}

/// Why a cache entry was not used.
#[derive(Debug, thiserror::Error)]
pub enum CacheMiss {
    /// No entry for this module and engine.
    #[error("no entry")]
    Absent,
    /// The entry could not be read.
    #[error("cannot read {path}: {error}")]
    Unreadable {
        /// Entry path.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// The header or the digest did not match: the file was damaged or
    /// replaced. It has been removed.
    #[error("{path} is corrupt ({why}); removed")]
    Corrupt {
        /// Entry path.
        path: String,
        /// Which check failed.
        why: &'static str,
    },
    /// wasmtime refused the payload (another engine or version).
    #[error("{path} was refused by wasmtime ({error}); removed")]
    Refused {
        /// Entry path.
        path: String,
        /// wasmtime's reason.
        error: String,
    },
}

/// Feeds `Hash` output into sha256, so the engine key is the same in
/// every process (unlike `DefaultHasher`, whose algorithm may change).
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn finish(&self) -> u64 {
        let d = self.0.clone().finalize();
        u64::from_le_bytes(d[..8].try_into().unwrap_or_default())
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// The key of `engine`'s compilation settings: 16 hex digits of a sha256
/// over wasmtime's precompile compatibility hash, which covers the
/// wasmtime version, the target and the compilation settings.
pub fn engine_key(engine: &Engine) -> String {
    let mut h = Sha256Hasher(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut h);
    hex::encode(&h.0.finalize()[..8])
}

impl DiskCache {
    /// Opens (creating it if needed) the cache folder `dir` for `engine`.
    ///
    /// Errors: the folder can't be created (the message names it).
    pub fn open(dir: &Path, engine: &Engine) -> Result<Self, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            engine_key: engine_key(engine),
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry file of the module with content hash `hash`.
    pub fn entry_path(&self, hash: &[u8; 32]) -> PathBuf {
        self.dir
            .join(format!("{}-{}.cwasm", hex::encode(hash), self.engine_key))
    }

    /// The compiled component of the module with content hash `hash`, if
    /// a sound entry exists. A corrupt or refused entry is removed.
    #[allow(unsafe_code)] // wasmtime deserialisation of our own, digest-checked artifact
    pub fn get(&self, engine: &Engine, hash: &[u8; 32]) -> Result<Component, CacheMiss> {
        let path = self.entry_path(hash);
        let shown = || path.display().to_string();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(CacheMiss::Absent),
            Err(error) => {
                return Err(CacheMiss::Unreadable {
                    path: shown(),
                    error,
                });
            }
        };
        let corrupt = |why: &'static str| {
            let _ = std::fs::remove_file(&path);
            CacheMiss::Corrupt { path: shown(), why }
        };
        if bytes.len() < HEADER || !bytes.starts_with(MAGIC) {
            return Err(corrupt("no effectgate header"));
        }
        let (module, rest) = bytes[MAGIC.len()..].split_at(32);
        let (digest, payload) = rest.split_at(32);
        if module != hash {
            return Err(corrupt("it names another module"));
        }
        if Sha256::digest(payload).as_slice() != digest {
            return Err(corrupt("the payload digest does not match"));
        }
        // SAFETY: `payload` is exactly what `put` wrote from
        // `Component::serialize` (its sha256 matches the one stored with
        // it), in a folder only the gateway's user may write
        // (documented with `policy.cache_dir`). wasmtime checks the
        // version and settings it was compiled with before using it.
        match unsafe { Component::deserialize(engine, payload) } {
            Ok(c) => Ok(c),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(CacheMiss::Refused {
                    path: shown(),
                    error: format!("{e:#}"),
                })
            }
        }
    }

    /// Stores `component` (compiled from the module with content hash
    /// `hash`).
    ///
    /// Errors: it can't be serialized or written (the message names the
    /// file); the cache then simply has no entry for it.
    pub fn put(&self, hash: &[u8; 32], component: &Component) -> Result<PathBuf, String> {
        let path = self.entry_path(hash);
        let payload = component
            .serialize()
            .map_err(|e| format!("cannot serialize the compiled module: {e:#}"))?;
        let tmp = self.dir.join(format!(
            ".{}.{}-{:08x}.tmp",
            hex::encode(&hash[..8]),
            std::process::id(),
            rand::random::<u32>()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(hash)?;
            f.write_all(&Sha256::digest(&payload))?;
            f.write_all(&payload)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write {}: {e}", path.display())
        })?;
        Ok(path)
    }
}
