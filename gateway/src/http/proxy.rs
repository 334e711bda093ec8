//! The proxy listener: authentication, route matching, pass-through
//! streaming, and the hand-over of effectful calls to [`crate::ops::admit`]
//! (docs/design.md "Request flow", steps 1–4).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header;

use crate::config::{Principal, Role, Route};
use crate::forward::{Inbound, build_request, upstream_uri};
use crate::http::auth::{Authenticate, ConnAuth};
use crate::http::body::{ROUTE_BODY_LIMIT, decode_body, read_body, watched, with_first_frame};
use crate::http::guards;
use crate::http::{answer_response, reply_response};
use crate::idempotency::{fingerprint, parse_key};
use crate::ops::OpError;
use crate::ops::admit::{Flow, PolicyView, policy_request, refusal};
use crate::ops::mcp::{McpCall, Prepared};
use crate::policy::evaluate_chain_async;
use crate::state::{AppState, Runtime};

/// The proxy listener's service: the guards ([`guards`]) and the decoding
/// of stored replays ([`crate::http::encoding::DecodeReplaysLayer`]), over
/// [`Dispatch`]: `GET /approvals/{id}` and `POST /inbox/{name}` go to their
/// router, every other request to the proxy path ([`handle`]) directly.
pub fn service(
    state: AppState,
) -> impl tower::Service<
    Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ Sync
+ 'static {
    let routes = Router::new()
        .route(
            "/approvals/{id}",
            axum::routing::get(approval_status).fallback(|| async {
                OpError::MethodNotAllowed("only GET on /approvals/{id}".into())
            }),
        )
        .route(
            "/inbox/{name}",
            axum::routing::post(crate::http::inbox::receive).fallback(|| async {
                OpError::MethodNotAllowed("only POST on /inbox/{name}".into())
            }),
        )
        // The framework's own rejections on these two routes (a path
        // segment that is no valid UTF-8) as problem+json naming the
        // parameter, as on the admin listener; never on the proxy path.
        .route_layer(axum::middleware::map_response(|resp: Response| {
            crate::http::admin::as_problem(resp, None)
        }))
        .fallback(handle)
        .with_state(state.clone());
    let app = state.clone();
    // Outermost first.
    tower::ServiceBuilder::new()
        .layer(guards::refuse(guards::refuse_methods))
        .layer(guards::refuse(move |req: &Request| {
            guards::limit_header_bytes(&app, req)
        }))
        .layer(guards::refuse(guards::refuse_dot_segments))
        .layer(crate::http::encoding::DecodeReplaysLayer::new(
            state.clone(),
        ))
        .service(Dispatch { state, routes })
}

/// Sends `/approvals/{id}` and `/inbox/{name}` (one non-empty segment
/// after the prefix, as the router matches them) to `routes`, and every
/// other request straight to the proxy path: the path every call takes
/// skips the router's matching, its boxed route services and its
/// extractors (7,600 instructions of a pass-through call).
#[derive(Clone)]
pub struct Dispatch {
    state: AppState,
    routes: Router,
}

/// Whether `path` is one of the proxy listener's own routes,
/// `/approvals/{id}` or `/inbox/{name}`.
fn own_route(path: &str) -> bool {
    ["/approvals/", "/inbox/"].iter().any(|p| {
        path.strip_prefix(p)
            .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
    })
}

