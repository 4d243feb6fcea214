//! `tollgate`: the command line for people, over the admin HTTP API (docs/openapi.json).
//! Reads the admin URL from `--admin-url` or `TOLLGATE_ADMIN_URL`, and the token from
//! `TOLLGATE_ADMIN_TOKEN`, a file (`--token-file` / `TOLLGATE_ADMIN_TOKEN_FILE`), or `--token`
//! (which any user of the host sees in the process list: prefer the other two).
//! `.tollgate/demo.env` exports the URL and the token. Tables by default, `--json` for scripts.
//! The token is never printed.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use tollgate_sidecar::control::keys::{issued_text, KeyCommand};

#[derive(Parser)]
#[command(name = "tollgate", version, about = "Tollgate admin CLI (over the sidecar's admin API)")]
struct Cli {
    /// Admin API base URL, e.g. http://127.0.0.1:9091
    #[arg(long, global = true, env = "TOLLGATE_ADMIN_URL")]
    admin_url: Option<String>,
    /// Bearer token of the admin API. Prefer TOLLGATE_ADMIN_TOKEN or --token-file: an argument
    /// shows in the process list.
    #[arg(long, global = true, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the admin token (surrounding whitespace trimmed).
    #[arg(long, global = true, env = "TOLLGATE_ADMIN_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<std::path::PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tenants and their subscriptions.
    Tenants {
        #[command(subcommand)]
        action: TenantAction,
    },
    /// API products.
    Products {
        #[command(subcommand)]
        action: SimpleAction,
    },
    /// Plans (lists of limits).
    Plans {
        #[command(subcommand)]
        action: PlanAction,
    },
    /// Routes (match → upstream cluster, product, overrides).
    Routes {
        #[command(subcommand)]
        action: RouteAction,
    },
    /// API keys.
    Keys {
        #[command(subcommand)]
        action: KeyCommand,
    },
    /// Prices of LLM calls (micro-units of the deployment's currency per million tokens).
    Prices {
        #[command(subcommand)]
        action: PriceAction,
    },
    /// The configuration version, and the stored objects this sidecar cannot use as stored.
    Version,
}

#[derive(Subcommand)]
enum TenantAction {
    /// Create a tenant.
    Create {
        id: String,
        #[arg(long, default_value = "")]
        name: String,
        /// Subscribe to this product (repeatable).
        #[arg(long = "product")]
        products: Vec<String>,
    },
    List,
    Get { id: String },
    Delete { id: String },
}

#[derive(Subcommand)]
enum SimpleAction {
    Create {
        id: String,
        #[arg(long, default_value = "")]
        name: String,
    },
    List,
    Get { id: String },
    Delete { id: String },
}

#[derive(Subcommand)]
enum PlanAction {
    /// Create or replace a plan. Limits as NAME:ALGORITHM:LIMIT[:WINDOW[:SUBJECT]], e.g.
    /// per-minute:fixed_window:100:60s — or the whole list with --limits-json.
    Set {
        id: String,
        #[arg(long = "limit")]
        limits: Vec<String>,
        /// A JSON array of limits (docs/configuration.md), instead of --limit.
        #[arg(long)]
        limits_json: Option<String>,
        /// Models the plan allows on LLM routes (names, or prefixes ending in '*'); default: any.
        #[arg(long = "model", value_delimiter = ',')]
        models: Vec<String>,
        /// An alias, ALIAS=MODEL: a client asks for ALIAS, the upstream is asked for MODEL.
        #[arg(long = "alias")]
        aliases: Vec<String>,
        /// Per-model rate limits, MODEL=RPM:TPM (either may be empty), e.g. 'gpt-4o*=60:90000' —
        /// or the whole list with --model-limits-json.
        #[arg(long = "model-limit", conflicts_with = "model_limits_json")]
        model_limits: Vec<String>,
        /// A JSON array of per-model limits (docs/configuration.md), instead of --model-limit.
        #[arg(long)]
        model_limits_json: Option<String>,
    },
    List,
    Get { id: String },
    Delete { id: String },
}

