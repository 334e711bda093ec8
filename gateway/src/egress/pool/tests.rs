//! Tests of the outbound pool against a provider written by hand.
use super::*;
use bytes::Bytes;
use http_body_util::BodyExt;
use std::sync::atomic::AtomicUsize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// How the test provider answers each request.
#[derive(Clone, Copy)]
enum Answer {
    /// `200`, body `hello`, the connection kept.
    Whole,
    /// `200` announcing 10 bytes, of which 5 are sent; then the
    /// connection stays open, silent.
    Half,
    /// `200`, body `hello`, then the connection is closed (no
    /// `Connection: close`: a provider that drops idle connections).
    ThenClose,
    /// `204`, no body, the connection kept.
    Empty,
    /// `200` with `Content-Length: 3` and `Transfer-Encoding: chunked`,
    /// body `hello world` in two chunks, the connection kept.
    LengthAndChunked,
}

/// A provider on 127.0.0.1 speaking HTTP/1.1 by hand: it counts the
/// connections it accepts and reports each one that ends.
async fn provider(answer: Answer) -> (Uri, Arc<AtomicUsize>, mpsc::UnboundedReceiver<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let (ended_tx, ended) = mpsc::unbounded_channel();
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let n = count.fetch_add(1, Ordering::SeqCst);
            let ended = ended_tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                loop {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    }
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        // The second connection of a `Half` provider
                        // answers whole.
                        let half = matches!(answer, Answer::Half) && n == 0;
                        let reply: &[u8] = if half {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello"
                        } else if matches!(answer, Answer::Empty) {
                            b"HTTP/1.1 204 No Content\r\n\r\n"
                        } else if matches!(answer, Answer::LengthAndChunked) {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n\
                              6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
                        };
                        s.write_all(reply).await.unwrap();
                        if matches!(answer, Answer::ThenClose) {
                            // Closed before it is reported: the
                            // client's socket has its end to read.
                            drop(s);
                            let _ = ended.send(());
                            return;
                        }
                    }
                }
                let _ = ended.send(());
            });
        }
    });
    let uri: Uri = format!("http://{addr}/v1/things?x=1").parse().unwrap();
    (uri, accepted, ended)
}

const IDLE: Duration = Duration::from_secs(30);

fn client() -> HttpClient {
    // Plain-HTTP providers only: no roots are needed.
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    super::super::build_client(super::super::ClientOptions {
        connect_timeout_ms: 5_000,
        tls,
        server_name: None,
        proxy: super::super::Proxy::Direct,
        idle_timeout_ms: IDLE.as_millis() as u64,
    })
}

fn get(uri: &Uri) -> Request<OutboundBody> {
    Request::get(uri.clone())
        .body(OutboundBody::empty())
        .unwrap()
}

async fn body_of(r: Response<ResponseBody>) -> Bytes {
    r.into_body().collect().await.unwrap().to_bytes()
}

