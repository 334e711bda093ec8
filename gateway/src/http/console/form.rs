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
/// unknown fields), or `form` when the body can't be read as one.
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
}
