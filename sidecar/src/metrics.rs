//! Metric names and the Prometheus recorder. Metrics go through the `metrics` facade; `/metrics`
//! renders them in Prometheus text format.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// Decisions, labelled `outcome` (allow | deny | unavailable) and `reason` (a deny code, or `ok`).
pub const DECISIONS: &str = "tollgate_sidecar_decisions_total";
/// Key-lookup cache results, labelled `result` (fresh | stale | miss).
pub const CACHE: &str = "tollgate_sidecar_key_cache_total";
/// Redis command latency in seconds, labelled `op`.
pub const REDIS_SECONDS: &str = "tollgate_sidecar_redis_seconds";
/// Redis command errors, labelled `op` and `kind` (transient | other).
pub const REDIS_ERRORS: &str = "tollgate_sidecar_redis_errors_total";
/// Limit checks Redis could not answer, labelled `mode` (open | closed | local: what was applied).
pub const LIMITS_FAILED: &str = "tollgate_sidecar_limits_unavailable_total";
/// Decisions of `local` limits by this sidecar while Redis could not answer, labelled `outcome`
/// (allowed | denied).
pub const LOCAL_DECISIONS: &str = "tollgate_sidecar_local_decisions_total";
/// The replica count `local` limits divide by (configured, else discovered in Redis).
pub const LOCAL_REPLICAS: &str = "tollgate_sidecar_local_replicas";
/// Requests a shadow limit would have denied, labelled `limit`.
pub const SHADOW_DENIALS: &str = "tollgate_sidecar_shadow_denials_total";
/// Completion reports settled, labelled `outcome` (reconciled | expired | duplicate).
pub const COMPLETIONS: &str = "tollgate_sidecar_completions_total";
/// Abandoned decisions the filter reported (issue 15.2), labelled `outcome`: refunded (what it
/// took was given back) | nothing (no record: denied, already refunded, expired) | completed
/// (served: nothing given back) | invalid (a malformed report or record) | unknown_key.
pub const REFUNDS: &str = "tollgate_sidecar_refunds_total";
/// Limits scripts that missed their deadline, refunded by the sidecar itself (decision 137),
/// labelled `outcome`: refunded (the script ran late; what it took was given back) | nothing (it
/// never ran) | completed | invalid | gave_up (Redis did not answer for 5 minutes) | dropped (more
/// than 2,000 waiting).
pub const LATE_REFUNDS: &str = "tollgate_sidecar_late_refunds_total";
/// Late refunds waiting now (at most 2,000): each waits for Redis to run or refuse its script.
pub const LATE_REFUNDS_PENDING: &str = "tollgate_sidecar_late_refunds_pending";
/// Redis connections replaced because a new one answered while the old one did not (a peer gone
/// without a reset; decision 140).
pub const REDIS_CONNECTIONS_REPLACED: &str = "tollgate_sidecar_redis_connections_replaced_total";
/// Stored configuration objects this sidecar does not use as stored (a row it cannot read, or
/// one that breaks a rule): each keeps its last good version or is left out (decision 206).
pub const CONFIG_UNUSABLE: &str = "tollgate_sidecar_config_unusable_objects";
/// Pub/sub connections of the configuration subscriber replaced because they stopped answering
/// its pings (decision 207).
pub const SUBSCRIBER_REPLACED: &str = "tollgate_sidecar_config_subscriber_replaced_total";
/// Tokens moved at reconciliation, labelled `direction` (refund | overrun).
pub const BUDGET_DELTA: &str = "tollgate_sidecar_budget_reconciled_tokens_total";
/// Lease asks answered, labelled `call` (request | renewal) and `result` (granted | none |
/// denied: a renewal for a key that is no longer allowed).
pub const LEASES: &str = "tollgate_sidecar_leases_total";
/// Units granted in leases (taken from the limits ahead of the requests that spend them).
pub const LEASE_UNITS: &str = "tollgate_sidecar_lease_units_total";
/// Token counts outside `0..=2^53` clamped at intake, labelled `source` (usage | completion |
/// estimate). An upstream (or a client's estimate) reported an impossible number.
pub const TOKENS_CLAMPED: &str = "tollgate_sidecar_tokens_clamped_total";
/// Audit lines written for revoked/expired key use.
pub const AUDITS: &str = "tollgate_sidecar_auth_failure_audits_total";

