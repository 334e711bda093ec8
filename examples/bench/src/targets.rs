//! The speed targets of the hot paths, as ratios measured in one run:
//! effectful (unique keys) against pass-through with the average group
//! commit size, the one-connection p50 against the machine's own fsync
//! time, duplicates against pass-through, PostgreSQL against SQLite, and
//! the resident memory after many effectful calls.

use std::io::Write;
use std::time::{Duration, Instant};

/// (sum, count) of `effectgate_ledger_batch_size` in this process so far.
pub fn batch_totals() -> (f64, f64) {
    let text = effectgate::metrics::handle().render();
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        value("effectgate_ledger_batch_size_sum"),
        value("effectgate_ledger_batch_size_count"),
    )
}

/// Average writes per commit between two [`batch_totals`].
pub fn average_batch(before: (f64, f64), after: (f64, f64)) -> f64 {
    let (sum, count) = (after.0 - before.0, after.1 - before.1);
    if count > 0.0 { sum / count } else { 0.0 }
}

/// The median time of one `fdatasync` of a 4 KiB append to a file in
/// `dir` (200 of them), in ms: what one durable commit costs at least.
pub fn fsync_ms(dir: &std::path::Path) -> anyhow::Result<f64> {
    let mut f = std::fs::File::create(dir.join("fsync-probe"))?;
    let block = [0u8; 4096];
    let mut times: Vec<Duration> = Vec::with_capacity(200);
    for _ in 0..200 {
        f.write_all(&block)?;
        let t = Instant::now();
        f.sync_data()?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2].as_secs_f64() * 1000.0)
}

/// One row of the targets table.
pub struct Row {
    /// What is compared.
    pub what: String,
    /// The measured figure.
    pub measured: String,
    /// The aim.
    pub aim: &'static str,
    /// Met, missed, or not measured (`None`).
    pub met: Option<bool>,
}

/// Prints the targets table.
pub fn print(rows: &[Row]) {
    println!("targets (ratios from this run):");
    println!("| target | measured | aim | met |");
    println!("|---|---|---|---|");
    for r in rows {
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "skipped",
        };
        println!("| {} | {} | {} | {met} |", r.what, r.measured, r.aim);
    }
}
