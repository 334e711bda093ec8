//! A payments-like provider that cannot deduplicate: every charge request
//! it accepts is one more effect. It keeps the ground truth: every effect,
//! keyed by the provider key the gateway stamped (`X-Provider-Key`, which
//! it records but never uses to deduplicate).
//!
//! While faults are on, each charge attempt draws one fault from the seed,
//! the provider key and the attempt's number at the provider (so a seed
//! gives an operation the same faults whatever the timing): the reply
//! dropped after the effect, a reply delayed past the gateway's timeout
//! after the effect, 500 before or after the effect, 503, 429, a permanent
//! 402, a connection reset before the effect. Read-backs lag (an effect is
//! visible only after a random delay below the route's settle delay) and
//! fail with 500 at random.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::rng::mix;

/// One effect the provider applied.
#[derive(Debug, Clone)]
pub struct Effect {
    /// `ch_<n>`.
    pub id: String,
    /// The provider key it was sent with.
    pub key: String,
    /// The charge object as answered.
    pub object: Value,
    /// When it becomes visible to read-back.
    visible_at: Instant,
}

/// A fault the provider applies to one charge attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// Applied and answered 200.
    None,
    /// The effect applied, then the connection closed without a reply.
    DropAfterEffect,
    /// The effect applied, the reply sent after the gateway's timeout.
    DelayPastTimeout,
    /// 500 without the effect.
    Status500Before,
    /// 500 after the effect.
    Status500After,
    /// 503 without the effect.
    Status503,
    /// 429 without the effect.
    Status429,
    /// 402 card declined: permanent, no effect.
    Declined,
    /// The connection reset before the effect.
    ResetBeforeEffect,
}

impl Fault {
    /// The fault's name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::DropAfterEffect => "reply dropped after effect",
            Fault::DelayPastTimeout => "reply delayed past timeout",
            Fault::Status500Before => "500 before effect",
            Fault::Status500After => "500 after effect",
            Fault::Status503 => "503",
            Fault::Status429 => "429",
            Fault::Declined => "402 declined",
            Fault::ResetBeforeEffect => "reset before effect",
        }
    }

    fn draw(r: u64) -> Fault {
        match r % 100 {
            0..=5 => Fault::DropAfterEffect,
            6..=9 => Fault::DelayPastTimeout,
            10..=13 => Fault::Status500Before,
            14..=16 => Fault::Status500After,
            17..=22 => Fault::Status503,
            23..=27 => Fault::Status429,
            28..=29 => Fault::Declined,
            30..=33 => Fault::ResetBeforeEffect,
            _ => Fault::None,
        }
    }
}

/// What the provider saw of one provider key: the faults of its attempts.
#[derive(Debug, Default, Clone)]
pub struct KeyLog {
    /// One fault per charge attempt, in order.
    pub attempts: Vec<Fault>,
    /// Read-backs answered (found, absent, error).
    pub read_backs: Vec<&'static str>,
}

#[derive(Debug, Default)]
struct Inner {
    effects: Vec<Effect>,
    by_key: HashMap<String, Vec<usize>>,
    log: HashMap<String, KeyLog>,
    faults_on: bool,
    counts: BTreeMap<&'static str, u64>,
}

/// The provider's shared state.
#[derive(Debug, Clone)]
pub struct Provider {
    inner: Arc<Mutex<Inner>>,
    seed: u64,
    /// How long a delayed reply waits, in ms (past the gateway's timeout).
    delay_ms: u64,
    /// The longest read-back lag, in ms.
    lag_ms: u64,
}

impl Provider {
    /// Turns the faults on or off.
    pub fn set_faults(&self, on: bool) {
        self.inner.lock().unwrap().faults_on = on;
    }
    /// Effects under `key`.
    pub fn effects(&self, key: &str) -> Vec<Effect> {
        let i = self.inner.lock().unwrap();
        i.by_key
            .get(key)
            .map(|ix| ix.iter().map(|&n| i.effects[n].clone()).collect())
            .unwrap_or_default()
    }
    /// Every effect.
    pub fn all_effects(&self) -> Vec<Effect> {
        self.inner.lock().unwrap().effects.clone()
    }
    /// What the provider saw of `key`.
    pub fn log(&self, key: &str) -> KeyLog {
        self.inner
            .lock()
            .unwrap()
            .log
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
    /// Faults injected, by name.
    pub fn counts(&self) -> BTreeMap<&'static str, u64> {
        self.inner.lock().unwrap().counts.clone()
    }
    /// Records an effect the provider never applied (the planted-violation
    /// self-check: the checker must find it).
    pub fn plant_duplicate(&self, key: &str) {
        let mut i = self.inner.lock().unwrap();
        let Some(&first) = i.by_key.get(key).and_then(|v| v.first()) else {
            return;
        };
        let mut e = i.effects[first].clone();
        e.id.push_str("-planted");
        let n = i.effects.len();
        i.effects.push(e);
        i.by_key.entry(key.to_owned()).or_default().push(n);
    }

