//! Times for people.
//!
//! The ledger stores every time as milliseconds since the Unix epoch, and
//! the JSON API keeps those numbers. Next to each of them the API adds the
//! same instant as an RFC 3339 string in UTC with milliseconds, under the
//! field's name plus `_rfc3339`: `created_at: 1796181622924` comes with
//! `created_at_rfc3339: "2026-12-02T03:20:22.924Z"` (`null` beside `null`).
//! The CLI prints that form; the console adds a relative hint
//! (`in 23 h`, `4 min ago`).

use serde_json::Value;

/// The fields holding times in ms since the epoch, in the objects of the
/// admin API and the CLI (operations, transitions, attempts, approvals,
/// dead letters).
pub const TIME_FIELDS: &[&str] = &[
    "at",
    "created_at",
    "updated_at",
    "expires_at",
    "lease_expires_at",
    "next_reconcile_at",
    "decided_at",
    "used_at",
    "dead_lettered_at",
    "received_at",
    "held_until",
    "since",
    "settle_until",
    "oldest_dead_letter_at",
    "oldest_unknown_at",
];

/// The lists and objects, inside those objects, whose items hold times too
/// (an operation's policy decisions and its compensation link among them).
const NESTED: &[&str] = &[
    "transitions",
    "attempts_log",
    "operations",
    "dead_letters",
    "dead_events",
    "approvals",
    "approval",
    "operation",
    "events",
    "inbox_events",
    "policy_decisions",
    "compensation",
];

/// `ms` since the epoch as RFC 3339 in UTC with milliseconds,
/// `2026-12-01T04:53:42.924Z`; `None` outside the years 0000–9999.
pub fn rfc3339(ms: i64) -> Option<String> {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()?;
    if !(0..=9999).contains(&t.year()) {
        return None;
    }
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    ))
}

/// How far `ms` is from `now_ms`, coarsely: `now`, `in 45 s`, `4 min ago`,
/// `in 23 h`, `3 d ago` (each unit rounded down).
pub fn relative(ms: i64, now_ms: i64) -> String {
    let delta = ms.saturating_sub(now_ms);
    let s = delta.unsigned_abs() / 1000;
    let amount = match s {
        0..10 => return "now".into(),
        10..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..172_800 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    };
    if delta > 0 {
        format!("in {amount}")
    } else {
        format!("{amount} ago")
    }
}

/// `ms` for a person: RFC 3339 and the relative hint,
/// `2026-12-01T04:53:42.924Z (in 23 h)`.
pub fn human(ms: i64, now_ms: i64) -> String {
    match rfc3339(ms) {
        Some(t) => format!("{t} ({})", relative(ms, now_ms)),
        None => format!("{ms} ms since the epoch"),
    }
}

/// Adds `<field>_rfc3339` beside every time field of `v` (see
/// [`TIME_FIELDS`]), in the object itself and in its nested lists of
/// operations, transitions, attempts and approvals. Request and response
/// bodies are left alone.
pub fn annotate(v: &mut Value) {
    match v {
        Value::Array(items) => items.iter_mut().for_each(annotate),
        Value::Object(map) => {
            for field in TIME_FIELDS {
                let rendered = match map.get(*field) {
                    Some(Value::Number(n)) => n.as_i64().and_then(rfc3339).map(Value::String),
                    Some(Value::Null) => Some(Value::Null),
                    _ => None,
                };
                if let Some(r) = rendered {
                    map.insert(format!("{field}_rfc3339"), r);
                }
            }
            for key in NESTED {
                if let Some(inner) = map.get_mut(*key) {
                    annotate(inner);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_in_utc_with_milliseconds() {
        assert_eq!(rfc3339(0).unwrap(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(1_796_181_622_924).unwrap(),
            "2026-12-02T03:20:22.924Z"
        );
        assert_eq!(rfc3339(i64::MAX), None);
    }

    #[test]
    fn relative_hints_round_down() {
        let now = 1_000_000_000_000;
        assert_eq!(relative(now + 2_000, now), "now");
        assert_eq!(relative(now - 45_000, now), "45 s ago");
        assert_eq!(relative(now - 4 * 60_000 - 59_000, now), "4 min ago");
        assert_eq!(relative(now + 24 * 3_600_000 - 60_000, now), "in 23 h");
        assert_eq!(relative(now - 3 * 86_400_000, now), "3 d ago");
    }

    #[test]
    fn annotate_adds_siblings_and_leaves_bodies_alone() {
        let mut v = serde_json::json!({
            "created_at": 0, "decided_at": null, "request_body": {"at": 5},
            "transitions": [{"at": 1000}], "dead_letters": [{"since": 2000}],
            "policy_decisions": [{"at": 3000}], "compensation": {"created_at": 4000},
        });
        annotate(&mut v);
        assert_eq!(v["created_at_rfc3339"], "1970-01-01T00:00:00.000Z");
        assert_eq!(v["decided_at_rfc3339"], Value::Null);
        assert_eq!(
            v["transitions"][0]["at_rfc3339"],
            "1970-01-01T00:00:01.000Z"
        );
        assert_eq!(
            v["dead_letters"][0]["since_rfc3339"],
            "1970-01-01T00:00:02.000Z"
        );
        assert_eq!(
            v["policy_decisions"][0]["at_rfc3339"],
            "1970-01-01T00:00:03.000Z"
        );
        assert_eq!(
            v["compensation"]["created_at_rfc3339"],
            "1970-01-01T00:00:04.000Z"
        );
        assert_eq!(v["request_body"], serde_json::json!({"at": 5}));
    }
}
