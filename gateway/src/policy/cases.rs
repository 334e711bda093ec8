//! `effectgate policy test MODULE.wasm CASES.{toml,json}`: runs a policy
//! against fixture requests and expected decisions, like `opa test`.
//!
//! Case file:
//! ```toml
//! config = { threshold = 1000 }          # the tenant config for every case
//!
//! [[cases]]
//! name = "large payment needs approval"
//! request = { method = "POST", path = "/v1/charges", body = { amount = 5000 } }
//! expect = { decision = "require-approval", reason_contains = "exceeds" }
//!
//! [[cases]]
//! name = "card errors are permanent"
//! classify = { status = 402, body = { error = { type = "card_error" } } }
//! expect = { class = "permanent" }
//!
//! [[cases]]
//! name = "payments replay only as the same operation"
//! replay = { effect_class = "payment", state = "completed" }
//! expect = { verdict = "same-operation-only" }
//!
//! [[cases]]
//! name = "undoing a permission needs an approval"
//! compensate = { effect_class = "permission", path = "/v1/grants/revoke", body = { grant = "g_1" } }
//! expect = { decision = "require-approval" }
//! ```
//!
//! A `compensate` case of a module without that export (world 0.1.0)
//! checks the gateway's default for the effect class.
//!
//! A case may carry its own `config`. Request fields default to: tenant
//! `test`, principal `test:client`, route `test`, effect class `payment`,
//! method `POST`, path `/`, no query, no headers, empty body.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::bindings::{self, Header, OperationState};
use super::{PolicyEngine, verdict_name};
use crate::config::EffectClass;

/// A case file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseFile {
    /// Tenant config for every case (default `{}`).
    #[serde(default)]
    pub config: Option<Value>,
    /// The cases.
    pub cases: Vec<Case>,
}

/// One case: exactly one of `request`, `classify`, `replay`, `compensate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Name printed with the result.
    pub name: String,
    /// Config for this case only.
    #[serde(default)]
    pub config: Option<Value>,
    /// An `evaluate` case.
    #[serde(default)]
    pub request: Option<CaseRequest>,
    /// A `classify-failure` case.
    #[serde(default)]
    pub classify: Option<CaseClassify>,
    /// A `replay` case.
    #[serde(default)]
    pub replay: Option<CaseReplay>,
    /// A `compensate` case.
    #[serde(default)]
    pub compensate: Option<CaseCompensate>,
    /// What must come out.
    pub expect: Expect,
}

/// Request fixture.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct CaseRequest {
    tenant: Option<String>,
    principal: Option<String>,
    route: Option<String>,
    effect_class: Option<EffectClass>,
    method: Option<String>,
    path: Option<String>,
    query: Option<String>,
    headers: BTreeMap<String, String>,
    /// JSON body.
    body: Option<Value>,
    /// Raw text body (instead of `body`).
    body_text: Option<String>,
    operation_id: Option<String>,
    existing_state: Option<String>,
}

/// Provider failure fixture.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseClassify {
    status: u16,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<Value>,
}

/// Operation fixture for `replay`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseReplay {
    effect_class: EffectClass,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    attempts: Option<u32>,
}

/// Compensation fixture for `compensate`: the operation undone (its effect
/// class; COMPLETED) and the compensating request (default `POST /`, no
/// body), asked by `principal` (default `test:operator`) with `reason`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseCompensate {
    effect_class: EffectClass,
    #[serde(default)]
    principal: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    query: Option<String>,
    #[serde(default)]
    body: Option<Value>,
}

/// Expected outcome.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Expect {
    decision: Option<String>,
    status: Option<u16>,
    reason_contains: Option<String>,
    effect_class: Option<EffectClass>,
    class: Option<String>,
    verdict: Option<String>,
}

/// The decisions a `request` or `compensate` case may expect.
const DECISIONS: [&str; 3] = ["allow", "deny", "require-approval"];
/// The classes a `classify` case may expect.
const CLASSES: [&str; 3] = ["transient", "permanent", "unknown"];
/// The verdicts a `replay` case may expect.
const VERDICTS: [&str; 5] = [
    "allow",
    "same-operation-only",
    "revalidate",
    "manual",
    "deny",
];