    fn charge(&self, key: &str, body: &[u8]) -> (Fault, Option<Value>) {
        let mut i = self.inner.lock().unwrap();
        let log = i.log.entry(key.to_owned()).or_default();
        let n = log.attempts.len() as u64;
        let fault = if i.faults_on {
            Fault::draw(mix(self.seed, &[key.as_bytes(), &n.to_be_bytes()]))
        } else {
            Fault::None
        };
        i.log.get_mut(key).unwrap().attempts.push(fault);
        if fault != Fault::None {
            *i.counts.entry(fault.name()).or_default() += 1;
        }
        let applies = matches!(
            fault,
            Fault::None | Fault::DropAfterEffect | Fault::DelayPastTimeout | Fault::Status500After
        );
        if !applies {
            return (fault, None);
        }
        let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let id = format!("ch_{}", i.effects.len() + 1);
        let object = json!({
            "id": id,
            "object": "charge",
            "amount": req["amount"],
            "client_ref": req["client_ref"],
            "metadata": req["metadata"],
            "provider_key": key,
        });
        let lag = if i.faults_on && self.lag_ms > 0 {
            mix(self.seed, &[key.as_bytes(), b"lag"]) % self.lag_ms
        } else {
            0
        };
        if lag > 0 {
            *i.counts.entry("read-back lag").or_default() += 1;
        }
        let n = i.effects.len();
        i.effects.push(Effect {
            id,
            key: key.to_owned(),
            object: object.clone(),
            visible_at: Instant::now() + Duration::from_millis(lag),
        });
        i.by_key.entry(key.to_owned()).or_default().push(n);
        (fault, Some(object))
    }

    fn read_back(&self, key: &str) -> Option<Value> {
        let mut i = self.inner.lock().unwrap();
        let log = i.log.entry(key.to_owned()).or_default();
        let n = log.read_backs.len() as u64;
        let error =
            i.faults_on && mix(self.seed, &[key.as_bytes(), b"rb", &n.to_be_bytes()]) % 100 < 15;
        if error {
            i.log.get_mut(key).unwrap().read_backs.push("error");
            *i.counts.entry("read-back error").or_default() += 1;
            return None;
        }
        let now = Instant::now();
        let found: Vec<Value> = i
            .by_key
            .get(key)
            .map(|ix| {
                ix.iter()
                    .map(|&n| &i.effects[n])
                    .filter(|e| e.visible_at <= now)
                    .map(|e| e.object.clone())
                    .collect()
            })
            .unwrap_or_default();
        let what = if found.is_empty() { "absent" } else { "found" };
        i.log.get_mut(key).unwrap().read_backs.push(what);
        Some(json!({ "object": "list", "data": found }))
    }
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

async fn handle(
    p: Provider,
    kill: Arc<Notify>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (head, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let key = head
        .headers
        .get("x-provider-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if head.uri.path() != "/v1/charges" {
        return Ok(reply(
            StatusCode::NOT_FOUND,
            &json!({"error": "no such path"}),
        ));
    }
    if head.method == http::Method::GET {
        let key = head
            .uri
            .query()
            .and_then(|q| url::form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "key"))
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        return Ok(match p.read_back(&key) {
            Some(list) => reply(StatusCode::OK, &list),
            None => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                &json!({"error": "read-back failed"}),
            ),
        });
    }
    let Some(key) = key else {
        return Ok(reply(
            StatusCode::BAD_REQUEST,
            &json!({"error": "X-Provider-Key is required"}),
        ));
    };
    let (fault, object) = p.charge(&key, &body);
    let err = |s: StatusCode| Ok(reply(s, &json!({"error": s.as_str()})));
    match fault {
        Fault::None => Ok(reply(StatusCode::OK, &object.unwrap())),
        Fault::DropAfterEffect | Fault::ResetBeforeEffect => {
            kill.notify_one();
            std::future::pending().await
        }
        Fault::DelayPastTimeout => {
            tokio::time::sleep(Duration::from_millis(p.delay_ms)).await;
            Ok(reply(StatusCode::OK, &object.unwrap()))
        }
        Fault::Status500Before | Fault::Status500After => err(StatusCode::INTERNAL_SERVER_ERROR),
        Fault::Status503 => err(StatusCode::SERVICE_UNAVAILABLE),
        Fault::Status429 => err(StatusCode::TOO_MANY_REQUESTS),
        Fault::Declined => Ok(reply(
            StatusCode::PAYMENT_REQUIRED,
            &json!({"error": {"type": "card_error", "code": "card_declined"}}),
        )),
    }
}

/// Starts the provider on a free loopback port.
pub async fn spawn(
    seed: u64,
    delay_ms: u64,
    lag_ms: u64,
) -> anyhow::Result<(Provider, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let p = Provider {
        inner: Arc::default(),
        seed,
        delay_ms,
        lag_ms,
    };
    let served = p.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let p = served.clone();
            tokio::spawn(async move {
                let kill = Arc::new(Notify::new());
                let k = kill.clone();
                let svc = hyper::service::service_fn(move |req| handle(p.clone(), k.clone(), req));
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc);
                // Dropping the connection closes the socket: the caller
                // sees the connection lost mid-request.
                tokio::select! {
                    _ = conn => {}
                    _ = kill.notified() => {}
                }
            });
        }
    });
    Ok((p, addr))
}
