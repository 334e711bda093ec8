//! The outbox relay: delivers events (approvals, operation events, inbox
//! events) to tenants' webhooks, at least once, from the outbox table the
//! events were written to in the same transaction as the change they
//! announce. Each POST is signed twice: `Effectgate-Signature` (hex
//! HMAC-SHA256 of the body) and Standard Webhooks (`webhook-id` = the
//! event id, stable across redeliveries; `webhook-timestamp`;
//! `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`,
//! keyed with the base64 after `whsec_` when the secret has that prefix).

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::state::AppState;
use crate::workers::WorkerError;
use tracing::Instrument;

/// The outbox relay: delivers approval events to tenants' webhooks, at
/// least once, signed. Runs until `shutdown`.
pub async fn relay(app: AppState, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    loop {
        if let Err(e) = crate::workers::inbox::tick(&app).await {
            tracing::warn!(error = %e, "inbox gap check failed");
        }
        if let Err(e) = relay_once(&app).await {
            tracing::warn!(error = %e, "outbox relay failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(app.settings().reconcile.interval_ms.min(500))) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

/// `Effectgate-Signature` value for `body`: `sha256=<hex HMAC-SHA256>`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// Standard Webhooks `webhook-signature` value for message `id` at unix
/// second `ts` with `body`: `v1,<base64 HMAC-SHA256 of "id.ts.body">`,
/// keyed with [`crate::config::standard_webhooks_key`] of `secret`.
pub fn standard_signature(secret: &[u8], id: &str, ts: i64, body: &[u8]) -> String {
    use base64::Engine;
    let key = std::str::from_utf8(secret)
        .ok()
        .and_then(crate::config::standard_webhooks_key)
        .unwrap_or_else(|| secret.to_vec());
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key).expect("HMAC accepts any key length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(ts.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

/// Events delivered at the same time by one relay.
const RELAY_CONCURRENCY: usize = 8;
/// Most events one relay pass delivers.
const RELAY_MAX_EVENTS: usize = 48;

/// One delivery pass over the due events, 8 at a time, so one tenant's
/// slow receiver doesn't hold up the others' events. Each round claims
/// only the 8 it delivers. Concurrent calls in one instance take turns: a
/// call while another pass is delivering waits for it
/// ([`crate::state::Lifecycle::relay_pass`]).
pub async fn relay_once(app: &AppState) -> Result<usize, WorkerError> {
    use futures_util::StreamExt;
    let _pass = app.lifecycle.relay_pass.lock().await;
    let rt = app.settings();
    let lease = i64::try_from(rt.reconcile.outbox_lease_ms).unwrap_or(i64::MAX);
    // A delivery must end well inside the claim, or the claim lapses and
    // another relay delivers the event too: claim only what is delivered
    // at once, and time a delivery out at two thirds of the claim.
    let timeout = Duration::from_millis((rt.reconcile.outbox_lease_ms * 2 / 3).clamp(1, 5_000));
    let mut delivered = 0;
    for _ in 0..(RELAY_MAX_EVENTS / RELAY_CONCURRENCY) {
        let events = app
            .ledger
            .claim_events(&app.instance_id, lease, RELAY_CONCURRENCY as u32)
            .await?;
        let claimed = events.len();
        let results: Vec<Result<bool, WorkerError>> = futures_util::stream::iter(events)
            .map(|ev| {
                let rt = rt.clone();
                async move { deliver(app, &rt, ev, timeout).await }
            })
            .buffer_unordered(RELAY_CONCURRENCY)
            .collect()
            .await;
        for r in results {
            if r? {
                delivered += 1;
            }
        }
        if claimed < RELAY_CONCURRENCY {
            break;
        }
    }
    let retention = i64::try_from(rt.reconcile.outbox_retention_ms).unwrap_or(i64::MAX);
    app.ledger.sweep_delivered_events(retention, 500).await?;
    Ok(delivered)
}

async fn deliver(
    app: &AppState,
    rt: &crate::state::Runtime,
    ev: crate::ledger::OutboxEvent,
    timeout: Duration,
) -> Result<bool, WorkerError> {
    let Some(hook) = rt.webhooks.get(&ev.tenant_id) else {
        // No webhook configured: nothing to deliver to; marked done.
        app.ledger
            .event_attempted(
                &ev.event_id,
                &app.instance_id,
                true,
                Some("no webhook configured"),
                0,
            )
            .await?;
        return Ok(false);
    };
    crate::failpoint::hit("before-deliver");
    let span = tracing::debug_span!(
        "webhook delivery",
        otel.name = "POST",
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        http.response.status_code = tracing::field::Empty,
        server.address = hook.url.host().unwrap_or(""),
        url.path = hook.url.path(),
        effectgate.tenant = ev.tenant_id.as_str(),
        effectgate.event_id = ev.event_id.as_str(),
        effectgate.event_type = ev.event_type.as_str(),
        effectgate.attempt = ev.attempts + 1,
    );
    let body = ev.payload.clone().into_bytes();
    let ts = app.ledger.clock().now_ms().div_euclid(1000);
    let inbox = (ev.event_type == "inbox.event")
        .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
        .flatten()
        .map(|v| v["data"].clone());
    let mut req = http::Request::post(hook.url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("effectgate-event-id", &ev.event_id)
        .header("effectgate-event-type", &ev.event_type)
        .header("effectgate-signature", signature(&hook.secret, &body))
        .header("webhook-id", &ev.event_id)
        .header("webhook-timestamp", ts.to_string())
        .header(
            "webhook-signature",
            standard_signature(&hook.secret, &ev.event_id, ts, &body),
        );
    if inbox.as_ref().is_some_and(|d| d["gap"] == true) {
        req = req.header("effectgate-gap", "true");
    }
    let req = req
        .body(crate::forward::OutboundBody::from(body))
        .map_err(|e| WorkerError::Request(e.to_string()))?;
    let result = tokio::time::timeout(timeout, hook.client.request(req))
        .instrument(span.clone())
        .await;
    match &result {
        Ok(Ok(r)) => {
            span.record("http.response.status_code", r.status().as_u16());
            if !r.status().is_success() {
                span.record("otel.status_code", "ERROR");
            }
        }
        _ => {
            span.record("otel.status_code", "ERROR");
        }
    }
    let now = app.ledger.clock().now_ms();
    match result {
        Ok(Ok(r)) if r.status().is_success() => {
            let done = app
                .ledger
                .event_attempted(&ev.event_id, &app.instance_id, true, None, now)
                .await?;
            if let (true, Some(d)) = (done, &inbox) {
                let source = d["source"].as_str().unwrap_or("");
                let received = d["received_at"].as_i64().unwrap_or(now);
                crate::metrics::inbox_delivered(
                    source,
                    Duration::from_millis(u64::try_from(now.saturating_sub(received)).unwrap_or(0)),
                );
            }
            Ok(true)
        }
        other => {
            let err = match other {
                Ok(Ok(r)) => format!("receiver answered {}", r.status()),
                Ok(Err(e)) => crate::forward::error_detail(&e),
                Err(_) => "timeout".into(),
            };
            // The retry budget: attempts and age. Past it the event is
            // dead-lettered, out of the relay's way, for an operator.
            let cfg = &rt.reconcile;
            let age = now.saturating_sub(ev.created_at);
            if ev.attempts + 1 >= i64::from(cfg.outbox_max_attempts)
                || age >= i64::try_from(cfg.outbox_max_age_ms).unwrap_or(i64::MAX)
            {
                tracing::warn!(tenant = %ev.tenant_id, event_id = %ev.event_id, attempts = ev.attempts + 1,
                    error = %err, "webhook event dead-lettered: its retry budget is spent");
                app.ledger
                    .event_given_up(&ev.event_id, &app.instance_id, &err)
                    .await?;
                return Ok(false);
            }
            // 1 s, doubling per failed attempt, at most 5 min.
            let attempt = u32::try_from(ev.attempts.clamp(0, 10)).unwrap_or(10) + 1;
            let backoff = crate::ops::backoff::delay_ms(
                1_000,
                300_000,
                attempt,
                crate::ops::backoff::Jitter::None,
            ) as i64;
            app.ledger
                .event_attempted(
                    &ev.event_id,
                    &app.instance_id,
                    false,
                    Some(&err),
                    now + backoff,
                )
                .await?;
            Ok(false)
        }
    }
}
