//! The pool's two body types: a request body that says when it has been
//! sent whole ([`Sending`]), and a provider's response body that gives its
//! HTTP/1.1 connection back to the pool at its end ([`ResponseBody`]).

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;

use super::{Driver, Inner, Key};
use crate::egress::OutboundBody;

/// A request body on its way to the provider, which records when it has
/// been sent whole (its last frame taken): see [`HttpClient::request`].
pub(super) struct Sending {
    inner: OutboundBody,
    sent: Arc<AtomicBool>,
}

impl Sending {
    /// `body` wrapped, and the flag it sets at its end.
    pub(super) fn wrap(body: OutboundBody) -> (OutboundBody, Arc<AtomicBool>) {
        let sent = Arc::new(AtomicBool::new(false));
        let body = OutboundBody::new(Sending {
            inner: body,
            sent: sent.clone(),
        });
        (body, sent)
    }
}

impl Body for Sending {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if frame.is_none() || self.inner.is_end_stream() {
            self.sent.store(true, Ordering::Release);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A provider's response body. An HTTP/1.1 connection goes back to its
/// pool when the body has been read to its end.
pub struct ResponseBody {
    pub(super) body: Incoming,
    pub(super) back: Option<GiveBack>,
}

/// What a pooled HTTP/1.1 connection needs to go back to its pool.
pub(super) struct GiveBack {
    pub(super) pool: Weak<Inner>,
    pub(super) key: Key,
    pub(super) tx: http1::SendRequest<OutboundBody>,
    pub(super) driver: Driver,
}

impl ResponseBody {
    pub(super) fn unpooled(body: Incoming) -> Self {
        Self { body, back: None }
    }

    pub(super) fn give_back(&mut self) {
        if let Some(b) = self.back.take()
            && let Some(pool) = b.pool.upgrade()
        {
            pool.put_back(&b.key, b.tx, b.driver);
        }
    }
}

impl fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("body", &self.body)
            .field("pooled", &self.back.is_some())
            .finish()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        // The connection first: it moves what the provider sent into the
        // body. If it ended, what it read is in the body already.
        if let Some(b) = &mut this.back
            && b.driver.poll(cx).is_ready()
        {
            this.back = None;
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.give_back(),
            Some(Err(_)) => this.back = None,
            Some(Ok(_)) if this.body.is_end_stream() => this.give_back(),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // Read to its end without a last poll (its length was known).
        if self.back.is_some() && self.body.is_end_stream() {
            self.give_back();
        }
    }
}