#[derive(Subcommand)]
enum RouteAction {
    /// Create or replace a route.
    Set {
        id: String,
        #[arg(long)]
        cluster: String,
        #[arg(long)]
        path_prefix: Option<String>,
        #[arg(long)]
        path: Option<String>,
        #[arg(long)]
        host: Option<String>,
        #[arg(long)]
        method: Option<String>,
        #[arg(long)]
        product: Option<String>,
        /// Limit override: this plan's limits apply on the route.
        #[arg(long)]
        plan: Option<String>,
        #[arg(long)]
        priority: Option<i32>,
    },
    List,
    Get { id: String },
    Delete { id: String },
}

#[derive(Subcommand)]
enum PriceAction {
    /// The prices in force: the file's (`[usage.pricing]`) and the stored ones, with their source.
    List,
    /// Create or replace a stored price. A change prices the usage taken after it; usage already
    /// taken keeps its cost.
    Set {
        /// The price's id (1-64 of A-Z a-z 0-9 _ . -), e.g. gpt-4o-mini-2026-03.
        id: String,
        /// A model name, a prefix of one ending in * (gpt-4o-mini*), or * (the default rates).
        #[arg(long)]
        model: String,
        /// Micro-units per million input tokens (an integer: 150000 is 0.15 per million).
        #[arg(long)]
        input: u64,
        /// Micro-units per million output tokens.
        #[arg(long)]
        output: u64,
        /// Micro-units per million cached input tokens (default: the input rate).
        #[arg(long)]
        cached: Option<u64>,
        /// When it takes effect: RFC 3339 or yyyy-MM-dd (default: always).
        #[arg(long)]
        from: Option<String>,
        /// The provider the rates are from (informative).
        #[arg(long)]
        provider: Option<String>,
    },
    Get { id: String },
    Delete { id: String },
}

struct Api {
    base: String,
    token: String,
    agent: ureq::Agent,
}

/// Keys a `keys list` asks for per page (the API's most): ~2.5 MB an answer, well under what one
/// answer may be read at (ureq's 10 MB).
const KEYS_PAGE: usize = 10_000;

