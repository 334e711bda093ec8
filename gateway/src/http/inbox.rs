//! `POST /inbox/<name>` on the proxy listener: provider webhooks. They
//! authenticate by the source's signature, not by a gateway key; the
//! answer (200, or a problem naming the failed check) comes as soon as the
//! event is durable in the inbox, never after its delivery.

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};

use crate::ops::OpError;
use crate::state::AppState;

/// Receives one webhook for source `name`: 200 `{"event_id", "state",
/// "delivery_id"}` (`state` is `accepted`, `stale`, `held` or
/// `duplicate`); 400 with check `signature-missing`, `signature-malformed`,
/// `signature-mismatch`, `timestamp-outside-tolerance`, `body-not-json`,
/// `event-id-missing`, `sequence-missing`, `text-invalid` or
/// `body-unreadable` (shorter than its `Content-Length`, a malformed or
/// cut-off chunk: RFC 9112 §6.3, §7.1); 413 `body-too-large` past the
/// source's `max_body_bytes` (named as `limit_bytes`); 408 `body-timeout`
/// when the body doesn't arrive whole within `limits.body_read_timeout_ms`
/// (named as `limit_ms`; the source's
/// signature is checked only on a whole body, so a sender without one
/// can't hold a connection longer than that); 404 for an unknown source.
pub async fn receive(
    State(app): State<AppState>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let settings = app.settings();
    let Some(src) = settings.inbox.get(&name).cloned() else {
        return OpError::NotFound(format!("no inbox source {name:?}")).into_response();
    };
    let timeout_ms = settings.limits.body_read_timeout_ms;
    drop(settings);
    let (parts, body) = req.into_parts();
    let read = crate::http::body::read_body(
        &parts.headers,
        body,
        src.max_body_bytes,
        "the source's max_body_bytes",
        timeout_ms,
    )
    .await;
    let bytes = match read {
        Ok(b) => b,
        Err(e) => {
            let (check, message, limit_bytes, limit_ms) = match e {
                OpError::PayloadTooLarge { .. } => (
                    "body-too-large",
                    format!(
                        "the body is larger than the source's max_body_bytes ({})",
                        src.max_body_bytes
                    ),
                    Some(src.max_body_bytes),
                    None,
                ),
                OpError::RequestTimeout { limit_ms } => (
                    "body-timeout",
                    format!(
                        "the body did not arrive whole within {limit_ms} ms (limits.body_read_timeout_ms)"
                    ),
                    None,
                    Some(limit_ms),
                ),
                other => ("body-unreadable", other.to_string(), None, None),
            };
            crate::metrics::inbox_rejected(&src.name, check);
            return OpError::InboxRejected {
                check,
                field: "body".into(),
                message,
                limit_bytes,
                limit_ms,
            }
            .into_response();
        }
    };
    match crate::ops::inbox::receive(&app, &src, &parts.headers, &bytes).await {
        Ok(r) => axum::Json(serde_json::json!({
            "event_id": r.event_id,
            "state": r.state,
            "delivery_id": r.delivery_id,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}