/// Two calls one after the other share one connection: it is back in
/// the pool once the first body was read to its end.
#[tokio::test]
async fn a_connection_is_reused_once_its_body_is_read() {
    let (uri, accepted, _ended) = provider(Answer::Whole).await;
    let c = client();
    for _ in 0..2 {
        let r = c.request(get(&uri)).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(body_of(r).await, "hello");
        assert_eq!(c.idle_connections(&uri), 1);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// A response without a body gives its connection back as its head
/// arrives (nothing is left to read): the next calls reuse it.
#[tokio::test]
async fn an_answer_without_a_body_gives_its_connection_back_at_once() {
    let (uri, accepted, _ended) = provider(Answer::Empty).await;
    let c = client();
    for _ in 0..3 {
        let r = c.request(get(&uri)).await.unwrap();
        assert_eq!(r.status(), 204);
        assert_eq!(c.idle_connections(&uri), 1);
        assert_eq!(body_of(r).await, "");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// A provider on 127.0.0.1 that answers `hello` on its first connection
/// and closes it when told (the receiver hears once it has), then answers
/// `new` on a second one.
async fn provider_closing_when_told() -> (
    Uri,
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
    tokio::task::JoinHandle<tokio::net::TcpStream>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri: Uri = format!("http://{}/x", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let (close_tx, close) = tokio::sync::oneshot::channel::<()>();
    let (closed_tx, closed) = tokio::sync::oneshot::channel::<()>();
    let provider = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let k = s.read(&mut buf).await.unwrap();
            assert!(k > 0, "the request arrives");
            seen.extend_from_slice(&buf[..k]);
        }
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            .await
            .unwrap();
        close.await.unwrap();
        drop(s);
        closed_tx.send(()).unwrap();
        let (mut s, _) = listener.accept().await.unwrap();
        let k = s.read(&mut buf).await.unwrap();
        assert!(k > 0);
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nnew")
            .await
            .unwrap();
        s
    });
    (uri, close_tx, closed, provider)
}

/// An idle connection has no task of its own: one the provider closed
/// while it sat in the pool is found ended by the reaper's poll and
/// dropped, and the next call opens a new connection.
#[tokio::test]
async fn an_idle_connection_the_provider_closed_is_dropped_by_the_reaper() {
    let (uri, close, _closed, provider) = provider_closing_when_told().await;
    let c = client();
    let r = c.request(get(&uri)).await.unwrap();
    assert_eq!(body_of(r).await, "hello");
    assert_eq!(c.idle_connections(&uri), 1);
    close.send(()).unwrap();
    // The end reaches the socket once the runtime has polled for events
    // (each yield lets it); a reap before that finds the connection idle.
    tokio::time::timeout(Duration::from_secs(10), async {
        while c.idle_connections(&uri) > 0 {
            tokio::task::yield_now().await;
            c.inner.reap(Instant::now());
        }
    })
    .await
    .expect("the closed connection is dropped");
    let r = c.request(get(&uri)).await.unwrap();
    assert_eq!(body_of(r).await, "new");
    drop(provider.await.unwrap());
}

/// A call that takes an idle connection the provider closed (and the
/// reaper has not looked at since) reads the close before it writes
/// anything, and goes out on a new connection: it succeeds.
#[tokio::test]
async fn a_call_that_takes_a_closed_idle_connection_goes_out_on_another() {
    let (uri, close, closed, provider) = provider_closing_when_told().await;
    let c = client();
    let r = c.request(get(&uri)).await.unwrap();
    assert_eq!(body_of(r).await, "hello");
    close.send(()).unwrap();
    closed.await.unwrap();
    // The runtime polls for events at a yield: the close is then known
    // to the socket, not yet to the pool.
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    assert_eq!(c.idle_connections(&uri), 1);
    let r = c.request(get(&uri)).await.unwrap();
    assert_eq!(body_of(r).await, "new");
    assert_eq!(c.idle_connections(&uri), 1);
    drop(provider.await.unwrap());
}

/// A body dropped before its end takes its connection with it: the
/// next call opens another and gets its whole answer.
#[tokio::test]
async fn a_body_dropped_before_its_end_takes_its_connection() {
    let (uri, accepted, mut ended) = provider(Answer::Half).await;
    let c = client();
    let r = c.request(get(&uri)).await.unwrap();
    let mut body = r.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "hello");
    drop(body);
    assert_eq!(c.idle_connections(&uri), 0);
    next_call_opens_a_connection(&c, &uri, &mut ended, &accepted, 2).await;
}

/// Once the provider has seen a connection end, the next call gets its
/// whole answer on the `n`th connection.
async fn next_call_opens_a_connection(
    c: &HttpClient,
    uri: &Uri,
    ended: &mut mpsc::UnboundedReceiver<()>,
    accepted: &AtomicUsize,
    n: usize,
) {
    ended.recv().await.unwrap();
    let r = c.request(get(uri)).await.unwrap();
    assert_eq!(body_of(r).await, "hello");
    assert_eq!(accepted.load(Ordering::SeqCst), n);
}

/// A pooled connection the provider closed is not used again: the next
/// call goes out on a new one and succeeds.
#[tokio::test]
async fn a_connection_the_provider_closed_is_not_used_again() {
    let (uri, accepted, mut ended) = provider(Answer::ThenClose).await;
    let c = client();
    for i in 1..=3 {
        let r = c.request(get(&uri)).await.unwrap();
        assert_eq!(body_of(r).await, "hello");
        ended.recv().await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), i);
    }
}

