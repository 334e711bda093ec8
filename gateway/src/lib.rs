//! effectgate: a reverse proxy for calls that change the world.
//!
//! Callers send effectful calls (payments, e-mail, publishing, tool calls)
//! through the gateway. Each call is identified by the caller's
//! `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header), recorded
//! in a durable effect ledger, forwarded with a deterministic provider key,
//! and its outcome stored, so that a duplicate delivery or a lost reply never
//! produces a second business effect.
//!
//! Modules:
//! - [`config`]: the TOML format and its validated runtime form;
//! - [`idempotency`]: key parsing, fingerprints, provider keys;
//! - [`ledger`]: the effect ledger and its state machine;
//! - [`proxy`], [`execute`], [`forward`]: the proxy path;
//! - [`admin`]: the admin listener;
//! - [`app`]: wiring and lifecycle;
//! - [`cli`]: the `effectgate` command.

pub mod admin;
pub mod answer;
pub mod app;
pub mod approvals;
pub mod cli;
pub mod config;
pub mod console;
pub mod egress;
pub mod encoding;
pub mod error;
pub mod execute;
pub mod failpoint;
pub mod forward;
pub mod idempotency;
pub mod ledger;
pub mod listener;
pub mod mcp;
pub mod metrics;
pub mod outbox;
pub mod policy;
pub mod proxy;
pub mod reconcile;
pub mod replay;
pub mod template;
pub mod times;
pub mod tls;

pub use app::{AppState, Gateway};
