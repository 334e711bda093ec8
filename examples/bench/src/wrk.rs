//! (w): the targets measured again with `wrk` as the load generator, the
//! gateway in a process of its own, and nginx in front of the same
//! provider.
//!
//! The bench's own client runs in the bench's process beside the mock
//! provider and (for the other scenarios) the gateway, and on two cores it
//! costs about as much per request as a proxy does: it caps every arm near
//! the same throughput and pulls ratios towards 1. `wrk` (Debian's package)
//! costs about 5 µs of CPU per request, so the ratios here are closer to
//! what the proxies themselves cost. Every arm runs `wrk -t1` for
//! [`SECONDS`] seconds; comparisons alternate their two arms for
//! [`CYCLES`] cycles and report the median of the per-cycle ratios. Without
//! `wrk` (or the gateway binary, or nginx for its comparison) a line says
//! what was skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{BODY, CLIENT_KEY, process, targets};

/// Seconds of each `wrk` run.
const SECONDS: u32 = 2;
/// Alternating cycles of each comparison.
const CYCLES: usize = 5;

/// The `wrk` binary: `$WRK`, else `wrk` on the `PATH`.
pub fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WRK").map(PathBuf::from) {
        return p.exists().then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("wrk"))
            .find(|p| p.exists())
    })
}

/// What one `wrk` run reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Requests per second (`Requests/sec:`).
    pub rps: f64,
    /// Median latency, µs (`50%` of `--latency`).
    pub p50_us: f64,
    /// 99th percentile latency, µs (`99%`).
    pub p99_us: f64,
    /// Non-2xx/3xx answers and socket errors together.
    pub errors: u64,
}

/// A latency of `wrk`'s output (`716.00us`, `1.46ms`, `2.00s`) in µs.
fn micros(text: &str) -> Option<f64> {
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1_000.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60_000_000.0)
    } else {
        (text.strip_suffix('s')?, 1_000_000.0)
    };
    Some(number.parse::<f64>().ok()? * scale)
}

/// Reads the report of `wrk --latency` from its standard output.
///
/// Errors: a figure the report must have (`Requests/sec`, the 50 % and
/// 99 % latencies) is missing or unreadable.
pub fn parse(out: &str) -> anyhow::Result<Report> {
    let mut rps = None;
    let (mut p50, mut p99) = (None, None);
    let mut errors = 0;
    for line in out.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("Requests/sec:"), Some(v)) => rps = v.parse::<f64>().ok(),
            (Some("50%"), Some(v)) => p50 = micros(v),
            (Some("99%"), Some(v)) => p99 = micros(v),
            _ => {}
        }
        if let Some(n) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += n.trim().parse::<u64>().unwrap_or(0);
        }
        if let Some(list) = line.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            errors += list
                .split(',')
                .filter_map(|kv| kv.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    match (rps, p50, p99) {
        (Some(rps), Some(p50_us), Some(p99_us)) => Ok(Report {
            rps,
            p50_us,
            p99_us,
            errors,
        }),
        _ => anyhow::bail!("wrk's report lacks Requests/sec, 50% or 99%:\n{out}"),
    }
}