/// A connection still sending its request's body after the provider
/// answered (and the answer was read) is not ready: the next call
/// doesn't wait for it but opens another.
#[tokio::test]
async fn a_connection_still_sending_is_not_waited_for() {
    let (uri, accepted, _ended) = provider(Answer::Whole).await;
    let c = client();
    let endless =
        OutboundBody::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
    let upload = Request::post(uri.clone())
        .header(header::TRANSFER_ENCODING, "chunked")
        .body(endless)
        .unwrap();
    let r = c.request(upload).await.unwrap();
    assert_eq!(body_of(r).await, "hello");
    let r = tokio::time::timeout(Duration::from_secs(10), c.request(get(&uri)))
        .await
        .expect("the next call did not wait for the busy connection")
        .unwrap();
    assert_eq!(body_of(r).await, "hello");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// Idle connections older than the idle timeout are closed by the
/// reaper (run here at a time past it), and a later call opens a new
/// one.
#[tokio::test]
async fn expired_idle_connections_are_closed() {
    let (uri, accepted, mut ended) = provider(Answer::Whole).await;
    let c = client();
    let r = c.request(get(&uri)).await.unwrap();
    body_of(r).await;
    assert_eq!(c.idle_connections(&uri), 1);
    // Not yet expired.
    c.inner.reap(Instant::now() + IDLE / 2);
    assert_eq!(c.idle_connections(&uri), 1);
    c.inner.reap(Instant::now() + IDLE);
    assert_eq!(c.idle_connections(&uri), 0);
    next_call_opens_a_connection(&c, &uri, &mut ended, &accepted, 2).await;
}

/// A URL without a scheme or host is refused before any connection,
/// and counts as nothing sent.
#[tokio::test]
async fn a_url_without_a_host_is_refused() {
    let c = client();
    let e = c
        .request(get(&Uri::from_static("/v1/things")))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Destination(_)), "{e:?}");
    assert!(e.is_connect());
}

/// `Host` names the port only when it is not the scheme's default, and
/// the target is in origin form; a caller's own `Host` is kept.
#[test]
fn requests_go_out_in_origin_form_with_a_host() {
    for (url, host, target) in [
        ("http://p.example/v1/a?b=1", "p.example", "/v1/a?b=1"),
        ("http://p.example:8080/", "p.example:8080", "/"),
        ("https://p.example:443/x", "p.example", "/x"),
        ("https://p.example:80/x", "p.example:80", "/x"),
        ("http://u:pw@p.example:8080/x", "p.example:8080", "/x"),
    ] {
        let uri: Uri = url.parse().unwrap();
        let mut req = get(&uri);
        to_origin_form(&mut req, host_value(&Key::of(&uri).unwrap()));
        assert_eq!(req.headers()[header::HOST], host, "{url}");
        assert_eq!(req.uri().to_string(), target, "{url}");
    }
    let uri: Uri = "http://10.0.0.1/x".parse().unwrap();
    let mut req = get(&uri);
    req.headers_mut()
        .insert(header::HOST, HeaderValue::from_static("p.example"));
    to_origin_form(&mut req, host_value(&Key::of(&uri).unwrap()));
    assert_eq!(req.headers()[header::HOST], "p.example");
}

