//! The proxy listener: authentication, route matching, pass-through
//! streaming, and the effectful request flow (DESIGN.md steps 1–9).

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{StatusCode, header};

use crate::answer::{answer_existing, resume_awaiting};
use crate::app::AppState;
use crate::config::{Role, Route};
use crate::error::ApiError;
use crate::forward::{
    add_route_headers, build_request, caller_headers, strip_hop_by_hop, to_pairs, upstream_uri,
};
use crate::idempotency::{fingerprint, parse_key, provider_key};
use crate::ledger::{NewOperation, Reservation, State as OpState};
use crate::policy::{Verdict, evaluate_chain_async, wit_class};

/// The proxy router: every path goes to [`handle`].
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/approvals/{id}",
            axum::routing::get(approval_status).fallback(|| async {
                ApiError::MethodNotAllowed("only GET on /approvals/{id}".into())
            }),
        )
        .fallback(handle)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::encoding::decode_replays,
        ))
        .with_state(state)
}

/// `GET /approvals/{id}`: the caller polls its approval with its own key.
/// Another tenant's approval is 404.
async fn approval_status(
    State(app): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    headers: http::HeaderMap,
) -> Response {
    let result = async {
        let principal = app.authenticate(&headers)?;
        let a = app
            .ledger
            .approval(&principal.tenant, &id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("no approval {id:?}")))?;
        let op = app.ledger.get(&principal.tenant, &a.operation_id).await?;
        let mut body = serde_json::json!({
            "approval_id": a.id,
            "status": a.status,
            "operation_id": a.operation_id,
            "operation_state": op.map(|o| o.state),
            "reason": a.reason,
            "expires_at": a.expires_at,
            "decided_by": a.decided_by,
            "comment": a.comment,
        });
        crate::times::annotate(&mut body);
        Ok::<_, ApiError>(axum::Json(body))
    }
    .await;
    match result {
        Ok(r) => r.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn handle(
    State(app): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Response {
    match handle_inner(&app, peer, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle_inner(
    app: &AppState,
    peer: SocketAddr,
    req: Request,
) -> Result<Response, ApiError> {
    // 1. Authenticate the principal.
    let principal = app.authenticate(req.headers())?;
    if principal.role != Role::Client {
        return Err(ApiError::Forbidden {
            role: principal.role.as_str(),
            action: "send calls through the proxy",
        });
    }
    // TRACE would echo injected credentials back; CONNECT would tunnel.
    if req.method() == http::Method::TRACE || req.method() == http::Method::CONNECT {
        return Err(ApiError::MethodNotAllowed(format!(
            "{} is never forwarded",
            req.method()
        )));
    }
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let max_header_bytes = app.settings().limits.max_header_bytes;
    if header_bytes > max_header_bytes {
        return Err(ApiError::HeadersTooLarge {
            limit: max_header_bytes,
        });
    }
    // Dot segments would walk out of the upstream's base path.
    if req.uri().path().split('/').any(|seg| {
        let s = seg.to_ascii_lowercase();
        s == "."
            || s == ".."
            || s.contains("%2e")
            || s.contains("%2f")
            || s.contains("%5c")
            || s.contains('\\')
    }) {
        return Err(ApiError::BadRequest {
            field: "path".into(),
            message: "dot segments and encoded separators are not allowed in paths".into(),
        });
    }
    // 2. Match the route; the gateway is never an open proxy. One snapshot
    // of the settings and policies serves the whole request.
    let rt = app.settings();
    let path = req.uri().path().to_owned();
    let route = rt
        .match_route(&path)
        .filter(|r| r.allows_tenant(&principal.tenant))
        .ok_or_else(|| ApiError::NotFound(format!("no route for {path}")))?
        .clone();
    let rest = &path[route.prefix.len() - 1..];
    let query = req.uri().query().map(str::to_owned);
    let policies = rt.policies.for_route(&principal.tenant, &route.name);
    let mcp_post = route.mcp.is_some() && req.method() == http::Method::POST;
    // The tenant's rate limit covers every call; its in-flight limit the
    // effectful ones (held until this caller is answered).
    let limits = rt.tenant_limits.get(&principal.tenant);
    if let Some(l) = limits {
        l.check_rate(&principal.tenant)?;
    }
    let _in_flight = match limits {
        Some(l) if mcp_post || route.is_effectful(req.method()) => {
            l.acquire_in_flight(&principal.tenant)?
        }
        _ => None,
    };
    if !mcp_post && !route.is_effectful(req.method()) {
        let uri = upstream_uri(&route, rest, query.as_deref())?;
        // On an MCP route policies decide tool calls; the session's other
        // traffic (GET streams, DELETE) passes.
        if !policies.is_empty() && route.mcp.is_none() {
            // Headers only: the body streams through unread.
            let request = policy_request(
                &principal,
                &route,
                req.method().as_str(),
                rest,
                query.as_deref(),
                req.headers(),
                &[],
                "",
                "",
                None,
            );
            match evaluate_chain_async(
                app.engine.clone(),
                policies,
                &route,
                &principal.tenant,
                request,
            )
            .await
            .0
            {
                Verdict::Allow { .. } => {}
                Verdict::Deny {
                    status,
                    reason,
                    policy,
                } => return Err(denied(status, policy, reason)),
                Verdict::RequireApproval { policy, .. } => {
                    return Err(denied(
                        403,
                        policy.0,
                        "approval is only possible for effectful calls".into(),
                    ));
                }
                Verdict::Failed { policy, failure } => {
                    return Err(ApiError::PolicyFailed {
                        policy,
                        detail: failure.to_string(),
                    });
                }
            }
        }
        return pass_through(&route, peer, req, uri).await;
    }

    let is_mcp = route.mcp.is_some() && req.method() == http::Method::POST;

    // 3. Identity: tenant + Idempotency-Key (MCP tool calls: see `mcp`).
    let key = if is_mcp {
        None
    } else {
        Some(
            parse_key(req.headers(), rt.limits.max_idempotency_key_len)?.ok_or_else(|| {
                ApiError::IdempotencyKeyMissing {
                    method: req.method().to_string(),
                    route: route.name.clone(),
                }
            })?,
        )
    };

    // 4. Read the body (bounded) and fingerprint the request.
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        && len > route.max_body_bytes
    {
        return Err(ApiError::PayloadTooLarge {
            limit: route.max_body_bytes,
        });
    }
    let body_timeout = rt.limits.body_read_timeout_ms;
    let body = tokio::time::timeout(
        std::time::Duration::from_millis(body_timeout),
        axum::body::to_bytes(body, route.max_body_bytes),
    )
    .await
    .map_err(|_| ApiError::RequestTimeout {
        limit_ms: body_timeout,
    })?
    .map_err(|_| ApiError::PayloadTooLarge {
        limit: route.max_body_bytes,
    })?;
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut mcp_call = None;
    let (key, fp) = match key {
        Some(k) => {
            let fp = fingerprint(
                parts.method.as_str(),
                &route.name,
                rest,
                query.as_deref(),
                content_type.as_deref(),
                &body,
            );
            (k, fp)
        }
        None => {
            let uri = upstream_uri(&route, rest, query.as_deref())?;
            let proto = crate::listener::ListenerScheme::of(&parts.extensions);
            match crate::mcp::prepare(
                app,
                &route,
                &principal,
                &parts.headers,
                &body,
                &uri,
                (peer, proto),
            )
            .await?
            {
                crate::mcp::Prepared::Respond(r) => return Ok(r),
                crate::mcp::Prepared::Forward => {
                    let (status, headers, bytes) = crate::mcp::forward_buffered(
                        &route,
                        &parts.headers,
                        body,
                        &uri,
                        (peer, proto),
                    )
                    .await?;
                    let mut r = Response::new(Body::from(bytes));
                    *r.status_mut() = status;
                    *r.headers_mut() = headers;
                    return Ok(r);
                }
                crate::mcp::Prepared::Call(c) => {
                    let kf = (c.key.clone(), c.fingerprint.clone());
                    mcp_call = Some(c);
                    kf
                }
            }
        }
    };
    let flow = Flow {
        app,
        route: &route,
        principal: &principal,
        peer,
        parts: &parts,
        rest,
        query: query.as_deref(),
        mcp: mcp_call.as_ref(),
    };
    let result = flow.run(body, content_type, key, fp).await;
    match &mcp_call {
        Some(c) => Ok(crate::mcp::readdress(result, &c.rpc_id).await),
        None => result,
    }
}

/// The effectful flow after identity and fingerprint (DESIGN.md steps 4b–9).
struct Flow<'a> {
    app: &'a AppState,
    route: &'a Route,
    principal: &'a crate::config::Principal,
    peer: SocketAddr,
    parts: &'a http::request::Parts,
    rest: &'a str,
    query: Option<&'a str>,
    mcp: Option<&'a crate::mcp::McpCall>,
}

impl Flow<'_> {
    async fn run(
        self,
        body: Bytes,
        content_type: Option<String>,
        key: String,
        fp: String,
    ) -> Result<Response, ApiError> {
        let Flow {
            app,
            route,
            principal,
            peer,
            parts,
            rest,
            query,
            mcp,
        } = self;
        let route = route.clone();
        let principal = principal.clone();
        let query = query.map(str::to_owned);
        let rt = app.settings();
        let policies = rt.policies.for_route(&principal.tenant, &route.name);
        // A JSON body that repeats a key reads differently to different
        // parsers: refuse it rather than fingerprint, approve or forward
        // something the provider may read otherwise.
        let json_body = content_type
            .as_deref()
            .and_then(|c| c.split(';').next())
            .map(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || m.ends_with("+json")
            })
            .unwrap_or(false);
        if (json_body || mcp.is_some()) && crate::idempotency::has_duplicate_keys(&body) {
            return Err(ApiError::BadRequest {
                field: "body".into(),
                message: "a JSON object in the body repeats a key (RFC 7493 §2.3)".into(),
            });
        }
        // 4b. The route's request contract, before the ledger; never retried.
        if let Some(schema) = &route.request_schema {
            let errors: Vec<(String, String)> =
                match serde_json::from_slice::<serde_json::Value>(&body) {
                    Err(e) => vec![("".into(), format!("the body is not JSON: {e}"))],
                    Ok(v) => schema
                        .iter_errors(&v)
                        .take(16)
                        .map(|e| (e.instance_path().to_string(), e.to_string()))
                        .collect(),
                };
            if !errors.is_empty() {
                crate::metrics::request(&route.name, "rejected");
                return Err(ApiError::ContractViolation { errors });
            }
        }

        // 6. Reserve in the ledger atomically. A duplicate of a finished
        // operation is answered from the read pool first: COMPLETED and FAILED
        // never change back, so this read can't be stale in a way that matters,
        // and it keeps replays off the single writer.
        if let Some(op) = app.ledger.get(&principal.tenant, &key).await?
            && op.expires_at > app.ledger.clock().now_ms()
            && (op.state.is_terminal()
                || op.fingerprint != fp
                || op.state == OpState::AwaitingApproval)
        {
            // A finished operation is replayed; a reused key with another
            // request is refused before any policy runs, so nothing of the
            // rejected request is recorded against the original. A re-send
            // of a request awaiting approval is answered by its approval:
            // the policies decided it already.
            return answer_existing(app, &route, op, &fp).await;
        }
        // 5. The tenant's policies on this route.
        let mut effect_class = mcp
            .and_then(|c| c.effect_class)
            .unwrap_or(route.effect_class);
        let mut forwarded = caller_headers(
            &route,
            &parts.headers,
            Some(peer),
            crate::listener::ListenerScheme::of(&parts.extensions),
        );
        let mut awaiting_approval = false;
        let mut approval = None;
        let mut decisions = Vec::new();
        if !policies.is_empty() {
            let request = match mcp {
                Some(call) => {
                    crate::mcp::call_policy_request(call, &principal, &route, &parts.headers, &body)
                }
                None => policy_request(
                    &principal,
                    &route,
                    parts.method.as_str(),
                    rest,
                    query.as_deref(),
                    &parts.headers,
                    &body,
                    &key,
                    &fp,
                    None,
                ),
            };
            let (verdict, records) = evaluate_chain_async(
                app.engine.clone(),
                policies,
                &route,
                &principal.tenant,
                request,
            )
            .await;
            decisions = records;
            match verdict {
                Verdict::Allow {
                    effect_class: ec,
                    add_headers,
                } => {
                    if let Some(c) = ec {
                        effect_class = c;
                    }
                    // A policy's header replaces the caller's of that
                    // name: a caller can't pre-empt what a policy pins.
                    for (n, _) in &add_headers {
                        forwarded.remove(n);
                    }
                    for (n, v) in add_headers {
                        forwarded.append(n, v);
                    }
                }
                Verdict::Deny {
                    status,
                    reason,
                    policy,
                } => {
                    app.ledger
                        .record_decisions(&principal.tenant, &key, &fp, &decisions)
                        .await?;
                    crate::metrics::request(&route.name, "rejected");
                    return Err(denied(status, policy, reason));
                }
                Verdict::Failed { policy, failure } => {
                    app.ledger
                        .record_decisions(&principal.tenant, &key, &fp, &decisions)
                        .await?;
                    crate::metrics::request(&route.name, "rejected");
                    return Err(ApiError::PolicyFailed {
                        policy,
                        detail: failure.to_string(),
                    });
                }
                Verdict::RequireApproval { reasons, policy } => {
                    awaiting_approval = true;
                    approval = Some(crate::ledger::NewApproval {
                        id: format!("apr_{}", hex::encode(rand::random::<[u8; 12]>())),
                        kind: "request".into(),
                        policy: policy.0,
                        policy_hash: policy.1,
                        reason: reasons.join("; "),
                        ttl_ms: i64::try_from(route.approval_ttl_ms).unwrap_or(i64::MAX),
                    });
                }
            }
        }
        let stored_headers = to_pairs(&forwarded);
        // The tenant goes into the body where the route's read-back checks
        // it (after the fingerprint: the caller's own bytes identify the request).
        let body = match &route.tenant_scoped_field {
            None => body,
            Some(ptr) => Bytes::from(
                crate::forward::stamp_tenant(
                    content_type.as_deref(),
                    &body,
                    ptr,
                    &principal.tenant,
                )
                .map_err(|m| ApiError::ContractViolation {
                    errors: vec![(ptr.clone(), m)],
                })?,
            ),
        };
        let new = NewOperation {
            tenant_id: principal.tenant.clone(),
            operation_id: key.clone(),
            route: route.name.clone(),
            method: parts.method.to_string(),
            path: rest.to_owned(),
            query,
            fingerprint: fp.clone(),
            provider_key: provider_key(
                &app.provider_key_secret,
                &principal.tenant,
                &key,
                &crate::idempotency::new_incarnation(),
            ),
            effect_class: Some(effect_class.as_str().to_owned()),
            request_content_type: content_type,
            request_body: body.to_vec(),
            request_headers: stored_headers,
            principal: principal.name.clone(),
            retention_ms: i64::try_from(route.key_retention_ms).unwrap_or(i64::MAX),
            awaiting_approval,
            decisions,
            approval,
        };
        let op = match app.ledger.reserve(&new).await? {
            Reservation::Created(op) if op.state == OpState::AwaitingApproval => {
                crate::metrics::request(&route.name, "awaiting-approval");
                return resume_awaiting(app, &route, op).await;
            }
            Reservation::Created(op) => {
                crate::failpoint::hit("after-reserve");
                op
            }
            Reservation::Existing(op) if op.state == OpState::Reserved && op.fingerprint == fp => {
                op
            }
            Reservation::Existing(op) => return answer_existing(app, &route, op, &fp).await,
        };

        // 7–9. Claim the lease, forward, record the outcome, answer.
        let lease = crate::execute::lease_ms(app);
        let Some(claim) = app
            .ledger
            .claim(
                &op.tenant_id,
                &op.operation_id,
                op.state,
                op.version,
                &app.instance_id,
                lease,
                "lease claimed for attempt",
            )
            .await?
        else {
            crate::metrics::request(&route.name, "in-flight");
            return Err(ApiError::InFlight {
                operation_id: op.operation_id.clone(),
                retry_after_s: 1,
            });
        };
        crate::metrics::request(&route.name, "forwarded");
        Ok(crate::execute::execute_for_caller(app, &route, op, claim).await)
    }
}

/// Streams a non-effectful request through without buffering either body.
async fn pass_through(
    route: &Route,
    peer: SocketAddr,
    req: Request,
    uri: http::Uri,
) -> Result<Response, ApiError> {
    let client = &route.client;
    let (parts, body) = req.into_parts();
    let proto = crate::listener::ListenerScheme::of(&parts.extensions);
    let mut headers = caller_headers(route, &parts.headers, Some(peer), proto);
    add_route_headers(route, &mut headers, None);
    let out = build_request(parts.method, uri, headers, body);
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    let resp = match tokio::time::timeout(timeout, client.request(out)).await {
        Err(_) => {
            return Err(ApiError::ProviderUnreachable(format!(
                "no response head within {} ms",
                route.response_timeout_ms
            )));
        }
        Ok(Err(e)) => {
            return Err(ApiError::ProviderUnreachable(crate::forward::error_detail(
                &e,
            )));
        }
        Ok(Ok(r)) => r,
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

fn denied(status: u16, policy: String, reason: String) -> ApiError {
    ApiError::PolicyDenied {
        status: StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN),
        policy,
        reason,
    }
}

/// The request as a policy sees it (the gateway's credential and
/// hop-by-hop headers removed).
#[allow(clippy::too_many_arguments)]
pub fn policy_request(
    principal: &crate::config::Principal,
    route: &Route,
    method: &str,
    path: &str,
    query: Option<&str>,
    headers: &http::HeaderMap,
    body: &[u8],
    operation_id: &str,
    fingerprint: &str,
    existing: Option<OpState>,
) -> crate::policy::Request {
    use crate::policy::bindings::{Header, OperationState};
    // The scheme the caller used isn't known here; policies see no
    // `X-Forwarded-Proto` rather than a guess.
    let mut visible = caller_headers(route, headers, None, "http");
    visible.remove("x-forwarded-proto");
    crate::policy::Request {
        tenant: principal.tenant.clone(),
        principal: principal.name.clone(),
        route: route.name.clone(),
        effect_class: wit_class(route.effect_class),
        method: method.to_owned(),
        path: path.to_owned(),
        query: query.map(str::to_owned),
        headers: visible
            .iter()
            .filter_map(|(n, v)| {
                Some(Header {
                    name: n.as_str().to_owned(),
                    value: v.to_str().ok()?.to_owned(),
                })
            })
            .collect(),
        body: body.to_vec(),
        operation_id: operation_id.to_owned(),
        fingerprint: fingerprint.to_owned(),
        existing_state: existing.map(|s| match s {
            OpState::Reserved => OperationState::Reserved,
            OpState::AwaitingApproval => OperationState::AwaitingApproval,
            OpState::Executing => OperationState::Executing,
            OpState::Completed => OperationState::Completed,
            OpState::Failed => OperationState::Failed,
            OpState::Unknown => OperationState::Unknown,
            OpState::Compensated => OperationState::Compensated,
        }),
    }
}
