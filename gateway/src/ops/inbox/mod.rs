//! Receiving provider webhooks: signature and timestamp checks, the event
//! id, then one ledger transaction: the deduplicating insert with its
//! ordering decision and delivery, and what the event says about the
//! operation it names (`resolves`).
//!
//! Signature schemes (`inbox[].scheme`):
//! - `stripe`: `Stripe-Signature: t=<unix s>,v1=<hex>[,v1=<hex>…]`, each
//!   `v1` an HMAC-SHA256 of `"<t>.<body>"` with the secret as written
//!   (Stripe's `Webhook.construct_event`);
//! - `standard-webhooks`: `webhook-id`, `webhook-timestamp` (unix s) and
//!   `webhook-signature: v1,<base64> [v1,<base64>…]`, each an HMAC-SHA256
//!   of `"<id>.<timestamp>.<body>"` keyed with the base64 after `whsec_`
//!   (standardwebhooks.com, "Verifying webhook authenticity");
//! - `hmac-sha256`: the named header holds `sha256=<hex>` (or bare hex)
//!   of the body (GitHub's `X-Hub-Signature-256`). It carries no
//!   timestamp: a replay is stopped by the dedupe window only.
//!
//! Either configured secret verifies (rotation). A timestamp more than
//! `tolerance_ms` away from now, in either direction, is refused after the
//! signature checked out. Every refusal is counted by its check and
//! nothing of it is stored.
//!
//! [`verify`] checks the signature and timestamp, [`parse`] reads the
//! event's id, type and ordering; this module stores the event and applies
//! what it says.

mod event;
mod verify;

pub use event::{Parsed, parse, text_at};
pub use verify::verify;

use http::HeaderMap;
use serde_json::Value;

use crate::config::{InboxSource, ResolveBy, Resolves};
use crate::ledger::{
    InboxOrdering, Naming, NewInboxEvent, Outcome, Received, Resolution, Resolve, Resolved,
    Resolving, Says, State,
};
use crate::ops::OpError;
use crate::state::AppState;

/// A refusal of check `check` (one of [`crate::metrics::INBOX_CHECKS`])
/// naming `field`.
fn reject(check: &'static str, field: impl Into<String>, message: impl Into<String>) -> OpError {
    OpError::InboxRejected {
        check,
        field: field.into(),
        message: message.into(),
        limit_bytes: None,
        limit_ms: None,
    }
}

/// What receiving a webhook did, for the answer to the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The provider's event id.
    pub event_id: String,
    /// `accepted`, `stale`, `held` or `duplicate`.
    pub state: String,
    /// The delivery's event id (the consumer's `webhook-id`), when queued.
    pub delivery_id: Option<String>,
}

