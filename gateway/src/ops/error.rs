//! The use cases' error type. [`crate::http::error`] renders it as RFC 9457
//! `application/problem+json`; workers log it.
//!
//! Every kind has a stable `type` URI of the form
//! `urn:effectgate:problem:<kind>` (see [`OpError::kind`]); the README's
//! status table lists them all. `Internal` and `LedgerUnavailable` carry
//! text for the log only: callers get an error id, never that text.

use http::StatusCode;

/// Seconds a duplicate of an operation whose outcome is unknown is told
/// to wait (`Retry-After` of its 409) when no read-back is scheduled.
pub const UNKNOWN_RETRY_AFTER_S: u64 = 5;

/// An error of a use case, answered to a caller by the HTTP surface.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// 401: no or unknown `Authorization: Bearer` key.
    #[error("a valid gateway API key is required (Authorization: Bearer <key>)")]
    Unauthenticated,
    /// 403: the key is valid but its role may not do this.
    #[error("the {role} role may not {action}")]
    Forbidden {
        /// The principal's role.
        role: &'static str,
        /// What was attempted (and, where it helps, which roles may).
        action: std::borrow::Cow<'static, str>,
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
        /// With a 409: seconds for `Retry-After` (RFC 9110 §10.2.3), when
        /// the next read-back is due if one is scheduled, else
        /// [`UNKNOWN_RETRY_AFTER_S`].
        retry_after_s: u64,
    },
    /// 409: the operation stopped running automatically (dead letter) and
    /// waits for an operator.
    #[error(
        "operation {operation_id:?} is a dead letter ({reason}); an operator must requeue or resolve it"
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
    /// 413: the request body exceeds `setting` (a route's
    /// `max_body_bytes`, or `limits.max_admin_body_bytes` on the admin
    /// listener), as sent or, with `decoded_from`, once decoded.
    #[error(
        "request body exceeds {setting} of {limit} bytes{}",
        decoded_note(.decoded_from.as_deref())
    )]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
        /// The setting that sets it, as the message names it.
        setting: &'static str,
        /// The request's `Content-Encoding`, when the body was under the
        /// limit as sent and went over it as it was decoded (`None`: as
        /// sent).
        decoded_from: Option<String>,
    },
    /// 415: the request body's `Content-Encoding` names a coding the
    /// gateway can't decode (it decodes gzip, deflate and br; RFC 9110
    /// §15.5.16, §12.5.3); nothing was recorded or sent.
    #[error(
        "the request body's content coding {coding:?} is not supported (gzip, deflate, br are); nothing was recorded or sent"
    )]
    UnsupportedContentEncoding {
        /// The coding, lowercased.
        coding: String,
    },
    /// 501: the request's `Transfer-Encoding` names a coding other than
    /// `chunked` (`gzip, chunked`), which the gateway does not implement
    /// (RFC 9112 §6.1: a server SHOULD answer 501). Its body would
    /// otherwise be taken as the coded bytes; nothing was recorded or sent.
    #[error(
        "the transfer coding {coding:?} is not implemented (only chunked is); nothing was recorded or sent"
    )]
    TransferCodingNotImplemented {
        /// The coding, lowercased.
        coding: String,
    },
    /// 408: the request body did not arrive within `limit_ms`
    /// (`limits.body_read_timeout_ms` for an effectful call's body; the
    /// route's `response_timeout_ms` for the first bytes of a small
    /// pass-through body); nothing was reserved or sent.
    #[error("the request body did not arrive within {limit_ms} ms; nothing was recorded or sent")]
    RequestTimeout {
        /// The limit in ms.
        limit_ms: u64,
    },
    /// 408: a pass-through request was being forwarded and its body had
    /// not reached its end when the route's `response_timeout_ms`
    /// (`limit_ms`) ran out, with no answer: the provider may have got
    /// the head and part of the body (whether the caller stalled or the
    /// provider stopped reading can't be told apart here). Kind
    /// `request-timeout`, as [`Self::RequestTimeout`].
    #[error(
        "the request body had not reached its end when the route's response timeout ({limit_ms} ms) ran out; the provider may have got part of it, and gave no answer"
    )]
    BodyStalled {
        /// The route's `response_timeout_ms`.
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
    /// 507: the tenant's operations hold `tenants[].max_stored_bytes` of
    /// bodies already (RFC 4918 §11.5 Insufficient Storage); nothing was
    /// recorded or sent.
    #[error(
        "the tenant's stored-bytes quota ({limit_bytes} bytes) is reached ({stored_bytes} stored, {body_bytes} more asked); nothing was recorded or sent"
    )]
    QuotaExceeded {
        /// `tenants[].max_stored_bytes`.
        limit_bytes: u64,
        /// Bytes the tenant's operations hold now, with those of its calls
        /// admitted on this instance and not yet reserved.
        stored_bytes: u64,
        /// This request's body, in bytes.
        body_bytes: u64,
    },
    /// 422: a compensation template names a value the stored request or
    /// response lacks (or a reference none was recorded for); nothing was
    /// reserved or sent.
    #[error("the compensation can't be built: {detail}")]
    CompensationUnresolved {
        /// The placeholder, without braces: `body:/amount`, `response:/id`,
        /// `reference`.
        placeholder: String,
        /// What is missing.
        detail: String,
    },
    /// 400: some other malformed input; `field` names it.
    #[error("{message}")]
    BadRequest {
        /// The offending field, parameter or header.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// 400 (413 for `body-too-large`, 408 for `body-timeout`): a webhook to
    /// an inbox source failed
    /// `check` (one of [`crate::metrics::INBOX_CHECKS`]); nothing was stored.
    #[error("{message}")]
    InboxRejected {
        /// The check that failed, e.g. `signature-mismatch`.
        check: &'static str,
        /// The header or body field it concerns, e.g. `header:Stripe-Signature`.
        field: String,
        /// What is wrong.
        message: String,
        /// The limit a `body-too-large` passed, bytes (the source's
        /// `max_body_bytes`); shown as `limit_bytes`.
        limit_bytes: Option<usize>,
        /// The limit a `body-timeout` passed, ms
        /// (`limits.body_read_timeout_ms`); shown as `limit_ms`.
        limit_ms: Option<u64>,
    },
    /// 502: the provider could not be reached and nothing was sent.
    #[error("the provider could not be reached: {0}")]
    ProviderUnreachable(String),
    /// 502: a call the gateway forwards outside the effect ledger was sent
    /// and its answer could not be read or used: an MCP call's
    /// (`tools/list`, a read-only tool call, `initialize`) larger than the
    /// route's MCP answer limit, not complete within
    /// `response_timeout_ms`, or broken off; such a call's or a
    /// pass-through call's exchange that failed after the request went out (the connection
    /// lost, a malformed answer), or an answer that switches protocols
    /// (`101`) though the gateway asked for no upgrade.
    #[error("the provider's answer could not be read: {0}")]
    ProviderAnswerUnreadable(String),
    /// 504: a call the gateway forwards outside the effect ledger (a
    /// pass-through call, an MCP `tools/list`) got no answer's head within the route's
    /// `response_timeout_ms` (`limit_ms`, which also bounds the
    /// connection's opening): the request may have gone out.
    #[error(
        "the provider sent no answer within {limit_ms} ms; the request may have gone out and been acted on"
    )]
    ProviderTimeout {
        /// The route's `response_timeout_ms`; shown as `limit_ms`.
        limit_ms: u64,
    },
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

