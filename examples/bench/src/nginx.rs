//! (n) nginx `proxy_pass` in front of the same mock provider, with a
//! keep-alive upstream block: the yardstick for plain pass-through.
//!
//! Started only when Debian's `nginx` binary is found (`$NGINX`, else
//! `/usr/sbin/nginx`, else `nginx` on `PATH`); it runs in the foreground
//! (`daemon off`) with its prefix, logs and pid file in a temp folder,
//! `worker_processes auto` and `access_log off`, and is stopped (`nginx -s
//! stop`) when the scenario ends.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running nginx; stopped on drop.
pub struct Nginx {
    child: Child,
    binary: PathBuf,
    /// Where it listens (loopback).
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Nginx {
    /// `nginx -s stop` (the master ends its workers, which a SIGKILL of the
    /// master alone would leave running), then a bounded wait (5 s) for
    /// the master; SIGKILL if it is still there.
    fn drop(&mut self) {
        let _ = Command::new(&self.binary)
            .arg("-p")
            .arg(self.dir.path())
            .arg("-c")
            .arg(self.dir.path().join("nginx.conf"))
            .args(["-s", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The nginx binary, if one is installed.
pub fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NGINX").map(PathBuf::from) {
        return p.exists().then_some(p);
    }
    let debian = Path::new("/usr/sbin/nginx");
    if debian.exists() {
        return Some(debian.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nginx"))
            .find(|p| p.exists())
    })
}

/// The configuration: one server on `listen` proxying everything to
/// `upstream` over HTTP/1.1 keep-alive connections (64 idle kept per
/// worker).
fn config(prefix: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let p = prefix.display();
    format!(
        "worker_processes auto;\n\
         pid {p}/nginx.pid;\n\
         error_log {p}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n\
         \x20 access_log off;\n\
         \x20 client_body_temp_path {p}/body;\n\
         \x20 proxy_temp_path {p}/proxy;\n\
         \x20 fastcgi_temp_path {p}/fastcgi;\n\
         \x20 uwsgi_temp_path {p}/uwsgi;\n\
         \x20 scgi_temp_path {p}/scgi;\n\
         \x20 keepalive_requests 1000000;\n\
         \x20 upstream provider {{ server {upstream}; keepalive 64; }}\n\
         \x20 server {{\n\
         \x20   listen {listen};\n\
         \x20   location / {{\n\
         \x20     proxy_pass http://provider;\n\
         \x20     proxy_http_version 1.1;\n\
         \x20     proxy_set_header Connection \"\";\n\
         \x20   }}\n\
         \x20 }}\n\
         }}\n"
    )
}

/// Starts nginx in front of `upstream` and waits (at most 10 s) until it
/// accepts connections.
///
/// Errors: the binary can't be started, or it exits or never listens.
pub fn start(binary: &Path, upstream: SocketAddr) -> anyhow::Result<Nginx> {
    let dir = tempfile::tempdir()?;
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let conf = dir.path().join("nginx.conf");
    std::fs::write(&conf, config(dir.path(), addr, upstream))?;
    let mut child = Command::new(binary)
        .arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(&conf)
        .args(["-g", "daemon off;"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(Nginx {
                child,
                binary: binary.to_path_buf(),
                addr,
                dir,
            });
        }
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
            anyhow::bail!("nginx exited with {status}: {log}");
        }
        if Instant::now() > deadline {
            anyhow::bail!("nginx did not listen on {addr} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
