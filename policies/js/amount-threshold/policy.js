// amount-threshold, in JavaScript: requires a human approval when a JSON
// field of the request body (default `/amount`) exceeds the tenant's
// threshold, and denies currencies that are not on the tenant's
// allow-list. The same behaviour and cases as the Rust example
// (`policies/amount-threshold`).
//
// Config:
//   {"threshold": 1000, "amount_pointer": "/amount",
//    "currency_pointer": "/currency", "currencies": ["eur", "usd"]}
//
// The world's types as JavaScript values (componentize-js):
//   request: {tenant, principal, route, effectClass, method, path, query,
//             headers: [{name, value}], body: Uint8Array, operationId,
//             fingerprint, existingState}
//   decision: {tag: "allow", val: {effectClass, addHeaders}}
//           | {tag: "deny", val: {status, reason}}
//           | {tag: "require-approval", val: reason}
//   enums (effect class, failure class, replay verdict): their WIT names.

import { log } from "effectgate:policy/log@0.2.0";

const SCHEMA = JSON.stringify({
  $schema: "https://json-schema.org/draft/2020-12/schema",
  type: "object",
  required: ["threshold"],
  additionalProperties: false,
  properties: {
    threshold: { type: "number", minimum: 0, description: "amounts above this need approval" },
    amount_pointer: { type: "string", pattern: "^(/.*)?$", default: "/amount" },
    currency_pointer: { type: "string", pattern: "^(/.*)?$", default: "/currency" },
    currencies: {
      type: "array",
      items: { type: "string" },
      description: "allowed currencies; absent = any",
    },
  },
});

const allow = () => ({ tag: "allow", val: { effectClass: undefined, addHeaders: [] } });
const deny = (status, reason) => ({ tag: "deny", val: { status, reason } });
const requireApproval = (reason) => ({ tag: "require-approval", val: reason });

// RFC 6901: "" is the whole document, "/a/0/b" walks objects and arrays.
function pointer(doc, ptr) {
  if (ptr === "") return doc;
  let cur = doc;
  for (const raw of ptr.slice(1).split("/")) {
    const key = raw.replaceAll("~1", "/").replaceAll("~0", "~");
    if (Array.isArray(cur)) {
      if (!/^(0|[1-9][0-9]*)$/.test(key)) return undefined;
      cur = cur[Number(key)];
    } else if (cur !== null && typeof cur === "object" && Object.hasOwn(cur, key)) {
      cur = cur[key];
    } else {
      return undefined;
    }
  }
  return cur;
}

function jsonBody(request) {
  try {
    return JSON.parse(new TextDecoder().decode(request.body));
  } catch {
    return undefined;
  }
}

// Numbers print as the Rust example prints its f64s (5000, 12.5).
const show = (n) => String(n);

export function configSchema() {
  return SCHEMA;
}

export function evaluate(configText, request) {
  if (request.operationId === "") {
    // Asked whether an MCP tool may be offered at all: amounts are judged
    // per call, not per tool.
    return allow();
  }
  const body = jsonBody(request);
  if (body === undefined) {
    return deny(400, "the request body must be JSON for the amount-threshold policy");
  }
  const config = JSON.parse(configText);
  const amountPtr = typeof config.amount_pointer === "string" ? config.amount_pointer : "/amount";
  const currencyPtr =
    typeof config.currency_pointer === "string" ? config.currency_pointer : "/currency";
  if (Array.isArray(config.currencies)) {
    const found = pointer(body, currencyPtr);
    const currency = typeof found === "string" ? found : "";
    const ok = config.currencies.some(
      (c) => typeof c === "string" && c.toLowerCase() === currency.toLowerCase(),
    );
    if (!ok) {
      return deny(403, `currency ${JSON.stringify(currency)} is not allowed for this tenant`);
    }
  }
  const threshold = typeof config.threshold === "number" ? config.threshold : 0;
  const amount = pointer(body, amountPtr);
  if (typeof amount !== "number") {
    return deny(400, `no numeric amount at ${amountPtr}`);
  }
  if (amount > threshold) {
    log("info", "approval required", [
      ["amount", show(amount)],
      ["threshold", show(threshold)],
    ]);
    return requireApproval(`amount ${show(amount)} exceeds the threshold ${show(threshold)}`);
  }
  return allow();
}

export function classifyFailure(_config, _head, _body) {
  return "unknown";
}

// The replay defaults by effect class (the gateway's design table).
const REPLAY_DEFAULTS = {
  derived: "allow",
  analytics: "allow",
  notification: "same-operation-only",
  payment: "same-operation-only",
  permission: "revalidate",
  irreversible: "manual",
};

export function replay(_config, op) {
  return REPLAY_DEFAULTS[op.effectClass] ?? "manual";
}

// The gateway's compensation defaults: an approval for permission and
// irreversible operations, allow for the rest.
export function compensate(_config, request) {
  const cls = request.operation.effectClass;
  if (cls === "permission" || cls === "irreversible") {
    return requireApproval(`compensating a ${cls} operation needs an approval`);
  }
  return allow();
}
