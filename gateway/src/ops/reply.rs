//! [`Reply`]: what a use case answers a caller with, before any HTTP
//! framework sees it. [`crate::http`] turns it into a response.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

/// The body of a [`Reply`].
#[derive(Debug)]
pub enum ReplyBody {
    /// The whole body, in memory.
    Full(Bytes),
    /// A provider answer larger than the stored limit: the prefix read so
    /// far, then the rest of the provider's body, streamed unread.
    Streamed(Bytes, Box<crate::forward::ResponseBody>),
    /// A provider answer whose body broke off (cut short, a malformed
    /// chunk, stalled past `response_timeout_ms`): what arrived, then the
    /// same break for the caller (the response ends without its framing's
    /// end), never a complete-looking body. The text says why it broke.
    CutShort(Bytes, String),
    /// A problem document for this error (RFC 9457), rendered by the HTTP
    /// surface; the reply's headers are added to it.
    Problem(Box<crate::ops::OpError>),
}

/// A use case's answer: status, headers and body.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: StatusCode,
    /// Response headers (hop-by-hop headers already removed).
    pub headers: HeaderMap,
    /// The body.
    pub body: ReplyBody,
    /// A stored answer served from the effect ledger (a replay): the HTTP
    /// surface decodes it for a caller that doesn't accept its coding.
    pub stored_replay: bool,
}

impl Reply {
    /// A reply with `status`, no headers and `body`.
    pub fn new(status: StatusCode, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            body: ReplyBody::Full(body.into()),
            stored_replay: false,
        }
    }

    /// `value` as `application/json` with `status`.
    pub fn json(status: StatusCode, value: &serde_json::Value) -> Self {
        let mut r = Self::new(status, value.to_string());
        r.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }

    /// The reply with header `name` set to `value` (replacing any).
    pub fn with_header(mut self, name: header::HeaderName, value: HeaderValue) -> Self {
        self.headers.insert(name, value);
        self
    }
}
