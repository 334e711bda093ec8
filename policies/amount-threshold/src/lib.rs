//! `amount-threshold`: requires a human approval when a JSON field of the
//! request body (default `/amount`) exceeds the tenant's threshold, and
//! denies currencies that are not on the tenant's allow-list.
//!
//! Config:
//! ```json
//! {"threshold": 1000, "amount_pointer": "/amount",
//!  "currency_pointer": "/currency", "currencies": ["eur", "usd"]}
//! ```

use effectgate_policy_sdk::*;

struct AmountThreshold;

impl Policy for AmountThreshold {
    fn config_schema() -> String {
        r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["threshold"],
  "additionalProperties": false,
  "properties": {
    "threshold": {"type": "number", "minimum": 0, "description": "amounts above this need approval"},
    "amount_pointer": {"type": "string", "pattern": "^(/.*)?$", "default": "/amount"},
    "currency_pointer": {"type": "string", "pattern": "^(/.*)?$", "default": "/currency"},
    "currencies": {"type": "array", "items": {"type": "string"}, "description": "allowed currencies; absent = any"}
  }
}"#
        .into()
    }

    fn evaluate(config: &Value, request: &Request) -> Decision {
        if request.operation_id.is_empty() {
            // Asked whether an MCP tool may be offered at all: amounts are
            // judged per call, not per tool.
            return allow();
        }
        let Some(body) = json_body(request) else {
            return deny(
                400,
                "the request body must be JSON for the amount-threshold policy",
            );
        };
        let amount_ptr = config["amount_pointer"].as_str().unwrap_or("/amount");
        let currency_ptr = config["currency_pointer"].as_str().unwrap_or("/currency");
        if let Some(allowed) = config["currencies"].as_array() {
            let currency = body
                .pointer(currency_ptr)
                .and_then(Value::as_str)
                .unwrap_or("");
            if !allowed
                .iter()
                .any(|c| c.as_str().is_some_and(|c| c.eq_ignore_ascii_case(currency)))
            {
                return deny(
                    403,
                    format!("currency {currency:?} is not allowed for this tenant"),
                );
            }
        }
        let threshold = config["threshold"].as_f64().unwrap_or(0.0);
        match body.pointer(amount_ptr).and_then(Value::as_f64) {
            Some(amount) if amount > threshold => {
                log::info(
                    "approval required",
                    &[
                        ("amount", &amount.to_string()),
                        ("threshold", &threshold.to_string()),
                    ],
                );
                require_approval(format!("amount {amount} exceeds the threshold {threshold}"))
            }
            Some(_) => allow(),
            None => deny(400, format!("no numeric amount at {amount_ptr}")),
        }
    }
}

export_policy!(AmountThreshold);
