//! Stored responses (issue 7): the tenant-scoped exact-match response cache and Idempotency-Key
//! replay.
//!
//! Both ride on the one decision call. The filter sends what identifies the response it would
//! reuse — [`DecideRequest::cache_key`](crate::DecideRequest) (a hash of the request, for a route
//! with a cache TTL) or [`DecideRequest::idempotency`](crate::DecideRequest) (the client's
//! `Idempotency-Key` and a digest of the operation) — and the sidecar looks it up inside the same
//! Redis script as the limits. The answer either carries a [`Replay`] (the filter answers locally,
//! the upstream is not called) or a [`StoreTicket`]: the filter may send the response back, once it
//! is complete, in a batched `POST /v1/responses` ([`StoreBatch`]) — never a call per request,
//! never on the request path.
//!
//! Invariants: a ticket is opaque to the filter (the sidecar validates every field again, and the
//! TTL comes from the sidecar's own route configuration); a stored response never holds the API
//! key (the filter stripped it before the upstream saw the request) nor hop-by-hop headers.

use serde::{Deserialize, Serialize};

use crate::Header;

/// Path of the batched store endpoint on the sidecar.
pub const RESPONSES_PATH: &str = "/v1/responses";
/// Path of the batched claim-keeping endpoint ([`ClaimRenewal`], decision 186).
pub const CLAIMS_PATH: &str = "/v1/responses/claims";
/// Claims per [`ClaimRenewal`] at most (a larger batch is refused with 400).
pub const MAX_CLAIM_BATCH: usize = 500;

/// Response header on responses of a route with a cache TTL: `hit`, `miss` or `bypass` (the request
/// was not looked up: `Cache-Control: no-store`, an oversized body, a method that is not cached…).
pub const CACHE_STATUS_HEADER: &str = "x-tollgate-cache";
/// Response header on an idempotent replay (the stored response of an earlier request).
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Response header (`true`) on an idempotent replay of an outcome kept without its body: too
/// large to keep (decision 49) or past the tenant's bound of stored bytes (decision 185). The
/// status and headers are the first answer's; its body is not there to give again.
pub const REPLAY_TRUNCATED_HEADER: &str = "x-tollgate-replay-truncated";
/// The request header carrying the idempotency key (IETF httpapi Idempotency-Key draft).
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Largest stored body the sidecar accepts (bytes of the body, before JSON escaping).
pub const MAX_STORED_BODY: usize = 1 << 20;

/// How long the sidecar may take to store one idempotency outcome (its Redis deadline for
/// `idem_complete.lua`), and so how long the filter holds the end of that answer for it: one
/// deadline on both sides, so an outcome the sidecar is still storing is never given up early
/// (given up, it rides the next batch and a retry meanwhile gets 409).
pub const OUTCOME_STORE_DEADLINE_MS: u64 = 2_000;

/// The sidecar's body limit on `POST /v1/responses`: a bigger batch is refused with 413 (and
/// split by the filter). Room for one item of the largest stored body at its worst JSON
/// inflation (a control character is 6 bytes escaped: ~6 MiB) and its headers.
pub const RESPONSES_BODY_LIMIT: usize = 32 << 20;

/// What the filter asks about an `Idempotency-Key` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdempotencyRequest {
    /// The client's key (the header's string value, unquoted).
    pub key: String,
    /// The first 32 hex characters of sha256(METHOD + " " + path + JSON(body)): the operation.
    pub digest: String,
}

/// A response as stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredResponse {
    pub status: u16,
    /// The upstream's headers worth replaying (no hop-by-hop, `date`, `content-length`,
    /// `set-cookie`, `x-tollgate-*` or rate-limit headers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<Header>,
    /// The body: UTF-8 text as is, anything else base64 (`base64: true`).
    #[serde(default)]
    pub body: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub base64: bool,
    /// The body was too large to keep: only status and headers are replayed (idempotency only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// When the response was stored (ms since the Unix epoch; the `age` of a cache hit).
    #[serde(default)]
    pub stored_at_ms: u64,
}

