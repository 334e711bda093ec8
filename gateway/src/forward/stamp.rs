//! A tenant stamped into an effectful request's body (a route's
//! `tenant_scoped_field`).

/// Writes `tenant` at `pointer` (a route's `tenant_scoped_field`, e.g.
/// `/metadata/tenant`) into an effectful request body, replacing whatever
/// the caller put there: a JSON object gets the field (intermediate objects
/// created), a form body (`application/x-www-form-urlencoded`) gets the
/// pair in bracket syntax (`metadata[tenant]=…`, other pairs kept in order).
///
/// Errors: a body that is neither a JSON object nor a form, or a JSON path
/// that runs into a non-object; the message names the pointer.
pub fn stamp_tenant(
    content_type: Option<&str>,
    body: &[u8],
    pointer: &str,
    tenant: &str,
) -> Result<Vec<u8>, String> {
    let segments: Vec<String> = pointer
        .split('/')
        .skip(1)
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect();
    let form = content_type.is_some_and(|c| {
        c.split(';').next().is_some_and(|m| {
            m.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
    });
    if form {
        let key = segments
            .iter()
            .enumerate()
            .map(|(i, s)| if i == 0 { s.clone() } else { format!("[{s}]") })
            .collect::<String>();
        let mut out = form_urlencoded::Serializer::new(String::new());
        for (k, v) in form_urlencoded::parse(body) {
            if k != key {
                out.append_pair(&k, &v);
            }
        }
        out.append_pair(&key, tenant);
        return Ok(out.finish().into_bytes());
    }
    let mut v: serde_json::Value = serde_json::from_slice(body).map_err(|_| {
        format!(
            "the route stamps the tenant at {pointer}: the body must be a JSON object or a form"
        )
    })?;
    let mut node = &mut v;
    for (i, seg) in segments.iter().enumerate() {
        let obj = node.as_object_mut().ok_or_else(|| {
            format!("the route stamps the tenant at {pointer}: the value on the way there is not an object")
        })?;
        if i == segments.len() - 1 {
            obj.insert(seg.clone(), serde_json::Value::String(tenant.to_owned()));
            break;
        }
        node = obj
            .entry(seg.clone())
            .or_insert_with(|| serde_json::json!({}));
    }
    serde_json::to_vec(&v).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_is_stamped_into_json_and_form_bodies() {
        let j = stamp_tenant(
            Some("application/json"),
            br#"{"amount":1,"metadata":{"tenant":"forged","order":"7"}}"#,
            "/metadata/tenant",
            "a",
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(
            v["metadata"],
            serde_json::json!({"order": "7", "tenant": "a"})
        );
        let j = stamp_tenant(None, br#"{"amount":1}"#, "/metadata/tenant", "a").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(v["metadata"]["tenant"], "a");
        let f = stamp_tenant(
            Some("application/x-www-form-urlencoded; charset=utf-8"),
            b"amount=1&metadata%5Btenant%5D=forged&metadata[order]=7",
            "/metadata/tenant",
            "a b",
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(f).unwrap(),
            "amount=1&metadata%5Border%5D=7&metadata%5Btenant%5D=a+b"
        );
        assert!(stamp_tenant(None, b"[1]", "/metadata/tenant", "a").is_err());
        assert!(stamp_tenant(None, br#"{"metadata":3}"#, "/metadata/tenant", "a").is_err());
        assert!(stamp_tenant(None, b"not json", "/t", "a").is_err());
    }
}