impl Api {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        self.call_paged(method, path, body).map(|(v, _)| v)
    }

    /// [`Api::call`], and the path of the next page its `Link: <…>; rel="next"` names, if any.
    fn call_paged(&self, method: &str, path: &str, body: Option<Value>) -> Result<(Value, Option<String>)> {
        let url = format!("{}{}", self.base.trim_end_matches('/'), path);
        let auth = format!("Bearer {}", self.token);
        let resp = match (method, body) {
            ("GET", _) => self.agent.get(&url).header("authorization", &auth).call(),
            ("DELETE", _) => self.agent.delete(&url).header("authorization", &auth).call(),
            ("PUT", b) => self.agent.put(&url).header("authorization", &auth).header("content-type", "application/json").send(b.unwrap_or(json!({})).to_string()),
            ("PATCH", b) => self.agent.patch(&url).header("authorization", &auth).header("content-type", "application/json").send(b.unwrap_or(json!({})).to_string()),
            (_, b) => self.agent.post(&url).header("authorization", &auth).header("content-type", "application/json").send(b.unwrap_or(json!({})).to_string()),
        };
        let mut resp = match resp {
            Ok(r) => r,
            // the server got the request: a write goes on to its end there (decision 179)
            Err(ureq::Error::Timeout(t)) if method != "GET" && !matches!(t, ureq::Timeout::Connect | ureq::Timeout::Resolve) => bail!(
                "no answer from the admin API at {} within {}s: the change may still take effect; check it (e.g. `tollgate keys list`) before retrying",
                self.base,
                CLIENT_TIMEOUT.as_secs()
            ),
            Err(e) => return Err(e).with_context(|| format!("cannot reach the admin API at {}", self.base)),
        };
        let status = resp.status().as_u16();
        let next = resp
            .headers()
            .get("link")
            .and_then(|l| l.to_str().ok())
            .filter(|l| l.ends_with("rel=\"next\""))
            .and_then(|l| l.strip_prefix('<')?.split_once('>').map(|(p, _)| p.to_string()));
        // an answer that cannot be read whole is an error, never an empty listing
        let text = resp.body_mut().read_to_string().with_context(|| format!("reading the admin API's answer to {method} {path}"))?;
        let v: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            // not the admin API's answer: never read as a success (decision 200)
            Err(_) if status < 400 => bail!("{} answered {status} to {method} {path} with something that is not JSON: is --admin-url the admin API?", self.base),
            Err(_) => Value::String(text),
        };
        if status >= 400 {
            let field = v.get("field").and_then(Value::as_str).map(|f| format!(" [{f}]")).unwrap_or_default();
            let msg = v.get("message").and_then(Value::as_str).unwrap_or("");
            bail!("{status} {}{field}: {msg}", v.get("error").and_then(Value::as_str).unwrap_or("error"));
        }
        Ok((v, next))
    }

    /// Every key (of a tenant), read page by page (decision 184) and shown by creation time, as
    /// one answer showed them: a listing of any size, each answer bounded.
    fn all_keys(&self, tenant: Option<&str>) -> Result<Value> {
        let tenant = match tenant {
            Some(t) => format!("&tenant={}", checked(t)?),
            None => String::new(),
        };
        let mut next = Some(format!("/v1/keys?limit={KEYS_PAGE}{tenant}"));
        let mut keys = Vec::new();
        while let Some(path) = next.take() {
            let (page, more) = self.call_paged("GET", &path, None)?;
            let Value::Array(rows) = page else { bail!("the admin API answered {path} with something other than a list") };
            keys.extend(rows);
            next = more;
        }
        let created = |k: &Value| (k["created_at"].as_u64().unwrap_or(0), k["key_id"].as_str().unwrap_or("").to_string());
        keys.sort_by_key(created);
        Ok(Value::Array(keys))
    }
}

fn parse_limit(s: &str) -> Result<Value> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() < 3 {
        bail!("--limit '{s}': use NAME:ALGORITHM:LIMIT[:WINDOW[:SUBJECT]]");
    }
    let limit: u64 = parts[2].parse().with_context(|| format!("--limit '{s}': LIMIT must be a number"))?;
    let mut v = json!({"name": parts[0], "algorithm": parts[1], "limit": limit});
    if let Some(w) = parts.get(3).filter(|w| !w.is_empty()) {
        v["window"] = json!(w);
    }
    if parts.len() > 4 {
        v["subject"] = json!(parts[4..].join(":"));
    }
    Ok(v)
}

fn cell(v: &Value, k: &str) -> String {
    match v.get(k) {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a.iter().map(|x| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string())).collect::<Vec<_>>().join(","),
        Some(Value::Object(_)) if k == "match" => {
            let m = &v[k];
            ["host", "method", "path", "path_prefix"]
                .iter()
                .filter_map(|f| m.get(*f).and_then(Value::as_str).map(|x| format!("{f}={x}")))
                .collect::<Vec<_>>()
                .join(" ")
        }
        Some(other) => other.to_string(),
    }
}

fn table(rows: &[Value], cols: &[&str]) {
    let mut widths: Vec<usize> = cols.iter().map(|c| c.len()).collect();
    let cells: Vec<Vec<String>> = rows.iter().map(|r| cols.iter().map(|c| cell(r, c)).collect()).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let line = |vals: Vec<String>| vals.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}")).collect::<Vec<_>>().join("  ");
    println!("{}", line(cols.iter().map(|c| c.to_uppercase()).collect()).trim_end());
    for row in cells {
        println!("{}", line(row).trim_end());
    }
}

