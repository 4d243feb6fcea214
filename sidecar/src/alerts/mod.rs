//! Budget alerts that reach people (issue 42 item 5; docs/alerts.md is the contract).
//!
//! A budget's usage at or past a threshold (`[alerts] thresholds`, 50/80/100 % by default) makes
//! one alert per (tenant, limit, subject, period, threshold), exactly once across every replica:
//! the first replica to see the crossing creates it in Redis (`alert_fire.lua`, a `SET NX`
//! marker), the others find the marker. Usage is what the budget counts at decide time — spent
//! plus reserved by requests in flight — so an alert may come a little before the spend it
//! announces settles (never after). Seeing a crossing costs the request path a lookup in this
//! replica's set of alerts already fired; the Redis call runs in the background.
//!
//! Delivery ([`deliver`]): a webhook per tenant (`[[alerts.webhooks]]`, or `tenant = "*"`),
//! a JSON body signed with HMAC-SHA256 over `<timestamp>.<body>` with the webhook's secret, the
//! alert's id as an idempotency id, retried with exponential backoff until `give_up_after`
//! (24 h); every step in the tenant's delivery log (admin API `GET /v1/alerts?tenant=`).

pub mod deliver;

use crate::invalid::{invalid, Invalid};
use crate::secret::{hex, hmac_sha256};
use crate::store::Store;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Metric: alerts created (by this replica), labelled `threshold`.
pub const FIRED: &str = "tollgate_sidecar_alerts_fired_total";
/// Metric: delivery attempts, labelled `outcome` (delivered | retry | failed | no_webhook).
pub const DELIVERIES: &str = "tollgate_sidecar_alert_deliveries_total";
/// Metric: alerts waiting for delivery (every replica's, read by the delivery loop).
pub const PENDING: &str = "tollgate_sidecar_alerts_pending";

pub use crate::scripts::alert_fire::LOG_MAX;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsConfig {
    /// Percentages of a budget that make an alert when reached (1–100, each once per period).
    pub thresholds: Vec<u8>,
    /// Where a tenant's alerts go.
    pub webhooks: Vec<WebhookConfig>,
    /// The first retry's wait; doubled per attempt up to `retry_max`.
    #[serde(with = "humantime_serde")]
    pub retry_base: Duration,
    #[serde(with = "humantime_serde")]
    pub retry_max: Duration,
    /// How long an undelivered alert is retried (from its creation).
    #[serde(with = "humantime_serde")]
    pub give_up_after: Duration,
    /// One delivery attempt's deadline (connect, send, answer).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// A tenant id, or `*` for every tenant without a webhook of its own.
    pub tenant: String,
    /// `http://` or `https://`.
    pub url: String,
    /// The HMAC key (at least 16 bytes), the tenant's to verify the signature.
    pub secret: String,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            thresholds: vec![50, 80, 100],
            webhooks: Vec::new(),
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(600),
            give_up_after: Duration::from_secs(24 * 3600),
            timeout: Duration::from_secs(5),
        }
    }
}

impl AlertsConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.thresholds.len() > 10 || self.thresholds.iter().any(|t| !(1..=100).contains(t)) {
            return Err(invalid("alerts.thresholds", "at most 10 percentages, each 1 to 100"));
        }
        if self.thresholds.iter().collect::<HashSet<_>>().len() != self.thresholds.len() {
            return Err(invalid("alerts.thresholds", "each percentage once"));
        }
        let mut tenants = HashSet::new();
        for (i, w) in self.webhooks.iter().enumerate() {
            let field = |f: &str| format!("alerts.webhooks[{i}].{f}");
            if w.tenant != "*" && crate::keys::Id::parse(&w.tenant).is_none() {
                return Err(invalid(field("tenant"), "a tenant id or *"));
            }
            if !tenants.insert(w.tenant.as_str()) {
                return Err(invalid(field("tenant"), "one webhook per tenant"));
            }
            let scheme_ok = w.url.starts_with("http://") || w.url.starts_with("https://");
            if !scheme_ok || w.url.len() > 2048 || w.url.bytes().any(|b| !b.is_ascii_graphic()) {
                return Err(invalid(field("url"), "an http:// or https:// URL without spaces or controls"));
            }
            if w.secret.len() < 16 || w.secret.len() > 1024 {
                return Err(invalid(field("secret"), "16 to 1024 bytes"));
            }
        }
        let bounded = |d: Duration, lo: Duration, hi: Duration| d >= lo && d <= hi;
        if !bounded(self.retry_base, Duration::from_millis(10), Duration::from_secs(3600)) || self.retry_max < self.retry_base {
            return Err(invalid("alerts.retry_base", "10ms to 1h, and at most retry_max"));
        }
        if !bounded(self.give_up_after, Duration::from_secs(1), Duration::from_secs(7 * 86400)) {
            return Err(invalid("alerts.give_up_after", "1s to 7d"));
        }
        if !bounded(self.timeout, Duration::from_millis(100), Duration::from_secs(60)) {
            return Err(invalid("alerts.timeout", "100ms to 60s"));
        }
        Ok(())
    }

    /// The webhook of `tenant`: its own, else the `*` one.
    pub fn webhook(&self, tenant: &str) -> Option<&WebhookConfig> {
        self.webhooks.iter().find(|w| w.tenant == tenant).or_else(|| self.webhooks.iter().find(|w| w.tenant == "*"))
    }
}