impl Expect {
    /// Refuses an `expect` that checks nothing for a case of `kind`
    /// (`request`, `compensate`, `classify`, `replay`): one with none of
    /// the fields that kind checks (`expect = {}` would always pass), one
    /// with a field only another kind checks, or a value no policy gives.
    fn check_for(&self, kind: &str) -> Result<(), String> {
        let decision = [
            ("decision", self.decision.is_some()),
            ("status", self.status.is_some()),
            ("reason_contains", self.reason_contains.is_some()),
            ("effect_class", self.effect_class.is_some()),
        ];
        let class = [("class", self.class.is_some())];
        let verdict = [("verdict", self.verdict.is_some())];
        let own: &[(&str, bool)] = match kind {
            "classify" => &class,
            "replay" => &verdict,
            _ => &decision,
        };
        for (field, given) in decision.iter().chain(&class).chain(&verdict) {
            if *given && !own.iter().any(|(f, _)| f == field) {
                return Err(format!(
                    "`expect.{field}` is not checked by a `{kind}` case"
                ));
            }
        }
        if !own.iter().any(|(_, given)| *given) {
            let names: Vec<String> = own.iter().map(|(f, _)| format!("`{f}`")).collect();
            return Err(format!(
                "`expect` checks nothing for a `{kind}` case: give {}",
                names.join(" or ")
            ));
        }
        let known = [
            ("decision", &self.decision, &DECISIONS[..]),
            ("class", &self.class, &CLASSES[..]),
            ("verdict", &self.verdict, &VERDICTS[..]),
        ];
        for (field, value, allowed) in known {
            if let Some(v) = value
                && !allowed.contains(&v.as_str())
            {
                return Err(format!(
                    "`expect.{field}` is {v:?}, which no policy gives: one of {}",
                    allowed.join(", ")
                ));
            }
        }
        Ok(())
    }
}

fn state_named(s: &str) -> Option<OperationState> {
    Some(match s.to_ascii_lowercase().replace('_', "-").as_str() {
        "reserved" => OperationState::Reserved,
        "awaiting-approval" => OperationState::AwaitingApproval,
        "executing" => OperationState::Executing,
        "completed" => OperationState::Completed,
        "failed" => OperationState::Failed,
        "unknown" => OperationState::Unknown,
        "compensated" => OperationState::Compensated,
        _ => return None,
    })
}

/// Loads a case file (`.toml` or `.json`).
///
/// Errors: unreadable, or not a valid case file (unknown fields are errors).
pub fn load(path: &Path) -> anyhow::Result<CaseFile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    if path.extension().is_some_and(|e| e == "json") {
        Ok(serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?)
    } else {
        Ok(toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?)
    }
}

/// Runs every case; prints `ok`/`FAIL` per case and a summary. Returns the
/// number of failed cases.
///
/// Errors: the module can't be loaded.
pub fn run(
    engine: &PolicyEngine,
    module: &Path,
    file: &CaseFile,
    out: &mut impl std::io::Write,
) -> anyhow::Result<usize> {
    let compiled = engine.load(module)?;
    let schema: Value = serde_json::from_str(&compiled.config_schema)?;
    let validator = jsonschema::validator_for(&schema)
        .map_err(|e| anyhow::anyhow!("config-schema() is not a valid JSON Schema: {e}"))?;
    let mut failed = 0;
    for (i, case) in file.cases.iter().enumerate() {
        let config = case
            .config
            .clone()
            .or_else(|| file.config.clone())
            .unwrap_or_else(|| Value::Object(Default::default()));
        let result = match validator.iter_errors(&config).next() {
            Some(e) => {
                let ptr = e.instance_path().to_string();
                Err(format!(
                    "config invalid at {}: {e}",
                    if ptr.is_empty() { "/" } else { ptr.as_str() }
                ))
            }
            None => run_case(engine, &compiled, &config.to_string(), case, i),
        };
        match result {
            Ok(()) => writeln!(out, "ok    {}", case.name)?,
            Err(why) => {
                failed += 1;
                writeln!(out, "FAIL  {}: {why}", case.name)?;
            }
        }
    }
    writeln!(out, "{} passed, {failed} failed", file.cases.len() - failed)?;
    Ok(failed)
}

fn headers(h: &BTreeMap<String, String>) -> Vec<Header> {
    h.iter()
        .map(|(n, v)| Header {
            name: n.to_ascii_lowercase(),
            value: v.clone(),
        })
        .collect()
}

fn run_case(
    engine: &PolicyEngine,
    compiled: &super::CompiledPolicy,
    config: &str,
    case: &Case,
    i: usize,
) -> Result<(), String> {
    let kinds = [
        case.request.is_some(),
        case.classify.is_some(),
        case.replay.is_some(),
        case.compensate.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if kinds != 1 {
        return Err(
            "a case needs exactly one of `request`, `classify`, `replay`, `compensate`".into(),
        );
    }
    let kind = if case.request.is_some() {
        "request"
    } else if case.classify.is_some() {
        "classify"
    } else if case.replay.is_some() {
        "replay"
    } else {
        "compensate"
    };
    case.expect.check_for(kind)?;
    let run = CaseRun {
        engine,
        compiled,
        config,
        expect: &case.expect,
        i,
    };
    if let Some(r) = &case.request {
        return run.request(r);
    }
    if let Some(c) = &case.classify {
        return run.classify(c);
    }
    if let Some(c) = &case.compensate {
        return run.compensate(c);
    }
    run.replay(case.replay.as_ref().expect("checked above"))
}

/// `Err("expected {what} {want}, got {got}")`.
fn fail(what: &str, want: &str, got: &str) -> Result<(), String> {
    Err(format!("expected {what} {want}, got {got}"))
}

/// One case being run against a compiled policy.
struct CaseRun<'a> {
    engine: &'a PolicyEngine,
    compiled: &'a super::CompiledPolicy,
    config: &'a str,
    expect: &'a Expect,
    i: usize,
}

