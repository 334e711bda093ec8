//! (n) nginx `proxy_pass` in front of the same mock provider, with a
//! keep-alive upstream block: the yardstick for plain pass-through.
//!
//! Started only when Debian's `nginx` binary is found (`$NGINX`, else
//! `/usr/sbin/nginx`, else `nginx` on `PATH`); it runs in the foreground
//! (`daemon off`) with its prefix, logs and pid file in a temp folder,
//! `worker_processes auto` and `access_log off`, and is stopped (`nginx -s
//! stop`) when the scenario ends.
//!
//! [`Forwarding::AsGateway`] has it send the provider what the gateway
//! sends on a pass route (a request id, `X-Forwarded-For`, `-Host` and
//! `-Proto`, no `Authorization`), so that the provider does the same work
//! behind both proxies; [`Forwarding::Plain`] is `proxy_pass` with its
//! defaults.

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

/// Which headers nginx sends the provider (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarding {
    /// `proxy_pass` with its defaults: the caller's headers as they came
    /// (`Authorization` included), `Host` set to the upstream's name.
    Plain,
    /// As the gateway forwards on a pass route: `X-Request-Id` (nginx's
    /// `$request_id`), `X-Forwarded-For`, `X-Forwarded-Host`,
    /// `X-Forwarded-Proto`, the caller's `Authorization` removed, `Host`
    /// the upstream's address.
    AsGateway,
}

/// The `proxy_set_header` lines of `forwarding`, after the keep-alive
/// one.
fn forwarding_lines(forwarding: Forwarding) -> &'static str {
    match forwarding {
        Forwarding::Plain => "",
        Forwarding::AsGateway => {
            "      proxy_set_header Host $proxy_host;\n\
             \x20     proxy_set_header Authorization \"\";\n\
             \x20     proxy_set_header X-Request-Id $request_id;\n\
             \x20     proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
             \x20     proxy_set_header X-Forwarded-Host $http_host;\n\
             \x20     proxy_set_header X-Forwarded-Proto $scheme;\n"
        }
    }
}

/// The configuration: one server on `listen` proxying everything to
/// `upstream` over HTTP/1.1 keep-alive connections (64 idle kept per
/// worker), with the headers of `forwarding`.
fn config(
    prefix: &Path,
    listen: SocketAddr,
    upstream: SocketAddr,
    forwarding: Forwarding,
) -> String {
    let p = prefix.display();
    let headers = forwarding_lines(forwarding);
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
         {headers}\
         \x20   }}\n\
         \x20 }}\n\
         }}\n"
    )
}

/// Starts nginx in front of `upstream` with its default forwarding
/// ([`start_with`]).
///
/// Errors: as [`start_with`].
pub fn start(binary: &Path, upstream: SocketAddr) -> anyhow::Result<Nginx> {
    start_with(binary, upstream, Forwarding::Plain)
}

/// Starts nginx in front of `upstream`, sending it the headers of
/// `forwarding`, and waits (at most 10 s) until it accepts connections.
///
/// Errors: the binary can't be started, or it exits or never listens.
pub fn start_with(
    binary: &Path,
    upstream: SocketAddr,
    forwarding: Forwarding,
) -> anyhow::Result<Nginx> {
    let dir = tempfile::tempdir()?;
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let conf = dir.path().join("nginx.conf");
    std::fs::write(&conf, config(dir.path(), addr, upstream, forwarding))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateways_forwarding_sends_its_headers_and_drops_authorization() {
        let (listen, up) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let plain = config(Path::new("/p"), listen, up, Forwarding::Plain);
        assert!(!plain.contains("X-Forwarded"), "{plain}");
        assert!(!plain.contains("Authorization"), "{plain}");
        let gw = config(Path::new("/p"), listen, up, Forwarding::AsGateway);
        for line in [
            "      proxy_set_header Authorization \"\";\n",
            "      proxy_set_header X-Request-Id $request_id;\n",
            "      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n",
            "      proxy_set_header X-Forwarded-Host $http_host;\n",
            "      proxy_set_header X-Forwarded-Proto $scheme;\n",
        ] {
            assert!(gw.contains(line), "{line:?} missing from {gw}");
        }
        // Inside the location block, before it closes.
        let at = gw.find("X-Forwarded-Proto").unwrap();
        assert!(
            gw[at..].starts_with("X-Forwarded-Proto $scheme;\n    }\n"),
            "{gw}"
        );
    }
}
