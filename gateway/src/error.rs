//! The gateway's one error type, rendered as RFC 9457 `application/problem+json`.
//!
//! Every kind has a stable `type` URI of the form
//! `urn:effectgate:problem:<kind>` (see [`ApiError::kind`]); the README's
//! status table lists them all.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

/// Media type of problem details (RFC 9457 §3).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An error answered to a caller.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 401: no or unknown `Authorization: Bearer` key.
    #[error("a valid gateway API key is required (Authorization: Bearer <key>)")]
    Unauthenticated,
    /// 403: the key is valid but its role may not do this.
    #[error("the {role} role may not {action}")]
    Forbidden {
        /// The principal's role.
        role: &'static str,
        /// What was attempted.
        action: &'static str,
    },
    /// 404: no route (or resource) by that name for this principal.
    #[error("{0}")]
    NotFound(String),
    /// 400: the `Idempotency-Key` header is missing on an effectful route
    /// (draft-ietf-httpapi-idempotency-key-header §2.7).
    #[error("the Idempotency-Key header is required for {method} on route {route}")]
    IdempotencyKeyMissing {
        /// Request method.
        method: String,
        /// Route name.
        route: String,
    },
    /// 400: the `Idempotency-Key` header is malformed, too long or repeated (§2.1).
    #[error("invalid Idempotency-Key header: {0}")]
    IdempotencyKeyInvalid(String),
    /// 422: the key was already used with a different request (§2.7).
    #[error(
        "idempotency key {key:?} was already used for a different request (fingerprint mismatch)"
    )]
    FingerprintMismatch {
        /// The key.
        key: String,
    },
    /// 409: the operation is being executed right now (§2.7).
    #[error("operation {operation_id:?} is in flight; retry after {retry_after_s} s")]
    InFlight {
        /// The operation.
        operation_id: String,
        /// Suggested `Retry-After`, in seconds.
        retry_after_s: u64,
    },
    /// 409 (duplicate) or 502/504 (first call): the provider may or may not
    /// have applied the effect. Never retried blindly.
    #[error("the outcome of operation {operation_id:?} is unknown: {detail}")]
    OutcomeUnknown {
        /// The operation.
        operation_id: String,
        /// What happened.
        detail: String,
        /// HTTP status to answer with.
        status: StatusCode,
    },
    /// 409: the operation stopped running automatically (dead letter) and
    /// waits for an operator.
    #[error(
        "operation {operation_id:?} is on the terminal route ({reason}); an operator must requeue or resolve it"
    )]
    DeadLettered {
        /// The operation.
        operation_id: String,
        /// Why it was dead-lettered.
        reason: String,
    },
    /// 409: the requested action is not allowed in the operation's state or by policy.
    #[error("{0}")]
    Conflict(String),
    /// 4xx chosen by a policy: the request was denied.
    #[error("denied by policy {policy}: {reason}")]
    PolicyDenied {
        /// The 4xx status the policy chose.
        status: StatusCode,
        /// The policy.
        policy: String,
        /// Its reason.
        reason: String,
    },
    /// 503: a policy trapped, timed out or ran out of memory, and the route
    /// fails closed. Nothing was forwarded.
    #[error("policy {policy} failed: {detail}")]
    PolicyFailed {
        /// The policy.
        policy: String,
        /// What happened.
        detail: String,
    },
    /// 422: the body does not satisfy the route's request contract (JSON Schema).
    #[error("the request body does not satisfy the route's contract")]
    ContractViolation {
        /// `[{pointer, message}]`.
        errors: Vec<(String, String)>,
    },
    /// 405: a method the gateway never forwards (TRACE, CONNECT).
    #[error("method not allowed: {0}")]
    MethodNotAllowed(String),
    /// 431: the request headers exceed `limits.max_header_bytes`.
    #[error("request headers exceed the limit of {limit} bytes")]
    HeadersTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 413: the request body exceeds the route's `max_body_bytes`.
    #[error("request body exceeds the route's limit of {limit} bytes")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 408: the request body did not arrive within
    /// `limits.body_read_timeout_ms`; nothing was reserved or sent.
    #[error("the request body did not arrive within {limit_ms} ms; nothing was recorded or sent")]
    RequestTimeout {
        /// The limit in ms.
        limit_ms: u64,
    },
    /// 429: the tenant's rate limit or in-flight limit refused the call
    /// (nothing was recorded or sent); retry after `retry_after_s`.
    #[error("the tenant's {limit} limit is reached; nothing was recorded or sent, retry later")]
    TenantLimited {
        /// `rate` or `in-flight`.
        limit: &'static str,
        /// Seconds to wait (`Retry-After`, RFC 9110 §10.2.3).
        retry_after_s: u64,
    },
    /// 400: some other malformed input; `field` names it.
    #[error("{message}")]
    BadRequest {
        /// The offending field, parameter or header.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// 502: the provider could not be reached and nothing was sent.
    #[error("the provider could not be reached: {0}")]
    ProviderUnreachable(String),
    /// 503: the effect ledger is not available, so the request was not
    /// forwarded. A ledger write that timed out may still have committed
    /// (the operation is then reserved and the reconciler finishes it), so
    /// the caller retries with the same `Idempotency-Key`.
    #[error(
        "the effect ledger is unavailable: {0}; the request was not forwarded; retry with the same Idempotency-Key"
    )]
    LedgerUnavailable(String),
    /// 500: a bug or an unexpected condition.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The stable problem kind (last segment of the `type` URI).
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Unauthenticated => "unauthenticated",
            ApiError::Forbidden { .. } => "forbidden",
            ApiError::NotFound(_) => "not-found",
            ApiError::IdempotencyKeyMissing { .. } => "idempotency-key-missing",
            ApiError::IdempotencyKeyInvalid(_) => "idempotency-key-invalid",
            ApiError::FingerprintMismatch { .. } => "idempotency-key-reused",
            ApiError::InFlight { .. } => "operation-in-flight",
            ApiError::OutcomeUnknown { .. } => "operation-outcome-unknown",
            ApiError::DeadLettered { .. } => "operation-dead-lettered",
            ApiError::PolicyDenied { .. } => "policy-denied",
            ApiError::MethodNotAllowed(_) => "method-not-allowed",
            ApiError::HeadersTooLarge { .. } => "headers-too-large",
            ApiError::PolicyFailed { .. } => "policy-failed",
            ApiError::ContractViolation { .. } => "contract-violation",
            ApiError::Conflict(_) => "conflict",
            ApiError::PayloadTooLarge { .. } => "payload-too-large",
            ApiError::RequestTimeout { .. } => "request-timeout",
            ApiError::TenantLimited { .. } => "tenant-limited",
            ApiError::BadRequest { .. } => "bad-request",
            ApiError::ProviderUnreachable(_) => "provider-unreachable",
            ApiError::LedgerUnavailable(_) => "ledger-unavailable",
            ApiError::Internal(_) => "internal",
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthenticated => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::IdempotencyKeyMissing { .. } | ApiError::IdempotencyKeyInvalid(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::FingerprintMismatch { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::InFlight { .. } => StatusCode::CONFLICT,
            ApiError::OutcomeUnknown { status, .. } => *status,
            ApiError::DeadLettered { .. } | ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PolicyDenied { status, .. } => *status,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::PolicyFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::ContractViolation { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::TenantLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ProviderUnreachable(_) => StatusCode::BAD_GATEWAY,
            ApiError::LedgerUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem details object (RFC 9457 §3.1) with extension members.
    pub fn problem(&self) -> Value {
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
            ApiError::IdempotencyKeyMissing { .. } | ApiError::IdempotencyKeyInvalid(_) => {
                body.insert("field".into(), json!("header:Idempotency-Key"));
            }
            ApiError::FingerprintMismatch { key } => {
                body.insert("field".into(), json!("header:Idempotency-Key"));
                body.insert("operation_id".into(), json!(key));
            }
            ApiError::InFlight { operation_id, .. }
            | ApiError::OutcomeUnknown { operation_id, .. } => {
                body.insert("operation_id".into(), json!(operation_id));
            }
            ApiError::DeadLettered {
                operation_id,
                reason,
            } => {
                body.insert("operation_id".into(), json!(operation_id));
                body.insert("reason".into(), json!(reason));
            }
            ApiError::PayloadTooLarge { limit } => {
                body.insert("field".into(), json!("body"));
                body.insert("limit_bytes".into(), json!(limit));
            }
            ApiError::MethodNotAllowed(_) => {
                body.insert("field".into(), json!("method"));
            }
            ApiError::RequestTimeout { limit_ms } => {
                body.insert("field".into(), json!("body"));
                body.insert("limit_ms".into(), json!(limit_ms));
            }
            ApiError::TenantLimited { limit, .. } => {
                body.insert("limit".into(), json!(limit));
            }
            ApiError::HeadersTooLarge { limit } => {
                body.insert("field".into(), json!("headers"));
                body.insert("limit_bytes".into(), json!(limit));
            }
            ApiError::PolicyDenied { policy, reason, .. } => {
                body.insert("policy".into(), json!(policy));
                body.insert("reason".into(), json!(reason));
            }
            ApiError::PolicyFailed { policy, .. } => {
                body.insert("policy".into(), json!(policy));
            }
            ApiError::ContractViolation { errors } => {
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
            ApiError::BadRequest { field, .. } => {
                body.insert("field".into(), json!(field));
            }
            ApiError::Unauthenticated => {
                body.insert("field".into(), json!("header:Authorization"));
            }
            _ => {}
        }
        Value::Object(body)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, ApiError::Internal(_) | ApiError::LedgerUnavailable(_)) {
            tracing::error!(kind = self.kind(), error = %self, "request failed");
        }
        let status = self.status();
        let mut resp = (status, self.problem().to_string()).into_response();
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let ApiError::InFlight { retry_after_s, .. }
        | ApiError::TenantLimited { retry_after_s, .. } = &self
        {
            h.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
        }
        if matches!(self, ApiError::RequestTimeout { .. }) {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let ApiError::OutcomeUnknown { status, .. } = &self
            && *status == StatusCode::CONFLICT
        {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        if matches!(self, ApiError::Unauthenticated) {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::LedgerUnavailable(e.to_string())
    }
}

impl From<crate::ledger::LedgerError> for crate::error::ApiError {
    fn from(e: crate::ledger::LedgerError) -> Self {
        match e {
            crate::ledger::LedgerError::IllegalTransition { .. } => {
                crate::error::ApiError::Internal(e.to_string())
            }
            other => crate::error::ApiError::LedgerUnavailable(other.to_string()),
        }
    }
}