impl tower::Service<Request> for Dispatch {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request) -> Self::Future {
        use tower::ServiceExt;
        if own_route(req.uri().path()) {
            return Box::pin(self.routes.clone().oneshot(req));
        }
        use futures_util::FutureExt;
        Box::pin(handle(State(self.state.clone()), req).map(Ok))
    }
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
            .ok_or_else(|| OpError::NotFound(format!("no approval {id:?}")))?;
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
        Ok::<_, OpError>(axum::Json(body))
    }
    .await;
    match result {
        Ok(r) => r.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn handle(State(app): State<AppState>, req: Request) -> Response {
    // Set by the listener on every request.
    let Some(inbound) = Inbound::of(req.extensions()) else {
        return OpError::Internal("the request came with no peer address".into()).into_response();
    };
    match handle_inner(&app, inbound.peer, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The proxy path, in the README's order: 1. authenticate the principal;
/// 2. match the route (never an open proxy) and take one settings
/// snapshot; the tenant's limits; pass-through for calls that change
/// nothing; 3. the identity (Idempotency-Key, or the MCP tool call);
/// 4. the bounded body and the fingerprint; then the effectful flow of
/// [`Flow`].
async fn handle_inner(app: &AppState, peer: SocketAddr, req: Request) -> Result<Response, OpError> {
    let conn_auth = req.extensions().get::<Arc<ConnAuth>>().cloned();
    let principal = authenticate_client(app, req.headers(), conn_auth.as_deref())?;
    let rt = app.settings();
    let path = req.uri().path().to_owned();
    let route = rt
        .match_route(&path)
        .filter(|r| r.allows_tenant(&principal.tenant))
        .ok_or_else(|| OpError::NotFound(format!("no route for {path}")))?;
    crate::http::observe::record_route(req.method(), &route.name, &route.prefix);
    tracing::Span::current().record("effectgate.tenant", principal.tenant.as_str());
    let rest = &path[route.prefix.len() - 1..];
    let query = req.uri().query().map(str::to_owned);
    let mcp_post = route.mcp.is_some() && req.method() == http::Method::POST;
    let effectful = mcp_post || route.is_effectful(req.method());
    // The tenant's rate limit covers every call; its in-flight limit the
    // effectful ones (held until this caller is answered).
    let limits = rt.tenant_limits.get(&principal.tenant);
    if let Some(l) = limits {
        l.check_rate(&principal.tenant).map_err(OpError::from)?;
    }
    let _in_flight = match limits {
        Some(l) if effectful => l
            .acquire_in_flight(&principal.tenant)
            .map_err(OpError::from)?,
        _ => None,
    };
    if !effectful {
        let uri = upstream_uri(route, rest, query.as_deref())?;
        // On an MCP route policies decide tool calls; the session's other
        // traffic (GET streams, DELETE) passes. Boxed, as the effectful
        // part below: a call without policies doesn't carry their
        // evaluation in its future.
        let policies = rt.policies.for_route(&principal.tenant, &route.name);
        if route.mcp.is_none() && !policies.is_empty() {
            let head = (req.method(), req.headers());
            let decision = boxed(pass_through_policies(
                app,
                policies,
                route,
                &principal,
                head,
                (rest, query.as_deref()),
            ));
            decision.await?;
        }
        return pass_through(route, peer, req, uri).await;
    }
    // The effectful part is a future of kilobytes (body reads, the MCP
    // decision, the flow's hand-over): boxed, so that the future of every
    // request, which each layer of the listener moves, stays the size of a
    // pass-through.
    let rest_at = path.len() - rest.len();
    let call = boxed(effectful_call(EffectfulCall {
        app,
        rt: &rt,
        route,
        principal,
        peer,
        req,
        path,
        rest_at,
        query,
        mcp_post,
    }));
    call.await
}

/// `f` moved into a box. A plain function, so that the caller's future
/// keeps room for the box only: a future built and boxed in an `async`
/// statement that also awaits it stays in the caller's future (the
/// effectful call's is 10 KB).
fn boxed<'a, T>(
    f: impl std::future::Future<Output = T> + Send + 'a,
) -> futures_util::future::BoxFuture<'a, T> {
    Box::pin(f)
}

/// An effectful call as [`handle_inner`] matched it.
struct EffectfulCall<'a> {
    app: &'a AppState,
    rt: &'a std::sync::Arc<Runtime>,
    /// The matched route, of `rt`.
    route: &'a Route,
    principal: Principal,
    peer: SocketAddr,
    req: Request,
    /// The request's path; the part below the route's prefix starts at
    /// `rest_at`.
    path: String,
    rest_at: usize,
    query: Option<String>,
    /// A POST on an MCP route: its identity is the tool call, not an
    /// `Idempotency-Key`.
    mcp_post: bool,
}