fn show(json_out: bool, v: &Value, cols: &[&str]) {
    if json_out {
        println!("{v}");
        return;
    }
    match v {
        Value::Array(rows) => table(rows, cols),
        other => table(std::slice::from_ref(other), cols),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The admin token: from the environment or `--token`, else from `--token-file`.
fn admin_token(token: Option<String>, file: Option<&std::path::Path>) -> Result<String> {
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        return Ok(t);
    }
    let Some(path) = file else { bail!("no admin token: set TOLLGATE_ADMIN_TOKEN or pass --token-file") };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the admin token from {}", path.display()))?;
    let t = text.trim();
    if t.is_empty() {
        bail!("the admin token file {} is empty", path.display());
    }
    Ok(t.to_string())
}

/// How long the CLI waits for an answer: longer than the server's own worst case (10 s for
/// PostgreSQL's connection, 10 s for its query, 5 s for Redis), so a slow write is answered
/// rather than abandoned.
const CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(45);

fn run() -> Result<()> {
    let cli = Cli::parse();
    let base = cli.admin_url.context("no admin URL: pass --admin-url or set TOLLGATE_ADMIN_URL")?;
    let token = admin_token(cli.token, cli.token_file.as_deref())?;
    let agent = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(CLIENT_TIMEOUT)).timeout_connect(Some(std::time::Duration::from_secs(5))).build().into();
    let api = Api { base, token, agent };
    let j = cli.json;
    const TENANT: &[&str] = &["id", "name", "products"];
    const PRODUCT: &[&str] = &["id", "name"];
    const PLAN: &[&str] = &["id", "limits"];
    const ROUTE: &[&str] = &["id", "priority", "match", "cluster", "product", "plan"];
    const KEY: &[&str] = &["key_id", "tenant", "plan", "status", "created_at", "expires_at", "last_used_at", "label"];
    const PRICE: &[&str] = &["id", "model", "provider", "input_per_mtok", "output_per_mtok", "cached_input_per_mtok", "effective_from"];
    match cli.command {
        Command::Tenants { action } => match action {
            TenantAction::Create { id, name, products } => {
                show(j, &api.call("POST", "/v1/tenants", Some(json!({"id": id, "name": name, "products": products})))?, TENANT)
            }
            TenantAction::List => show(j, &api.call("GET", "/v1/tenants", None)?, TENANT),
            TenantAction::Get { id } => show(j, &api.call("GET", &format!("/v1/tenants/{}", checked(&id)?), None)?, TENANT),
            TenantAction::Delete { id } => show(j, &api.call("DELETE", &format!("/v1/tenants/{}", checked(&id)?), None)?, &["deleted", "version"]),
        },
        Command::Products { action } => match action {
            SimpleAction::Create { id, name } => show(j, &api.call("POST", "/v1/products", Some(json!({"id": id, "name": name})))?, PRODUCT),
            SimpleAction::List => show(j, &api.call("GET", "/v1/products", None)?, PRODUCT),
            SimpleAction::Get { id } => show(j, &api.call("GET", &format!("/v1/products/{}", checked(&id)?), None)?, PRODUCT),
            SimpleAction::Delete { id } => show(j, &api.call("DELETE", &format!("/v1/products/{}", checked(&id)?), None)?, &["deleted", "version"]),
        },
        Command::Plans { action } => match action {
            PlanAction::Set { id, limits, limits_json, models, aliases, model_limits, model_limits_json } => {
                let limits: Value = match limits_json {
                    Some(text) => serde_json::from_str(&text).context("--limits-json: not JSON")?,
                    None => Value::Array(limits.iter().map(|l| parse_limit(l)).collect::<Result<_>>()?),
                };
                let mut plan = json!({"id": id, "limits": limits});
                if !models.is_empty() {
                    plan["models"] = json!(models);
                }
                if !aliases.is_empty() {
                    let pairs = aliases.iter().map(|a| a.split_once('=').map(|(k, v)| (k.to_string(), json!(v))).ok_or_else(|| anyhow::anyhow!("--alias '{a}': ALIAS=MODEL")));
                    plan["model_aliases"] = Value::Object(pairs.collect::<Result<_>>()?);
                }
                let model_limits: Vec<Value> = match model_limits_json {
                    Some(text) => serde_json::from_str(&text).context("--model-limits-json: not a JSON array")?,
                    None => model_limits.iter().map(|l| parse_model_limit(l)).collect::<Result<_>>()?,
                };
                if !model_limits.is_empty() {
                    plan["model_limits"] = Value::Array(model_limits);
                }
                let v = api.call("PUT", &format!("/v1/plans/{}", checked(&id)?), Some(plan))?;
                if j {
                    println!("{v}");
                } else {
                    println!("plan {id} stored (version {})", cell(&v, "version"));
                }
            }
            PlanAction::List => show(j, &api.call("GET", "/v1/plans", None)?, PLAN),
            PlanAction::Get { id } => println!("{}", api.call("GET", &format!("/v1/plans/{}", checked(&id)?), None)?),
            PlanAction::Delete { id } => show(j, &api.call("DELETE", &format!("/v1/plans/{}", checked(&id)?), None)?, &["deleted", "version"]),
        },
        Command::Routes { action } => match action {
            RouteAction::Set { id, cluster, path_prefix, path, host, method, product, plan, priority } => {
                let mut m = json!({});
                for (k, v) in [("path_prefix", path_prefix), ("path", path), ("host", host), ("method", method)] {
                    if let Some(v) = v {
                        m[k] = json!(v);
                    }
                }
                let mut r = json!({"id": id, "cluster": cluster, "match": m});
                for (k, v) in [("product", product), ("plan", plan)] {
                    if let Some(v) = v {
                        r[k] = json!(v);
                    }
                }
                if let Some(p) = priority {
                    r["priority"] = json!(p);
                }
                show(j, &api.call("PUT", &format!("/v1/routes/{}", checked(&id)?), Some(r))?, ROUTE)
            }
            RouteAction::List => show(j, &api.call("GET", "/v1/routes", None)?, ROUTE),
            RouteAction::Get { id } => show(j, &api.call("GET", &format!("/v1/routes/{}", checked(&id)?), None)?, ROUTE),
            RouteAction::Delete { id } => show(j, &api.call("DELETE", &format!("/v1/routes/{}", checked(&id)?), None)?, &["deleted", "version"]),
        },
        Command::Keys { action } => match action {
            KeyCommand::Create { tenant, plan, expires_in, scope } => {
                let mut body = json!({"tenant": tenant, "plan": plan});
                if let Some(e) = expires_in {
                    body["expires_in"] = json!(e);
                }
                if let Some(l) = &scope.label {
                    body["label"] = json!(l);
                }
                if scope.any_scope() {
                    body["scopes"] = scope.scopes_json();
                }
                let v = api.call("POST", "/v1/keys", Some(body))?;
                if j {
                    println!("{v}");
                } else {
                    println!("{}", issued_text(&cell(&v, "key_id"), &cell(&v, "tenant"), &cell(&v, "plan"), None, &cell(&v, "key")));
                }
            }
            KeyCommand::Revoke { key_id } => {
                let v = api.call("POST", &format!("/v1/keys/{}/revoke", checked(&key_id)?), None)?;
                if j {
                    println!("{v}");
                } else {
                    println!("revoked {} (tenant {})", cell(&v, "key_id"), cell(&v, "tenant"));
                }
            }
            KeyCommand::Update { key_id, scope, no_scopes } => {
                let mut body = json!({});
                if let Some(l) = &scope.label {
                    body["label"] = json!(l);
                }
                if scope.any_scope() || no_scopes {
                    body["scopes"] = scope.scopes_json();
                }
                let v = api.call("PATCH", &format!("/v1/keys/{}", checked(&key_id)?), Some(body))?;
                show(j, &v, KEY);
            }
            KeyCommand::Rotate { key_id, overlap } => {
                let body = overlap.map(|o| json!({"overlap": o}));
                let v = api.call("POST", &format!("/v1/keys/{}/rotate", checked(&key_id)?), body)?;
                if j {
                    println!("{v}");
                } else {
                    println!("rotated {}: it keeps working until {} (unix seconds), then expires", cell(&v, "rotated_from"), cell(&v["previous"], "expires_at"));
                    println!("{}", issued_text(&cell(&v, "key_id"), &cell(&v, "tenant"), &cell(&v, "plan"), None, &cell(&v, "key")));
                }
            }
            KeyCommand::List { tenant } => show(j, &api.all_keys(tenant.as_deref())?, KEY),
        },
        Command::Prices { action } => match action {
            PriceAction::List => {
                let v = api.call("GET", "/v1/pricing", None)?;
                if j {
                    println!("{v}");
                } else {
                    println!("currency {} (micro-units per million tokens)", cell(&v, "currency"));
                    let mut cols = PRICE.to_vec();
                    cols.push("source");
                    table(v["prices"].as_array().map_or(&[][..], Vec::as_slice), &cols);
                }
            }
            PriceAction::Set { id, model, input, output, cached, from, provider } => {
                let mut p = json!({"id": id, "model": model, "input_per_mtok": input, "output_per_mtok": output});
                for (k, v) in [("effective_from", from), ("provider", provider)] {
                    if let Some(v) = v {
                        p[k] = json!(v);
                    }
                }
                if let Some(c) = cached {
                    p["cached_input_per_mtok"] = json!(c);
                }
                show(j, &api.call("PUT", &format!("/v1/prices/{}", checked(&id)?), Some(p))?, PRICE)
            }
            PriceAction::Get { id } => show(j, &api.call("GET", &format!("/v1/prices/{}", checked(&id)?), None)?, PRICE),
            PriceAction::Delete { id } => show(j, &api.call("DELETE", &format!("/v1/prices/{}", checked(&id)?), None)?, &["deleted", "version"]),
        },
        Command::Version => {
            let v = api.call("GET", "/v1/version", None)?;
            show(j, &v, &["version", "loaded"]);
            // stored rows this sidecar cannot use as stored (decision 206): each to mend or delete
            if let Some(rows) = v["unusable"].as_array().filter(|rows| !j && !rows.is_empty()) {
                println!("\n{} stored object(s) not in force as stored (mend or delete each):", rows.len());
                table(rows, &["kind", "id", "in_force", "reason"]);
            }
        }
    }
    Ok(())
}