/// Calls to the filter-facing API refused for a missing or wrong filter secret, labelled `path`.
pub const UNAUTHORIZED: &str = "tollgate_sidecar_unauthorized_calls_total";
/// Connections the server cut, labelled `reason` (header_read_timeout | idle_timeout).
pub const CONNECTIONS_CUT: &str = "tollgate_sidecar_connections_cut_total";

/// Usage events, labelled `outcome`: spooled (durable, acknowledged to the filter) | invalid
/// (refused for good) | delivered (acknowledged by Kafka, alone or in an aggregate) | aggregated
/// (the part of delivered carried in aggregates) | duplicate (with aggregation on: an id accepted
/// lately, dropped at intake, or repeated within one segment's aggregated events) | refused (the
/// spool did not take them: full, an i/o error; the filter sends them again) | in_flight (with
/// aggregation on: a copy of a batch whose write is not answered yet, refused with 503) | lost (a
/// denial that could not be spooled) | torn (a crash's partial line skipped in the spool).
pub const USAGE_EVENTS: &str = "tollgate_sidecar_usage_events_total";
/// Aggregate messages (`tollgate.usage.aggregate.v1`) acknowledged by Kafka.
pub const USAGE_AGGREGATES: &str = "tollgate_sidecar_usage_aggregates_total";
/// Bytes waiting in the usage spool.
pub const USAGE_SPOOL_BYTES: &str = "tollgate_sidecar_usage_spool_bytes";
/// Failed delivery rounds (the segment stays spooled and is retried), labelled `kind` (queue_full | transient | unknown_topic | fatal).
pub const USAGE_KAFKA_ERRORS: &str = "tollgate_sidecar_usage_kafka_errors_total";
/// Batches the Redis usage meter missed (Redis unavailable).
pub const USAGE_METER_ERRORS: &str = "tollgate_sidecar_usage_meter_errors_total";

/// From a request's arrival at the filter to the end of its response, labelled `tenant`
/// (recorded by `telemetry`).
pub const DURATION: &str = "tollgate_request_duration_seconds";
/// How long the sidecar took to answer a decision call, labelled `outcome` (allow | deny).
pub const DECISION_SECONDS: &str = "tollgate_sidecar_decision_seconds";
/// Decision streams open now (a Wasm worker each, decision 223; crate::stream).
pub const DECISION_STREAMS: &str = "tollgate_sidecar_decision_streams";
/// Decision messages read on those streams, labelled `format` (compact | json; decision 224).
pub const STREAM_MESSAGES: &str = "tollgate_sidecar_stream_messages_total";
/// Decision calls (`POST /v1/decide`) read, labelled `format`: compact when the call accepts a
/// compact answer (decision 224), else json (errors are JSON either way).
pub const DECIDE_CALLS: &str = "tollgate_sidecar_decide_calls_total";

/// `n` within `0..=2^53`, counting a clamp under `source` in [`TOKENS_CLAMPED`].
pub fn clamp_tokens(n: u64, source: &'static str) -> u64 {
    let (n, clamped) = tollgate_wire::usage::clamp_tokens(n);
    if clamped {
        metrics::counter!(TOKENS_CLAMPED, "source" => source).increment(1);
    }
    n
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its handle (later calls reuse it, so
/// several sidecars in one test process share it).
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let buckets = [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 1.0];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(REDIS_SECONDS.to_string()), &buckets)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(DECISION_SECONDS.to_string()), &buckets))
                .and_then(|b| {
                    let request = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
                    b.set_buckets_for_metric(Matcher::Full(DURATION.to_string()), &request)
                })
                .map(|b| b.build_recorder())
                .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
            let handle = recorder.handle();
            // Fails only if another recorder is installed already; then ours just stays empty.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}