/// Steps 3–4 and the effectful flow of [`handle_inner`].
async fn effectful_call(call: EffectfulCall<'_>) -> Result<Response, OpError> {
    let EffectfulCall {
        app,
        rt,
        route,
        principal,
        peer,
        req,
        path,
        rest_at,
        query,
        mcp_post,
    } = call;
    let rest = &path[rest_at..];
    let key = if mcp_post {
        None
    } else {
        Some(
            parse_key(req.headers(), rt.limits.max_idempotency_key_len)?.ok_or_else(|| {
                OpError::IdempotencyKeyMissing {
                    method: req.method().to_string(),
                    route: route.name.clone(),
                }
            })?,
        )
    };
    let (mut parts, body) = req.into_parts();
    let body = read_body(
        &parts.headers,
        body,
        route.max_body_bytes,
        ROUTE_BODY_LIMIT,
        rt.limits.body_read_timeout_ms,
    )
    .await?;
    let body = decode_body(&mut parts.headers, body, route.max_body_bytes).await?;
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let scheme = Inbound::scheme_of(&parts.extensions);
    let (key, fp, mcp_call) = match key {
        Some(k) => {
            let fp = fingerprint(
                parts.method.as_str(),
                &route.name,
                rest,
                query.as_deref(),
                content_type.as_deref(),
                &body,
            );
            (k, fp, None)
        }
        None => {
            let uri = upstream_uri(route, rest, query.as_deref())?;
            let post = crate::ops::mcp::Post {
                app,
                rt,
                route,
                principal: &principal,
                headers: &parts.headers,
                body: &body,
                uri: &uri,
                peer: (peer, scheme),
            };
            let call = match mcp_decision(&post).await? {
                Ok(call) => call,
                Err(answered) => return Ok(answered),
            };
            (call.key.clone(), call.fingerprint.clone(), Some(call))
        }
    };
    let answer = run_flow(
        OwnedFlow {
            app: app.clone(),
            route_index: rt
                .routes
                .iter()
                .position(|r| std::ptr::eq(r, route))
                .ok_or_else(|| OpError::Internal("the route left its snapshot".into()))?,
            rt: rt.clone(),
            principal,
            peer,
            scheme,
            method: parts.method,
            headers: parts.headers,
            rest_at,
            path,
            query,
            mcp: mcp_call.clone(),
        },
        (body, content_type, key, fp),
    )
    .await;
    Ok(match &mcp_call {
        Some(c) => crate::http::mcp::readdress(answer, &c.rpc_id).await,
        None => answer_response(answer),
    })
}

/// What [`Flow`] borrows, owned, for the task it runs in.
struct OwnedFlow {
    app: AppState,
    rt: std::sync::Arc<Runtime>,
    /// The matched route: `rt.routes[route_index]`.
    route_index: usize,
    principal: Principal,
    peer: SocketAddr,
    scheme: &'static str,
    method: http::Method,
    headers: http::HeaderMap,
    /// The request path; the part below the route's prefix starts at
    /// `rest_at`.
    path: String,
    rest_at: usize,
    query: Option<String>,
    mcp: Option<McpCall>,
}

/// Runs the effectful flow of `f` in a task of its own, tracked with the
/// calls (shutdown waits for it within `shutdown.drain_ms`), and
/// returns its answer. A caller that hangs up drops only the wait: a flow
/// dropped half-way would lose a reservation or a claim already queued
/// for the ledger's commit, and a claim committed without the attempt it
/// was made for leaves the operation EXECUTING, unrun, until its lease
/// ends. So once the request is read, the call is carried out, and a
/// retry with the same key gets its outcome.
async fn run_flow(
    f: OwnedFlow,
    (body, content_type, key, fp): (Bytes, Option<String>, String, String),
) -> crate::ops::Answer {
    spawn_flow(f, (body, content_type, key, fp))
        .await
        .unwrap_or_else(|e| Err(OpError::Internal(format!("the call's task failed: {e}"))))
}

/// The task of [`run_flow`]: a function of its own, not a step of the
/// caller's future, so that the flow's future (5 KB) is built and boxed
/// here and the caller's future holds no room for it while it waits.
fn spawn_flow(
    f: OwnedFlow,
    (body, content_type, key, fp): (Bytes, Option<String>, String, String),
) -> tokio::task::JoinHandle<crate::ops::Answer> {
    use tracing::Instrument;
    let tracker = f.app.lifecycle.calls.clone();
    let flow = async move {
        let flow = Flow {
            app: &f.app,
            rt: &f.rt,
            route: &f.rt.routes[f.route_index],
            principal: &f.principal,
            peer: f.peer,
            scheme: f.scheme,
            method: &f.method,
            headers: &f.headers,
            rest: &f.path[f.rest_at..],
            query: f.query.as_deref(),
            mcp: f.mcp.as_ref(),
        };
        flow.run(body, content_type, key, fp).await
    };
    // Boxed before it is wrapped and spawned: the flow's future is
    // kilobytes, and each wrapper and the spawn would copy it whole.
    let flow = Box::pin(flow);
    tracker.spawn(
        crate::telemetry::with_request(crate::telemetry::request_context(), flow).in_current_span(),
    )
}

