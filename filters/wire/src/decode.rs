//! How a [`DecideResponse`] is read: in one pass over its fields, flat as they travel.
//!
//! serde's internally tagged enums (`#[serde(tag = "verdict")]`) buffer every field of the
//! object as generic content before they know the variant, then decode it a second time: an
//! allocation per key and value, ~2 µs natively for one 237-byte answer, and several times that
//! in the filter's Wasm, where every decision is read. The wire format is unchanged (the
//! enum's `Serialize` still writes it tagged). What is accepted is the same (the verdict's
//! fields, any field it does not know ignored, a missing required field an error) but for one
//! thing: the other verdict's fields are decoded too, so a field name has one type in both
//! verdicts (decision 146).

use crate::{responses, DecideResponse, Header, Lease, Ticket};
use serde::Deserialize;

/// Every field a decision may carry, of either verdict.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct DecideFlat {
    verdict: Verdict,
    tenant: Option<String>,
    key_id: Option<String>,
    plan: Option<String>,
    #[serde(default)]
    request_headers: Vec<Header>,
    #[serde(default)]
    response_headers: Vec<Header>,
    cache_for_ms: Option<u64>,
    ticket: Option<Ticket>,
    replay: Option<Box<responses::Replay>>,
    store: Option<Box<responses::StoreTicket>>,
    lease: Option<Lease>,
    #[serde(default)]
    no_lease: bool,
    model: Option<String>,
    status: Option<u16>,
    error: Option<String>,
    message: Option<String>,
    limit: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
enum Verdict {
    Allow,
    Deny,
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing field `{field}`"))
}

impl TryFrom<DecideFlat> for DecideResponse {
    type Error = String;

    fn try_from(f: DecideFlat) -> Result<DecideResponse, String> {
        Ok(match f.verdict {
            Verdict::Allow => DecideResponse::Allow {
                tenant: required(f.tenant, "tenant")?,
                key_id: required(f.key_id, "keyId")?,
                plan: required(f.plan, "plan")?,
                request_headers: f.request_headers,
                response_headers: f.response_headers,
                cache_for_ms: f.cache_for_ms,
                ticket: f.ticket,
                replay: f.replay,
                store: f.store,
                lease: f.lease,
                no_lease: f.no_lease,
                model: f.model,
            },
            Verdict::Deny => DecideResponse::Deny {
                status: required(f.status, "status")?,
                error: required(f.error, "error")?,
                message: required(f.message, "message")?,
                limit: f.limit,
                response_headers: f.response_headers,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{DecideResponse, Header, Lease, Ticket};

    fn read(json: &str) -> Result<DecideResponse, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    fn round_trip(d: &DecideResponse) -> DecideResponse {
        serde_json::from_slice(&serde_json::to_vec(d).expect("encode")).expect("decode")
    }

    #[test]
    fn every_field_of_either_verdict_reads_back() {
        let allow = DecideResponse::Allow {
            tenant: "t".into(),
            key_id: "k".into(),
            plan: "p".into(),
            request_headers: vec![Header::new("x-a", "1")],
            response_headers: vec![Header::new("ratelimit", "limit=5")],
            cache_for_ms: Some(250),
            ticket: Some(serde_json::from_str::<Ticket>(r#"{"tenant":"t","requestId":"r","expiresAtMs":5}"#).unwrap()),
            replay: None,
            store: None,
            lease: Some(Lease { units: 7, ttl_ms: 900, response_headers: vec![Header::new("ratelimit-policy", "5;w=60")] }),
            no_lease: true,
            model: Some("gpt-4o-mini".into()),
        };
        assert_eq!(round_trip(&allow), allow);
        let deny = DecideResponse::Deny {
            status: 429,
            error: "rate_limited".into(),
            message: "slow down".into(),
            limit: Some("per-minute".into()),
            response_headers: vec![Header::new("retry-after", "3")],
        };
        assert_eq!(round_trip(&deny), deny);
        assert_eq!(round_trip(&DecideResponse::allow("t", "k", "p")), DecideResponse::allow("t", "k", "p"));
    }

    #[test]
    fn unknown_fields_and_the_other_verdicts_fields_are_ignored() {
        let d = read(r#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p","later":{"x":[1]},"limit":"l"}"#).unwrap();
        assert_eq!(d, DecideResponse::allow("t", "k", "p"));
        let d = read(r#"{"tenant":"t","status":403,"error":"e","message":"m","verdict":"deny"}"#).unwrap();
        assert!(matches!(d, DecideResponse::Deny { status: 403, .. }), "{d:?}");
    }

    #[test]
    fn a_field_name_has_one_type_in_both_verdicts() {
        // the one difference from serde's buffered decode, which ignored the other verdict's
        // fields whatever they held (decision 146)
        assert!(read(r#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p","status":"x"}"#).is_err());
        assert!(read(r#"{"verdict":"deny","status":429,"error":"e","message":"m","requestHeaders":null}"#).is_err());
    }

    #[test]
    fn a_missing_field_or_verdict_is_an_error_naming_it() {
        let e = read(r#"{"verdict":"allow","tenant":"t","plan":"p"}"#).unwrap_err();
        assert!(e.contains("keyId"), "{e}");
        let e = read(r#"{"verdict":"deny","status":429,"error":"e"}"#).unwrap_err();
        assert!(e.contains("message"), "{e}");
        assert!(read(r#"{"tenant":"t","keyId":"k","plan":"p"}"#).unwrap_err().contains("verdict"));
        assert!(read(r#"{"verdict":"maybe","tenant":"t","keyId":"k","plan":"p"}"#).is_err());
        assert!(read(r#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p","tenant":"u"}"#).is_err(), "a field twice");
    }
}
