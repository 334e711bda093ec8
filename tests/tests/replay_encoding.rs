//! Replays stay byte-correct under compression: the provider gzips when
//! asked, the body is stored as sent with its `Content-Encoding`, and each
//! duplicate gets it in a form its client decodes (curl with and without
//! `--compressed`, Python `requests`, a raw client).

use std::io::Read;

use effectgate_tests::*;

const BODY: &str = r#"{"amount":100,"currency":"eur","client_ref":"gz"}"#;

async fn curl_charge(app: &TestApp, key: &str, compressed: bool) -> Vec<u8> {
    let url = app.proxy("/pay/v1/charges");
    let auth = format!("Authorization: Bearer {KEY_A}");
    let idem = format!("Idempotency-Key: {key}");
    let mut args = vec![
        "-X",
        "POST",
        "-H",
        &auth,
        "-H",
        &idem,
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        BODY,
        "--fail-with-body",
    ];
    if compressed {
        args.push("--compressed");
    }
    args.push(&url);
    let (code, out, err) = curl(&args).await;
    assert_eq!(code, 0, "curl: {err} {}", String::from_utf8_lossy(&out));
    out
}

async fn python_charge(app: &TestApp, python: &std::path::Path, key: &str) -> Vec<u8> {
    let script = r#"
import sys, requests
r = requests.post(sys.argv[1], data=sys.argv[4].encode(), headers={
    "Authorization": "Bearer " + sys.argv[2], "Idempotency-Key": sys.argv[3],
    "Content-Type": "application/json"})
assert r.status_code == 200, (r.status_code, r.headers)
r.json()  # parses
sys.stdout.buffer.write(r.content)
"#;
    let out = tokio::process::Command::new(python)
        .args([
            "-c",
            script,
            &app.proxy("/pay/v1/charges"),
            KEY_A,
            key,
            BODY,
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "requests: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

async fn raw_charge(app: &TestApp, key: &str, accept: Option<&str>) -> (Option<String>, Vec<u8>) {
    let mut h = vec![];
    if let Some(a) = accept {
        h.push(("Accept-Encoding", a));
    }
    let r = app.charge_with(key, BODY, &h).await;
    assert_eq!(r.status(), 200);
    let coding = r
        .headers()
        .get("content-encoding")
        .map(|v| v.to_str().unwrap().to_owned());
    (coding, r.bytes().await.unwrap().to_vec())
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap();
    out
}

#[tokio::test]
async fn gzip_answers_are_replayed_byte_correct_to_every_client() {
    let app = spawn_app().await;
    // The first caller asks for gzip: the provider gzips, the gateway
    // stores the gzip bytes with their Content-Encoding.
    let first = curl_charge(&app, "gz1", true).await;
    let v: serde_json::Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(v["id"], "ch_1");
    let op = app.op_json("gz1").await;
    assert!(
        op["response_headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "content-encoding" && h[1] == "gzip"),
        "{}",
        op["response_headers"]
    );
    // curl without --compressed: decoded by the gateway.
    assert_eq!(curl_charge(&app, "gz1", false).await, first);
    // curl --compressed: gzip, decoded by curl.
    assert_eq!(curl_charge(&app, "gz1", true).await, first);
    // A raw client that accepts gzip gets the stored bytes, marked.
    let (coding, bytes) = raw_charge(&app, "gz1", Some("gzip")).await;
    assert_eq!(coding.as_deref(), Some("gzip"));
    assert_eq!(gunzip(&bytes), first);
    // One that accepts only br or nothing gets them decoded, unmarked.
    for accept in [Some("br"), None, Some("gzip;q=0, identity")] {
        let (coding, bytes) = raw_charge(&app, "gz1", accept).await;
        assert_eq!(coding, None, "{accept:?}");
        assert_eq!(bytes, first, "{accept:?}");
    }
    if let Some(python) = test_python(&["requests"]) {
        assert_eq!(python_charge(&app, &python, "gz1").await, first);
        // Python first (it sends Accept-Encoding: gzip, deflate), then curl.
        let py_first = python_charge(&app, &python, "gz2").await;
        assert_eq!(python_charge(&app, &python, "gz2").await, py_first);
        assert_eq!(curl_charge(&app, "gz2", false).await, py_first);
        assert_eq!(app.mock.provider.effects(), 2);
    } else {
        assert_eq!(app.mock.provider.effects(), 1);
    }
}

#[tokio::test]
async fn an_uncompressed_first_answer_is_replayed_as_is() {
    let app = spawn_app().await;
    let first = curl_charge(&app, "plain", false).await;
    let (coding, bytes) = raw_charge(&app, "plain", Some("gzip, br")).await;
    assert_eq!(coding, None);
    assert_eq!(bytes, first);
    assert_eq!(app.mock.provider.effects(), 1);
}

fn gzip(body: &[u8], level: u32) -> Vec<u8> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
    gz.write_all(body).unwrap();
    gz.finish().unwrap()
}

async fn post_encoded(app: &TestApp, key: &str, coding: &str, body: Vec<u8>) -> reqwest::Response {
    app.http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .header("Content-Encoding", coding)
        .body(body)
        .send()
        .await
        .unwrap()
}

async fn problem(r: reqwest::Response) -> (u16, serde_json::Value) {
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// A request body sent compressed is decoded when it arrives: the provider
/// gets the JSON without `Content-Encoding`, the fingerprint is the JSON's
/// (a retry compressed at another level, or not at all, is a replay; other
/// JSON under the key is 422), and the decoded size is held to the route's
/// `max_body_bytes`. An unknown coding is 415 with `Accept-Encoding`, and
/// corrupt data 400; neither records nor sends anything.
#[tokio::test]
async fn compressed_request_bodies_are_decoded_and_fingerprinted_as_json() {
    let app = spawn_app().await;
    // Digests of the compressed bytes go with them: the provider gets
    // neither.
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "gz-req")
        .header("Content-Type", "application/json")
        .header("Content-Encoding", "gzip")
        .header("Content-Digest", "sha-256=:AAAA:")
        .header("Repr-Digest", "sha-256=:AAAA:")
        .header("Content-MD5", "AAAA")
        .body(gzip(BODY.as_bytes(), 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].amount, 100);
    assert_eq!(charges[0].client_ref.as_deref(), Some("gz"));
    let seen = app.mock.provider.requests();
    let post = seen.iter().find(|r| r.method == "POST").unwrap();
    for name in [
        "content-encoding",
        "content-digest",
        "repr-digest",
        "content-md5",
    ] {
        assert!(
            !post.headers.iter().any(|(n, _)| n == name),
            "{name}: {:?}",
            post.headers
        );
    }
    let length = post.headers.iter().find(|(n, _)| n == "content-length");
    assert_eq!(
        length.map(|(_, v)| v.as_str()),
        Some(BODY.len().to_string().as_str())
    );

    for retry in [
        post_encoded(&app, "gz-req", "gzip", gzip(BODY.as_bytes(), 9)).await,
        // Empty list elements and `identity` are no codings (RFC 9110
        // §5.6.1): one gzip.
        post_encoded(
            &app,
            "gz-req",
            ", gzip, , identity, , , ",
            gzip(BODY.as_bytes(), 5),
        )
        .await,
        app.charge("gz-req", BODY).await,
        post_encoded(&app, "gz-req", "identity", BODY.into()).await,
    ] {
        assert_eq!(retry.status(), 200);
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
    }
    let other = br#"{"amount":999,"currency":"eur","client_ref":"gz"}"#;
    let (status, p) = problem(post_encoded(&app, "gz-req", "gzip", gzip(other, 6)).await).await;
    assert_eq!(status, 422, "{p}");
    assert_eq!(p["type"], "urn:effectgate:problem:idempotency-key-reused");

    let r = post_encoded(&app, "zstd-req", "zstd", BODY.into()).await;
    assert_eq!(r.headers()["accept-encoding"], "gzip, deflate, br");
    let (status, p) = problem(r).await;
    assert_eq!(status, 415, "{p}");
    assert_eq!(
        p["type"],
        "urn:effectgate:problem:unsupported-content-encoding"
    );
    assert_eq!(p["field"], "header:Content-Encoding");
    assert_eq!(p["coding"], "zstd");

    let (status, p) =
        problem(post_encoded(&app, "bad-gz", "gzip", b"not gzip".to_vec()).await).await;
    assert_eq!(status, 400, "{p}");
    assert_eq!(p["field"], "body");

    // 1 MiB of JSON whitespace gzips to about 1 KiB: under the test
    // route's 4096-byte `max_body_bytes` as sent, far over it decoded.
    let mut bomb = b"{\"amount\":1".to_vec();
    bomb.extend(std::iter::repeat_n(b' ', 1 << 20));
    bomb.push(b'}');
    let (status, p) = problem(post_encoded(&app, "gz-bomb", "gzip", gzip(&bomb, 9)).await).await;
    assert_eq!(status, 413, "{p}");
    assert_eq!(p["limit_bytes"], 4096);
    assert_eq!(p["content_encoding"], "gzip");
    assert_eq!(
        p["detail"],
        "request body exceeds the route's max_body_bytes of 4096 bytes once decoded from its Content-Encoding \"gzip\""
    );

    assert_eq!(app.mock.provider.charges().len(), 1);
    for key in ["zstd-req", "bad-gz", "gz-bomb"] {
        let r = app.operation(ADMIN_A, "a", key).await;
        assert_eq!(r.status(), 404, "{key} was recorded");
    }
}

/// A stored compressed answer larger than `limits.max_decoded_replay_bytes`
/// is replayed as stored, whole and still marked, to a client that doesn't
/// accept its coding (the limit is on the decoded size, and decoding it
/// would pass it); never an empty body under the stored coding.
#[tokio::test]
async fn a_stored_body_larger_than_the_decode_limit_is_replayed_as_stored() {
    let app = spawn_with(Opts {
        more: "[limits]\nmax_decoded_replay_bytes = 20\n".into(),
        ..Default::default()
    })
    .await;
    let (coding, stored) = raw_charge(&app, "gz-big", Some("gzip")).await;
    assert_eq!(coding.as_deref(), Some("gzip"));
    assert!(stored.len() > 20, "{} stored bytes", stored.len());
    let (coding, bytes) = raw_charge(&app, "gz-big", None).await;
    assert_eq!(coding.as_deref(), Some("gzip"));
    assert_eq!(bytes, stored);
    assert_eq!(app.mock.provider.effects(), 1);
}