impl CaseRun<'_> {
    /// An `evaluate` case: the decision, status, reason and class expected.
    fn request(&self, r: &CaseRequest) -> Result<(), String> {
        let (engine, compiled, config, i) = (self.engine, self.compiled, self.config, self.i);
        let body = match (&r.body, &r.body_text) {
            (_, Some(t)) => t.as_bytes().to_vec(),
            (Some(v), None) => serde_json::to_vec(v).unwrap_or_default(),
            (None, None) => Vec::new(),
        };
        let req = bindings::Request {
            tenant: r.tenant.clone().unwrap_or_else(|| "test".into()),
            principal: r.principal.clone().unwrap_or_else(|| "test:client".into()),
            route: r.route.clone().unwrap_or_else(|| "test".into()),
            effect_class: super::wit_class(r.effect_class.unwrap_or(EffectClass::Payment)),
            method: r
                .method
                .clone()
                .unwrap_or_else(|| "POST".into())
                .to_ascii_uppercase(),
            path: r.path.clone().unwrap_or_else(|| "/".into()),
            query: r.query.clone(),
            headers: headers(&r.headers),
            body,
            operation_id: r
                .operation_id
                .clone()
                .unwrap_or_else(|| format!("case-{i}")),
            fingerprint: "0".repeat(64),
            existing_state: r.existing_state.as_deref().and_then(state_named),
        };
        let d = engine
            .call(compiled, "policy-test", |inst, store| {
                inst.call_evaluate(store, config, &req)
            })
            .map_err(|e| e.to_string())?;
        self.decision(&d)
    }

    /// Checks a decision against `expect` (decision, status, reason, class).
    fn decision(&self, d: &bindings::Decision) -> Result<(), String> {
        let e = self.expect;
        let (name, status, reason, class) = match d {
            bindings::Decision::Allow(a) => (
                "allow",
                None,
                None,
                a.effect_class.map(super::from_wit_class),
            ),
            bindings::Decision::Deny(d) => ("deny", Some(d.status), Some(d.reason.clone()), None),
            bindings::Decision::RequireApproval(r) => {
                ("require-approval", None, Some(r.clone()), None)
            }
        };
        if let Some(want) = &e.decision
            && want != name
        {
            return fail(
                "decision",
                want,
                &format!(
                    "{name} ({})",
                    super::failure::shown(&reason.unwrap_or_default(), 1024)
                ),
            );
        }
        if let Some(want) = e.status
            && Some(want) != status
        {
            return fail("status", &want.to_string(), &format!("{status:?}"));
        }
        if let Some(want) = &e.reason_contains
            && !reason.as_deref().unwrap_or("").contains(want.as_str())
        {
            return fail("a reason containing", want, &format!("{reason:?}"));
        }
        if let Some(want) = e.effect_class
            && Some(want) != class
        {
            return fail("effect class", want.as_str(), &format!("{class:?}"));
        }
        Ok(())
    }

    /// A `compensate` case: the decision expected (a module without the
    /// export gets the gateway's default for the effect class).
    fn compensate(&self, c: &CaseCompensate) -> Result<(), String> {
        let (engine, compiled, config, i) = (self.engine, self.compiled, self.config, self.i);
        let op = bindings::Operation {
            tenant: "test".into(),
            operation_id: format!("case-{i}"),
            route: "test".into(),
            effect_class: super::wit_class(c.effect_class),
            state: OperationState::Completed,
            attempts: 1,
            fingerprint: "0".repeat(64),
        };
        let request = bindings::Compensation {
            compensation_id: format!("case-{i}#compensation"),
            operation: op,
            principal: c
                .principal
                .clone()
                .unwrap_or_else(|| "test:operator".into()),
            reason: c.reason.clone().unwrap_or_default(),
            method: c
                .method
                .clone()
                .unwrap_or_else(|| "POST".into())
                .to_ascii_uppercase(),
            path: c.path.clone().unwrap_or_else(|| "/".into()),
            query: c.query.clone(),
            body: c
                .body
                .as_ref()
                .map(|b| serde_json::to_vec(b).unwrap_or_default())
                .unwrap_or_default(),
            fingerprint: "0".repeat(64),
        };
        let d = match engine
            .call_compensate(compiled, "policy-test", config, &request)
            .map_err(|e| e.to_string())?
        {
            Some(d) => d,
            None => match super::compensate::default_compensate(c.effect_class) {
                super::Verdict::RequireApproval { reasons, .. } => {
                    bindings::Decision::RequireApproval(reasons.join("; "))
                }
                _ => bindings::Decision::Allow(bindings::Allow {
                    effect_class: None,
                    add_headers: Vec::new(),
                }),
            },
        };
        self.decision(&d)
    }

    /// A `classify-failure` case: the class expected.
    fn classify(&self, c: &CaseClassify) -> Result<(), String> {
        let (engine, compiled, config, e) = (self.engine, self.compiled, self.config, self.expect);
        let head = bindings::ResponseHead {
            status: c.status,
            headers: headers(&c.headers),
        };
        let body = c
            .body
            .as_ref()
            .map(|b| serde_json::to_vec(b).unwrap_or_default())
            .unwrap_or_default();
        let class = engine
            .call(compiled, "policy-test", |inst, store| {
                inst.call_classify_failure(store, config, &head, &body)
            })
            .map_err(|e| e.to_string())?;
        let got = match class {
            bindings::FailureClass::Transient => "transient",
            bindings::FailureClass::Permanent => "permanent",
            bindings::FailureClass::Unknown => "unknown",
        };
        match &e.class {
            Some(want) if want != got => fail("class", want, got),
            _ => Ok(()),
        }
    }

    /// A `replay` case: the verdict expected.
    fn replay(&self, r: &CaseReplay) -> Result<(), String> {
        let (engine, compiled, config, e, i) =
            (self.engine, self.compiled, self.config, self.expect, self.i);
        let op = bindings::Operation {
            tenant: "test".into(),
            operation_id: format!("case-{i}"),
            route: "test".into(),
            effect_class: super::wit_class(r.effect_class),
            state: r
                .state
                .as_deref()
                .and_then(state_named)
                .unwrap_or(OperationState::Completed),
            attempts: r.attempts.unwrap_or(1),
            fingerprint: "0".repeat(64),
        };
        let v = engine
            .call(compiled, "policy-test", |inst, store| {
                inst.call_replay(store, config, &op)
            })
            .map_err(|e| e.to_string())?;
        match &e.verdict {
            Some(want) if want != verdict_name(v) => fail("verdict", want, verdict_name(v)),
            _ => Ok(()),
        }
    }
}

