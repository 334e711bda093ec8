//! A verified webhook's event id, type and ordering, read from its body
//! or headers.

use http::HeaderMap;
use serde_json::Value;

use super::reject;
use crate::config::{EventIdAt, InboxSource};
use crate::ops::OpError;

/// The text at `ptr` in `v`: a string as it is, a number or boolean
/// written out; `None` for anything else or nothing. What a resolution
/// rule compares (`match`, `provider_key`, `reference`) and a success
/// event records.
pub fn text_at(v: &Value, ptr: &str) -> Option<String> {
    match v.pointer(ptr)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// An identity at `ptr` in `v` (the event id, type or sequence key):
/// `Ok(None)` when there is nothing there, `Ok(Some)` for a string or an
/// integer within 64 bits (its digits). Anything else is `Err`: a number
/// that is not such an integer (`1.0`, `98765432109876543210001`) is read
/// as a float, whose text is not the provider's (`9.876543210987654e+22`),
/// so two distinct ids would read alike; a boolean or an object names no
/// one event.
fn identity_at(v: &Value, ptr: &str) -> Result<Option<String>, ()> {
    match v.pointer(ptr) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(Some(n.to_string())),
        Some(_) => Err(()),
    }
}

/// Refuses an id, type or sequence key holding U+0000: the ledger stores
/// them as text, which on PostgreSQL can't hold it, and replacing it
/// would make two ids one.
///
/// Errors: [`OpError::InboxRejected`] with check `text-invalid` naming
/// `field`.
fn without_nul(text: String, field: impl Into<String>, what: &str) -> Result<String, OpError> {
    if text.contains('\0') {
        return Err(reject(
            "text-invalid",
            field,
            format!("the {what} holds U+0000 (NUL), which the inbox does not store"),
        ));
    }
    Ok(text)
}

/// A verified event, read.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The body as JSON.
    pub json: Value,
    /// The event id.
    pub event_id: String,
    /// Its type, if the body names one.
    pub event_type: Option<String>,
    /// `(sequence key, sequence)`, when the source orders events.
    pub ordering: Option<(String, i64)>,
}

/// Reads the event id, type and sequence of a verified body; the event id
/// and the sequence key are at most `max_id_bytes` long
/// (`limits.max_inbox_id_bytes`).
///
/// Errors: [`OpError::InboxRejected`] with check `body-not-json` (also
/// for an object that repeats a key, at any depth: RFC 7493 §2.3),
/// `event-id-missing` or `sequence-missing` (also for one longer than
/// `max_id_bytes`), or `text-invalid`.
pub fn parse(
    src: &InboxSource,
    headers: &HeaderMap,
    body: &[u8],
    max_id_bytes: usize,
) -> Result<Parsed, OpError> {
    let json: Value = serde_json::from_slice(body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| reject("body-not-json", "body", "the body is not a JSON object"))?;
    // Which of two `"id"` members names the event is the reader's guess:
    // a consumer taking the first would dedupe on another id than the
    // ledger's (the last), so a repeated key is no I-JSON object.
    if crate::idempotency::has_duplicate_keys(body) {
        return Err(reject(
            "body-not-json",
            "body",
            "a JSON object in the body repeats a key (RFC 7493 §2.3)",
        ));
    }
    let (event_id, field) = match &src.event_id {
        EventIdAt::Pointer(p) => (identity_at(&json, p).ok().flatten(), format!("body:{p}")),
        EventIdAt::Header(h) => {
            let field = format!("header:{h}");
            let mut values = headers.get_all(h).iter();
            // Two ids name no one event; a byte outside visible ASCII
            // (RFC 9110 §5.5 obs-text, and the space and tab a field value
            // may hold inside it) is no id a provider sends. HTTP/1.1's
            // parser drops the whitespace around a value (§5.5); over
            // HTTP/2 a value with it is malformed (RFC 9113 §8.2.1) and
            // refused here too, so an id is the very bytes a signature
            // over the header covered, over either protocol.
            let id = match (values.next(), values.next()) {
                (None, _) => Ok(None),
                (Some(_), Some(_)) => Err("appears more than once"),
                (Some(v), None) => v
                    .to_str()
                    .ok()
                    .filter(|s| s.bytes().all(|b| b.is_ascii_graphic()))
                    .map(|s| Some(s.to_owned()))
                    .ok_or("is not visible ASCII"),
            };
            let id = id.map_err(|fault| {
                reject(
                    "event-id-missing",
                    field.clone(),
                    format!("the {h} header {fault}; it names one event id"),
                )
            })?;
            (id, field)
        }
    };
    let event_id = event_id
        .filter(|s| !s.is_empty() && s.len() <= max_id_bytes)
        .ok_or_else(|| {
            reject(
                "event-id-missing",
                field.clone(),
                format!(
                    "no event id (a string of 1..={max_id_bytes} bytes, limits.max_inbox_id_bytes, or an integer) there"
                ),
            )
        })?;
    let event_id = without_nul(event_id, field, "event id")?;
    let type_field = format!("body:{}", src.event_type);
    let event_type = identity_at(&json, &src.event_type)
        .map_err(|()| {
            reject(
                "text-invalid",
                type_field.clone(),
                "the event type there is not a string (or an integer)",
            )
        })?
        .map(|t| without_nul(t, type_field, "event type"))
        .transpose()?;
    let ordering = match &src.ordering {
        None => None,
        Some((kp, sp)) => {
            let key = identity_at(&json, kp)
                .ok()
                .flatten()
                .filter(|k| !k.is_empty() && k.len() <= max_id_bytes)
                .ok_or_else(|| {
                    reject(
                        "sequence-missing",
                        format!("body:{kp}"),
                        format!("no sequence key (a string of 1..={max_id_bytes} bytes, limits.max_inbox_id_bytes, or an integer) there"),
                    )
                })?;
            let key = without_nul(key, format!("body:{kp}"), "sequence key")?;
            let seq = json
                .pointer(sp)
                .and_then(|v| {
                    v.as_i64()
                        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                })
                .ok_or_else(|| {
                    reject(
                        "sequence-missing",
                        format!("body:{sp}"),
                        "no integer sequence there",
                    )
                })?;
            Some((key, seq))
        }
    };
    Ok(Parsed {
        json,
        event_id,
        event_type,
        ordering,
    })
}