impl StoredResponse {
    /// A response with `body`, kept as text when it is UTF-8.
    pub fn new(status: u16, headers: Vec<Header>, body: Vec<u8>, stored_at_ms: u64) -> StoredResponse {
        let (body, base64) = match String::from_utf8(body) {
            Ok(s) => (s, false),
            Err(e) => (base64_encode(e.as_bytes()), true),
        };
        StoredResponse { status, headers, body, base64, truncated: false, stored_at_ms }
    }

    /// The body bytes (`None` when base64 does not decode).
    pub fn body_bytes(&self) -> Option<Vec<u8>> {
        if self.base64 {
            base64_decode(&self.body)
        } else {
            Some(self.body.as_bytes().to_vec())
        }
    }

    /// Bytes of the body as stored (base64: as decoded, its padding not counted).
    pub fn body_len(&self) -> usize {
        if self.base64 {
            let padding = self.body.bytes().rev().take(2).take_while(|b| *b == b'=').count();
            (self.body.len() / 4 * 3).saturating_sub(padding)
        } else {
            self.body.len()
        }
    }
}

/// Why a response is replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ReplayKind {
    /// A response-cache hit (`x-tollgate-cache: hit`).
    Cache,
    /// The stored response of an earlier request with the same idempotency key and operation
    /// (`Idempotent-Replayed: true`).
    Idempotency,
}

/// A stored response to answer with, instead of calling the upstream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Replay {
    pub kind: ReplayKind,
    pub response: StoredResponse,
}

/// Where the response of an allowed request may be stored. Echoed back by the filter in a
/// [`StoreItem`]; the sidecar checks its [`Seal`] and validates every field again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum StoreTicket {
    /// A response-cache miss: store a successful response under the route's TTL.
    #[serde(rename_all = "camelCase")]
    Cache {
        tenant: String,
        /// The plan the request was decided on: a plan's responses are its own (decision 169).
        /// Absent from a ticket of an older sidecar: such a ticket stores nothing.
        #[serde(default)]
        plan: String,
        route: String,
        hash: String,
        #[serde(flatten)]
        seal: Seal,
    },
    /// A claimed idempotency key: store the 2xx outcome (24 h) or release the claim.
    #[serde(rename_all = "camelCase")]
    Idempotency {
        tenant: String,
        key_id: String,
        digest: String,
        key: String,
        token: String,
        #[serde(flatten)]
        seal: Seal,
    },
}

impl StoreTicket {
    /// The ticket's seal (set by the sidecar).
    pub fn seal(&self) -> &Seal {
        match self {
            StoreTicket::Cache { seal, .. } | StoreTicket::Idempotency { seal, .. } => seal,
        }
    }

    pub fn seal_mut(&mut self) -> &mut Seal {
        match self {
            StoreTicket::Cache { seal, .. } | StoreTicket::Idempotency { seal, .. } => seal,
        }
    }
}

/// What the sidecar adds to a store ticket at decision time: the decision's id, until when the
/// ticket is taken back, and a MAC over every field of the ticket. Opaque to the filter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Seal {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expires_at_ms: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One finished request's response (or, for an idempotency claim without a 2xx outcome, `None`:
/// release the claim so the client may retry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreItem {
    pub ticket: StoreTicket,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
    /// A cache fill's own freshness left when it was received (`Cache-Control` `s-maxage`, else
    /// `max-age`, less its `Age`), when it says one: the entry lives no longer than that nor
    /// than the route's TTL (decision 211). A sidecar that does not know the field ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_ms: Option<u64>,
}

/// The body of `POST /v1/responses`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoreBatch {
    pub responses: Vec<StoreItem>,
}

/// The answer to a [`StoreBatch`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoreAck {
    pub stored: u64,
    pub released: u64,
    /// Invalid items (refused for good) and items whose claim was no longer held.
    pub refused: u64,
    /// Items Redis could not take (not retried: the cache misses again, the claim expires).
    pub failed: u64,
}

/// The body of `POST /v1/responses/claims`: the idempotency claims of requests still running,
/// to be kept in flight (decision 186). A claim lives its in-flight TTL from its decision; a
/// request that outlives it would lose it (a retry would run the operation beside it), so the
/// worker running the request asks, while it runs, for the claim and its ticket to live on.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClaimRenewal {
    /// Idempotency store tickets (the sidecar checks each seal, as for a store).
    pub claims: Vec<StoreTicket>,
}

