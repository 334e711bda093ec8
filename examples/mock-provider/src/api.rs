//! The provider's HTTP API: charges and refunds (with their read-backs),
//! the fault knobs and the request log, over [`Provider`]'s state.

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Charge, ConnKill, Faults, Inner, Provider, ReadBack, Refund, SeenRequest};

/// The provider's router.
pub fn router(provider: Provider) -> Router {
    Router::new()
        .route("/v1/charges", post(create_charge).get(list_charges))
        .route("/v1/charges/{id}", get(get_charge))
        .route("/v1/refunds", post(create_refund).get(list_refunds))
        .route("/stats", get(stats))
        .route(
            "/requests",
            get(|State(p): State<Provider>| async move { axum::Json(p.requests()) }),
        )
        .route("/admin/faults", post(set_faults))
        .route("/admin/reset", post(reset))
        // Gzip when asked (Accept-Encoding), as real providers do.
        .layer(tower_http::compression::CompressionLayer::new().gzip(true))
        .with_state(provider)
}

async fn stats(State(p): State<Provider>) -> impl IntoResponse {
    let i = p.inner.lock().unwrap();
    axum::Json(
        json!({"effects": i.charges.len(), "requests": i.requests.len(), "readbacks": i.readbacks,
               "refunds": i.refunds.len()}),
    )
}

async fn set_faults(
    State(p): State<Provider>,
    axum::Json(f): axum::Json<Faults>,
) -> impl IntoResponse {
    p.set_faults(f);
    StatusCode::NO_CONTENT
}

async fn reset(State(p): State<Provider>) -> impl IntoResponse {
    *p.inner.lock().unwrap() = Inner::default();
    StatusCode::NO_CONTENT
}

fn record(p: &Provider, req: &Request) {
    let seen = SeenRequest {
        method: req.method().to_string(),
        uri: req.uri().to_string(),
        version: format!("{:?}", req.version()),
        headers: req
            .headers()
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
    };
    p.inner.lock().unwrap().requests.push(seen);
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

async fn create_charge(State(p): State<Provider>, req: Request) -> Response {
    record(&p, &req);
    let kill = req.extensions().get::<ConnKill>().cloned();
    let (parts, body) = req.into_parts();
    let h = &parts.headers;
    let body = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let form = header(h, "content-type")
        .is_some_and(|c| c.starts_with("application/x-www-form-urlencoded"));
    let parsed = if form {
        Some(form_to_json(&body))
    } else {
        serde_json::from_slice(&body).ok()
    };
    let v: Value = match parsed {
        Some(v @ Value::Object(_)) => v,
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": {"type": "invalid_request_error", "message": "body must be a JSON object"}})),
            )
                .into_response();
        }
    };
    let key = header(h, "idempotency-key").map(str::to_owned);
    let client_ref = v
        .get("client_ref")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let fault = header(h, "x-mock-fault").unwrap_or("").to_owned();

    // Delay (header, then knob).
    let mut delay = header(h, "x-mock-delay-ms")
        .and_then(|d| d.parse::<u64>().ok())
        .unwrap_or(0);
    {
        let mut i = p.inner.lock().unwrap();
        if i.faults.delay_times > 0 {
            i.faults.delay_times -= 1;
            delay = delay.max(i.faults.delay_ms);
        }
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }

    let mut drop_after = fault == "drop-after-effect";
    let cut_body = fault == "cut-body-after-effect";
    let stall_body = fault == "stall-body-after-effect";
    let delay_reply = fault
        .strip_prefix("delay-reply:")
        .and_then(|d| d.parse::<u64>().ok());
    let response = {
        let mut i = p.inner.lock().unwrap();
        // Refusals without an effect.
        let per_key = key
            .clone()
            .or_else(|| client_ref.clone())
            .unwrap_or_default();
        if let Some(n) = fault
            .strip_prefix("fail-503:")
            .and_then(|n| n.parse::<u32>().ok())
        {
            let seen = i.per_key_failures.entry(per_key).or_insert(0);
            if *seen < n {
                *seen += 1;
                return unavailable(None);
            }
        }
        if let Some(code) = fault
            .strip_prefix("status:")
            .and_then(|c| c.parse::<u16>().ok())
        {
            return refuse(code);
        }
        if i.faults.fail_503_times > 0 {
            i.faults.fail_503_times -= 1;
            return unavailable(i.faults.retry_after_s);
        }
        if i.faults.fail_status_times > 0 {
            i.faults.fail_status_times -= 1;
            return refuse(i.faults.fail_status);
        }
        if i.faults.drop_after_effect_times > 0 {
            i.faults.drop_after_effect_times -= 1;
            drop_after = true;
        }
        // The provider's own idempotency.
        if let Some(c) = key
            .as_ref()
            .and_then(|k| i.by_key.get(k))
            .and_then(|idx| i.charges.get(*idx))
        {
            let c = c.clone();
            let mut r = (StatusCode::OK, axum::Json(c)).into_response();
            r.headers_mut()
                .insert("idempotent-replayed", "true".parse().unwrap());
            r
        } else {
            let charge = Charge {
                id: format!("ch_{}", i.charges.len() + 1),
                object: "charge",
                metadata: v.get("metadata").cloned().unwrap_or_else(|| json!({})),
                amount: v.get("amount").cloned().unwrap_or(Value::Null),
                currency: v.get("currency").cloned().unwrap_or(Value::Null),
                client_ref,
                idempotency_key: key.clone(),
                created: Some(Instant::now()),
            };
            i.charges.push(charge.clone());
            if let Some(k) = key {
                let n = i.charges.len() - 1;
                i.by_key.insert(k, n);
            }
            (StatusCode::OK, axum::Json(charge)).into_response()
        }
    };
    if let Some(ms) = delay_reply {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if drop_after && let Some(kill) = kill {
        kill.0.notify_one();
        std::future::pending::<()>().await;
    }
    if cut_body || stall_body {
        return cut_short(response, stall_body).await;
    }
    response
}

