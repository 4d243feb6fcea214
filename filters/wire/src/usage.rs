//! Usage events (issue 6): one [`UsageEvent`] per request of a known tenant, the unit of billing.
//!
//! Path of an event: the filter records every request it let through with an identity (allowed by
//! the sidecar or by the filter's auth cache) when the request ends, queues it per worker and
//! sends [`UsageBatch`]es to `POST /v1/usage`; the sidecar also writes one for every request it
//! denies with a known tenant (429, 401 revoked/expired, 503 limits). The sidecar appends them to
//! its durable spool before answering, then ships them to Kafka (`usage_events`, keyed by tenant);
//! the billing consumer rolls them up per day in PostgreSQL.
//!
//! Invariants:
//! - `id` is unique per request and made by the gateway (never taken from a client header), so
//!   every hop may deliver an event more than once (retries are how nothing is lost) and the
//!   billing consumer counts each id once.
//! - The same JSON is the filter→sidecar body and the Kafka message value: readers ignore unknown
//!   fields, new fields are optional.
//! - No secret: an event names the key by its id, never its hash or value; `path` carries no query
//!   string (where an API key may have been).

use serde::{Deserialize, Serialize};

/// Path of the usage endpoint on the sidecar.
pub const USAGE_PATH: &str = "/v1/usage";

/// Longest `path` kept in an event (longer ones are cut at a character boundary).
pub const MAX_PATH: usize = 256;

/// Longest `authority` kept in an event (a longer Host is cut at a character boundary, never
/// refused: a client must not escape billing by choosing a long Host).
pub const MAX_AUTHORITY: usize = 255;

/// Longest `method` in an event (ASCII letters only; anything else is metered as `OTHER`).
pub const MAX_METHOD: usize = 16;

/// The largest token count an event, a completion or a meter takes: 2^53 (exact in a double, so
/// in Lua, JSON readers and PostgreSQL `float8` alike; 1023 of them still fit an `i64`). An
/// upstream's number outside `0..=MAX_TOKENS` is clamped to the nearest end.
pub const MAX_TOKENS: u64 = 1 << 53;

/// `n` within `0..=MAX_TOKENS`, and whether it had to be clamped.
pub fn clamp_tokens(n: u64) -> (u64, bool) {
    if n > MAX_TOKENS {
        (MAX_TOKENS, true)
    } else {
        (n, false)
    }
}

/// One request of a known tenant. `Default` (every field empty) is for fixtures that set only
/// what they test.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageEvent {
    /// Unique per request, made by the gateway: the billing consumer's deduplication key.
    pub id: String,
    pub tenant: String,
    pub key_id: String,
    pub plan: String,
    pub method: String,
    pub authority: String,
    /// The request path without its query string, at most [`MAX_PATH`] bytes.
    pub path: String,
    /// The status the client got; 0 when the client went away before a response.
    pub status: u16,
    /// When the request arrived (ms since the Unix epoch, the gateway's clock). Its UTC day is the
    /// day the request is billed on.
    pub start_ms: u64,
    /// From arrival to the end of the response (or of the stream).
    #[serde(default)]
    pub duration_ms: u64,
    /// Tokens used (`usage.total_tokens` of an LLM response), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// The response was to be read for its token usage and could not be (a JSON document over
    /// the filter's bound, a stream the client left before its end, a chunk Envoy would not
    /// give): `tokens` is absent for that reason, not because the upstream reported none
    /// (decision 183). A token budget was charged its reservation for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tokens_unread: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_bytes: Option<u64>,
    /// The gateway's own refusal (a deny code such as `rate_limited`); absent when the request
    /// went to the upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied: Option<String>,
    /// The route the request took (routing on), and its API product.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// An LLM call's models and tokens apart (event schema v2, issue 42): on routes marked
    /// `llm`, when anything of it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<crate::llm::LlmUsage>,
}

/// The body of `POST /v1/usage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageBatch {
    pub events: Vec<UsageEvent>,
}

/// The sidecar's answer to a usage batch it took: `accepted` events are durable (spooled),
/// `invalid` ones were refused for good (retrying cannot fix them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageAck {
    pub accepted: u64,
    pub invalid: u64,
}