/// A budget's usage as one decision saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetUse<'a> {
    pub limit: &'a str,
    pub subject: &'a str,
    /// `yyyyMM` (a month) or `yyyyMMdd` (a day: daily money budgets).
    pub period: u32,
    /// What the budget counts: `tokens`, or `micros` (micro-units of the pricing currency).
    pub unit: &'static str,
    /// Spent and reserved after this decision.
    pub used: u64,
    pub budget: u64,
}

/// The thresholds `used` of `budget` has reached (percentages compared in integers).
pub fn crossed(used: u64, budget: u64, thresholds: &[u8]) -> Vec<u8> {
    if budget == 0 {
        return Vec::new();
    }
    thresholds.iter().copied().filter(|t| u128::from(used) * 100 >= u128::from(*t) * u128::from(budget)).collect()
}

/// What a webhook receives (its body, as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Alert {
    /// Stable for this threshold and period: the receiver's idempotency id.
    pub id: String,
    /// `budget.threshold`.
    #[serde(rename = "type")]
    pub kind: String,
    pub tenant: String,
    pub limit: String,
    pub subject: String,
    /// `yyyy-MM`, or `yyyy-MM-dd` for a daily budget.
    pub period: String,
    /// `tokens`, or `micros` of the pricing currency (money budgets).
    pub unit: String,
    pub threshold: u8,
    pub used: u64,
    pub budget: u64,
    /// When the first replica saw the crossing (ms since the Unix epoch).
    pub at_ms: u64,
}

impl Alert {
    /// The marker that makes the alert once: what names it across replicas.
    pub fn marker(tenant: &str, u: &BudgetUse<'_>, threshold: u8) -> String {
        format!("{{alerts}}:fired:{tenant}:{}:{}:{}:{threshold}", u.limit, u.subject, u.period)
    }

    pub fn new(tenant: &str, u: &BudgetUse<'_>, threshold: u8, at_ms: u64) -> Alert {
        let digest = Sha256::digest(Alert::marker(tenant, u, threshold).as_bytes());
        Alert {
            id: format!("alert_{}", &hex(&digest)[..32]),
            kind: "budget.threshold".into(),
            tenant: tenant.into(),
            limit: u.limit.into(),
            subject: u.subject.into(),
            period: period_text(u.period),
            unit: u.unit.into(),
            threshold,
            used: u.used,
            budget: u.budget,
            at_ms,
        }
    }
}

/// `202612` → `2026-12`; `20261205` → `2026-12-05`.
pub fn period_text(period: u32) -> String {
    match period {
        p if p > 999_999 => format!("{:04}-{:02}-{:02}", p / 10_000, p / 100 % 100, p % 100),
        p => format!("{:04}-{:02}", p / 100, p % 100),
    }
}

/// The `x-tollgate-signature` of `body` sent at `timestamp` (Unix seconds): `v1=` and the hex
/// HMAC-SHA256 of `<timestamp>.<body>` under the webhook's secret.
pub fn signature(secret: &str, timestamp: u64, body: &[u8]) -> String {
    let mut msg = format!("{timestamp}.").into_bytes();
    msg.extend_from_slice(body);
    format!("v1={}", hex(&hmac_sha256(secret.as_bytes(), &[&msg])))
}

/// The alerts of this sidecar: its configuration, its store, and the alerts it knows exist.
pub struct Alerts {
    pub config: AlertsConfig,
    store: Store,
    /// Markers this replica created or found: no Redis call for them again (bounded: cleared
    /// past 100 000, which only costs a `SET NX` that finds the marker).
    known: Mutex<HashSet<String>>,
}

static ALERTS: OnceLock<Arc<Alerts>> = OnceLock::new();

/// Turns alerts on for this process (once, at start).
pub fn install(store: Store, config: AlertsConfig) -> Arc<Alerts> {
    ALERTS.get_or_init(|| Arc::new(Alerts { config, store, known: Mutex::new(HashSet::new()) })).clone()
}

