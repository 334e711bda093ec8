//! The clients: for each tenant, workers that send effectful calls through
//! a random gateway, duplicate some of them concurrently, retry timeouts,
//! 5xx, 409 and 202 with the same key, and replay whole batches later (as
//! an agent replaying a turn). Every answer is kept.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::rng::mix;

/// One answer a client got.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status, or 0 when no answer came (timeout, connection error).
    pub status: u16,
    /// `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// The body.
    pub body: Bytes,
    /// Which gateway answered.
    pub gateway: usize,
    /// When, in ms since the run started.
    pub at_ms: u64,
    /// Why it was sent (`first`, `retry`, `duplicate`, `replay`, `converge`).
    pub why: &'static str,
}

/// One operation a client started.
#[derive(Debug, Clone)]
pub struct Op {
    /// Tenant.
    pub tenant: String,
    /// The idempotency key (also the operation id).
    pub key: String,
    /// The request body.
    pub body: String,
    /// Every answer, in order.
    pub answers: Vec<Answer>,
}

/// Everything the clients did.
#[derive(Debug, Default)]
pub struct History {
    /// Operations by (tenant, key).
    pub ops: Mutex<BTreeMap<(String, String), Op>>,
    /// Requests sent.
    pub requests: AtomicU64,
}

/// Where the clients send.
#[derive(Clone)]
pub struct Target {
    /// Each gateway's proxy port.
    pub proxies: Vec<Arc<AtomicU16>>,
    /// (tenant, client key).
    pub tenants: Vec<(String, String)>,
    /// The run's start.
    pub started: Instant,
    /// The history.
    pub history: Arc<History>,
    /// HTTP client.
    pub http: reqwest::Client,
}

/// Whether an answer is final: the ledger holds the outcome (a replay, a
/// provider's answer the gateway recorded, a dead letter).
pub fn is_final(a: &Answer) -> bool {
    a.replayed || matches!(a.status, 200 | 402) || a.body.windows(13).any(|w| w == b"dead-lettered")
}

impl Target {
    /// Sends one request of `op` and records the answer.
    pub async fn send(
        &self,
        tenant: usize,
        key: &str,
        body: &str,
        pick: u64,
        why: &'static str,
    ) -> Answer {
        let gateway = (pick % self.proxies.len() as u64) as usize;
        let port = self.proxies[gateway].load(Ordering::SeqCst);
        let (t, api_key) = &self.tenants[tenant];
        self.history.requests.fetch_add(1, Ordering::Relaxed);
        let r = self
            .http
            .post(format!("http://127.0.0.1:{port}/pay/v1/charges"))
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body.to_owned())
            .timeout(Duration::from_secs(4))
            .send()
            .await;
        let answer = match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let replayed = r
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                let body = r.bytes().await.unwrap_or_default();
                Answer {
                    status,
                    replayed,
                    body,
                    gateway,
                    at_ms: 0,
                    why,
                }
            }
            Err(_) => Answer {
                status: 0,
                replayed: false,
                body: Bytes::new(),
                gateway,
                at_ms: 0,
                why,
            },
        };
        let answer = Answer {
            at_ms: self.started.elapsed().as_millis() as u64,
            ..answer
        };
        let mut ops = self.history.ops.lock().unwrap();
        let op = ops
            .entry((t.clone(), key.to_owned()))
            .or_insert_with(|| Op {
                tenant: t.clone(),
                key: key.to_owned(),
                body: body.to_owned(),
                answers: Vec::new(),
            });
        op.answers.push(answer.clone());
        answer
    }

    /// Sends `op` until a final answer or `until`; retries wait 30–150 ms.
    pub async fn run_op(&self, tenant: usize, key: &str, body: &str, seed: u64, until: Instant) {
        let mut n = 0u64;
        loop {
            let pick = mix(seed, &[key.as_bytes(), &n.to_be_bytes()]);
            let a = self
                .send(
                    tenant,
                    key,
                    body,
                    pick,
                    if n == 0 { "first" } else { "retry" },
                )
                .await;
            if is_final(&a) || Instant::now() > until {
                return;
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(30 + pick % 120)).await;
        }
    }
}

/// Runs worker `w` of tenant `t` until `stop`; its attempts at an
/// operation end at `until`.
pub async fn worker(
    target: Target,
    t: usize,
    w: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
    until: Instant,
) {
    let mut n = 0u64;
    let tenant = target.tenants[t].0.clone();
    while !stop.load(Ordering::SeqCst) {
        let r = mix(
            seed,
            &[
                tenant.as_bytes(),
                &(w as u64).to_be_bytes(),
                &n.to_be_bytes(),
            ],
        );
        let batch_len = 1 + r % 4;
        let mut batch = Vec::new();
        for i in 0..batch_len {
            let key = format!("{tenant}-w{w}-{}", n + i);
            let amount = 100 + mix(seed, &[key.as_bytes()]) % 900;
            let body = format!(
                r#"{{"amount":{amount},"currency":"eur","client_ref":"{key}","metadata":{{"tenant":"{tenant}"}}}}"#
            );
            batch.push((key, body));
        }
        n += batch_len;
        for (key, body) in &batch {
            let d = mix(seed, &[key.as_bytes(), b"dup"]);
            if d % 100 < 15 {
                // A concurrent duplicate (a client that sent twice).
                let (tg, k, b) = (target.clone(), key.clone(), body.clone());
                let dup = tokio::spawn(async move {
                    tg.send(t, &k, &b, d, "duplicate").await;
                });
                target.run_op(t, key, body, seed, until).await;
                let _ = dup.await;
            } else {
                target.run_op(t, key, body, seed, until).await;
            }
        }
        if r % 100 < 25 {
            // The whole batch again, later: an agent replaying its turn.
            for (key, body) in &batch {
                let pick = mix(seed, &[key.as_bytes(), b"replay"]);
                target.send(t, key, body, pick, "replay").await;
            }
        }
    }
}