impl OpError {
    /// The stable problem kind (last segment of the `type` URI).
    pub fn kind(&self) -> &'static str {
        match self {
            OpError::Unauthenticated => "unauthenticated",
            OpError::Forbidden { .. } => "forbidden",
            OpError::NotFound(_) => "not-found",
            OpError::IdempotencyKeyMissing { .. } => "idempotency-key-missing",
            OpError::IdempotencyKeyInvalid(_) => "idempotency-key-invalid",
            OpError::FingerprintMismatch { .. } => "idempotency-key-reused",
            OpError::InFlight { .. } => "operation-in-flight",
            OpError::OutcomeUnknown { .. } => "operation-outcome-unknown",
            OpError::DeadLettered { .. } => "operation-dead-lettered",
            OpError::PolicyDenied { .. } => "policy-denied",
            OpError::MethodNotAllowed(_) => "method-not-allowed",
            OpError::HeadersTooLarge { .. } => "headers-too-large",
            OpError::PolicyFailed { .. } => "policy-failed",
            OpError::ContractViolation { .. } => "contract-violation",
            OpError::Conflict(_) => "conflict",
            OpError::PayloadTooLarge { .. } => "payload-too-large",
            OpError::RequestTimeout { .. } | OpError::BodyStalled { .. } => "request-timeout",
            OpError::UnsupportedContentEncoding { .. } => "unsupported-content-encoding",
            OpError::TransferCodingNotImplemented { .. } => "transfer-coding-not-implemented",
            OpError::TenantLimited { .. } => "tenant-limited",
            OpError::QuotaExceeded { .. } => "tenant-quota-exceeded",
            OpError::BadRequest { .. } => "bad-request",
            OpError::InboxRejected { check, .. } => check,
            OpError::CompensationUnresolved { .. } => "compensation-unresolved",
            OpError::ProviderUnreachable(_) => "provider-unreachable",
            OpError::ProviderAnswerUnreadable(_) => "provider-answer-unreadable",
            OpError::ProviderTimeout { .. } => "provider-timeout",
            OpError::LedgerUnavailable(_) => "ledger-unavailable",
            OpError::Internal(_) => "internal",
        }
    }
}

impl From<sqlx::Error> for OpError {
    fn from(e: sqlx::Error) -> Self {
        OpError::LedgerUnavailable(e.to_string())
    }
}

impl From<crate::config::TenantLimited> for OpError {
    fn from(e: crate::config::TenantLimited) -> Self {
        OpError::TenantLimited {
            limit: e.limit,
            retry_after_s: e.retry_after_s,
        }
    }
}

impl From<crate::idempotency::InvalidKey> for OpError {
    fn from(e: crate::idempotency::InvalidKey) -> Self {
        OpError::IdempotencyKeyInvalid(e.0)
    }
}

impl From<crate::forward::BadUri> for OpError {
    fn from(e: crate::forward::BadUri) -> Self {
        OpError::BadRequest {
            field: "path".into(),
            message: e.to_string(),
        }
    }
}

/// What a 413's message adds for a body that went over its limit as it
/// was decoded.
fn decoded_note(coding: Option<&str>) -> String {
    coding.map_or_else(String::new, |c| {
        format!(" once decoded from its Content-Encoding {c:?}")
    })
}

impl From<crate::ledger::LedgerError> for OpError {
    fn from(e: crate::ledger::LedgerError) -> Self {
        match e {
            crate::ledger::LedgerError::IllegalTransition { .. } => {
                OpError::Internal(e.to_string())
            }
            other => OpError::LedgerUnavailable(other.to_string()),
        }
    }
}