/// `id` as it may go into a path or a query: an id of the admin API (1–64 of `A-Z a-z 0-9 _ . -`).
/// Anything else is refused before a request is sent (decision 200): a `#` or `?` in it would cut
/// the path short, and `plans delete 'gold#old'` deleted `gold`.
fn checked(id: &str) -> Result<&str> {
    match tollgate_sidecar::keys::Id::parse(id) {
        Some(_) => Ok(id),
        None => bail!("{id:?} is not an id: 1-64 of A-Z a-z 0-9 _ . -"),
    }
}

/// `MODEL=RPM:TPM` (either count may be empty) as the admin API's model limit; the counts are
/// checked by the sidecar, which names the field.
fn parse_model_limit(s: &str) -> Result<Value> {
    let bad = || anyhow::anyhow!("--model-limit '{s}': MODEL=RPM:TPM, e.g. 'gpt-4o*=60:90000' (either count may be empty)");
    let (model, counts) = s.rsplit_once('=').ok_or_else(bad)?;
    let (rpm, tpm) = counts.split_once(':').ok_or_else(bad)?;
    let mut v = json!({"model": model});
    for (field, n) in [("requests_per_minute", rpm), ("tokens_per_minute", tpm)] {
        if !n.is_empty() {
            v[field] = json!(n.parse::<u64>().map_err(|_| bad())?);
        }
    }
    Ok(v)
}

#[cfg(test)]
#[path = "tollgate/tests.rs"]
mod tests;
