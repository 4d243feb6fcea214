//! Live figures from the sidecar's own counters: its Prometheus exposition, read back (this
//! replica's view since it started). Pure: a parser of the text format and the sums the pages
//! show.

use std::collections::BTreeMap;

/// One sample: its metric name, labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of a Prometheus text exposition (comments and unreadable lines skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(sample).collect()
}

fn sample(line: &str) -> Option<Sample> {
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.trim().parse().ok()?;
    let (name, labels) = match head.split_once('{') {
        Some((n, rest)) => (n, labels(rest.strip_suffix('}')?)?),
        None => (head, BTreeMap::new()),
    };
    Some(Sample { name: name.trim().to_string(), labels, value })
}

fn labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(out);
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if chars.next()? != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()? {
                '\\' => match chars.next()? {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key.trim().to_string(), value);
    }
}

/// One tenant's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantFigures {
    /// Requests by outcome (`allowed`, `rate_limited`, …).
    pub outcomes: BTreeMap<String, u64>,
    pub tokens: u64,
    /// The share of each limit used after the tenant's last decision that ran it.
    pub used: BTreeMap<String, f64>,
}

impl TenantFigures {
    pub fn requests(&self) -> u64 {
        self.outcomes.values().sum()
    }
    /// Requests answered 429 (a limit or a budget said no).
    pub fn throttled(&self) -> u64 {
        use tollgate_wire::codes::{CONCURRENCY_LIMITED, QUOTA_EXCEEDED, RATE_LIMITED};
        self.outcomes.iter().filter(|(o, _)| [RATE_LIMITED, QUOTA_EXCEEDED, CONCURRENCY_LIMITED].contains(&o.as_str())).map(|(_, n)| n).sum()
    }
}

/// Figures per tenant from the per-tenant series (crate::telemetry).
pub fn per_tenant(samples: &[Sample]) -> BTreeMap<String, TenantFigures> {
    let mut out: BTreeMap<String, TenantFigures> = BTreeMap::new();
    for s in samples {
        let Some(tenant) = s.labels.get("tenant") else { continue };
        let f = out.entry(tenant.clone()).or_default();
        match s.name.as_str() {
            crate::telemetry::REQUESTS => {
                let outcome = s.labels.get("outcome").cloned().unwrap_or_else(|| "other".into());
                *f.outcomes.entry(outcome).or_default() += s.value as u64;
            }
            crate::telemetry::TOKENS => f.tokens += s.value as u64,
            crate::telemetry::LIMIT_USED => {
                if let Some(limit) = s.labels.get("limit") {
                    f.used.insert(limit.clone(), s.value);
                }
            }
            _ => {}
        }
    }
    out.retain(|_, f| f.requests() > 0 || f.tokens > 0 || !f.used.is_empty());
    out
}

/// The PromQL of the overview's figures per tenant (every replica's series).
pub const PROMQL_OUTCOMES: &str = "sum by (tenant, outcome) (tollgate_requests_total)";
pub const PROMQL_TOKENS: &str = "sum by (tenant) (tollgate_request_tokens_total)";

/// Figures per tenant from the answers of Prometheus's `/api/v1/query` to [`PROMQL_OUTCOMES`] and
/// [`PROMQL_TOKENS`]; `None` when an answer is not a successful vector.
pub fn from_prometheus(outcomes: &serde_json::Value, tokens: &serde_json::Value) -> Option<BTreeMap<String, TenantFigures>> {
    let vector = |v: &serde_json::Value| -> Option<Vec<serde_json::Value>> {
        (v["status"] == "success" && v["data"]["resultType"] == "vector").then(|| v["data"]["result"].as_array().cloned().unwrap_or_default())
    };
    let value = |s: &serde_json::Value| s["value"][1].as_str().and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0) as u64;
    let mut out: BTreeMap<String, TenantFigures> = BTreeMap::new();
    for s in vector(outcomes)? {
        let (Some(t), Some(o)) = (s["metric"]["tenant"].as_str(), s["metric"]["outcome"].as_str()) else { continue };
        *out.entry(t.to_string()).or_default().outcomes.entry(o.to_string()).or_default() += value(&s);
    }
    for s in vector(tokens)? {
        let Some(t) = s["metric"]["tenant"].as_str() else { continue };
        out.entry(t.to_string()).or_default().tokens += value(&s);
    }
    out.retain(|_, f| f.requests() > 0 || f.tokens > 0);
    Some(out)
}