/// Receives one webhook for `src`: verified, read, and stored once with
/// its ordering decision, its delivery and what it says of the operation
/// it names (`resolves`), all in one ledger commit. The answer is due as
/// soon as this returns: the event, and its resolution, are durable.
///
/// Errors: [`OpError::InboxRejected`] (counted by check; nothing stored),
/// or the ledger's.
pub async fn receive(
    app: &AppState,
    src: &InboxSource,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Receipt, OpError> {
    let now = app.ledger.clock().now_ms();
    let max_id_bytes = app.settings().limits.max_inbox_id_bytes;
    let parsed = match verify(src, headers, body, now)
        .and_then(|()| parse(src, headers, body, max_id_bytes))
    {
        Ok(p) => p,
        Err(e) => {
            if let OpError::InboxRejected { check, .. } = &e {
                crate::metrics::inbox_rejected(&src.name, check);
                tracing::info!(source = %src.name, check, "inbox: webhook refused");
            }
            return Err(e);
        }
    };
    let payload = String::from_utf8_lossy(body);
    let ordering = parsed.ordering.as_ref().map(|(k, s)| InboxOrdering {
        key: k,
        sequence: *s,
        gaps: src.sequence_gaps,
        start: src.sequence_start,
        reorder_window_ms: i64::try_from(src.reorder_window_ms).unwrap_or(i64::MAX),
    });
    let actor = format!("inbox:{}", src.name);
    let lease_reason = format!(
        "inbox: {} event {} ({})",
        src.name,
        parsed.event_id,
        parsed.event_type.as_deref().unwrap_or("")
    );
    let resolving = resolving(app, src, &parsed, &actor, &lease_reason);
    let got = app
        .ledger
        .receive_inbox(&NewInboxEvent {
            tenant: &src.tenant,
            source: &src.name,
            event_id: &parsed.event_id,
            event_type: parsed.event_type.as_deref(),
            payload: &payload,
            deliver: src.deliver,
            ordering,
            resolve: resolving.as_ref(),
        })
        .await?;
    drop(resolving);
    crate::failpoint::hit("after-inbox-commit");
    let (state, delivery_id) = match got {
        Received::Duplicate { outbox_event_id } => {
            crate::metrics::inbox_received(&src.name, "duplicate");
            // The stored event's delivery, as its first answer gave it (a
            // held event's, once released).
            return Ok(Receipt {
                event_id: parsed.event_id,
                state: "duplicate".into(),
                delivery_id: outbox_event_id,
            });
        }
        Received::Stored {
            state,
            outbox_event_id,
            released,
            resolution,
        } => {
            let m = match state.as_str() {
                "stale" => "stale",
                "held" => "held",
                _ => "accepted",
            };
            crate::metrics::inbox_received(&src.name, m);
            if !released.is_empty() {
                tracing::info!(source = %src.name, released = ?released, "inbox: held events released in order");
            }
            if let Some(r) = resolution {
                resolved(app, src, &parsed, r).await?;
            }
            (state, outbox_event_id)
        }
    };
    Ok(Receipt {
        event_id: parsed.event_id,
        state,
        delivery_id,
    })
}

/// The `resolves` rules of `src` that apply to the event's type, in
/// order, for the ledger to apply in the event's commit; `None` when no
/// rule names the type.
fn resolving<'a>(
    app: &'a AppState,
    src: &'a InboxSource,
    ev: &'a Parsed,
    actor: &'a str,
    lease_reason: &'a str,
) -> Option<Resolving<'a>> {
    let ty = ev.event_type.as_deref()?;
    let mut rules = Vec::new();
    for rule in &src.resolves {
        let says = if rule.succeeded.iter().any(|t| t == ty) {
            let max = app.settings().limits.max_provider_reference_bytes;
            Says::Succeeded(Box::new(succeeded(src, rule, ev, ty, max)))
        } else if rule.failed.iter().any(|t| t == ty) {
            Says::Failed
        } else {
            continue;
        };
        let Some(naming) = naming(rule, &ev.json) else {
            continue;
        };
        rules.push(Resolve { naming, says });
    }
    if rules.is_empty() {
        return None;
    }
    Some(Resolving {
        rules,
        event_type: ty,
        actor,
        lease_owner: &app.instance_id[..],
        lease_ms: i64::try_from(app.settings().reconcile.lease_ms).unwrap_or(i64::MAX),
        lease_reason,
        max_candidates: app.settings().limits.max_list_limit,
    })
}

/// How `rule` names an operation in `event`; `None` when the event lacks
/// the provider key or reference it points at.
fn naming<'a>(rule: &'a Resolves, event: &'a Value) -> Option<Naming<'a>> {
    // No provider key or reference holds U+0000 (PostgreSQL's text can't):
    // such a value names no operation.
    let named = |p: &str| text_at(event, p).filter(|t| !t.contains('\0'));
    Some(match &rule.by {
        ResolveBy::ProviderKey(p) => Naming::ProviderKey(named(p)?),
        ResolveBy::Reference(p) => Naming::Reference(named(p)?),
        ResolveBy::Match { route, fields } => Naming::Match {
            route: route.as_str(),
            accepts: Box::new(move |o: &crate::ledger::Operation| {
                let body =
                    crate::template::body_value(o.request_content_type.as_deref(), &o.request_body);
                let vars = crate::template::Vars {
                    operation_id: &o.operation_id,
                    provider_key: &o.provider_key,
                    body: &body,
                    tenant: &o.tenant_id,
                    reference: None,
                    response: &Value::Null,
                };
                fields.iter().all(|(p, t)| {
                    text_at(event, p).is_some_and(|v| v == t.render(&vars, |s| s.to_owned()))
                })
            }),
        },
    })
}

/// The outcome a success event records: COMPLETED, the value at the
/// rule's `object` as the stored response, the reference at its
/// `reference`.
fn succeeded(
    src: &InboxSource,
    rule: &Resolves,
    ev: &Parsed,
    ty: &str,
    max_reference_bytes: usize,
) -> Outcome {
    let object = ev.json.pointer(&rule.object).unwrap_or(&ev.json);
    let body = serde_json::to_vec(object).unwrap_or_default();
    let mut o = Outcome::new(
        State::Completed,
        format!(
            "inbox: {} event {} ({ty}) says the effect exists",
            src.name, ev.event_id
        ),
    );
    o.response_status = Some(200);
    o.response_headers = vec![("content-type".into(), "application/json".into())];
    o.response_body_bytes = Some(body.len() as i64);
    o.response_body = Some(body);
    o.provider_reference = crate::ops::bounded_reference(
        rule.reference.as_deref().and_then(|p| text_at(&ev.json, p)),
        max_reference_bytes,
        &format!("inbox {} event {}", src.name, ev.event_id),
    );
    o
}

