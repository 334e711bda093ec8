//! The HTTP surfaces: thin handlers that parse a request, call a use case
//! in [`crate::ops`] and render its answer or its [`crate::ops::OpError`]
//! (RFC 9457 problem details, [`error`]).

pub mod admin;
pub mod approvals;
pub mod auth;
pub mod body;
pub mod console;
pub mod encoding;
pub mod error;
pub mod guards;
pub mod inbox;
pub mod listener;
pub mod mcp;
pub mod observe;
pub mod proxy;
pub mod replay;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

use crate::ops::reply::ReplyBody;
use crate::ops::{Answer, Reply};

/// A use case's reply as an HTTP response: a streamed provider body stays
/// streamed; a stored replay is marked for [`encoding::DecodeReplaysLayer`].
pub fn reply_response(r: Reply) -> Response {
    let problem = matches!(r.body, ReplyBody::Problem(_));
    let mut resp = match r.body {
        ReplyBody::Full(b) => Response::new(Body::from(b)),
        ReplyBody::Streamed(prefix, rest) => {
            let rest = http_body_util::BodyStream::new(rest)
                .filter_map(|f| async move { f.map(|f| f.into_data().ok()).transpose() });
            Response::new(Body::from_stream(
                futures_util::stream::once(async move { Ok::<_, hyper::Error>(prefix) })
                    .chain(rest),
            ))
        }
        // The break waits one turn of the runtime, in which the server
        // writes out the head and the prefix: one it meets at once drops
        // what it has not written, and the caller would see no answer.
        ReplyBody::CutShort(prefix, why) => {
            let broken = futures_util::stream::once(async move {
                tokio::task::yield_now().await;
                Err(std::io::Error::other(format!(
                    "the provider's response body broke off: {why}"
                )))
            });
            Response::new(Body::from_stream(
                futures_util::stream::iter([Ok(prefix)]).chain(broken),
            ))
        }
        ReplyBody::Problem(e) => e.into_response(),
    };
    if !problem {
        *resp.status_mut() = r.status;
    }
    for (name, value) in r.headers.iter() {
        resp.headers_mut().append(name.clone(), value.clone());
    }
    if r.stored_replay {
        resp.extensions_mut().insert(encoding::StoredReplay);
    }
    resp
}

/// [`reply_response`], or the error's problem document.
pub fn answer_response(a: Answer) -> Response {
    match a {
        Ok(r) => reply_response(r),
        Err(e) => e.into_response(),
    }
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        reply_response(self)
    }
}

/// Whether `a` and `b` hold the same bytes, in a time that depends on their
/// length only: a secret (a CSRF token, a connection's remembered
/// `Authorization`) compared this way tells a caller nothing of how much of
/// it matched.
pub(crate) fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_compares_whole_values() {
        assert!(same_bytes(b"Bearer k1", b"Bearer k1"));
        assert!(same_bytes(b"", b""));
        assert!(!same_bytes(b"Bearer k1", b"Bearer k2"));
        assert!(!same_bytes(b"Bearer k1", b"Bearer k10"));
        assert!(!same_bytes(b"bearer k1", b"Bearer k1"));
    }
}