/// The idempotency keys of an arm's requests.
#[derive(Clone, Copy, Debug)]
enum Keys {
    /// No `Idempotency-Key` (pass-through).
    None,
    /// The same key on every request: duplicates of one operation.
    Same(&'static str),
    /// `<prefix>-<run tag>-<n>`, a counter: unique, each key after the last.
    Counter(&'static str),
    /// A random UUIDv4-shaped key per request, as client SDKs draw them
    /// (Stripe's, for one): unique, in no order (Lua's generator is seeded
    /// per run: [`script`]'s `seed`).
    Random,
}

/// The Lua script of one arm: a POST of [`BODY`] with the bench's client
/// key and `keys` (see [`Keys`]); `tag` names the run (a counter's keys
/// carry it, so runs never share keys), `seed` seeds random keys.
fn script(keys: Keys, tag: &str, seed: u32) -> String {
    let mut s = format!(
        "wrk.method = \"POST\"\nwrk.body = '{BODY}'\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.headers[\"Authorization\"] = \"Bearer {CLIENT_KEY}\"\n"
    );
    match keys {
        Keys::Counter(prefix) => s.push_str(&format!(
            "local n = 0\nrequest = function()\n  n = n + 1\n  \
             wrk.headers[\"Idempotency-Key\"] = \"{prefix}-{tag}-\" .. n\n  \
             return wrk.format(nil, wrk.path)\nend\n"
        )),
        Keys::Same(key) => {
            s.push_str(&format!("wrk.headers[\"Idempotency-Key\"] = \"{key}\"\n"));
        }
        Keys::Random => s.push_str(&format!(
            "math.randomseed({seed})\n\
             local function r(n) return math.random(0, n) end\n\
             request = function()\n  \
             wrk.headers[\"Idempotency-Key\"] = string.format(\
             \"%04x%04x-%04x-4%03x-%04x-%04x%04x%04x\", r(65535), r(65535), r(65535), \
             r(4095), 32768 + r(16383), r(65535), r(65535), r(65535))\n  \
             return wrk.format(nil, wrk.path)\nend\n"
        )),
        Keys::None => {}
    }
    s
}

/// One arm of a comparison.
#[derive(Clone)]
struct Arm {
    name: &'static str,
    url: String,
    keys: Keys,
}

/// Runs `wrk` once against `arm` with `connections` connections, on a
/// blocking thread (the mock provider answers on this runtime); `tag`
/// names the run and makes its idempotency keys unique across runs.
async fn run(
    bin: &Path,
    dir: &Path,
    arm: &Arm,
    connections: usize,
    tag: &str,
) -> anyhow::Result<Report> {
    // A seed of its own per run: random keys never repeat an earlier
    // run's (which the gateway would answer as duplicates).
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.subsec_nanos() ^ (d.as_secs() as u32));
    let file = dir.join(format!("{tag}.lua"));
    std::fs::write(&file, script(arm.keys, tag, seed))?;
    let mut cmd = Command::new(bin);
    cmd.args(["-t1", &format!("-c{connections}"), &format!("-d{SECONDS}s")])
        .arg("--latency")
        .arg("-s")
        .arg(&file)
        .arg(&arm.url);
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    if !out.status.success() {
        anyhow::bail!(
            "wrk failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let report = parse(&String::from_utf8_lossy(&out.stdout))?;
    println!(
        "  {tag:>4}: {:<42} {:>8.0} req/s {:>7.0} µs p50 {:>7.0} µs p99 {:>4} errors",
        arm.name, report.rps, report.p50_us, report.p99_us, report.errors
    );
    Ok(report)
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The outcome of a comparison: medians over the cycles.
struct Compared {
    /// Median of the per-cycle throughput ratios `b / a`.
    ratio: f64,
    /// Median p99 of `a` and of `b`, µs.
    p99_us: (f64, f64),
    /// Errors of both arms, all cycles.
    errors: u64,
}

/// `a` and `b` in [`CYCLES`] alternating cycles (`a` first in even
/// cycles, `b` first in odd ones).
async fn compare(
    bin: &Path,
    dir: &Path,
    (a, b): (&Arm, &Arm),
    connections: usize,
    tag: &str,
) -> anyhow::Result<Compared> {
    let (mut ratios, mut a99, mut b99, mut errors) = (vec![], vec![], vec![], 0);
    for cycle in 0..CYCLES {
        let (a_tag, b_tag) = (format!("{tag}a{cycle}"), format!("{tag}b{cycle}"));
        let (ra, rb) = if cycle % 2 == 0 {
            let ra = run(bin, dir, a, connections, &a_tag).await?;
            (ra, run(bin, dir, b, connections, &b_tag).await?)
        } else {
            let rb = run(bin, dir, b, connections, &b_tag).await?;
            (run(bin, dir, a, connections, &a_tag).await?, rb)
        };
        ratios.push(rb.rps / ra.rps);
        a99.push(ra.p99_us);
        b99.push(rb.p99_us);
        errors += ra.errors + rb.errors;
    }
    Ok(Compared {
        ratio: median(ratios),
        p99_us: (median(a99), median(b99)),
        errors,
    })
}

/// Runs (w) in front of the provider at `up` (the gateway's config takes
/// the client key digest `hash`), with `c` connections; `fsync_ms` is the
/// machine's fsync time for the one-connection target. Returns the target
/// rows it measured, or none when `wrk` or the gateway binary is missing
/// (a line says so).
///
/// Errors: a process fails to start, or `wrk` fails.
pub async fn targets(
    up: &str,
    upstream: std::net::SocketAddr,
    hash: &str,
    c: usize,
    fsync_ms: f64,
) -> anyhow::Result<Vec<targets::Row>> {
    let Some(wrk) = binary() else {
        println!("(w) skipped: wrk is not installed (apt-get install wrk, or set WRK)");
        return Ok(vec![]);
    };
    let Some(gateway) = process::binary() else {
        println!(
            "(w) skipped: no effectgate binary next to the bench (cargo build --release -p bench -p effectgate) and no $BENCH_EFFECTGATE_BIN"
        );
        return Ok(vec![]);
    };
    let gw = process::spawn(
        &gateway,
        &format!(
            "[storage]\npath = \"{{db}}\"\n{}",
            crate::config::tenant_and_routes(up, hash)
        ),
        &[("RUST_LOG", "warn")],
    )
    .await
    .map_err(|e| anyhow::anyhow!("(w): {e}"))?;
    let dir = tempfile::tempdir()?;
    let pass = format!("http://127.0.0.1:{}/pass/v1/charges", gw.proxy);
    let pay = format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy);
    println!(
        "(w) wrk -t1 -c{c} as the load generator, {SECONDS} s per run, the gateway in a process of its own ({}):",
        gateway.display()
    );
    let pass_arm = Arm {
        name: "(w-b) effectgate, pass-through",
        url: pass,
        keys: Keys::None,
    };
    let (wrk, dir) = (wrk.as_path(), dir.path());
    // Warm-up: connections, the allocator, one completed key.
    let warm = Arm {
        name: "warmup, duplicates of one key",
        url: pay.clone(),
        keys: Keys::Same("w-dup"),
    };
    run(wrk, dir, &warm, 1, "warm").await?;

    let mut rows = Vec::new();
    match crate::nginx::binary() {
        Some(bin) => {
            use crate::nginx::Forwarding;
            // nginx as `proxy_pass` has it (the target), then sending the
            // provider the headers the gateway sends (for comparison: the
            // provider's share of the difference out).
            for (forwarding, tag, name) in [
                (Forwarding::Plain, "n", "(w-n) nginx proxy_pass"),
                (
                    Forwarding::AsGateway,
                    "nh",
                    "(w-nh) nginx, the gateway's forwarding headers",
                ),
            ] {
                let server = crate::nginx::start_with(&bin, upstream, forwarding)?;
                let n = Arm {
                    name,
                    url: format!("http://{}/v1/charges", server.addr),
                    keys: Keys::None,
                };
                let r = compare(wrk, dir, (&n, &pass_arm), c, tag).await?;
                let target = forwarding == Forwarding::Plain;
                println!(
                    "  (w-b) / (w-{tag}): median of {CYCLES} per-cycle throughput ratios {:.3}; median p99 {:.0} vs {:.0} µs; {} errors{}",
                    r.ratio,
                    r.p99_us.1,
                    r.p99_us.0,
                    r.errors,
                    if target {
                        ""
                    } else {
                        " (for comparison, not a target)"
                    }
                );
                if target {
                    rows.push(targets::Row {
                        what: "(w) pass-through / nginx proxy_pass, p99 (wrk)".into(),
                        measured: format!(
                            "{:.3}×, p99 {:.0} µs vs nginx {:.0} µs ({} errors)",
                            r.ratio, r.p99_us.1, r.p99_us.0, r.errors
                        ),
                        aim: "≥ 0.9×, p99 ≤ nginx",
                        met: Some(r.ratio >= 0.9 && r.p99_us.1 <= r.p99_us.0 && r.errors == 0),
                    });
                }
            }
        }
        None => {
            println!("(w-n) skipped: nginx is not installed (apt-get install nginx, or set NGINX)")
        }
    }
    // Effectful with unique keys, then duplicates of one key, each against
    // pass-through: (arm, its tag, the row's name, the aim's ratio).
    let against_pass = [
        (
            Arm {
                name: "(w-c) effectgate, effectful, unique keys",
                url: pay.clone(),
                keys: Keys::Counter("wc"),
            },
            "c",
            format!("(w) effectful, unique keys, {c} connections / pass-through (wrk)"),
            Some((0.15, "≥ 0.15×")),
        ),
        // The same with random keys: every B-tree keyed by the caller's
        // key takes each one on a random page (comparison, not a target).
        (
            Arm {
                name: "(w-cr) effectgate, effectful, random keys",
                url: pay.clone(),
                keys: Keys::Random,
            },
            "cr",
            String::new(),
            None,
        ),
        (
            Arm {
                name: "(w-d) effectgate, duplicates of one key",
                url: pay.clone(),
                keys: Keys::Same("w-dup"),
            },
            "d",
            "(w) duplicates of one key / pass-through (wrk)".to_owned(),
            Some((1.0, "≥ 1.0×")),
        ),
    ];
    for (arm, tag, what, target) in against_pass {
        let r = compare(wrk, dir, (&pass_arm, &arm), c, tag).await?;
        println!(
            "  (w-{tag}) / (w-b): median of {CYCLES} per-cycle throughput ratios {:.3}{}",
            r.ratio,
            if target.is_some() {
                ""
            } else {
                " (for comparison, not a target)"
            }
        );
        let Some((least, aim)) = target else {
            continue;
        };
        rows.push(targets::Row {
            what,
            measured: format!("{:.3}× ({} errors)", r.ratio, r.errors),
            aim,
            met: Some(r.ratio >= least && r.errors == 0),
        });
    }
    let one = Arm {
        name: "(w-c1) effectgate, effectful, 1 connection",
        url: pay,
        keys: Keys::Counter("wc1"),
    };
    let one = run(wrk, dir, &one, 1, "c1").await?;
    let aim_ms = 2.0 * fsync_ms + 0.5;
    rows.push(targets::Row {
        what: "(w) effectful, 1 connection, p50 / (2 fsyncs + 0.5 ms) (wrk)".into(),
        measured: format!(
            "{:.2} ms / {aim_ms:.2} ms ({} errors)",
            one.p50_us / 1000.0,
            one.errors
        ),
        aim: "≤ 1",
        met: Some(one.p50_us / 1000.0 <= aim_ms && one.errors == 0),
    });
    drop(gw);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report as wrk 4.2 prints it with `--latency`, errors included.
    const REPORT: &str = "Running 2s test @ http://127.0.0.1:1/pay/v1/charges
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   716.00us  120.00us   8.29ms   95.50%
    Req/Sec    45.31k     1.20k   47.00k    80.00%
  Latency Distribution
     50%  716.00us
     75%  800.00us
     90%  900.00us
     99%    1.46ms
  90000 requests in 2.00s, 26.21MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  45314.23
Transfer/sec:     13.21MB
";

    #[test]
    fn a_wrk_report_gives_throughput_percentiles_and_errors() {
        let r = parse(REPORT).unwrap();
        assert_eq!(
            r,
            Report {
                rps: 45314.23,
                p50_us: 716.0,
                p99_us: 1460.0,
                errors: 7,
            }
        );
    }

    #[test]
    fn a_report_without_percentiles_is_refused() {
        let cut: String = REPORT
            .lines()
            .filter(|l| !l.contains("99%"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = parse(&cut).unwrap_err().to_string();
        assert!(e.contains("99%"), "{e}");
    }

    #[test]
    fn latencies_in_every_unit_wrk_prints() {
        assert_eq!(micros("87.00us"), Some(87.0));
        assert_eq!(micros("1.50ms"), Some(1500.0));
        assert_eq!(micros("2.00s"), Some(2_000_000.0));
        assert_eq!(micros("1.00m"), Some(60_000_000.0));
        assert_eq!(micros("fast"), None);
    }

    #[test]
    fn unique_keys_count_per_run_and_duplicates_repeat_one() {
        let unique = script(Keys::Counter("wc"), "c0", 7);
        assert!(unique.contains("\"wc-c0-\" .. n"), "{unique}");
        let dup = script(Keys::Same("w-dup"), "d0", 7);
        assert!(
            dup.contains("wrk.headers[\"Idempotency-Key\"] = \"w-dup\""),
            "{dup}"
        );
        assert!(!dup.contains("request = function"), "{dup}");
        assert!(!script(Keys::None, "b0", 7).contains("Idempotency-Key"));
        let random = script(Keys::Random, "cr0", 12345);
        assert!(random.contains("math.randomseed(12345)"), "{random}");
        assert!(
            random.contains("\"%04x%04x-%04x-4%03x-%04x-%04x%04x%04x\""),
            "{random}"
        );
    }
}
