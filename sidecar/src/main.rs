//! `tollgate-sidecar`: run the sidecar, check a configuration, or manage API keys.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tollgate_shared::settings;
use tollgate_sidecar::apikey::{self, KeyRecord};
use tollgate_sidecar::config::{Config, LogFormat};
use tollgate_sidecar::control::keys::{expiry, issued_text, KeyCommand};
use tollgate_sidecar::control::model::Snapshot;
use tollgate_sidecar::control::source::{postgres::PgSource, SourceKind};
use tollgate_sidecar::decision::unix_now;
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::store::Store;

#[derive(Parser)]
#[command(name = "tollgate-sidecar", version, about = "Tollgate sidecar: decisions for the Envoy filter")]
struct Cli {
    /// Configuration file (TOML). Environment overrides: TOLLGATE_SIDECAR_<FIELD>, nested with __.
    #[arg(long, global = true, env = "TOLLGATE_SIDECAR_CONFIG")]
    config: Option<PathBuf>,
    /// Validate the configuration, print it (secrets and credentials redacted), and exit.
    #[arg(long)]
    check_config: bool,
    /// `keys list`: JSON lines instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Manage API keys (stored as sha256 hashes only).
    Keys {
        #[command(subcommand)]
        action: KeyCommand,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let config = settings::or_exit(Config::load(cli.config.as_deref()));
    if cli.check_config {
        println!("configuration OK");
        // Secrets and credentials redacted: this output ends up in terminals and CI logs.
        println!("{:#?}", config.redacted());
        return Ok(());
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    let runtime = runtime.enable_all().build()?;
    match cli.command {
        None => {
            init_logging(&config);
            runtime.block_on(async {
                tollgate_sidecar::run(&config, shutdown_signal()).await.context("sidecar failed")
            })
        }
        Some(Command::Keys { action }) => runtime.block_on(keys(&config, action, cli.json)),
    }
}

fn init_logging(config: &Config) {
    // validated with the configuration
    let filter = config.log.filter().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown signal received; draining");
}

fn parse_id(what: &str, s: &str) -> Result<Id> {
    Id::parse(s).with_context(|| format!("--{what} '{s}': use 1-64 of letters, digits, '_', '-', '.'"))
}

/// The store of record when the configuration's source is PostgreSQL: a key is written there
/// before Redis (else a start's re-warm would resurrect a key revoked in Redis alone, and a wiped
/// Redis would lose one created there alone; decision 130).
async fn store_of_record(config: &Config) -> Result<Option<PgSource>> {
    if config.source.kind != SourceKind::Postgres {
        return Ok(None);
    }
    let pg = PgSource::open(&config.source.postgres_url, config.source.connect_timeout).context("source.postgres_url")?;
    Ok(Some(pg))
}

async fn keys(config: &Config, action: KeyCommand, json: bool) -> Result<()> {
    let store = Store::new(&config.redis)?;
    match action {
        KeyCommand::Create { tenant, plan, expires_in, scope } => {
            let tenant = parse_id("tenant", &tenant)?;
            let plan = parse_id("plan", &plan)?;
            let now = unix_now();
            let expires_at = expiry(expires_in.as_deref(), now).with_context(|| format!("--expires-in '{}'", expires_in.unwrap_or_default()))?;
            let pg = store_of_record(config).await?;
            if pg.is_none() {
                // the file source: the plan must be one of the file's (an unknown plan has no
                // limits, decision 12); PostgreSQL checks both under its write lock below
                let s = Snapshot::from_file(&config.tenants, &config.products, &config.plans, &config.routes).context("the configuration file")?;
                if !s.plans.contains_key(plan.as_str()) {
                    bail!("--plan '{plan}': no such plan in the configuration");
                }
            }
            let mut issued = apikey::issue(tenant, plan, now, expires_at);
            if let Some(l) = scope.label.filter(|l| !l.is_empty()) {
                tollgate_sidecar::scopes::check_label(&l).map_err(|e| anyhow::anyhow!("--label: {}", e.message))?;
                issued.record.label = Some(l);
            }
            issued.record.scopes = tollgate_sidecar::scopes::KeyScopes::from_lists(&scope.routes, &scope.products, &scope.methods, &scope.networks, &scope.models)
                .map_err(|e| anyhow::anyhow!("{}: {}", e.field, e.message))?;
            if let Some(pg) = &pg {
                pg.create_key(&issued.hash, &issued.record).await.context("storing the key in PostgreSQL")?;
            }
            if let Err(e) = store.create_key(&issued.hash, &issued.record).await {
                // its raw value is never shown: no active record of it may stay (decision 157)
                if let Some(pg) = &pg {
                    if let Err(undo) = pg.delete_key(&issued.record.key_id).await {
                        eprintln!("warning: key {} stays in PostgreSQL: revoke it ({undo})", issued.record.key_id);
                    }
                }
                return Err(anyhow::Error::new(e).context("storing the key in Redis"));
            }
            let r = &issued.record;
            println!("{}", issued_text(r.key_id.as_str(), r.tenant.as_str(), r.plan.as_str(), Some(&fmt_time(r.expires_at)), &issued.raw));
        }
        KeyCommand::Revoke { key_id } => {
            let id = parse_id("key-id", &key_id)?;
            let in_pg = match store_of_record(config).await? {
                Some(pg) => pg.revoke_key(&id, unix_now()).await.with_context(|| format!("revoking {id} in PostgreSQL"))?,
                None => None,
            };
            let r = match in_pg {
                Some((hash, record)) => {
                    store.create_key(&hash, &record).await.with_context(|| {
                        format!("{id} is revoked in PostgreSQL, but Redis did not take it: run this again, or start a sidecar (its start copies it)")
                    })?;
                    record
                }
                // the file source; or a key PostgreSQL lacks (created in Redis alone by an older
                // `keys create`): Redis is where it lives
                None => store.revoke_key(&id, unix_now()).await.with_context(|| format!("revoking {id}"))?,
            };
            // Every replica forgets the key's cached answers now, not when its cache entry ends.
            tollgate_sidecar::control::announce(&store, Some(&r.tenant)).await.context("announcing the revocation")?;
            println!("revoked {} (tenant {})", r.key_id, r.tenant);
        }
        KeyCommand::Update { .. } => {
            anyhow::bail!("change a key's label or scopes through the admin API: `tollgate keys update <key-id> …` (every replica is told)");
        }
        KeyCommand::Rotate { .. } => {
            // a successor and the old key's expiry written in both stores together, announced:
            // the admin API's work (crate::control::keys::rotate), not a single store's write
            anyhow::bail!("rotate a key through the admin API: `tollgate keys rotate <key-id> [--overlap 24h]`");
        }
        KeyCommand::List { tenant } => {
            let tenant = tenant.map(|t| parse_id("tenant", &t)).transpose()?;
            let records = store.list_keys(tenant.as_ref()).await.context("listing keys")?;
            if json {
                for r in &records {
                    println!("{}", record_json(r));
                }
            } else {
                println!("{:<22} {:<16} {:<12} {:<8} {:<20} {:<20}", "KEY ID", "TENANT", "PLAN", "STATUS", "CREATED", "EXPIRES");
                for r in &records {
                    println!(
                        "{:<22} {:<16} {:<12} {:<8} {:<20} {:<20}",
                        r.key_id.as_str(),
                        r.tenant.as_str(),
                        r.plan.as_str(),
                        r.status.as_str(),
                        fmt_time(Some(r.created_at)),
                        fmt_time(r.expires_at)
                    );
                }
            }
        }
    }
    Ok(())
}

fn fmt_time(t: Option<u64>) -> String {
    match t {
        None => "never".into(),
        Some(s) => humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s)).to_string(),
    }
}

fn record_json(r: &KeyRecord) -> String {
    serde_json::json!({
        "keyId": r.key_id.as_str(),
        "tenant": r.tenant.as_str(),
        "plan": r.plan.as_str(),
        "status": r.status.as_str(),
        "createdAt": r.created_at,
        "expiresAt": r.expires_at,
        "revokedAt": r.revoked_at,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed_and_takes_json_after_the_subcommand() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["tollgate-sidecar", "keys", "list", "--tenant", "acme", "--json"]).unwrap();
        assert!(cli.json);
        assert!(matches!(cli.command, Some(Command::Keys { action: KeyCommand::List { tenant: Some(t) } }) if t == "acme"));
        let cli = Cli::try_parse_from(["tollgate-sidecar", "keys", "create", "--tenant", "t", "--plan", "p", "--expires-in", "30d"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Keys { action: KeyCommand::Create { expires_in: Some(_), .. } })));
    }
}
