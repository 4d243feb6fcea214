//! Usage as CloudEvents (issue 42 item 6): the form metering systems ingest (OpenMeter's:
//! CloudEvents 1.0, JSON, structured mode). Pure mapping, no I/O: the outbox
//! ([`crate::outbox`]) sends these to a Kafka topic, [`crate::export`] writes them to a monthly
//! file. docs/usage-events.md, "CloudEvents export", is the contract.
//!
//! - `id`: the usage event's id (an aggregate's id): a consumer that deduplicates by
//!   `(source, id)`, as OpenMeter does, counts a re-sent event once.
//! - `source`: the deployment's configured `export.source` (a URI reference, `tollgate` by default).
//! - `type`: `tollgate.request` for a request, `tollgate.llm.call` for a request on an LLM route
//!   (its event has LLM facts), `tollgate.requests` for an aggregate of a high-rate tenant's second.
//! - `subject`: the tenant. `time`: when the request arrived (RFC 3339, UTC, milliseconds).
//! - `data`: the facts, camelCase; money as integer micro-units with the currency beside it.

use serde_json::{json, Map, Value};
use tollgate_shared::aggregate::UsageAggregate;
use tollgate_wire::usage::{Day, UsageEvent};

/// The CloudEvents version every event names.
pub const SPEC_VERSION: &str = "1.0";
/// The content type of a structured-mode CloudEvent (Kafka header `content-type`).
pub const CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";
pub const TYPE_REQUEST: &str = "tollgate.request";
pub const TYPE_LLM_CALL: &str = "tollgate.llm.call";
pub const TYPE_AGGREGATE: &str = "tollgate.requests";

/// Who the events come from and in which currency their costs are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub source: String,
    pub currency: String,
}

/// Why an export setting cannot be used.
pub fn invalid_source(source: &str) -> Option<&'static str> {
    if source.is_empty() || source.len() > 256 {
        return Some("1 to 256 characters");
    }
    // a URI reference: no spaces, controls, or characters RFC 3986 never allows unescaped
    if !source.bytes().all(|b| b.is_ascii_graphic() && !b"\"<>\\^`{|}".contains(&b)) {
        return Some("a URI reference (RFC 3986): no spaces, controls, quotes or <>\\^`{|}");
    }
    None
}

/// `ms` since the Unix epoch as RFC 3339 UTC with milliseconds (`2025-11-30T00:00:01.000Z`).
pub fn rfc3339_ms(ms: u64) -> String {
    let day = Day::of_ms(ms);
    let in_day = ms % 86_400_000;
    let (h, m, s, milli) = (in_day / 3_600_000, in_day / 60_000 % 60, in_day / 1000 % 60, in_day % 1000);
    format!("{:04}-{:02}-{:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z", day.year, day.month, day.day)
}

fn put<T: Into<Value>>(data: &mut Map<String, Value>, name: &str, value: Option<T>) {
    if let Some(v) = value {
        data.insert(name.into(), v.into());
    }
}

/// The CloudEvent of one usage event.
pub fn of_event(origin: &Origin, e: &UsageEvent) -> Value {
    let mut data = Map::new();
    data.insert("keyId".into(), e.key_id.clone().into());
    data.insert("plan".into(), e.plan.clone().into());
    data.insert("method".into(), e.method.clone().into());
    data.insert("authority".into(), e.authority.clone().into());
    data.insert("path".into(), e.path.clone().into());
    data.insert("status".into(), e.status.into());
    data.insert("class".into(), e.class().name().into());
    data.insert("durationMs".into(), e.duration_ms.into());
    put(&mut data, "denied", e.denied.clone());
    put(&mut data, "route", e.route.clone());
    put(&mut data, "product", e.product.clone());
    put(&mut data, "tokens", e.tokens);
    if e.tokens_unread {
        data.insert("tokensUnread".into(), true.into());
    }
    put(&mut data, "requestBytes", e.request_bytes);
    put(&mut data, "responseBytes", e.response_bytes);
    let kind = match &e.llm {
        Some(llm) => {
            put(&mut data, "model", llm.billed_model().map(str::to_string));
            put(&mut data, "requestedModel", llm.requested_model.clone());
            put(&mut data, "inputTokens", llm.input_tokens);
            put(&mut data, "outputTokens", llm.output_tokens);
            put(&mut data, "cachedTokens", llm.cached_tokens);
            if let Some(cost) = llm.cost_micros {
                data.insert("costMicros".into(), cost.into());
                data.insert("currency".into(), origin.currency.clone().into());
            }
            TYPE_LLM_CALL
        }
        None => TYPE_REQUEST,
    };
    envelope(origin, &e.id, kind, &e.tenant, e.start_ms, Value::Object(data))
}