/// The answer to a [`ClaimRenewal`], in its order: the ticket sealed again (living another
/// in-flight TTL) while its claim is still this request's and kept; the same ticket unchanged
/// when Redis could not say (ask again); `None` when it is not (expired, settled, another
/// request's, an invalid ticket): stop asking.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClaimsKept {
    pub claims: Vec<Option<StoreTicket>>,
    /// The in-flight TTL a kept claim lives from now (ms): the worker asks again after a third
    /// of it, by its own clock (not comparing its clock with the tickets' expiries).
    #[serde(default, rename = "inFlightMs")]
    pub in_flight_ms: u64,
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes [`base64_encode`]'s output; `None` on anything else.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let val = |c: u8| -> Option<u32> { B64.iter().position(|&x| x == c).map(|p| p as u32) };
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (ci, chunk) in s.chunks(4).enumerate() {
        let last = ci == s.len() / 4 - 1;
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            let v = if i >= 4 - pad { 0 } else { val(c)? };
            n |= v << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for (raw, enc) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foobar", "Zm9vYmFy")] {
            assert_eq!(base64_encode(raw.as_bytes()), enc);
            assert_eq!(base64_decode(enc).unwrap(), raw.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(base64_decode(&base64_encode(&all)).unwrap(), all);
        assert!(base64_decode("Zg=").is_none());
        assert!(base64_decode("Z===").is_none());
        assert!(base64_decode("Zg==Zm8=").is_none());
        assert!(base64_decode("Z!==").is_none());
    }

    #[test]
    fn stored_responses_keep_text_as_text_and_bytes_as_base64() {
        let t = StoredResponse::new(200, vec![], b"{\"a\":1}".to_vec(), 5);
        assert!(!t.base64);
        assert_eq!(serde_json::to_string(&t).unwrap(), r#"{"status":200,"body":"{\"a\":1}","storedAtMs":5}"#);
        let b = StoredResponse::new(201, vec![Header::new("content-type", "image/png")], vec![0xff, 0, 1], 0);
        assert!(b.base64);
        assert_eq!(b.body_bytes().unwrap(), vec![0xff, 0, 1]);
        let back: StoredResponse = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(back, b);
        // the body's length is its bytes', whatever the padding of its base64
        for n in 1..=7 {
            let r = StoredResponse::new(200, vec![], vec![0xff; n], 0);
            assert_eq!((r.base64, r.body_len()), (true, n));
        }
    }

    #[test]
    fn tickets_are_tagged_by_kind() {
        let t = StoreTicket::Cache { tenant: "acme".into(), plan: "gold".into(), route: "r".into(), hash: "ab".into(), seal: Seal::default() };
        assert_eq!(serde_json::to_string(&t).unwrap(), r#"{"kind":"cache","tenant":"acme","plan":"gold","route":"r","hash":"ab"}"#);
        let sealed = StoreTicket::Cache {
            tenant: "acme".into(),
            plan: "gold".into(),
            route: "r".into(),
            hash: "ab".into(),
            seal: Seal { id: "d".into(), expires_at_ms: 7, mac: "m".into() },
        };
        let s = serde_json::to_string(&sealed).unwrap();
        assert_eq!(s, r#"{"kind":"cache","tenant":"acme","plan":"gold","route":"r","hash":"ab","id":"d","expiresAtMs":7,"mac":"m"}"#);
        assert_eq!(serde_json::from_str::<StoreTicket>(&s).unwrap(), sealed);
        let i = StoreItem {
            ticket: StoreTicket::Idempotency {
                tenant: "acme".into(),
                key_id: "key_1".into(),
                digest: "d".into(),
                key: "k".into(),
                token: "t".into(),
                seal: Seal::default(),
            },
            response: None,
            max_age_ms: None,
        };
        let s = serde_json::to_string(&i).unwrap();
        assert_eq!(s, r#"{"ticket":{"kind":"idempotency","tenant":"acme","keyId":"key_1","digest":"d","key":"k","token":"t"}}"#);
        assert_eq!(serde_json::from_str::<StoreItem>(&s).unwrap(), i);
    }
}