/// A decision's budget usage: each threshold reached for the first time (on this replica) is
/// created in Redis in the background. Nothing when alerts are not installed.
pub fn observe<'a>(tenant: &str, uses: impl Iterator<Item = BudgetUse<'a>>, now_ms: u64) {
    let Some(alerts) = ALERTS.get() else { return };
    for u in uses {
        for t in crossed(u.used, u.budget, &alerts.config.thresholds) {
            let marker = Alert::marker(tenant, &u, t);
            {
                let mut known = alerts.known.lock().unwrap_or_else(|p| p.into_inner());
                if known.len() > 100_000 {
                    known.clear();
                }
                if !known.insert(marker.clone()) {
                    continue;
                }
            }
            let alert = Alert::new(tenant, &u, t, now_ms);
            let alerts = alerts.clone();
            tokio::spawn(async move {
                let entry = serde_json::json!({
                    "alert": alert.id, "event": "fired", "atMs": alert.at_ms, "body": alert,
                    "detail": format!("{} reached {}% of {} ({} of {})", alert.period, alert.threshold, alert.limit, alert.used, alert.budget),
                });
                let fire = crate::scripts::alert_fire::Fire {
                    marker: &marker,
                    id: &alert.id,
                    tenant: &alert.tenant,
                    at_ms: alert.at_ms,
                    body: serde_json::to_string(&alert).unwrap_or_default(),
                    log_entry: entry.to_string(),
                    ttl_ms: alerts.marker_ttl_ms(),
                };
                match crate::scripts::alert_fire::fire(&alerts.store, fire).await {
                    Ok(true) => {
                        metrics::counter!(FIRED, "threshold" => alert.threshold.to_string()).increment(1);
                        tracing::info!(tenant = %alert.tenant, limit = %alert.limit, threshold = alert.threshold, id = %alert.id, "budget alert");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        // not known after all: the next decision past the threshold tries again
                        alerts.known.lock().unwrap_or_else(|p| p.into_inner()).remove(&marker);
                        tracing::warn!(error = %e, "a budget alert could not be recorded; the next decision past it tries again");
                    }
                }
            });
        }
    }
}

impl Alerts {
    /// How long a marker and its alert live: past any month's end and the delivery's give-up.
    pub(crate) fn marker_ttl_ms(&self) -> u64 {
        (32 * 86_400_000u64).saturating_add(self.config.give_up_after.as_millis() as u64)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_hmac_of_timestamp_dot_body() {
        assert_eq!(signature("k", 7, b"{}"), format!("v1={}", hex(&hmac_sha256(b"k", &[b"7.", b"{}"]))));
    }

    #[test]
    fn thresholds_are_reached_in_integers() {
        let t = [50, 80, 100];
        assert_eq!(crossed(49, 100, &t), Vec::<u8>::new());
        assert_eq!(crossed(50, 100, &t), vec![50]);
        assert_eq!(crossed(799, 1000, &t), vec![50]);
        assert_eq!(crossed(800, 1000, &t), vec![50, 80]);
        assert_eq!(crossed(u64::MAX, u64::MAX, &t), vec![50, 80, 100]);
        assert_eq!(crossed(5, 0, &t), Vec::<u8>::new(), "no budget, no share");
    }

    #[test]
    fn an_alert_is_named_by_its_threshold_and_period_alone() {
        let u = BudgetUse { limit: "monthly", subject: "k.key_1", period: 202612, unit: "tokens", used: 81, budget: 100 };
        let a = Alert::new("acme", &u, 80, 1);
        let later = Alert::new("acme", &BudgetUse { used: 95, ..u.clone() }, 80, 2);
        assert_eq!(a.id, later.id, "the same crossing on another replica, later, is the same alert");
        assert_ne!(a.id, Alert::new("acme", &u, 50, 1).id);
        assert_ne!(a.id, Alert::new("acme", &BudgetUse { period: 202701, ..u.clone() }, 80, 1).id);
        assert_eq!(a.period, "2026-12");
        assert_eq!(period_text(20261205), "2026-12-05", "a daily budget's period");
        assert!(Alert::marker("acme", &u, 80).starts_with("{alerts}:fired:acme:"));
    }

    #[test]
    fn settings_are_checked_by_name() {
        let ok = AlertsConfig { webhooks: vec![WebhookConfig { tenant: "acme".into(), url: "https://hooks.example/a".into(), secret: "0123456789abcdef".into() }], ..AlertsConfig::default() };
        ok.validate().unwrap();
        let bad = |f: &dyn Fn(&mut AlertsConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(bad(&|c| c.thresholds = vec![0]).contains("alerts.thresholds"));
        assert!(bad(&|c| c.thresholds = vec![80, 80]).contains("alerts.thresholds"));
        assert!(bad(&|c| c.webhooks[0].url = "ftp://x".into()).contains("webhooks[0].url"));
        assert!(bad(&|c| c.webhooks[0].url = "https://a b".into()).contains("webhooks[0].url"));
        assert!(bad(&|c| c.webhooks[0].secret = "short".into()).contains("webhooks[0].secret"));
        assert!(bad(&|c| c.webhooks.push(c.webhooks[0].clone())).contains("one webhook per tenant"));
        assert!(bad(&|c| c.retry_base = Duration::ZERO).contains("alerts.retry_base"));
        let star = AlertsConfig { webhooks: vec![WebhookConfig { tenant: "*".into(), ..ok.webhooks[0].clone() }], ..AlertsConfig::default() };
        assert_eq!(star.webhook("beta").map(|w| w.tenant.as_str()), Some("*"));
        assert_eq!(ok.webhook("beta"), None);
    }
}
