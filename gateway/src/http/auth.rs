//! Authentication of callers on both listeners: `Authorization: Bearer
//! <key>` (RFC 6750 §2.1) against the key table, by digest.

use std::sync::{Arc, Mutex, Weak};

use http::HeaderMap;

use crate::config::{Principal, Role};
use crate::ops::OpError;
use crate::state::{AppState, Runtime};

/// Authentication and authorisation of a request's principal.
pub trait Authenticate {
    /// The principal of `Authorization: Bearer <key>`.
    ///
    /// Errors: 401 when the header is missing, malformed or unknown.
    fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, OpError>;

    /// An admin-listener caller for tenant `tenant` with one of `roles`.
    ///
    /// Errors: 401 for a bad key; 403 for a `client` key or a role not in
    /// `roles`; 404 when the key belongs to another tenant (another
    /// tenant's data is answered as not found, never as forbidden).
    fn authorize_admin(
        &self,
        headers: &HeaderMap,
        tenant: &str,
        roles: &[Role],
    ) -> Result<Principal, OpError>;
}

/// What one connection last authenticated: its `Authorization` value and
/// the principal it named under one settings snapshot. A keep-alive
/// caller's next call with the same header, while the settings are the
/// same, is answered from here without the SHA-256 of its key (about 3 %
/// of a pass-through call's instructions). The listener gives each
/// connection one ([`ConnAuth::default`], a request extension); a settings
/// reload (keys added or revoked) makes it stale at once.
#[derive(Debug, Default)]
pub struct ConnAuth(Mutex<Option<Memo>>);

struct Memo {
    authorization: http::HeaderValue,
    /// The snapshot the principal was found in. Weak: an old snapshot's
    /// contents are not kept alive by a connection, while its allocation
    /// is, so no later snapshot can have its address.
    settings: Weak<Runtime>,
    principal: Principal,
}

impl std::fmt::Debug for Memo {
    /// Names the principal; the `Authorization` value (a key) is never
    /// written.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memo")
            .field("authorization", &"<redacted>")
            .field("principal", &self.principal)
            .finish()
    }
}

impl ConnAuth {
    /// The memo's principal when `authorization` and `settings` are the ones
    /// it was found with.
    fn get(&self, authorization: &http::HeaderValue, settings: &Arc<Runtime>) -> Option<Principal> {
        let memo = self.0.lock().ok()?;
        let m = memo.as_ref()?;
        (m.settings.as_ptr() == Arc::as_ptr(settings)
            && crate::http::same_bytes(m.authorization.as_bytes(), authorization.as_bytes()))
        .then(|| m.principal.clone())
    }

    fn set(
        &self,
        authorization: &http::HeaderValue,
        settings: &Arc<Runtime>,
        principal: &Principal,
    ) {
        if let Ok(mut memo) = self.0.lock() {
            *memo = Some(Memo {
                authorization: authorization.clone(),
                settings: Arc::downgrade(settings),
                principal: principal.clone(),
            });
        }
    }
}

impl AppState {
    /// [`Authenticate::authenticate`] for a request of a connection that
    /// keeps a [`ConnAuth`] (the proxy listener's): the same answers, the
    /// key hashed only when the connection's last one was another.
    ///
    /// Errors: as [`Authenticate::authenticate`].
    pub fn authenticate_on(
        &self,
        headers: &HeaderMap,
        conn: Option<&ConnAuth>,
    ) -> Result<Principal, OpError> {
        let mut values = headers.get_all(http::header::AUTHORIZATION).iter();
        let value = values.next().ok_or(OpError::Unauthenticated)?;
        if values.next().is_some() {
            // Two credentials: a proxy in front that takes the last one
            // would answer for another principal than this first one.
            return Err(OpError::BadRequest {
                field: "header:Authorization".into(),
                message: "a request must have at most one Authorization header (RFC 9110 §11.6.2)"
                    .into(),
            });
        }
        let settings = self.settings();
        if let Some(p) = conn.and_then(|c| c.get(value, &settings)) {
            return Ok(p);
        }
        let principal = principal_of(&settings, value)?;
        if let Some(c) = conn {
            c.set(value, &settings, &principal);
        }
        Ok(principal)
    }
}

/// The principal of an `Authorization` value in `settings`' key table.
fn principal_of(settings: &Runtime, value: &http::HeaderValue) -> Result<Principal, OpError> {
    let value = value.to_str().map_err(|_| OpError::Unauthenticated)?;
    let (scheme, key) = value.split_once(' ').ok_or(OpError::Unauthenticated)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(OpError::Unauthenticated);
    }
    settings
        .keys
        .get(&crate::config::key_digest(key.trim()))
        .cloned()
        .ok_or(OpError::Unauthenticated)
}

impl Authenticate for AppState {
    /// Authenticates `Authorization: Bearer <key>` against the key table.
    ///
    /// Errors: 401 when the header is missing, malformed or unknown.
    fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, OpError> {
        self.authenticate_on(headers, None)
    }

    /// Authenticates an admin-listener caller for tenant `tenant`.
    ///
    /// Errors: 401 for a bad key; 403 for a `client` key or a role not in
    /// `roles`; 404 when the key belongs to another tenant (another tenant's
    /// data is answered as not found, never as forbidden).
    fn authorize_admin(
        &self,
        headers: &HeaderMap,
        tenant: &str,
        roles: &[Role],
    ) -> Result<Principal, OpError> {
        let p = self.authenticate(headers)?;
        if p.role == Role::Client {
            return Err(OpError::Forbidden {
                role: "client",
                action: "use the admin API".into(),
            });
        }
        if p.tenant != tenant {
            return Err(OpError::NotFound(format!("no tenant {tenant:?}")));
        }
        if !roles.contains(&p.role) {
            let may: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
            return Err(OpError::Forbidden {
                role: p.role.as_str(),
                action: format!("do this (roles that may: {})", may.join(", ")).into(),
            });
        }
        Ok(p)
    }
}
