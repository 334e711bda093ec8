//! Which headers carry credentials, and their values hidden where people
//! read a call's headers (the admin API, the console).

/// Header names whose values are credentials: shown as `[redacted]` in the
/// admin API and the console (stored as sent: a new attempt needs them).
pub const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "api-key",
    "x-auth-token",
    "x-amz-security-token",
    "x-csrf-token",
];

/// Words that make a header name a credential's wherever they stand in it
/// (`X-Client-Secret`, `X-Hub-Signature-256`, `X-Session-Id`): a header the
/// gateway can't tell apart is shown as `[redacted]` rather than shown.
pub const CREDENTIAL_WORDS: &[&str] = &[
    "secret",
    "token",
    "password",
    "api-key",
    "apikey",
    "private-key",
    "privatekey",
    "credential",
    "signature",
    "session",
    "auth",
    "passwd",
    "pwd",
    "jwt",
    "bearer",
];

/// Whether header `name` (lower case) carries a credential: one of
/// [`CREDENTIAL_HEADERS`], a name with one of [`CREDENTIAL_WORDS`] in
/// it, or a name ending in `-key` (`Ocp-Apim-Subscription-Key`,
/// `X-Access-Key`) but an idempotency key's (`Idempotency-Key`, shown:
/// it is the operation's id). `_` is read as `-` (`api_key`,
/// `X_Auth_Token`, `private_key`: names with underscores are valid
/// fields, RFC 9110 §5.1, and servers often read them as the hyphenated
/// ones).
pub fn is_credential(name: &str) -> bool {
    let hyphenated;
    let name = if name.contains('_') {
        hyphenated = name.replace('_', "-");
        hyphenated.as_str()
    } else {
        name
    };
    CREDENTIAL_HEADERS.contains(&name)
        || CREDENTIAL_WORDS.iter().any(|w| name.contains(w))
        || (name.ends_with("-key") && !name.ends_with("idempotency-key"))
}

/// `pairs` with the values of credential headers ([`is_credential`])
/// replaced by `[redacted]`.
pub fn redacted(mut pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    for (n, v) in &mut pairs {
        if is_credential(&n.to_ascii_lowercase()) {
            *v = "[redacted]".into();
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credential names are recognised with `_` for `-` too; other names
    /// are shown.
    #[test]
    fn credential_headers_are_redacted_whatever_their_separator() {
        let pairs = |names: &[&str]| {
            names
                .iter()
                .map(|n| ((*n).to_owned(), "s3cret".to_owned()))
                .collect::<Vec<_>>()
        };
        for name in [
            "api_key",
            "Api_Key",
            "x_api_key",
            "X-Api-Key",
            "apikey",
            "x_auth_token",
            "client_secret",
            "Proxy_Authorization",
            "private_key",
            "X-Signature",
            "Stripe-Signature",
            "X-Hub-Signature-256",
            "X-Client-Credential",
            "X-Session-Id",
            "X-Auth-User",
            "Ocp-Apim-Subscription-Key",
            "X-Access-Key",
            "x_access_key",
            "X-Passwd",
            "X-Pwd",
            "X-Jwt",
            "X-Bearer",
        ] {
            assert_eq!(redacted(pairs(&[name]))[0].1, "[redacted]", "{name}");
        }
        for name in [
            "content_type",
            "x-request-id",
            "idempotency_key",
            "Idempotency-Key",
            "X-Idempotency-Key",
            "traceparent",
            "x-forwarded-for",
            "user-agent",
        ] {
            assert_eq!(redacted(pairs(&[name]))[0].1, "s3cret", "{name}");
        }
    }
}
