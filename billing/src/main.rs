//! `tollgate-billing`: run the billing consumer, or report a tenant's usage per day.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tollgate_billing::config::Config;

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
    /// A tenant's usage per day (UTC): the rollup in PostgreSQL and, with --redis, the gateway's
    /// Redis meter; each day shows the larger of the two (seed 004: the meter is ahead of the
    /// rollup, the rollup survives the meter's eviction).
    Report {
        #[arg(long)]
        tenant: String,
        /// First day, yyyy-MM-dd.
        #[arg(long)]
        from: String,
        /// Last day, yyyy-MM-dd (inclusive).
        #[arg(long)]
        to: String,
        /// The gateway's Redis (redis://…), to read `usage:{tenant}:{day}`.
        #[arg(long)]
        redis: Option<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: configuration: {e}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        None => {
            let filter = tracing_subscriber::EnvFilter::try_new(&config.log.level).unwrap_or_else(|_| "info".into());
            let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
            if config.log.format == "text" {
                b.init()
            } else {
                b.json().init()
            }
            runtime.block_on(async { tollgate_billing::run(&config, shutdown_signal()).await.context("billing consumer failed") })
        }
        Some(Command::Report { tenant, from, to, redis }) => runtime.block_on(report(&config, &tenant, &from, &to, redis.as_deref())),
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

async fn report(config: &Config, tenant: &str, from: &str, to: &str, redis_url: Option<&str>) -> Result<()> {
    let db = tollgate_billing::db::Db::connect(&config.postgres.url).await.context("connecting to postgres")?;
    let rows = db.daily(tenant, from, to).await.context("reading usage_daily")?;
    let mut days: std::collections::BTreeMap<String, ([i64; 5], i64)> =
        rows.into_iter().map(|(d, c, t)| (d, (c, t))).collect();
    if let Some(url) = redis_url {
        let client = redis::Client::open(url).context("redis url")?;
        let mut conn = client.get_multiplexed_async_connection().await.context("connecting to redis")?;
        for day in tollgate_billing::report::days(from, to).context("--from/--to must be yyyy-MM-dd")? {
            let key = format!("usage:{{{tenant}}}:{}", day.replace('-', ""));
            let m: std::collections::HashMap<String, i64> = redis::cmd("HGETALL").arg(&key).query_async(&mut conn).await?;
            if m.is_empty() {
                continue;
            }
            let e = days.entry(day).or_default();
            *e = tollgate_billing::report::larger(*e, &m);
        }
    }
    println!("{:<12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}", "DAY", "OK", "4XX", "5XX", "DENIED", "ABORTED", "TOKENS");
    for (day, (c, t)) in days {
        println!("{:<12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}", day, c[0], c[1], c[2], c[3], c[4], t);
    }
    Ok(())
}
