//! RFC 9457 problem details for [`OpError`]: the status, the problem
//! object with its extension members, and the response headers that go
//! with it (`Retry-After`, `WWW-Authenticate`).
//!
//! Internal errors (`internal`, `ledger-unavailable`) are logged with an
//! error id; the caller's `detail` names that id, never the internal text
//! (SQL, driver messages).

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

pub use crate::ops::OpError;

/// Media type of problem details (RFC 9457 §3).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The HTTP mapping of an [`OpError`].
pub trait Problem {
    /// The HTTP status.
    fn status(&self) -> StatusCode;
    /// The problem details object (RFC 9457 §3.1) with extension members.
    fn problem(&self) -> Value;
}

impl Problem for OpError {
    fn status(&self) -> StatusCode {
        match self {
            OpError::Unauthenticated => StatusCode::UNAUTHORIZED,
            OpError::Forbidden { .. } => StatusCode::FORBIDDEN,
            OpError::NotFound(_) => StatusCode::NOT_FOUND,
            OpError::IdempotencyKeyMissing { .. } | OpError::IdempotencyKeyInvalid(_) => {
                StatusCode::BAD_REQUEST
            }
            OpError::FingerprintMismatch { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            OpError::InFlight { .. } => StatusCode::CONFLICT,
            OpError::OutcomeUnknown { status, .. } => *status,
            OpError::DeadLettered { .. } | OpError::Conflict(_) => StatusCode::CONFLICT,
            OpError::PolicyDenied { status, .. } => *status,
            OpError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            OpError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            OpError::PolicyFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            OpError::ContractViolation { .. } | OpError::CompensationUnresolved { .. } => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            OpError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            OpError::RequestTimeout { .. } | OpError::BodyStalled { .. } => {
                StatusCode::REQUEST_TIMEOUT
            }
            OpError::UnsupportedContentEncoding { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            OpError::TransferCodingNotImplemented { .. } => StatusCode::NOT_IMPLEMENTED,
            OpError::TenantLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            OpError::QuotaExceeded { .. } => StatusCode::INSUFFICIENT_STORAGE,
            OpError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            OpError::InboxRejected { check, .. } if *check == "body-too-large" => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            OpError::InboxRejected { check, .. } if *check == "body-timeout" => {
                StatusCode::REQUEST_TIMEOUT
            }
            OpError::InboxRejected { .. } => StatusCode::BAD_REQUEST,
            OpError::ProviderUnreachable(_) | OpError::ProviderAnswerUnreadable(_) => {
                StatusCode::BAD_GATEWAY
            }
            OpError::ProviderTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            OpError::LedgerUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn problem(&self) -> Value {
        let status = self.status();
        let mut body = Map::new();
        body.insert(
            "type".into(),
            json!(format!("urn:effectgate:problem:{}", self.kind())),
        );
        body.insert(
            "title".into(),
            json!(status.canonical_reason().unwrap_or("Error")),
        );
        body.insert("status".into(), json!(status.as_u16()));
        body.insert("detail".into(), json!(self.to_string()));
        match self {
            OpError::IdempotencyKeyMissing { .. } | OpError::IdempotencyKeyInvalid(_) => {
                body.insert("field".into(), json!("header:Idempotency-Key"));
            }
            OpError::FingerprintMismatch { key } => {
                body.insert("field".into(), json!("header:Idempotency-Key"));
                body.insert("operation_id".into(), json!(key));
            }
            OpError::InFlight { operation_id, .. }
            | OpError::OutcomeUnknown { operation_id, .. } => {
                body.insert("operation_id".into(), json!(operation_id));
            }
            OpError::DeadLettered {
                operation_id,
                reason,
            } => {
                body.insert("operation_id".into(), json!(operation_id));
                body.insert("reason".into(), json!(reason));
            }
            OpError::PayloadTooLarge {
                limit,
                decoded_from,
                ..
            } => {
                body.insert("field".into(), json!("body"));
                body.insert("limit_bytes".into(), json!(limit));
                if let Some(coding) = decoded_from {
                    body.insert("content_encoding".into(), json!(coding));
                }
            }
            OpError::MethodNotAllowed(_) => {
                body.insert("field".into(), json!("method"));
            }
            OpError::UnsupportedContentEncoding { coding } => {
                body.insert("field".into(), json!("header:Content-Encoding"));
                body.insert("coding".into(), json!(coding));
            }
            OpError::TransferCodingNotImplemented { coding } => {
                body.insert("field".into(), json!("header:Transfer-Encoding"));
                body.insert("coding".into(), json!(coding));
            }
            OpError::RequestTimeout { limit_ms } | OpError::BodyStalled { limit_ms } => {
                body.insert("field".into(), json!("body"));
                body.insert("limit_ms".into(), json!(limit_ms));
            }
            OpError::ProviderTimeout { limit_ms } => {
                body.insert("limit_ms".into(), json!(limit_ms));
            }
            OpError::QuotaExceeded {
                limit_bytes,
                stored_bytes,
                ..
            } => {
                body.insert("limit_bytes".into(), json!(limit_bytes));
                body.insert("stored_bytes".into(), json!(stored_bytes));
            }
            OpError::TenantLimited { limit, .. } => {
                body.insert("limit".into(), json!(limit));
            }
            OpError::HeadersTooLarge { limit } => {
                body.insert("field".into(), json!("headers"));
                body.insert("limit_bytes".into(), json!(limit));
            }
            OpError::PolicyDenied { policy, reason, .. } => {
                body.insert("policy".into(), json!(policy));
                body.insert("reason".into(), json!(reason));
            }
            OpError::PolicyFailed { policy, .. } => {
                body.insert("policy".into(), json!(policy));
            }
            OpError::ContractViolation { errors } => {
                body.insert("field".into(), json!("body"));
                body.insert(
                    "errors".into(),
                    json!(
                        errors
                            .iter()
                            .map(|(p, m)| json!({"pointer": p, "message": m}))
                            .collect::<Vec<_>>()
                    ),
                );
            }
            OpError::BadRequest { field, .. } => {
                body.insert("field".into(), json!(field));
            }
            OpError::InboxRejected {
                check,
                field,
                limit_bytes,
                limit_ms,
                ..
            } => {
                body.insert("check".into(), json!(check));
                body.insert("field".into(), json!(field));
                if let Some(limit) = limit_bytes {
                    body.insert("limit_bytes".into(), json!(limit));
                }
                if let Some(limit) = limit_ms {
                    body.insert("limit_ms".into(), json!(limit));
                }
            }
            OpError::CompensationUnresolved { placeholder, .. } => {
                body.insert("field".into(), json!(format!("{{{placeholder}}}")));
                body.insert("placeholder".into(), json!(placeholder));
            }
            OpError::Unauthenticated => {
                body.insert("field".into(), json!("header:Authorization"));
            }
            _ => {}
        }
        Value::Object(body)
    }
}

impl IntoResponse for OpError {
    fn into_response(self) -> Response {
        let mut problem = self.problem();
        if matches!(self, OpError::Internal(_) | OpError::LedgerUnavailable(_)) {
            // The internal text goes to the log under an id; the caller
            // gets the id, to quote when asking.
            let error_id = format!("{:016x}", rand::random::<u64>());
            tracing::error!(kind = self.kind(), %error_id, error = %self, "request failed");
            problem["detail"] = json!(match self {
                OpError::LedgerUnavailable(_) => format!(
                    "the effect ledger is unavailable; nothing was forwarded (error id {error_id})"
                ),
                _ => format!("internal error (error id {error_id})"),
            });
            problem["error_id"] = json!(error_id);
        }
        let status = self.status();
        let mut resp = (status, problem.to_string()).into_response();
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let OpError::InFlight { retry_after_s, .. }
        | OpError::TenantLimited { retry_after_s, .. } = &self
        {
            h.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
        }
        if matches!(
            self,
            OpError::RequestTimeout { .. } | OpError::BodyStalled { .. }
        ) || matches!(&self, OpError::InboxRejected { check, .. } if *check == "body-timeout")
        {
            // The rest of the body may still come: the connection can't
            // carry another request (RFC 9110 §15.5.9).
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let OpError::OutcomeUnknown {
            status,
            retry_after_s,
            ..
        } = &self
            && *status == StatusCode::CONFLICT
        {
            h.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
        }
        if matches!(self, OpError::UnsupportedContentEncoding { .. }) {
            // The codings a request body may have (RFC 9110 §12.5.3).
            h.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static(crate::encoding::REQUEST_CODINGS),
            );
        }
        if matches!(self, OpError::Unauthenticated) {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