/// `response` with its whole body's `Content-Length`, of which only the
/// first 10 bytes are sent before the body fails and the connection
/// closes (the failure waits one turn of the runtime, in which the server
/// writes out the head and those bytes: a failure it meets at once drops
/// what it has not written); with `stall`, the body never goes on and
/// never fails.
async fn cut_short(response: Response, stall: bool) -> Response {
    use futures_util::StreamExt as _;
    let (mut parts, body) = response.into_parts();
    let whole = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    parts
        .headers
        .insert(axum::http::header::CONTENT_LENGTH, whole.len().into());
    let prefix = whole.slice(..whole.len().min(10));
    let chunks =
        futures_util::stream::iter([Ok(prefix)]).chain(futures_util::stream::once(async move {
            tokio::task::yield_now().await;
            if stall {
                std::future::pending::<()>().await;
            }
            Err(std::io::Error::other("cut-body-after-effect"))
        }));
    Response::from_parts(parts, axum::body::Body::from_stream(chunks))
}

async fn create_refund(State(p): State<Provider>, req: Request) -> Response {
    record(&p, &req);
    let kill = req.extensions().get::<ConnKill>().cloned();
    let (parts, body) = req.into_parts();
    let h = &parts.headers;
    let body = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let form = header(h, "content-type")
        .is_some_and(|c| c.starts_with("application/x-www-form-urlencoded"));
    let v = if form {
        form_to_json(&body)
    } else {
        serde_json::from_slice(&body).unwrap_or(Value::Null)
    };
    let key = header(h, "idempotency-key").map(str::to_owned);
    let (response, drop_after, delay) = {
        let mut i = p.inner.lock().unwrap();
        let Some(charge) = v
            .get("charge")
            .and_then(Value::as_str)
            .and_then(|id| i.charges.iter().find(|c| c.id == id))
            .cloned()
        else {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": {"type": "invalid_request_error", "message": "no such charge"}})),
            )
                .into_response();
        };
        let drop_after = i.faults.refund_drop_after_effect_times > 0;
        if drop_after {
            i.faults.refund_drop_after_effect_times -= 1;
        }
        let delay = i.faults.refund_delay_reply_ms;
        let response = if let Some(idx) = key.as_ref().and_then(|k| i.refunds_by_key.get(k)) {
            let r = i.refunds[*idx].clone();
            let mut resp = (StatusCode::OK, axum::Json(r)).into_response();
            resp.headers_mut()
                .insert("idempotent-replayed", "true".parse().unwrap());
            resp
        } else {
            let refund = Refund {
                id: format!("re_{}", i.refunds.len() + 1),
                object: "refund",
                charge: charge.id.clone(),
                amount: v.get("amount").cloned().unwrap_or(charge.amount.clone()),
                reason: v.get("reason").cloned().unwrap_or(Value::Null),
                status: "succeeded",
                idempotency_key: key.clone(),
                metadata: v.get("metadata").cloned().unwrap_or_else(|| json!({})),
            };
            i.refunds.push(refund.clone());
            if let Some(k) = key {
                let n = i.refunds.len() - 1;
                i.refunds_by_key.insert(k, n);
            }
            (StatusCode::OK, axum::Json(refund)).into_response()
        };
        (response, drop_after, delay)
    };
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if drop_after && let Some(kill) = kill {
        kill.0.notify_one();
        std::future::pending::<()>().await;
    }
    response
}

#[derive(Debug, Deserialize)]
struct RefundQuery {
    charge: Option<String>,
}

async fn list_refunds(
    State(p): State<Provider>,
    Query(q): Query<RefundQuery>,
    req: Request,
) -> Response {
    record(&p, &req);
    let mut i = p.inner.lock().unwrap();
    i.readbacks += 1;
    let data: Vec<&Refund> = i
        .refunds
        .iter()
        .filter(|r| q.charge.as_ref().is_none_or(|c| &r.charge == c))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

fn unavailable(retry_after: Option<u32>) -> Response {
    let mut r = (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"error": {"type": "api_error", "message": "temporarily unavailable"}})),
    )
        .into_response();
    if let Some(s) = retry_after {
        r.headers_mut().insert("retry-after", s.into());
    }
    r
}