/// A provider that answers each request at once, before it reads the
/// request's body: a head announcing `answer` bytes, then the bytes, from
/// a task of their own, while it reads the chunked upload to its end and
/// reports how many bytes of it came.
async fn early_answering_provider(answer: usize) -> (Uri, mpsc::UnboundedReceiver<usize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (got_tx, got) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let head_end = loop {
            let k = rd.read(&mut chunk).await.unwrap();
            assert!(k > 0, "the request head came");
            buf.extend_from_slice(&chunk[..k]);
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
        };
        buf.drain(..head_end);
        tokio::spawn(async move {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {answer}\r\n\r\n");
            wr.write_all(head.as_bytes()).await.unwrap();
            wr.write_all(&vec![b'a'; answer]).await.unwrap();
            // Kept open until the test ends.
            std::future::pending::<()>().await;
        });
        // The chunked upload: the payload bytes, to the last chunk.
        let mut payload = 0;
        loop {
            while let Some(line) = buf.windows(2).position(|w| w == b"\r\n") {
                let size = usize::from_str_radix(std::str::from_utf8(&buf[..line]).unwrap(), 16)
                    .expect("a chunk size");
                if buf.len() < line + 2 + size + 2 {
                    break;
                }
                buf.drain(..line + 2 + size + 2);
                if size == 0 {
                    let _ = got_tx.send(payload);
                    return;
                }
                payload += size;
            }
            let k = rd.read(&mut chunk).await.unwrap();
            assert!(k > 0, "the upload broke off after {payload} bytes");
            buf.extend_from_slice(&chunk[..k]);
        }
    });
    (format!("http://{addr}/v1/uploads").parse().unwrap(), got)
}

/// Full duplex: the provider answers with more than the sockets hold
/// before it has read the upload, and the caller sends its whole upload
/// before it reads any of the answer. The upload goes on while nobody
/// reads the answer (its connection is driven by a task of its own once
/// the answer's head came with the upload unfinished); then the whole
/// answer is read, and the connection is not pooled.
#[tokio::test]
async fn an_upload_goes_on_while_an_early_answer_is_unread() {
    const UPLOAD: usize = 16 * 1024 * 1024;
    const ANSWER: usize = 16 * 1024 * 1024;
    let (uri, mut got) = early_answering_provider(ANSWER).await;
    let c = client();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let upload = Request::post(uri.clone())
        .header(header::TRANSFER_ENCODING, "chunked")
        .body(OutboundBody::from_stream(stream))
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), c.request(upload))
        .await
        .expect("the answer's head came")
        .unwrap();
    assert_eq!(r.status(), 200);
    let piece = Bytes::from(vec![b'u'; 64 * 1024]);
    tokio::time::timeout(Duration::from_secs(20), async {
        for _ in 0..UPLOAD / piece.len() {
            tx.send(Ok(piece.clone())).await.unwrap();
        }
        drop(tx);
        got.recv().await
    })
    .await
    .map(|n| assert_eq!(n, Some(UPLOAD)))
    .expect("the upload went on while the answer was unread");
    assert_eq!(body_of(r).await.len(), ANSWER);
    assert_eq!(c.idle_connections(&uri), 0);
}

/// An answer with both `Content-Length` and `Transfer-Encoding` is read
/// by its transfer coding, whole, and reaches the caller without the
/// `Content-Length` (RFC 9112 §6.3 ¶3), which would tell another length
/// than the body has.
#[tokio::test]
async fn a_content_length_beside_a_transfer_coding_is_removed() {
    let (uri, _accepted, _ended) = provider(Answer::LengthAndChunked).await;
    let c = client();
    for _ in 0..2 {
        let r = c.request(get(&uri)).await.unwrap();
        assert_eq!(r.headers().get(header::CONTENT_LENGTH), None);
        assert_eq!(body_of(r).await, "hello world");
    }
}
