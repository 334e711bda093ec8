//! The console's form bodies (`application/x-www-form-urlencoded`, HTML
//! §4.10.21.7), read into a type with every mistake named the way the
//! console's own checks name theirs (`form:<field>`). Fields a form's type
//! doesn't know are ignored (a browser may send its buttons' names).

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::ops::OpError;

/// The media type of an HTML form post.
const FORM: &str = "application/x-www-form-urlencoded";

/// A console form of type `T`. The admin listener has already read the body
/// whole within its limits (`limits.max_admin_body_bytes`,
/// `limits.body_read_timeout_ms`).
///
/// Rejections: 400 `bad-request` naming `header:content-type` when the
/// body is not declared a form, `form:<field>` for a field that is
/// missing or of the wrong shape (or unknown, to a type that refuses
/// unknown fields) or not well formed ([`well_formed`]), or `form` when
/// the body can't be read as one.
pub(crate) struct ConsoleForm<T>(pub T);

impl<T, S> FromRequest<S> for ConsoleForm<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = OpError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, OpError> {
        let is_form = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case(FORM));
        if !is_form {
            return Err(OpError::BadRequest {
                field: "header:content-type".into(),
                message: format!("a console form is sent as {FORM}"),
            });
        }
        let body = axum::body::to_bytes(req.into_body(), usize::MAX)
            .await
            .map_err(|e| OpError::BadRequest {
                field: "form".into(),
                message: format!("the form could not be read: {e}"),
            })?;
        parse(&body).map(ConsoleForm)
    }
}

/// `body` (a form's bytes) as `T`.
///
/// Errors: 400 naming `form:<field>` (the field's path, else the field a
/// message names in backticks: ``missing field `decision` ``), else
/// `form`.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, OpError> {
    well_formed(body)?;
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(body));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let at = e.path().to_string();
        let message = e.inner().to_string();
        let named = if at != "." && !at.is_empty() {
            Some(at)
        } else {
            message
                .split('`')
                .nth(1)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
        };
        OpError::BadRequest {
            field: named.map_or_else(|| "form".into(), |n| format!("form:{n}")),
            message: format!("invalid form: {message}"),
        }
    })
}

/// Refuses a form a browser would not send: a `%` not followed by two hex
/// digits (RFC 3986 §2.1), or a name or value whose decoded bytes are not
/// UTF-8. `form_urlencoded` reads the first as literal text and puts
/// U+FFFD in place of the second's bytes, so either would be taken as
/// another value without a word.
///
/// Errors: 400 naming `form:<name>` (at most 64 characters of it), or
/// `form` when the name itself is not well formed or is empty.
fn well_formed(body: &[u8]) -> Result<(), OpError> {
    for pair in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        let (name, value) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &[][..]),
        };
        let (field, fault) = match (decoded(name), decoded(value)) {
            (Ok(_), Ok(_)) => continue,
            (Err(fault), _) => ("form".to_owned(), fault),
            (Ok(n), Err(fault)) if n.is_empty() => ("form".to_owned(), fault),
            (Ok(n), Err(fault)) => (
                format!("form:{}", n.chars().take(64).collect::<String>()),
                fault,
            ),
        };
        return Err(OpError::BadRequest {
            field,
            message: format!("the form holds {fault}"),
        });
    }
    Ok(())
}

/// One name or value of a form, decoded (`+` is a space).
///
/// Errors: what is wrong with it, as the end of a sentence.
fn decoded(part: &[u8]) -> Result<String, &'static str> {
    const BAD_ESCAPE: &str = "a % not followed by two hex digits (RFC 3986 §2.1)";
    let mut out = Vec::with_capacity(part.len());
    let mut rest = part;
    while let Some((&b, tail)) = rest.split_first() {
        rest = tail;
        out.push(match b {
            b'%' => {
                let (hex, tail) = rest.split_first_chunk::<2>().ok_or(BAD_ESCAPE)?;
                rest = tail;
                let digit = |h: u8| (h as char).to_digit(16).ok_or(BAD_ESCAPE);
                (digit(hex[0])? * 16 + digit(hex[1])?) as u8
            }
            b'+' => b' ',
            b => b,
        });
    }
    String::from_utf8(out).map_err(|_| "bytes that are not UTF-8 once decoded")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Decide {
        csrf: String,
        decision: String,
        #[serde(default)]
        limit: Option<u32>,
    }

    fn field_of(body: &str) -> String {
        match parse::<Decide>(body.as_bytes()) {
            Err(OpError::BadRequest { field, .. }) => field,
            other => panic!("expected a 400 for {body:?}, got {other:?}"),
        }
    }

    /// A form reads as its type; a missing, unknown or wrongly shaped field
    /// is named.
    #[test]
    fn form_mistakes_are_named() {
        assert_eq!(
            parse::<Decide>(b"csrf=a&decision=approve&limit=3").unwrap(),
            Decide {
                csrf: "a".into(),
                decision: "approve".into(),
                limit: Some(3)
            }
        );
        assert_eq!(field_of("csrf=a"), "form:decision");
        assert_eq!(field_of("csrf=a&decision=x&extra=1"), "form:extra");
        assert_eq!(field_of("csrf=a&decision=x&limit=many"), "form:limit");
    }

    /// A `%` without two hex digits after it, or bytes that are not UTF-8
    /// once decoded, are refused naming their field; well-formed escapes,
    /// `+` and multibyte text read as written.
    #[test]
    fn malformed_escapes_are_refused() {
        assert_eq!(
            parse::<Decide>(b"csrf=a%2Bb&decision=tr%C3%A8s+bien").unwrap(),
            Decide {
                csrf: "a+b".into(),
                decision: "très bien".into(),
                limit: None
            }
        );
        for (body, field) in [
            ("csrf=a&decision=%ZZ", "form:decision"),
            ("csrf=a&decision=50%", "form:decision"),
            ("csrf=a&decision=%4", "form:decision"),
            ("csrf=%+1&decision=x", "form:csrf"),
            ("csrf=a&decision=%FF%FE", "form:decision"),
            ("csrf=a&%ZZ=1&decision=x", "form"),
            ("csrf=a&=%ZZ&decision=x", "form"),
        ] {
            assert_eq!(field_of(body), field, "{body}");
        }
        for (body, says) in [
            ("csrf=a&decision=%ZZ", "two hex digits"),
            ("csrf=a&decision=%FF%FE", "not UTF-8"),
        ] {
            match parse::<Decide>(body.as_bytes()) {
                Err(OpError::BadRequest { message, .. }) => {
                    assert!(message.contains(says), "{message}")
                }
                other => panic!("{other:?}"),
            }
        }
        // Empty pairs, an empty name, a value holding `=`, a name alone,
        // either case of hex, and a trailing `&` are all well formed.
        assert!(well_formed(b"&&=&a=b=c&x&k=%c3%a8+%C3%A8&").is_ok());
        // Raw bytes that are not UTF-8, unescaped.
        match parse::<Decide>(b"csrf=a&decision=\xff") {
            Err(OpError::BadRequest { field, .. }) => assert_eq!(field, "form:decision"),
            other => panic!("{other:?}"),
        }
    }
}
