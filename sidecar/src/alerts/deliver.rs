//! Delivering budget alerts to webhooks (issue 42 item 5): every replica runs this loop; each
//! alert is taken by one at a time (`alert_claim.lua`), posted, and settled — delivered, due
//! again after its backoff, or given up after `give_up_after` — with each step in the tenant's
//! delivery log. At least once per alert: a replica that dies after posting and before settling
//! leaves the alert to be posted again with the same `x-tollgate-alert-id`.

use super::{signature, Alerts, DELIVERIES, PENDING};
use crate::scripts::alert_claim::claim;
use crate::scripts::alert_fire::{alert_key, log_entry, log_key, DUE};
use crate::store::StoreError;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often the loop looks for due alerts.
const POLL: Duration = Duration::from_millis(250);
/// Alerts taken per round.
const BATCH: usize = 10;

/// The wait before attempt `attempts + 1`: `base` doubled per attempt made, at most `max`.
pub fn backoff(base: Duration, max: Duration, attempts: u32) -> Duration {
    base.saturating_mul(1u32 << attempts.min(20)).min(max)
}

/// What became of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    Delivered(u16),
    Failed(String),
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Runs until `stop`.
pub async fn run(alerts: Arc<Alerts>, stop: CancellationToken) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(alerts.config.timeout))
        .max_redirects(0)
        .build()
        .into();
    let mut counted = Instant::now() - Duration::from_secs(60);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = stop.cancelled() => return,
        }
        if counted.elapsed() >= Duration::from_secs(5) {
            counted = Instant::now();
            let store = alerts.store();
            if let Ok(n) = store.run_with_deadline("alert_pending", Duration::from_secs(2), |mut c| async move { redis::cmd("ZCARD").arg(DUE).query_async::<u64>(&mut c).await }).await {
                metrics::gauge!(PENDING).set(n as f64);
            }
        }
        if let Err(e) = round(&alerts, &agent).await {
            tracing::debug!(error = %e, "alert delivery: redis could not answer; trying again");
        }
    }
}

async fn round(alerts: &Arc<Alerts>, agent: &ureq::Agent) -> Result<(), StoreError> {
    let store = alerts.store();
    let now = now_ms();
    // held for a whole attempt and its settling, with room to spare
    let hold_ms = alerts.config.timeout.as_millis() as u64 * 2 + 10_000;
    for id in claim(store, now, now + hold_ms, BATCH).await? {
        let key = alert_key(&id);
        let k = key.clone();
        let fields: HashMap<String, String> =
            store.run_with_deadline("alert_read", Duration::from_secs(2), |mut c| async move { redis::cmd("HGETALL").arg(&k).query_async(&mut c).await }).await?;
        let (Some(body), Some(tenant)) = (fields.get("alert"), fields.get("tenant")) else {
            // expired (past its period and give-up time): nothing to deliver
            settle(alerts, &id, None, Settle::Drop).await?;
            continue;
        };
        let attempts: u32 = fields.get("attempts").and_then(|a| a.parse().ok()).unwrap_or(0);
        let created: u64 = fields.get("created_ms").and_then(|a| a.parse().ok()).unwrap_or(now);
        let Some(hook) = alerts.config.webhook(tenant).cloned() else {
            metrics::counter!(DELIVERIES, "outcome" => "no_webhook").increment(1);
            settle(alerts, &id, Some(tenant), Settle::NoWebhook).await?;
            continue;
        };
        let (agent, body) = (agent.clone(), body.clone());
        let attempt = tokio::task::spawn_blocking(move || post(&agent, &hook.url, &hook.secret, &id_header(&body), body.as_bytes()))
            .await
            .unwrap_or_else(|e| Attempt::Failed(format!("delivery task: {e}")));
        let attempts = attempts + 1;
        let outcome = match attempt {
            Attempt::Delivered(status) => Settle::Delivered { attempts, status },
            Attempt::Failed(why) if now_ms().saturating_sub(created) >= alerts.config.give_up_after.as_millis() as u64 => Settle::GaveUp { attempts, why },
            Attempt::Failed(why) => {
                let wait = backoff(alerts.config.retry_base, alerts.config.retry_max, attempts - 1);
                Settle::Retry { attempts, why, at_ms: now_ms() + wait.as_millis() as u64 }
            }
        };
        metrics::counter!(DELIVERIES, "outcome" => outcome.label()).increment(1);
        settle(alerts, &id, Some(tenant), outcome).await?;
    }
    Ok(())
}