/// What `effectgate policy check` prints about a module.
pub fn describe(engine: &PolicyEngine, module: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(module)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", module.display()))?;
    let compiled = engine.compile(&bytes)?;
    let schema: Value = serde_json::from_str(&compiled.config_schema)
        .unwrap_or(Value::String(compiled.config_schema.clone()));
    // A component without `compensate` was built for an earlier world.
    let (world, compensate) = if compiled.has_compensate {
        (bindings::WORLD, ", compensate")
    } else {
        (
            bindings::EARLIER_WORLDS
                .first()
                .copied()
                .unwrap_or(bindings::WORLD),
            " (no compensate: its compensations get the defaults)",
        )
    };
    Ok(format!(
        "module:  {}\nsha256:  {}\nworld:   {world}\nexports: config-schema, evaluate, classify-failure, replay{compensate}\nconfig schema:\n{}\n",
        module.display(),
        compiled.hash_hex,
        serde_json::to_string_pretty(&schema).unwrap_or_default()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect(toml_text: &str) -> Expect {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn an_expect_that_checks_nothing_or_the_wrong_thing_is_refused() {
        assert_eq!(
            expect("").check_for("request").unwrap_err(),
            "`expect` checks nothing for a `request` case: give `decision` or `status` or \
             `reason_contains` or `effect_class`"
        );
        assert_eq!(
            expect("").check_for("replay").unwrap_err(),
            "`expect` checks nothing for a `replay` case: give `verdict`"
        );
        assert_eq!(
            expect("verdict = \"allow\"")
                .check_for("request")
                .unwrap_err(),
            "`expect.verdict` is not checked by a `request` case"
        );
        assert_eq!(
            expect("decision = \"allow\"")
                .check_for("classify")
                .unwrap_err(),
            "`expect.decision` is not checked by a `classify` case"
        );
        assert_eq!(
            expect("decision = \"allowed\"")
                .check_for("compensate")
                .unwrap_err(),
            "`expect.decision` is \"allowed\", which no policy gives: one of allow, deny, \
             require-approval"
        );
        assert!(expect("status = 403").check_for("request").is_ok());
        assert!(
            expect("decision = \"deny\"\nstatus = 403")
                .check_for("compensate")
                .is_ok()
        );
        assert!(
            expect("class = \"permanent\"")
                .check_for("classify")
                .is_ok()
        );
        assert!(
            expect("verdict = \"revalidate\"")
                .check_for("replay")
                .is_ok()
        );
    }
}
