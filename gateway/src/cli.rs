//! The `effectgate` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config;
use crate::ledger::{Ledger, State, SystemClock};

mod table;
use table::{cell, json_line, print_table, readable_time};

/// effectgate: a reverse proxy that makes effectful API calls idempotent,
/// recorded and reconcilable.
#[derive(Debug, Parser)]
#[command(name = "effectgate", version, about, long_about = None)]
pub struct Cli {
    /// Log lines on stderr: `text` (human-readable) or `json` (one JSON
    /// object a line, with the request id, trace id and operation id of the
    /// request it belongs to).
    #[arg(long, global = true, env = "EFFECTGATE_LOG_FORMAT", default_value = "text",
          value_parser = clap::value_parser!(LogFormatArg))]
    log_format: LogFormatArg,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format` as clap parses it.
#[derive(Debug, Clone, Copy)]
struct LogFormatArg(crate::telemetry::LogFormat);

impl std::str::FromStr for LogFormatArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.parse().map(Self)
    }
}

#[derive(Debug, clap::Args)]
struct ConfigArg {
    /// TOML config file. Without it the documented defaults apply (proxy on
    /// 127.0.0.1:8080, admin on 127.0.0.1:8081, ledger ./effectgate.db, no
    /// routes). `EFFECTGATE_*` environment variables override fields.
    #[arg(long, short, env = "EFFECTGATE_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (proxy and admin listeners) until SIGINT/SIGTERM.
    Serve(ConfigArg),
    /// Validate a config file; print the bad field's path on error.
    CheckConfig {
        /// TOML config file to check (else `EFFECTGATE_CONFIG`).
        #[arg(long, short, env = "EFFECTGATE_CONFIG")]
        config: PathBuf,
    },
    /// Create the ledger file if needed and apply the embedded migrations.
    Migrate(ConfigArg),
    /// Inspect the effect ledger.
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
    },
    /// Check and test policy components.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Inspect the inbox (provider webhooks received).
    Inbox {
        #[command(subcommand)]
        command: InboxCommand,
    },
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// List a tenant's inbox events, newest first, one line each.
    List {
        /// Tenant id.
        tenant: String,
        /// Only this source (`[[inbox]]` name).
        #[arg(long)]
        source: Option<String>,
        /// Only this state: accepted, stale, held, quarantined, dropped
        /// (any case, as `ledger list --state`).
        #[arg(long)]
        state: Option<String>,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// One JSON object a line instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        config: ConfigArg,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyCommand {
    /// Print the world version a module targets, its exports and its config
    /// schema; exit 2 if it is not a component of this gateway's world.
    Check {
        /// The policy component (`.wasm`).
        module: PathBuf,
        #[command(flatten)]
        limits: PolicyLimitArgs,
    },
    /// Run a module against fixture requests and expected decisions; print
    /// pass/fail per case; exit 1 if any case fails.
    Test {
        /// The policy component (`.wasm`).
        module: PathBuf,
        /// Case file (`.toml` or `.json`).
        cases: PathBuf,
        #[command(flatten)]
        limits: PolicyLimitArgs,
    },
    /// Write a new policy project: the world's WIT (its language's tool
    /// generates the bindings from it), a config schema, an `evaluate`
    /// that allows, a case file with one case and a README with the build
    /// command.
    New {
        /// Policy name: lower-case letters, digits and '-'.
        name: String,
        /// Language: rust, js or python.
        #[arg(long, default_value = "rust")]
        lang: crate::policy::scaffold::Lang,
        /// Folder to create (default: ./NAME); must be missing or empty.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Print the policy world's WIT, to generate bindings with any tool.
    Wit,
}

/// The `[policy]` limits `policy check` and `policy test` run with; the
/// others keep their defaults.
#[derive(Debug, clap::Args)]
struct PolicyLimitArgs {
    /// Linear memory the policy may use, in bytes, as `[policy]
    /// memory_bytes` (default 16 MiB; JavaScript and Python policies
    /// need more, see policies/README.md).
    #[arg(
        long,
        default_value_t = crate::config::PolicyLimitsSpec::default().memory_bytes as u64,
        value_parser = clap::value_parser!(u64).range(65536..)
    )]
    memory_bytes: u64,
    /// CPU deadline per call, in ms, as `[policy] deadline_ms` (default 10).
    #[arg(
        long,
        default_value_t = crate::config::PolicyLimitsSpec::default().deadline_ms,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    deadline_ms: u64,
    /// Keep compiled modules in this folder, as `[policy] cache_dir`
    /// (default: compile in memory).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum LedgerCommand {
    /// Show one operation with its transitions and attempts, as JSON.
    Show {
        /// Tenant id.
        tenant: String,
        /// Operation id (the idempotency key).
        operation_id: String,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// List operations, newest change first, one line each.
    List {
        /// Only this state (RESERVED, EXECUTING, COMPLETED, FAILED, UNKNOWN,
        /// …; any case, as in the admin API).
        #[arg(long, ignore_case = true)]
        state: Option<State>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// One JSON object a line instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Compensate a COMPLETED operation with its route's compensation (the
    /// same use case as `POST /admin/tenants/{t}/operations/{id}/compensate`,
    /// run in this process as operator `cli:$USER`, the tenant's policies
    /// deciding as for the API). Waits for the compensation's attempt and
    /// prints the report as JSON; exit 0 when the operation is COMPENSATED,
    /// 3 while the compensation awaits an approval or is still under way,
    /// 1 when refused.
    Compensate {
        /// Tenant id.
        tenant: String,
        /// Operation id (the idempotency key) of the COMPLETED operation.
        operation_id: String,
        /// Why (recorded in the transitions).
        #[arg(long)]
        reason: String,
        /// Longest wait for the compensation's attempt, in ms.
        #[arg(long, default_value_t = 60_000)]
        wait_ms: u64,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// List dead letters (operations on the terminal route) with the reason
    /// and the check an operator must make before requeueing, as JSON lines.
    DeadLetters {
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        #[command(flatten)]
        config: ConfigArg,
    },
}

impl clap::ValueEnum for State {
    fn value_variants<'a>() -> &'a [Self] {
        &State::ALL
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()))
    }
    fn from_str(input: &str, _ignore_case: bool) -> Result<Self, String> {
        input
            .parse()
            .map_err(|e: crate::ledger::UnknownState| e.to_string())
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::failpoint::setup();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let log_format = cli.log_format.0;
    if !matches!(cli.command, Command::Serve(_)) {
        crate::telemetry::init(log_format, &Default::default())?;
    }
    match cli.command {
        Command::Serve(c) => {
            let settings = config::load(c.config.as_deref())?;
            let telemetry = crate::telemetry::init(log_format, &settings.telemetry)?;
            let gw = crate::server::Gateway::start(settings).await;
            let result = match gw {
                Ok(gw) => gw.run_until_signal().await,
                Err(e) => Err(e),
            };
            // Flushing waits for export requests that run on this runtime.
            let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
            result?;
        }
        Command::CheckConfig { config: path } => match config::load(Some(&path)) {
            Ok(s) => {
                // What `serve` refuses of `[storage]` before it opens it.
                if let Err(e) = crate::ledger::Ledger::check_storage(&s.storage) {
                    eprintln!("{}: invalid: {e}", path.display());
                    return Ok(ExitCode::from(2));
                }
                // The policies too: compile each module and validate every
                // tenant's config against its schema, as `serve` will.
                let limits = crate::config::PolicyLimitsSpec {
                    pooling: false,
                    ..s.policy_limits.clone()
                };
                // Policy calls block: off the async runtime.
                let s2 = s.clone();
                let built = tokio::task::spawn_blocking(move || {
                    let engine = crate::policy::PolicyEngine::new(&limits)?;
                    crate::policy::PolicySet::build(&engine, &s2)
                        .map(|_| ())
                        .map_err(anyhow::Error::from)
                })
                .await?;
                if let Err(e) = built {
                    eprintln!("{}: invalid: {e}", path.display());
                    return Ok(ExitCode::from(2));
                }
                println!(
                    "{}: ok ({}, {}, {}, {}, {})",
                    path.display(),
                    config::counted(s.tenants.len(), "tenant"),
                    config::counted(s.routes.len(), "route"),
                    config::counted(s.keys.len(), "key"),
                    config::counted(s.policy_bindings.len(), "policy binding"),
                    config::counted(s.inbox.len(), "inbox source")
                );
                for w in &s.warnings {
                    eprintln!("{}: warning: {w}", path.display());
                }
            }
            Err(e) => {
                eprintln!("{}: invalid: {e}", path.display());
                return Ok(ExitCode::from(2));
            }
        },
        Command::Migrate(c) => {
            let storage = config::load_storage(c.config.as_deref())?;
            Ledger::migrate(&storage).await?;
            println!("ledger {} is migrated", storage.display_name());
        }
        Command::Policy { command } => {
            // Policy calls block (and a policy's stdout/stderr block on the
            // runtime): run the whole command on the blocking pool.
            return tokio::task::spawn_blocking(move || policy_command(command)).await?;
        }
        Command::Inbox {
            command:
                InboxCommand::List {
                    tenant,
                    source,
                    state,
                    limit,
                    json,
                    config: c,
                },
        } => {
            // Stored in lowercase; any case is taken, as `ledger list` does.
            let state = state.map(|s| s.to_ascii_lowercase());
            if let Some(s) = &state
                && !crate::ledger::INBOX_STATES.contains(&s.as_str())
            {
                eprintln!(
                    "--state: unknown inbox state {s:?}; expected one of {}",
                    crate::ledger::INBOX_STATES.join(", ")
                );
                return Ok(ExitCode::from(2));
            }
            let ledger = open(c).await?;
            let events = ledger
                .inbox_events(&tenant, source.as_deref(), state.as_deref(), limit)
                .await?;
            if events.is_empty() {
                // Nothing on stdout (no header, no JSON line), a word for
                // the person reading.
                eprintln!("no inbox events");
            }
            if json {
                for e in events {
                    let mut v = serde_json::to_value(&e)?;
                    crate::times::annotate(&mut v);
                    println!("{}", json_line(&v));
                }
            } else {
                let rows = events
                    .iter()
                    .map(|e| {
                        vec![
                            cell(&e.source),
                            cell(&e.event_id),
                            e.event_type.as_deref().map_or_else(|| "-".into(), cell),
                            if e.gap {
                                format!("{}(gap)", e.state)
                            } else {
                                e.state.clone()
                            },
                            e.operation_id.as_deref().map_or_else(|| "-".into(), cell),
                            readable_time(e.received_at),
                        ]
                    })
                    .collect::<Vec<_>>();
                print_table(
                    &[
                        "SOURCE",
                        "EVENT",
                        "TYPE",
                        "STATE",
                        "OPERATION",
                        "RECEIVED (UTC)",
                    ],
                    &rows,
                    &[],
                );
            }
        }
        Command::Ledger { command } => match command {
            LedgerCommand::Show {
                tenant,
                operation_id,
                config: c,
            } => {
                let ledger = open(c).await?;
                let Some(op) = ledger.get(&tenant, &operation_id).await? else {
                    eprintln!("error: no operation {operation_id:?} for tenant {tenant:?}");
                    return Ok(ExitCode::from(1));
                };
                // The row as the admin API lists it: credential headers
                // shown as `[redacted]`.
                let mut v =
                    crate::ops::operator::operation_row(&op).map_err(|e| anyhow::anyhow!("{e}"))?;
                v["transitions"] =
                    serde_json::to_value(ledger.transitions(&tenant, &operation_id).await?)?;
                v["attempts_log"] =
                    serde_json::to_value(ledger.attempts(&tenant, &operation_id).await?)?;
                crate::times::annotate(&mut v);
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            LedgerCommand::List {
                state,
                tenant,
                limit,
                json,
                config: c,
            } => {
                let ledger = open(c).await?;
                let ops = ledger.list(tenant.as_deref(), state, limit).await?;
                if ops.is_empty() {
                    eprintln!("no operations");
                }
                if json {
                    for op in ops {
                        let mut v = serde_json::json!({
                            "tenant": op.tenant_id,
                            "operation_id": op.operation_id,
                            "state": op.state.as_str(),
                            "attempts": op.attempts,
                            "route": op.route,
                            "updated_at": op.updated_at,
                        });
                        crate::times::annotate(&mut v);
                        println!("{}", json_line(&v));
                    }
                    return Ok(ExitCode::SUCCESS);
                }
                let rows = ops
                    .iter()
                    .map(|op| {
                        vec![
                            cell(&op.tenant_id),
                            cell(&op.operation_id),
                            op.state.as_str().to_owned(),
                            op.attempts.to_string(),
                            cell(&op.route),
                            readable_time(op.updated_at),
                        ]
                    })
                    .collect::<Vec<_>>();
                print_table(
                    &[
                        "TENANT",
                        "OPERATION",
                        "STATE",
                        "ATTEMPTS",
                        "ROUTE",
                        "UPDATED (UTC)",
                    ],
                    &rows,
                    &[3],
                );
            }
            LedgerCommand::Compensate {
                tenant,
                operation_id,
                reason,
                wait_ms,
                config: c,
            } => return compensate(c, &tenant, &operation_id, reason, wait_ms).await,
            LedgerCommand::DeadLetters {
                tenant,
                limit,
                config: c,
            } => {
                let ledger = open(c).await?;
                let found = ledger.dead_letters(tenant.as_deref(), limit).await?;
                if found.is_empty() {
                    // Nothing on stdout (one JSON object a line: none), a
                    // word for the person reading.
                    eprintln!("no dead letters");
                }
                for op in found {
                    let mut v = crate::ops::operator::dead_letter_json(&op);
                    v["tenant"] = serde_json::json!(op.tenant_id);
                    crate::times::annotate(&mut v);
                    println!("{}", json_line(&v));
                }
            }
        },
    }
    Ok(ExitCode::SUCCESS)
}

/// `effectgate ledger compensate`: the compensation use case in this
/// process, with the gateway's state built from the config (its ledger and
/// the tenants' policies).
async fn compensate(
    c: ConfigArg,
    tenant: &str,
    operation_id: &str,
    reason: String,
    wait_ms: u64,
) -> anyhow::Result<ExitCode> {
    let settings = config::load(c.config.as_deref())?;
    if !settings.tenants.contains(tenant) {
        eprintln!("no tenant {tenant:?} in the configuration");
        return Ok(ExitCode::from(1));
    }
    let app = crate::state::AppState::new(settings, std::sync::Arc::new(SystemClock)).await?;
    let principal = config::Principal {
        tenant: tenant.to_owned(),
        name: format!("cli:{}", login_name()),
        role: config::Role::Operator,
    };
    let wait = std::time::Duration::from_millis(wait_ms);
    match crate::ops::compensate::compensate_as(
        &app,
        &principal,
        tenant,
        operation_id,
        Some(reason),
        wait,
    )
    .await
    {
        Ok((status, mut v)) => {
            crate::times::annotate(&mut v);
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(if status == http::StatusCode::OK {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
        Err(e) => {
            eprintln!("refused: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

/// The ledger the config names, for a command that only reads or writes
/// the ledger: only `[storage]` is checked ([`config::load_storage`]).
async fn open(c: ConfigArg) -> anyhow::Result<Ledger> {
    let storage = config::load_storage(c.config.as_deref())?;
    if let Ok(config::Backend::Sqlite(path)) = storage.backend()
        && !path.exists()
    {
        let shown = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
        // Say where the path came from (a variable overrides the file),
        // and blame --config only when the default path was used.
        let migrate = "or create the ledger with `effectgate migrate`";
        let (named_by, hint) = if std::env::var_os("EFFECTGATE_STORAGE__URL").is_some() {
            (
                "named by EFFECTGATE_STORAGE__URL".to_owned(),
                format!("check the variable, {migrate}"),
            )
        } else if std::env::var_os("EFFECTGATE_STORAGE__PATH").is_some() {
            (
                "named by EFFECTGATE_STORAGE__PATH".to_owned(),
                format!("check the variable, {migrate}"),
            )
        } else if let Some(file) = &c.config {
            (
                format!("named by [storage] in {}", file.display()),
                format!("check storage.path, {migrate}"),
            )
        } else {
            (
                "the default storage.path: no config file was given".to_owned(),
                format!(
                    "name the gateway's config with --config (or EFFECTGATE_CONFIG), {migrate}"
                ),
            )
        };
        anyhow::bail!(
            "ledger file {} does not exist ({named_by}): {hint}",
            shown.display()
        );
    }
    let storage = config::StorageSpec {
        max_read_connections: 1,
        max_connections: 2,
        min_connections: 0,
        ..storage
    };
    Ok(Ledger::open_storage(&storage, std::sync::Arc::new(SystemClock)).await?)
}

fn policy_command(command: PolicyCommand) -> anyhow::Result<ExitCode> {
    // `policy check` and `policy test` run with the memory, deadline and
    // cache folder asked for, the other default limits, and without the
    // pooling allocator.
    let engine = |limits: &PolicyLimitArgs| {
        crate::policy::PolicyEngine::new(&crate::config::PolicyLimitsSpec {
            pooling: false,
            memory_bytes: usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX),
            deadline_ms: limits.deadline_ms,
            cache_dir: limits.cache_dir.clone(),
            ..Default::default()
        })
    };
    match command {
        PolicyCommand::Check { module, limits } => {
            match crate::policy::cases::describe(&engine(&limits)?, &module) {
                Ok(text) => print!("{text}"),
                Err(e) => {
                    eprintln!("{}: rejected: {e:#}", module.display());
                    return Ok(ExitCode::from(2));
                }
            }
        }
        PolicyCommand::Test {
            module,
            cases,
            limits,
        } => {
            let file = crate::policy::cases::load(&cases)?;
            let failed = crate::policy::cases::run(
                &engine(&limits)?,
                &module,
                &file,
                &mut std::io::stdout(),
            )?;
            if failed > 0 {
                return Ok(ExitCode::from(1));
            }
        }
        PolicyCommand::New { name, lang, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            match crate::policy::scaffold::create(&name, lang, &dir) {
                Ok(files) => {
                    for f in files {
                        println!("{}", dir.join(f).display());
                    }
                    println!(
                        "build and test it as {} says",
                        dir.join("README.md").display()
                    );
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            }
        }
        PolicyCommand::Wit => print!("{}", crate::policy::scaffold::wit()),
    }
    Ok(ExitCode::SUCCESS)
}

/// Who runs the command, for the ledger's actor: `$USER`, else `$LOGNAME`,
/// else the process's user id (`uid 1000`), else `unknown`.
fn login_name() -> String {
    ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|n| !n.is_empty()))
        .or_else(|| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata("/proc/self")
                .ok()
                .map(|m| format!("uid {}", m.uid()))
        })
        .unwrap_or_else(|| "unknown".into())
}
