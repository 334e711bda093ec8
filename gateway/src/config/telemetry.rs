//! `[telemetry]` and the standard OpenTelemetry variables, converted into
//! the runtime [`crate::telemetry::TelemetrySettings`].

use super::*;

/// `[telemetry]` with the standard variables applied (`env` reads one):
/// `OTEL_EXPORTER_OTLP_ENDPOINT` over `endpoint`, `OTEL_SERVICE_NAME` over
/// `service_name`, `OTEL_EXPORTER_OTLP_HEADERS` (`k=v,k2=v2`) added to
/// `headers`.
///
/// Errors: an endpoint that isn't an `http(s)://` URL, a ratio outside
/// 0.0–1.0, a zero timeout, a header that isn't a valid name or value.
pub(super) fn telemetry(
    spec: &TelemetrySpec,
    env: impl Fn(&str) -> Option<String>,
) -> Result<crate::telemetry::TelemetrySettings, ConfigError> {
    let from_env = env("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|v| !v.trim().is_empty());
    let (field, endpoint) = match (&from_env, &spec.endpoint) {
        (Some(v), _) => ("OTEL_EXPORTER_OTLP_ENDPOINT", Some(v.clone())),
        (None, Some(v)) if !v.trim().is_empty() => ("telemetry.endpoint", Some(v.clone())),
        _ => ("telemetry.endpoint", None),
    };
    let traces_endpoint = match endpoint {
        None => None,
        Some(e) => {
            let ok = url::Url::parse(e.trim())
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(ConfigError::new(
                    field,
                    format!("{e:?} is not an http:// or https:// URL"),
                ));
            }
            Some(crate::telemetry::traces_url(&e))
        }
    };
    if !(0.0..=1.0).contains(&spec.sampling_ratio) {
        return Err(ConfigError::new(
            "telemetry.sampling_ratio",
            format!("{} is outside 0.0–1.0", spec.sampling_ratio),
        ));
    }
    if spec.export_timeout_ms == 0 {
        return Err(ConfigError::new(
            "telemetry.export_timeout_ms",
            "must be at least 1",
        ));
    }
    let mut headers: Vec<(String, String)> = Vec::new();
    for (k, v) in &spec.headers {
        headers.push((k.clone(), v.clone()));
    }
    if let Some(list) = env("OTEL_EXPORTER_OTLP_HEADERS") {
        for pair in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(ConfigError::new(
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    format!("{pair:?} is not key=value"),
                ));
            };
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    for (k, v) in &headers {
        if http::HeaderName::from_bytes(k.as_bytes()).is_err()
            || http::HeaderValue::from_str(v).is_err()
        {
            return Err(ConfigError::new(
                format!("telemetry.headers.{k}"),
                "not a valid header name and value",
            ));
        }
    }
    let service_name = env("OTEL_SERVICE_NAME")
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| spec.service_name.clone());
    Ok(crate::telemetry::TelemetrySettings {
        traces_endpoint,
        service_name,
        sampling_ratio: spec.sampling_ratio,
        headers,
        export_timeout_ms: spec.export_timeout_ms,
    })
}