/// After the commit: counts and logs what the event did to the operation
/// it named; a failure event's read-back (already moved to now in the
/// ledger) is also started at once.
async fn resolved(
    app: &AppState,
    src: &InboxSource,
    ev: &Parsed,
    r: Resolution,
) -> Result<(), OpError> {
    match r.resolved {
        Resolved::Completed => {
            crate::metrics::inbox_resolution(&src.name, "completed");
            tracing::info!(tenant = %src.tenant, operation_id = %r.operation_id, source = %src.name,
                event_id = %ev.event_id, "inbox: UNKNOWN operation completed from a webhook event");
        }
        Resolved::Ignored(_) => crate::metrics::inbox_resolution(&src.name, "ignored"),
        Resolved::ReadBack => {
            // An event is not proof of absence: read back now instead.
            crate::metrics::inbox_resolution(&src.name, "read-back");
            let Some(op) = app.ledger.get(&src.tenant, &r.operation_id).await? else {
                return Ok(());
            };
            let app2 = app.clone();
            app.lifecycle.executions.spawn(async move {
                if let Err(e) = crate::ops::reconcile::reconcile_op(&app2, op).await {
                    tracing::warn!(error = %e, "inbox: read-back after a failure event failed");
                }
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::verify::mac;
    use super::*;
    use crate::config::{EventIdAt, InboxSource, OnGap, SignatureScheme};
    use hmac::Mac;

    fn source(scheme: SignatureScheme, secrets: &[&[u8]]) -> InboxSource {
        InboxSource {
            name: "s".into(),
            tenant: "t".into(),
            scheme,
            header: (scheme == SignatureScheme::HmacSha256)
                .then(|| http::HeaderName::from_static("x-hub-signature-256")),
            secrets: secrets.iter().map(|s| s.to_vec()).collect(),
            tolerance_ms: 300_000,
            event_id: EventIdAt::Pointer("/id".into()),
            event_type: "/type".into(),
            max_body_bytes: 1024,
            dedupe_window_ms: 300_000,
            sequence_window_ms: 300_000,
            deliver: true,
            ordering: None,
            sequence_gaps: true,
            sequence_start: 1,
            reorder_window_ms: 1,
            on_gap: OnGap::Deliver,
            resolves: Vec::new(),
        }
    }

    fn hex_mac(key: &[u8], msg: &[u8]) -> String {
        let mut m = mac(key);
        m.update(msg);
        hex::encode(m.finalize().into_bytes())
    }

    fn check(r: Result<(), OpError>) -> &'static str {
        match r {
            Ok(()) => "ok",
            Err(OpError::InboxRejected { check, .. }) => check,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn stripe_signatures_verify_under_either_secret_and_within_the_tolerance() {
        let src = source(SignatureScheme::Stripe, &[b"old", b"new"]);
        let body = br#"{"id":"evt_1"}"#;
        let now = 1_700_000_000_000;
        let sig = |key: &[u8], t: i64| {
            let mut h = HeaderMap::new();
            let v = format!(
                "t={t},v1={}",
                hex_mac(
                    key,
                    format!("{t}.{}", std::str::from_utf8(body).unwrap()).as_bytes()
                )
            );
            h.insert("stripe-signature", v.parse().unwrap());
            h
        };
        assert_eq!(
            check(verify(&src, &sig(b"old", now / 1000), body, now)),
            "ok"
        );
        assert_eq!(
            check(verify(&src, &sig(b"new", now / 1000), body, now)),
            "ok"
        );
        assert_eq!(
            check(verify(&src, &sig(b"other", now / 1000), body, now)),
            "signature-mismatch"
        );
        assert_eq!(
            check(verify(&src, &sig(b"new", now / 1000 - 301), body, now)),
            "timestamp-outside-tolerance"
        );
        assert_eq!(
            check(verify(&src, &sig(b"new", now / 1000 + 301), body, now)),
            "timestamp-outside-tolerance"
        );
        assert_eq!(
            check(verify(&src, &sig(b"new", now / 1000 - 299), body, now)),
            "ok"
        );
        assert_eq!(
            check(verify(&src, &HeaderMap::new(), body, now)),
            "signature-missing"
        );
        let mut h = HeaderMap::new();
        h.insert("stripe-signature", "t=abc".parse().unwrap());
        assert_eq!(check(verify(&src, &h, body, now)), "signature-malformed");
    }

    #[test]
    fn standard_webhooks_and_hmac_signatures_verify() {
        use base64::Engine;
        let key = b"0123456789abcdef";
        let src = source(SignatureScheme::StandardWebhooks, &[key]);
        let body = b"{}";
        let now = 1_700_000_000_000;
        let mut m = mac(key);
        m.update(b"msg_1.1700000000.{}");
        let sig = base64::engine::general_purpose::STANDARD.encode(m.finalize().into_bytes());
        let mut h = HeaderMap::new();
        h.insert("webhook-id", "msg_1".parse().unwrap());
        h.insert("webhook-timestamp", "1700000000".parse().unwrap());
        h.insert(
            "webhook-signature",
            format!("v1,AAAA v1,{sig}").parse().unwrap(),
        );
        assert_eq!(check(verify(&src, &h, body, now)), "ok");
        h.insert("webhook-id", "msg_2".parse().unwrap());
        assert_eq!(check(verify(&src, &h, body, now)), "signature-mismatch");

        let gh = source(SignatureScheme::HmacSha256, &[b"gh"]);
        let mut h = HeaderMap::new();
        h.insert(
            "x-hub-signature-256",
            format!("sha256={}", hex_mac(b"gh", body)).parse().unwrap(),
        );
        assert_eq!(check(verify(&gh, &h, body, now)), "ok");
        h.insert("x-hub-signature-256", "sha256=nothex".parse().unwrap());
        assert_eq!(check(verify(&gh, &h, body, now)), "signature-malformed");
    }

    #[test]
    fn the_event_id_and_sequence_are_read_or_refused() {
        let mut src = source(SignatureScheme::Stripe, &[b"k"]);
        src.ordering = Some(("/data/id".into(), "/data/v".into()));
        let h = HeaderMap::new();
        let p = parse(
            &src,
            &h,
            br#"{"id":"e","type":"x","data":{"id":"k1","v":"7"}}"#,
            255,
        )
        .unwrap();
        assert_eq!(
            (p.event_id.as_str(), p.event_type.as_deref()),
            ("e", Some("x"))
        );
        assert_eq!(p.ordering, Some(("k1".into(), 7)));
        let refused = |b: &[u8]| match parse(&src, &h, b, 4) {
            Err(OpError::InboxRejected { check, .. }) => check,
            other => panic!("{other:?}"),
        };
        assert_eq!(refused(b"[1]"), "body-not-json");
        assert_eq!(refused(br#"{"id":"d1","id":"d2"}"#), "body-not-json");
        assert_eq!(
            refused(br#"{"id":"e","data":{"id":"k1","v":1,"v":2}}"#),
            "body-not-json"
        );
        assert_eq!(refused(br#"{"id":""}"#), "event-id-missing");
        assert_eq!(
            refused(br#"{"id":"e","data":{"id":"k1"}}"#),
            "sequence-missing"
        );
        // Past the limit (4 bytes here): refused as missing, by name.
        assert_eq!(
            refused(br#"{"id":"e1234","data":{"id":"k1","v":1}}"#),
            "event-id-missing"
        );
        assert_eq!(
            refused(br#"{"id":"e","data":{"id":"k1234","v":1}}"#),
            "sequence-missing"
        );
        assert!(parse(&src, &h, br#"{"id":"e123","data":{"id":"k123","v":1}}"#, 4).is_ok());

        // An id from a header: one value of visible ASCII.
        let mut src = source(SignatureScheme::HmacSha256, &[b"k"]);
        src.event_id = EventIdAt::Header(http::HeaderName::from_static("x-delivery"));
        let with = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-delivery", http::HeaderValue::from_bytes(v).unwrap());
            }
            parse(&src, &h, br#"{"action":"opened"}"#, 255)
        };
        assert_eq!(with(&[b"d-1"]).unwrap().event_id, "d-1");
        for (values, says) in [
            (&[&b"d-1"[..], b"d-2"][..], "appears more than once"),
            (&[&b"d-\xe9"[..]][..], "is not visible ASCII"),
            (&[&b"d\t1"[..]][..], "is not visible ASCII"),
            (&[&b"d 1"[..]][..], "is not visible ASCII"),
            // As HTTP/2 hands it over (HTTP/1.1 drops the whitespace).
            (&[&b" d-1\t"[..]][..], "is not visible ASCII"),
            (&[][..], "no event id"),
        ] {
            match with(values) {
                Err(OpError::InboxRejected {
                    check,
                    field,
                    message,
                    ..
                }) => {
                    assert_eq!(
                        (check, field.as_str()),
                        ("event-id-missing", "header:x-delivery")
                    );
                    assert!(message.contains(says), "{message}");
                }
                other => panic!("{values:?}: {other:?}"),
            }
        }
    }
}
