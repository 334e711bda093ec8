//! Authentication of callers on both listeners: `Authorization: Bearer
//! <key>` (RFC 6750 §2.1) against the key table, by digest.

use http::HeaderMap;

use crate::config::{Principal, Role};
use crate::ops::OpError;
use crate::state::AppState;

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

impl Authenticate for AppState {
    /// Authenticates `Authorization: Bearer <key>` against the key table.
    ///
    /// Errors: 401 when the header is missing, malformed or unknown.
    fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, OpError> {
        let value = headers
            .get(http::header::AUTHORIZATION)
            .ok_or(OpError::Unauthenticated)?;
        let value = value.to_str().map_err(|_| OpError::Unauthenticated)?;
        let (scheme, key) = value.split_once(' ').ok_or(OpError::Unauthenticated)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(OpError::Unauthenticated);
        }
        self.settings()
            .keys
            .get(&crate::config::key_digest(key.trim()))
            .cloned()
            .ok_or(OpError::Unauthenticated)
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