/// The CloudEvent of one aggregate (the requests of a high-rate tenant's second, per key).
pub fn of_aggregate(origin: &Origin, a: &UsageAggregate) -> Value {
    let keys = serde_json::to_value(&a.keys).unwrap_or(Value::Array(Vec::new()));
    envelope(origin, &a.id, TYPE_AGGREGATE, &a.tenant, a.second_ms, json!({ "requests": a.count, "keys": keys }))
}

fn envelope(origin: &Origin, id: &str, kind: &str, tenant: &str, at_ms: u64, data: Value) -> Value {
    json!({
        "specversion": SPEC_VERSION,
        "id": id,
        "source": origin.source,
        "type": kind,
        "subject": tenant,
        "time": rfc3339_ms(at_ms),
        "datacontenttype": "application/json",
        "data": data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_wire::llm::LlmUsage;

    fn origin() -> Origin {
        Origin { source: "tollgate/eu-1".into(), currency: "EUR".into() }
    }

    fn event() -> UsageEvent {
        serde_json::from_value(json!({
            "id": "ev-1", "tenant": "acme", "keyId": "k1", "plan": "gold", "method": "POST",
            "authority": "api.test", "path": "/v1/chat", "status": 200, "startMs": 1_764_460_801_234u64,
            "durationMs": 12, "tokens": 30
        }))
        .unwrap()
    }

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_764_460_801_234), "2025-11-30T00:00:01.234Z");
        assert_eq!(rfc3339_ms(1_709_251_199_999), "2024-02-29T23:59:59.999Z");
    }

    #[test]
    fn a_request_is_a_cloudevent_named_by_its_event_id_with_the_tenant_as_subject() {
        let ce = of_event(&origin(), &event());
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!((ce["id"].as_str(), ce["type"].as_str(), ce["subject"].as_str()), (Some("ev-1"), Some(TYPE_REQUEST), Some("acme")));
        assert_eq!(ce["source"], "tollgate/eu-1");
        assert_eq!(ce["time"], "2025-11-30T00:00:01.234Z");
        assert_eq!(ce["data"]["keyId"], "k1");
        assert_eq!(ce["data"]["class"], "ok");
        assert_eq!(ce["data"]["tokens"], 30);
        assert!(ce["data"].get("costMicros").is_none() && ce["data"].get("model").is_none());
    }

    #[test]
    fn an_llm_call_carries_models_tokens_apart_and_its_cost_with_the_currency() {
        let mut e = event();
        e.llm = Some(LlmUsage {
            requested_model: Some("fast".into()),
            model: Some("gpt-4o-mini-2024-07-18".into()),
            input_tokens: Some(20),
            output_tokens: Some(10),
            cached_tokens: Some(5),
            cost_micros: Some(1234),
        });
        let ce = of_event(&origin(), &e);
        assert_eq!(ce["type"], TYPE_LLM_CALL);
        let d = &ce["data"];
        assert_eq!((d["model"].as_str(), d["requestedModel"].as_str()), (Some("gpt-4o-mini-2024-07-18"), Some("fast")));
        assert_eq!((d["inputTokens"].as_u64(), d["outputTokens"].as_u64(), d["cachedTokens"].as_u64()), (Some(20), Some(10), Some(5)));
        assert_eq!((d["costMicros"].as_u64(), d["currency"].as_str()), (Some(1234), Some("EUR")));
        // unpriced: no cost and no currency, never a zero cost
        e.llm.as_mut().unwrap().cost_micros = None;
        let d = of_event(&origin(), &e)["data"].clone();
        assert!(d.get("costMicros").is_none() && d.get("currency").is_none());
    }

    #[test]
    fn sources_must_be_uri_references() {
        assert_eq!(invalid_source("tollgate"), None);
        assert_eq!(invalid_source("https://gw.example/eu-1"), None);
        assert!(invalid_source("").is_some());
        assert!(invalid_source("has space").is_some());
        assert!(invalid_source("a\u{7f}b").is_some());
        assert!(invalid_source("{x}").is_some());
        assert!(invalid_source(&"a".repeat(257)).is_some());
    }
}
