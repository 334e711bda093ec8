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
/// `event-id-missing` or `sequence-missing`; 413 `body-too-large` past the
/// source's `max_body_bytes`; 404 for an unknown source.
pub async fn receive(
    State(app): State<AppState>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let settings = app.settings();
    let Some(src) = settings.inbox.get(&name).cloned() else {
        return OpError::NotFound(format!("no inbox source {name:?}")).into_response();
    };
    drop(settings);
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, src.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            crate::metrics::inbox_rejected(&src.name, "body-too-large");
            return OpError::InboxRejected {
                check: "body-too-large",
                field: "body".into(),
                message: format!(
                    "the body is larger than the source's max_body_bytes ({})",
                    src.max_body_bytes
                ),
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