/// Step 3 on an MCP route: what the POST is. A world-changing tool call
/// comes back for the effectful flow; anything else is answered here
/// (`Err`): refused, or forwarded without the ledger.
async fn mcp_decision(
    post: &crate::ops::mcp::Post<'_>,
) -> Result<Result<McpCall, Response>, OpError> {
    Ok(match post.prepare().await? {
        Prepared::Respond(r) => Err(reply_response(r)),
        Prepared::Forward => {
            let (status, headers, bytes) = crate::ops::mcp::forward_buffered(
                post.route,
                post.headers,
                post.body.clone(),
                post.uri,
                post.peer,
            )
            .await?;
            let mut r = Response::new(Body::from(bytes));
            *r.status_mut() = status;
            *r.headers_mut() = headers;
            Err(r)
        }
        Prepared::Call(c) => Ok(c),
    })
}

/// Step 1: the caller's principal, which must hold the `client` role.
///
/// Errors: 401 without a valid key; 403 for any other role.
fn authenticate_client(
    app: &AppState,
    headers: &http::HeaderMap,
    conn: Option<&ConnAuth>,
) -> Result<Principal, OpError> {
    let principal = app.authenticate_on(headers, conn)?;
    if principal.role != Role::Client {
        return Err(OpError::Forbidden {
            role: principal.role.as_str(),
            action: "send calls through the proxy".into(),
        });
    }
    Ok(principal)
}

/// The tenant's policies on a call that changes nothing: they see the
/// head only (the body streams through unread), and a refusal is final.
async fn pass_through_policies(
    app: &AppState,
    policies: &[crate::policy::BoundPolicy],
    route: &Route,
    principal: &Principal,
    (method, headers): (&http::Method, &http::HeaderMap),
    (rest, query): (&str, Option<&str>),
) -> Result<(), OpError> {
    let request = policy_request(
        principal,
        route,
        &PolicyView {
            method: method.as_str(),
            path: rest,
            query,
            headers,
            body: &[],
            operation_id: "",
            fingerprint: "",
            existing: None,
        },
    );
    let (verdict, _) = evaluate_chain_async(
        app.engine.clone(),
        policies,
        route,
        &principal.tenant,
        request,
    )
    .await;
    match refusal(verdict) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Streams a non-effectful request through without buffering either body
/// (of a small one, the first frame is read before the request goes out:
/// [`with_first_frame`]), all within the route's `response_timeout_ms`.
///
/// Errors: the caller's body broken off (400) or stalled (408); 502
/// `provider-unreachable` when nothing was sent, 504 `provider-timeout`
/// when no answer's head came in time, 502 `provider-answer-unreadable`
/// when the exchange failed after the request went out, or the provider
/// switched protocols unasked.
async fn pass_through(
    route: &Route,
    peer: SocketAddr,
    req: Request,
    uri: http::Uri,
) -> Result<Response, OpError> {
    let (mut parts, body) = req.into_parts();
    let proto = Inbound::scheme_of(&parts.extensions);
    crate::forward::pass_through_headers(route, &mut parts.headers, peer, proto);
    // One limit for the body's first bytes and the response head together.
    let started = std::time::Instant::now();
    let (body, whole) = with_first_frame(body, route.response_timeout_ms).await?;
    let left = std::time::Duration::from_millis(route.response_timeout_ms)
        .saturating_sub(started.elapsed());
    // A body still streaming is watched: when the send fails, its end says
    // whose fault it was.
    let (body, end) = if whole || http_body::Body::is_end_stream(&body) {
        (body, None)
    } else {
        let (body, end) = watched(body);
        (body, Some(end))
    };
    let out = build_request(parts.method, uri, parts.headers, body);
    match crate::forward::send_within(route, out, left).await {
        // The gateway asks for no upgrade (`Upgrade` is hop-by-hop): a
        // switch it didn't ask for is no answer the caller can use.
        Ok(resp) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
            Err(OpError::ProviderAnswerUnreadable(
                "the provider answered 101 Switching Protocols to a request that asked for no upgrade"
                    .into(),
            ))
        }
        Ok(resp) => Ok(resp.map(Body::new)),
        Err(e) => Err(match end {
            Some(end) if end.broken() => OpError::BadRequest {
                field: "body".into(),
                message: "the request body broke off before its end (RFC 9112 §6.3); \
                          the provider got part of it, and no answer"
                    .into(),
            },
            Some(end) if e.timed_out && !end.whole() => OpError::BodyStalled {
                limit_ms: route.response_timeout_ms,
            },
            _ if e.timed_out => OpError::ProviderTimeout {
                limit_ms: route.response_timeout_ms,
            },
            _ if e.nothing_sent => OpError::ProviderUnreachable(e.detail),
            _ => OpError::ProviderAnswerUnreadable(e.detail),
        }),
    }
}