/// Asks Prometheus (blocking: run it off the async workers) for the figures per tenant.
pub fn query_prometheus(base: &str) -> Result<BTreeMap<String, TenantFigures>, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(std::time::Duration::from_secs(5))).build().into();
    let ask = |q: &str| -> Result<serde_json::Value, String> {
        let mut r = agent.get(&format!("{}/api/v1/query", base.trim_end_matches('/'))).query("query", q).call().map_err(|e| e.to_string())?;
        let text = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
        serde_json::from_str(&text).map_err(|e| e.to_string())
    };
    from_prometheus(&ask(PROMQL_OUTCOMES)?, &ask(PROMQL_TOKENS)?).ok_or_else(|| "not a successful vector answer".to_string())
}

/// The sum of a metric's samples (over every label set).
pub fn total(samples: &[Sample], name: &str) -> f64 {
    samples.iter().filter(|s| s.name == name).map(|s| s.value).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE tollgate_requests_total counter\n\
        tollgate_requests_total{tenant=\"acme\",route=\"r\",plan=\"p\",outcome=\"allowed\"} 12\n\
        tollgate_requests_total{tenant=\"acme\",route=\"r2\",plan=\"p\",outcome=\"allowed\"} 3\n\
        tollgate_requests_total{tenant=\"acme\",route=\"r\",plan=\"p\",outcome=\"rate_limited\"} 4\n\
        tollgate_requests_total{tenant=\"we,ird \\\"x\\\"\",route=\"r\",plan=\"p\",outcome=\"allowed\"} 1\n\
        tollgate_request_tokens_total{tenant=\"acme\"} 900\n\
        tollgate_limit_used_ratio{tenant=\"acme\",limit=\"per_minute\"} 0.25\n\
        tollgate_sidecar_usage_spool_bytes 42\n\
        garbage line\n";

    #[test]
    fn per_tenant_figures_are_summed() {
        let s = parse(TEXT);
        let t = per_tenant(&s);
        let acme = &t["acme"];
        assert_eq!(acme.outcomes["allowed"], 15);
        assert_eq!(acme.throttled(), 4);
        assert_eq!(acme.requests(), 19);
        assert_eq!(acme.tokens, 900);
        assert_eq!(acme.used["per_minute"], 0.25);
        assert_eq!(t["we,ird \"x\""].requests(), 1, "escaped label values");
        assert_eq!(total(&s, "tollgate_sidecar_usage_spool_bytes"), 42.0);
    }

    #[test]
    fn prometheus_answers_are_read() {
        let outcomes = serde_json::json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"tenant": "acme", "outcome": "allowed"}, "value": [1.0, "12"]},
            {"metric": {"tenant": "acme", "outcome": "rate_limited"}, "value": [1.0, "3"]},
            {"metric": {"tenant": "beta", "outcome": "allowed"}, "value": [1.0, "1"]}]}});
        let tokens = serde_json::json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"tenant": "acme"}, "value": [1.0, "900"]}]}});
        let t = from_prometheus(&outcomes, &tokens).unwrap();
        assert_eq!((t["acme"].requests(), t["acme"].throttled(), t["acme"].tokens), (15, 3, 900));
        assert_eq!(t["beta"].requests(), 1);
        assert!(from_prometheus(&serde_json::json!({"status": "error"}), &tokens).is_none());
    }
}
