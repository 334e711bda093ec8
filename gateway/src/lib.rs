//! effectgate: a reverse proxy for calls that change the world.
//!
//! Callers send effectful calls (payments, e-mail, publishing, tool calls)
//! through the gateway. Each call is identified by the caller's
//! `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header), recorded
//! in a durable effect ledger, forwarded with a deterministic provider key,
//! and its outcome stored, so that a duplicate delivery or a lost reply never
//! produces a second business effect.
//!
//! Layers, highest first; a module names only modules of lower layers
//! (`tests/layering.rs` in this crate checks the `use crate::` lines):
//! - [`server`], [`cli`]: assembly (listeners, routers, workers) and the command;
//! - [`http`]: thin HTTP surfaces (proxy, admin, console, MCP transport) and
//!   the RFC 9457 mapping of [`ops::OpError`];
//! - [`workers`]: background loops (reconciler, outbox relay, sweeper);
//! - [`ops`]: the use cases, free of HTTP framework types;
//! - [`state`]: the shared state and its reloadable settings snapshot;
//! - [`policy`], [`forward`], [`ledger`], [`idempotency`], [`mcp`],
//!   [`encoding`]: the policy host, the outbound client, the effect ledger
//!   and the pure protocol pieces;
//! - [`config`]: the TOML format and its validated runtime form;
//! - [`egress`], [`tls`], [`metrics`], [`template`], [`times`],
//!   [`failpoint`]: foundations.
//!
//! `docs/design.md` holds the vocabulary, the state machine and the
//! request flow.

pub mod cli;
pub mod config;
pub mod egress;
pub mod encoding;
pub mod failpoint;
pub mod forward;
pub mod http;
pub mod idempotency;
pub mod ledger;
pub mod mcp;
pub mod metrics;
pub mod ops;
pub mod policy;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod template;
pub mod times;
pub mod tls;
pub mod workers;

pub use server::Gateway;
pub use state::AppState;