crate::named_enum! {
    /// How an event counts in the rollups. Its name is the counter's in the Redis meter and
    /// (prefixed `requests_`) in `usage_daily`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum UsageClass {
        /// Answered by the upstream below 400.
        Ok => "ok",
        /// Answered by the upstream (or Envoy) with 4xx.
        ClientError => "4xx",
        /// 5xx.
        ServerError => "5xx",
        /// Refused by the gateway itself (limits, revoked key …): not sent upstream.
        Denied => "denied",
        /// The client went away before any response.
        Aborted => "aborted",
    }
}

impl UsageEvent {
    pub fn class(&self) -> UsageClass {
        if self.denied.is_some() {
            return UsageClass::Denied;
        }
        match self.status {
            0 => UsageClass::Aborted,
            1..=399 => UsageClass::Ok,
            400..=499 => UsageClass::ClientError,
            _ => UsageClass::ServerError,
        }
    }

    /// The UTC day the event is billed on.
    pub fn day(&self) -> Day {
        Day::of_ms(self.start_ms)
    }
}

/// A UTC calendar day.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Day {
    pub year: i32,
    pub month: u32,
    pub day: u32,
}

impl Day {
    pub fn of_ms(ms: u64) -> Day {
        // Howard Hinnant's civil_from_days (proleptic Gregorian).
        let z = (ms / 86_400_000) as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
        Day { year, month, day }
    }
    /// Days from 1970-01-01 to this day (negative before; Howard Hinnant's days_from_civil). The
    /// day need not exist: 1 March less one day is the last of February.
    pub fn days_since_epoch(self) -> i64 {
        let y = i64::from(self.year) - i64::from(self.month <= 2);
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let m = i64::from(self.month);
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(self.day) - 1;
        era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
    }
    /// The first day of the next month.
    pub fn next_month(self) -> Day {
        let (year, month) = if self.month >= 12 { (self.year + 1, 1) } else { (self.year, self.month + 1) };
        Day { year, month, day: 1 }
    }
    /// `yyyyMMdd`, as in Redis meter keys.
    pub fn compact(self) -> String {
        format!("{:04}{:02}{:02}", self.year, self.month, self.day)
    }
    /// `yyyy-MM-dd`, as PostgreSQL reads a date.
    pub fn iso(self) -> String {
        format!("{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }
}

/// `path` without its query string, cut to at most [`MAX_PATH`] bytes.
pub fn event_path(path: &str) -> String {
    let p = path.split(['?', '#']).next().unwrap_or("");
    let mut end = p.len().min(MAX_PATH);
    while !p.is_char_boundary(end) {
        end -= 1;
    }
    p[..end].to_string()
}

/// `text` cut to at most `max` bytes at a character boundary, without ASCII control characters
/// (the schema refuses them; Envoy lets a tab through in a header value).
pub fn bounded_text(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars().filter(|c| !c.is_ascii_control()) {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

/// The `authority` of an event: the Host as sent, bounded ([`MAX_AUTHORITY`], no control
/// characters).
pub fn event_authority(authority: &str) -> String {
    bounded_text(authority, MAX_AUTHORITY)
}

/// The `method` of an event: the request's method when it is 1-16 ASCII letters (every method
/// of RFC 9110 and WebDAV), else `OTHER` (an extension method with other token characters, or
/// longer: the request is still metered).
pub fn event_method(method: &str) -> String {
    if !method.is_empty() && method.len() <= MAX_METHOD && method.bytes().all(|b| b.is_ascii_alphabetic()) {
        method.to_string()
    } else {
        "OTHER".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_chosen_fields_are_bounded_never_refused() {
        let host = "h".repeat(300);
        assert_eq!(event_authority(&host).len(), MAX_AUTHORITY);
        let wide = "é".repeat(200); // 400 bytes of 2-byte characters
        let a = event_authority(&wide);
        assert!(a.len() <= MAX_AUTHORITY && a.len() == 254 && a.chars().all(|c| c == 'é'));
        assert_eq!(event_authority("api.test\tx"), "api.testx");
        assert_eq!(event_authority("api.test:8080"), "api.test:8080");
        assert_eq!(event_method("PROPFIND"), "PROPFIND");
        assert_eq!(event_method("M-SEARCH"), "OTHER");
        assert_eq!(event_method(&"A".repeat(17)), "OTHER");
        assert_eq!(event_method(""), "OTHER");
    }

    #[test]
    fn token_counts_are_clamped_to_2_pow_53() {
        assert_eq!(clamp_tokens(0), (0, false));
        assert_eq!(clamp_tokens(MAX_TOKENS), (MAX_TOKENS, false));
        assert_eq!(clamp_tokens(MAX_TOKENS + 1), (MAX_TOKENS, true));
        assert_eq!(clamp_tokens(u64::MAX), (MAX_TOKENS, true));
        assert!(i64::try_from(MAX_TOKENS * 1023).is_ok());
    }

    fn event() -> UsageEvent {
        UsageEvent {
            id: "0123456789abcdef0000000000000001".into(),
            tenant: "acme".into(),
            key_id: "key_1".into(),
            plan: "gold".into(),
            method: "POST".into(),
            authority: "api.test".into(),
            path: "/v1/chat".into(),
            status: 200,
            start_ms: 1_764_460_800_000,
            duration_ms: 12,
            tokens: Some(42),
            tokens_unread: false,
            request_bytes: None,
            response_bytes: Some(300),
            denied: None,
            route: None,
            product: None,
            llm: None,
        }
    }

    #[test]
    fn unread_tokens_are_said_only_when_so() {
        let unread = UsageEvent { tokens: None, tokens_unread: true, ..event() };
        let s = serde_json::to_string(&unread).unwrap();
        assert!(s.contains(r#""tokensUnread":true"#), "{s}");
        assert_eq!(serde_json::from_str::<UsageEvent>(&s).unwrap(), unread);
        // absent: read (an event of an older gateway, too)
        assert!(!serde_json::to_string(&event()).unwrap().contains("tokensUnread"));
    }

    #[test]
    fn json_is_camel_case_and_tolerant() {
        let s = serde_json::to_string(&event()).unwrap();
        assert_eq!(
            s,
            r#"{"id":"0123456789abcdef0000000000000001","tenant":"acme","keyId":"key_1","plan":"gold","method":"POST","authority":"api.test","path":"/v1/chat","status":200,"startMs":1764460800000,"durationMs":12,"tokens":42,"responseBytes":300}"#
        );
        let with_more = s.replace("\"status\"", "\"later\":[1],\"status\"");
        assert_eq!(serde_json::from_str::<UsageEvent>(&with_more).unwrap(), event());
    }

    #[test]
    fn classes() {
        let mut e = event();
        assert_eq!(e.class(), UsageClass::Ok);
        e.status = 304;
        assert_eq!(e.class(), UsageClass::Ok);
        e.status = 404;
        assert_eq!(e.class(), UsageClass::ClientError);
        e.status = 503;
        assert_eq!(e.class(), UsageClass::ServerError);
        e.status = 0;
        assert_eq!(e.class(), UsageClass::Aborted);
        e.status = 429;
        e.denied = Some("rate_limited".into());
        assert_eq!(e.class(), UsageClass::Denied);
    }

    #[test]
    fn days_are_utc() {
        assert_eq!(Day::of_ms(0).iso(), "1970-01-01");
        assert_eq!(Day::of_ms(1_764_460_800_000).compact(), "20251130"); // 2025-11-30T00:00:00Z
        assert_eq!(Day::of_ms(1_764_460_799_999).iso(), "2025-11-29");
        assert_eq!(Day::of_ms(951_782_400_000).iso(), "2000-02-29");
        assert_eq!(Day::of_ms(1_767_225_600_000).iso(), "2026-01-01");
    }

    #[test]
    fn days_since_epoch_inverts_of_ms() {
        // 1970 to 2399: leap years, leap and common centuries
        for d in 0..157_000u64 {
            assert_eq!(Day::of_ms(d * 86_400_000).days_since_epoch(), d as i64);
        }
        assert_eq!(Day { year: 1969, month: 12, day: 31 }.days_since_epoch(), -1);
        assert_eq!(Day { year: 2000, month: 3, day: 1 }.days_since_epoch() - 1, Day { year: 2000, month: 2, day: 29 }.days_since_epoch());
        assert_eq!(Day { year: 2025, month: 12, day: 9 }.next_month(), Day { year: 2026, month: 1, day: 1 });
        assert_eq!(Day { year: 2026, month: 2, day: 28 }.next_month().days_since_epoch() * 86_400_000, 1_772_323_200_000);
    }

    #[test]
    fn paths_lose_their_query_and_are_bounded() {
        assert_eq!(event_path("/v1/chat?api_key=x&y=1"), "/v1/chat");
        assert_eq!(event_path("/a#frag"), "/a");
        let long = format!("/{}", "é".repeat(300));
        let p = event_path(&long);
        assert!(p.len() <= MAX_PATH && p.starts_with("/é"));
    }
}
