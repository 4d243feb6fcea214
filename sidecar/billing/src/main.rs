//! `tollgate-billing`: run the billing consumer, or report a tenant's usage per day.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tollgate_billing::config::Config;
use tollgate_shared::settings;

#[derive(Parser)]
#[command(name = "tollgate-billing", version, about = "Tollgate billing consumer: usage events from Kafka into PostgreSQL")]
struct Cli {
    /// Configuration file (TOML). Environment overrides: TOLLGATE_BILLING_<FIELD>, nested with __.
    #[arg(long, global = true, env = "TOLLGATE_BILLING_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// A tenant's usage per day (UTC): each day the larger of the PostgreSQL rollup and, with
    /// --redis, the gateway's Redis meter (seed 004), and the total.
    Usage {
        #[arg(long)]
        tenant: String,
        /// One day, yyyy-MM-dd.
        #[arg(long, conflicts_with = "month")]
        day: Option<String>,
        /// A month, yyyy-MM (default: the current one).
        #[arg(long)]
        month: Option<String>,
        /// The gateway's Redis (redis://…), to read `usage:{tenant}:{day}`.
        #[arg(long)]
        redis: Option<String>,
    },
    /// A tenant's invoice-ready month: LLM calls by model (requests, input/output/cached
    /// tokens, cost) and the billable requests, from the rollup.
    Invoice {
        #[arg(long)]
        tenant: String,
        /// yyyy-MM.
        #[arg(long)]
        month: String,
        #[arg(long, value_enum, default_value = "text")]
        format: InvoiceFormat,
    },
    /// A month's usage as a file: CloudEvents in JSON Lines, or CSV (every stored event of the
    /// month; written aside, renamed into place once complete).
    Export {
        /// yyyy-MM.
        #[arg(long)]
        month: String,
        /// One tenant only (default: every tenant).
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, value_enum)]
        format: FileFormat,
        /// The file to write (replaced once the export is complete).
        #[arg(long)]
        out: PathBuf,
        /// Write the file even when the month's events may have been pruned (events_retention).
        #[arg(long)]
        partial: bool,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum InvoiceFormat {
    Text,
    Json,
    Csv,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum FileFormat {
    Csv,
    Jsonl,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let config = settings::or_exit(Config::load(cli.config.as_deref()).map_err(|e| format!("configuration: {e}")));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        None => {
            let filter = config.log.filter().unwrap_or_else(|_| "info".into());
            let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
            if config.log.format == "text" {
                b.init()
            } else {
                b.json().init()
            }
            runtime.block_on(async { tollgate_billing::run(&config, shutdown_signal()).await.context("billing consumer failed") })
        }
        Some(Command::Usage { tenant, day, month, redis }) => runtime.block_on(usage(&config, &tenant, day, month, redis.as_deref())),
        Some(Command::Invoice { tenant, month, format }) => runtime.block_on(invoice(&config, &tenant, &month, format)),
        Some(Command::Export { month, tenant, format, out, partial }) => {
            let format = match format {
                FileFormat::Csv => tollgate_billing::export::Format::Csv,
                FileFormat::Jsonl => tollgate_billing::export::Format::JsonLines,
            };
            let job = tollgate_billing::export::MonthExport {
                month: &month,
                tenant: tenant.as_deref(),
                format,
                out: &out,
                partial,
                retention: config.events_retention,
            };
            runtime.block_on(export(&config, &job))
        }
    }
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn invoice(config: &Config, tenant: &str, month: &str, format: InvoiceFormat) -> Result<()> {
    let db = tollgate_billing::db::Db::connect(&config.postgres.url).await.context("connecting to postgres")?;
    let inv = tollgate_billing::invoice::read(&db, tenant, month, &config.export.currency).await?;
    match format {
        InvoiceFormat::Text => print!("{}", inv.text()),
        InvoiceFormat::Json => println!("{}", serde_json::to_string_pretty(&inv)?),
        InvoiceFormat::Csv => print!("{}", inv.csv()),
    }
    Ok(())
}

async fn export(config: &Config, job: &tollgate_billing::export::MonthExport<'_>) -> Result<()> {
    let db = tollgate_billing::db::Db::connect(&config.postgres.url).await.context("connecting to postgres")?;
    let origin = config.export.origin();
    let n = tollgate_billing::export::month(&db, &origin, job, |n| eprintln!("exported {n} events …")).await?;
    eprintln!("exported {n} events of {} to {}", job.month, job.out.display());
    Ok(())
}

async fn usage(config: &Config, tenant: &str, day: Option<String>, month: Option<String>, redis_url: Option<&str>) -> Result<()> {
    use tollgate_billing::report;
    let (from, to) = match (day, month) {
        (Some(d), _) => (d.clone(), d),
        (None, Some(m)) => report::month_days(&m).context("--month must be yyyy-MM")?,
        (None, None) => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
            let today = tollgate_wire::usage::Day::of_ms(now).iso();
            report::month_days(&today[..7]).context("current month")?
        }
    };
    let db = tollgate_billing::db::Db::connect(&config.postgres.url).await.context("connecting to postgres")?;
    let mut conn = match redis_url {
        Some(url) => Some(redis::Client::open(url).context("redis url")?.get_multiplexed_async_connection().await.context("connecting to redis")?),
        None => None,
    };
    let days = report::usage(&db, conn.as_mut(), tenant, &from, &to).await?;
    println!("{:<12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}", "DAY", "OK", "4XX", "5XX", "DENIED", "ABORTED", "TOKENS");
    for (day, u) in &days {
        let c = u.by_class;
        println!("{:<12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}", day, c[0], c[1], c[2], c[3], c[4], u.tokens);
    }
    let t = report::month_total(&days);
    let c = t.by_class;
    println!("{:<12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}", "TOTAL", c[0], c[1], c[2], c[3], c[4], t.tokens);
    println!("billable requests (ok + 4xx): {}", t.billable());
    if t.tokens_unread > 0 {
        println!("requests whose token usage could not be read (not in TOKENS): {}", t.tokens_unread);
    }
    // LLM calls per model (issue 42): the rollup's alone (the Redis meter has no models)
    let models = tollgate_billing::report::by_model(&db, tenant, &from, &to).await?;
    if !models.is_empty() {
        println!();
        // cost in micro-units of the sidecars' `usage.pricing.currency`, shown with 6 decimals
        println!("{:<40} {:>10} {:>14} {:>14} {:>14} {:>14} {:>18}", "MODEL", "REQUESTS", "INPUT", "OUTPUT", "CACHED", "TOKENS", "COST");
        for (model, n) in &models {
            let name = if model.is_empty() { "(unknown)" } else { model.as_str() };
            let cost = format!("{}.{:06}", n[5] / 1_000_000, n[5] % 1_000_000);
            println!("{:<40} {:>10} {:>14} {:>14} {:>14} {:>14} {:>18}", name, n[0], n[1], n[2], n[3], n[4], cost);
        }
    }
    Ok(())
}