fn refuse(code: u16) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    let kind = if code < 500 {
        "card_error"
    } else {
        "api_error"
    };
    (
        status,
        axum::Json(json!({"error": {"type": kind, "message": format!("refused with {code}")}})),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct ChargeQuery {
    client_ref: Option<String>,
    idempotency_key: Option<String>,
}

async fn list_charges(
    State(p): State<Provider>,
    Query(q): Query<ChargeQuery>,
    req: Request,
) -> Response {
    record(&p, &req);
    let started = Instant::now();
    let query = req.uri().query().unwrap_or_default().to_owned();
    let delay = p.inner.lock().unwrap().faults.readback_delay_ms;
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let response = answer_read_back(&p, &q);
    p.inner.lock().unwrap().readback_log.push(ReadBack {
        query,
        started,
        ended: Instant::now(),
    });
    response
}

fn answer_read_back(p: &Provider, q: &ChargeQuery) -> Response {
    let mut i = p.inner.lock().unwrap();
    i.readbacks += 1;
    if i.faults.readback_fail_times > 0 {
        i.faults.readback_fail_times -= 1;
        return refuse(500);
    }
    if i.faults.readback_hidden {
        return axum::Json(json!({"object": "list", "data": []})).into_response();
    }
    let lag = Duration::from_millis(i.faults.readback_lag_ms);
    let data: Vec<&Charge> = i
        .charges
        .iter()
        .filter(|c| c.created.is_none_or(|t| t.elapsed() >= lag))
        .filter(|c| {
            q.client_ref
                .as_ref()
                .is_none_or(|r| c.client_ref.as_ref() == Some(r))
        })
        .filter(|c| {
            q.idempotency_key
                .as_ref()
                .is_none_or(|k| c.idempotency_key.as_ref() == Some(k))
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_charge(State(p): State<Provider>, Path(id): Path<String>) -> Response {
    let i = p.inner.lock().unwrap();
    match i.charges.iter().find(|c| c.id == id) {
        Some(c) => axum::Json(c.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {"type": "invalid_request_error"}})),
        )
            .into_response(),
    }
}

/// A form body in Stripe's bracket syntax as JSON: `a[b]=1&a[c]=x&l[]=y`
/// → `{"a": {"b": 1, "c": "x"}, "l": ["y"]}`. Values are strings, except
/// `amount`, which becomes a number when it is one. A field whose name
/// nests deeper than 128 levels (the depth `serde_json` allows JSON) is
/// left out: a value that deep is dropped by recursion.
pub fn form_to_json(body: &[u8]) -> Value {
    let mut root = json!({});
    for (k, v) in form_urlencoded::parse(body) {
        let mut path: Vec<&str> = Vec::new();
        let (head, mut rest) = match k.find('[') {
            Some(i) => (&k[..i], &k[i..]),
            None => (&k[..], ""),
        };
        path.push(head);
        // `[seg]` groups only; anything else after the name is ignored.
        while let Some(inner) = rest.strip_prefix('[') {
            let Some(end) = inner.find(']') else { break };
            path.push(&inner[..end]);
            rest = &inner[end + 1..];
            if path.len() > 128 {
                break;
            }
        }
        if path.len() > 128 {
            continue;
        }
        let value = match (path.as_slice(), v.parse::<i64>()) {
            (["amount"], Ok(n)) => json!(n),
            _ => Value::String(v.into_owned()),
        };
        let mut node = &mut root;
        for (i, seg) in path.iter().enumerate() {
            let last = i == path.len() - 1;
            if seg.is_empty() {
                if !node.is_array() {
                    *node = json!([]);
                }
                let arr = node.as_array_mut().expect("just made an array");
                if last {
                    arr.push(value.clone());
                    break;
                }
                arr.push(json!({}));
                node = arr.last_mut().expect("just pushed");
                continue;
            }
            if !node.is_object() {
                *node = json!({});
            }
            let obj = node.as_object_mut().expect("just made an object");
            if last {
                obj.insert((*seg).to_owned(), value.clone());
                break;
            }
            node = obj.entry((*seg).to_owned()).or_insert_with(|| json!({}));
        }
    }
    root
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_bodies_become_json_and_odd_keys_never_panic() {
        let v = form_to_json(b"amount=100&currency=eur&metadata[order]=42&expand[]=a&expand[]=b");
        assert_eq!(
            v,
            json!({"amount": 100, "currency": "eur", "metadata": {"order": "42"}, "expand": ["a", "b"]})
        );
        for odd in [
            "a[b]]=1",
            "a[b]\u{e9}]=1",
            "a[=1",
            "]=1",
            "a]b[=1",
            "[]=1",
            "a[b][=1",
        ] {
            let _ = form_to_json(odd.as_bytes());
        }
    }

    /// A field nested 100,000 levels deep is left out, and the rest read:
    /// such a value used to overflow the stack when dropped.
    #[test]
    fn a_form_field_nested_too_deep_is_left_out() {
        let deep = format!("amount=5&a{}=1", "[a]".repeat(100_000));
        assert_eq!(form_to_json(deep.as_bytes()), json!({"amount": 5}));
    }
}