/// The alert id inside a stored body (the header that lets a receiver drop a second delivery).
fn id_header(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body).ok().and_then(|v| v["id"].as_str().map(str::to_string)).unwrap_or_default()
}

/// Posts `body` signed; any 2xx is delivered (a redirect is not followed: a failure).
pub fn post(agent: &ureq::Agent, url: &str, secret: &str, id: &str, body: &[u8]) -> Attempt {
    let ts = now_ms() / 1000;
    let sent = agent
        .post(url)
        .header("content-type", "application/json")
        .header("user-agent", "tollgate-alerts/1")
        .header("x-tollgate-alert-id", id)
        .header("x-tollgate-timestamp", ts.to_string())
        .header("x-tollgate-signature", signature(secret, ts, body))
        .send(body);
    match sent {
        Ok(r) if r.status().is_success() => Attempt::Delivered(r.status().as_u16()),
        Ok(r) => Attempt::Failed(format!("status {}", r.status().as_u16())),
        Err(e) => Attempt::Failed(e.to_string()),
    }
}

enum Settle {
    Delivered { attempts: u32, status: u16 },
    Retry { attempts: u32, why: String, at_ms: u64 },
    GaveUp { attempts: u32, why: String },
    NoWebhook,
    Drop,
}

impl Settle {
    fn label(&self) -> &'static str {
        match self {
            Settle::Delivered { .. } => "delivered",
            Settle::Retry { .. } => "retry",
            Settle::GaveUp { .. } => "failed",
            Settle::NoWebhook => "no_webhook",
            Settle::Drop => "expired",
        }
    }
}

/// Records what became of an attempt, in one MULTI: the due set, the alert, the tenant's log.
async fn settle(alerts: &Arc<Alerts>, id: &str, tenant: Option<&str>, s: Settle) -> Result<(), StoreError> {
    let now = now_ms();
    let ttl_ms = alerts.marker_ttl_ms() as i64;
    let mut p = redis::pipe();
    p.atomic();
    let key = alert_key(id);
    let (event, detail) = match &s {
        Settle::Delivered { attempts, status } => {
            p.zrem(DUE, id).hset_multiple(&key, &[("status", "delivered".to_string()), ("attempts", attempts.to_string()), ("delivered_ms", now.to_string())]);
            ("delivered", format!("attempt {attempts}: status {status}"))
        }
        Settle::Retry { attempts, why, at_ms } => {
            p.zadd(DUE, id, *at_ms).hset_multiple(&key, &[("attempts", attempts.to_string()), ("last_error", why.clone())]);
            ("retry", format!("attempt {attempts}: {why}; next at {at_ms}"))
        }
        Settle::GaveUp { attempts, why } => {
            p.zrem(DUE, id).hset_multiple(&key, &[("status", "failed".to_string()), ("attempts", attempts.to_string()), ("last_error", why.clone())]);
            ("failed", format!("gave up after {attempts} attempts: {why}"))
        }
        Settle::NoWebhook => {
            p.zrem(DUE, id).hset(&key, "status", "no_webhook");
            ("no_webhook", "no webhook configured for the tenant".to_string())
        }
        Settle::Drop => {
            p.zrem(DUE, id);
            ("expired", String::new())
        }
    };
    if let Some(t) = tenant {
        let log = log_key(t);
        p.lpush(&log, log_entry(id, event, now, Some(&detail))).ltrim(&log, 0, super::LOG_MAX as isize - 1);
        p.pexpire(&log, ttl_ms);
    }
    // every key keeps a TTL, even one that expired and was written again meanwhile
    if !matches!(s, Settle::Drop) {
        p.pexpire(&key, ttl_ms);
    }
    p.pexpire(DUE, ttl_ms);
    alerts.store().run_with_deadline("alert_settle", Duration::from_secs(2), |mut c| async move { p.query_async::<()>(&mut c).await }).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_its_base_up_to_its_bound() {
        let (b, m) = (Duration::from_secs(1), Duration::from_secs(600));
        assert_eq!(backoff(b, m, 0), Duration::from_secs(1));
        assert_eq!(backoff(b, m, 3), Duration::from_secs(8));
        assert_eq!(backoff(b, m, 10), m);
        assert_eq!(backoff(b, m, u32::MAX), m, "never overflows");
    }

    #[test]
    fn the_idempotency_id_is_read_from_the_body() {
        assert_eq!(id_header(r#"{"id":"alert_1","type":"budget.threshold"}"#), "alert_1");
        assert_eq!(id_header("not json"), "");
    }
}
