//! A webhook's signature and timestamp, under its source's scheme (see
//! the module above for the schemes).

use base64::Engine;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;

use super::reject;
use crate::config::{InboxSource, SignatureScheme};
use crate::ops::OpError;

/// An HMAC-SHA256 keyed with `secret`.
pub(super) fn mac(secret: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length")
}

/// Whether `sig` is the HMAC-SHA256 of `parts` under one of `secrets`
/// (compared in constant time).
fn signed_by(secrets: &[Vec<u8>], parts: &[&[u8]], sig: &[u8]) -> bool {
    secrets.iter().any(|s| {
        let mut m = mac(s);
        for p in parts {
            m.update(p);
        }
        m.verify_slice(sig).is_ok()
    })
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, OpError> {
    let field = format!("header:{name}");
    let v = headers.get(name).ok_or_else(|| {
        reject(
            "signature-missing",
            field.clone(),
            format!("the {name} header is required"),
        )
    })?;
    v.to_str().map_err(|_| {
        reject(
            "signature-malformed",
            field,
            format!("the {name} header holds a byte outside ASCII"),
        )
    })
}

fn check_time(src: &InboxSource, field: &str, ts_s: i64, now_ms: i64) -> Result<(), OpError> {
    let off = now_ms
        .saturating_sub(ts_s.saturating_mul(1000))
        .unsigned_abs();
    if off > src.tolerance_ms {
        return Err(reject(
            "timestamp-outside-tolerance",
            format!("header:{field}"),
            format!(
                "the signed timestamp is {} s away from now; at most {} s is accepted",
                off / 1000,
                src.tolerance_ms / 1000
            ),
        ));
    }
    Ok(())
}

/// Checks the request's signature and timestamp under `src`'s scheme at
/// `now_ms`.
///
/// Errors: [`OpError::InboxRejected`] with check `signature-missing`,
/// `signature-malformed`, `signature-mismatch` or
/// `timestamp-outside-tolerance`.
pub fn verify(
    src: &InboxSource,
    headers: &HeaderMap,
    body: &[u8],
    now_ms: i64,
) -> Result<(), OpError> {
    match src.scheme {
        SignatureScheme::Stripe => {
            let name = "Stripe-Signature";
            let v = header(headers, name)?;
            let mut t = None;
            let mut sigs = Vec::new();
            for item in v.split(',') {
                match item.trim().split_once('=') {
                    Some(("t", x)) => t = x.parse::<i64>().ok(),
                    Some(("v1", x)) => sigs.extend(hex::decode(x).ok()),
                    _ => {}
                }
            }
            let (Some(t), false) = (t, sigs.is_empty()) else {
                return Err(reject(
                    "signature-malformed",
                    "header:Stripe-Signature",
                    "expected t=<unix seconds>,v1=<hex HMAC-SHA256>",
                ));
            };
            let ts = t.to_string();
            if !sigs
                .iter()
                .any(|s| signed_by(&src.secrets, &[ts.as_bytes(), b".", body], s))
            {
                return Err(reject(
                    "signature-mismatch",
                    "header:Stripe-Signature",
                    "no v1 signature matches the body under the source's secrets",
                ));
            }
            check_time(src, "Stripe-Signature", t, now_ms)
        }
        SignatureScheme::StandardWebhooks => {
            let id = header(headers, "webhook-id")?;
            let ts = header(headers, "webhook-timestamp")?;
            let sig = header(headers, "webhook-signature")?;
            let t: i64 = ts.trim().parse().map_err(|_| {
                reject(
                    "signature-malformed",
                    "header:webhook-timestamp",
                    "expected unix seconds",
                )
            })?;
            let b64 = base64::engine::general_purpose::STANDARD;
            let sigs: Vec<Vec<u8>> = sig
                .split(' ')
                .filter_map(|s| s.strip_prefix("v1,"))
                .filter_map(|s| b64.decode(s).ok())
                .collect();
            if sigs.is_empty() {
                return Err(reject(
                    "signature-malformed",
                    "header:webhook-signature",
                    "expected v1,<base64 HMAC-SHA256> (space-separated)",
                ));
            }
            let parts: [&[u8]; 5] = [id.as_bytes(), b".", ts.as_bytes(), b".", body];
            if !sigs.iter().any(|s| signed_by(&src.secrets, &parts, s)) {
                return Err(reject(
                    "signature-mismatch",
                    "header:webhook-signature",
                    "no v1 signature matches the message under the source's secrets",
                ));
            }
            check_time(src, "webhook-timestamp", t, now_ms)
        }
        SignatureScheme::HmacSha256 => {
            let h = src.header.as_ref().map_or("x-signature", |h| h.as_str());
            let v = header(headers, h)?;
            let hexed = v.trim().strip_prefix("sha256=").unwrap_or(v.trim());
            let sig = hex::decode(hexed).map_err(|_| {
                reject(
                    "signature-malformed",
                    format!("header:{h}"),
                    "expected sha256=<hex HMAC-SHA256 of the body>",
                )
            })?;
            if !signed_by(&src.secrets, &[body], &sig) {
                return Err(reject(
                    "signature-mismatch",
                    format!("header:{h}"),
                    "the signature does not match the body under the source's secrets",
                ));
            }
            Ok(())
        }
    }
}
