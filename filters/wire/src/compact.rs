//! Compact messages on the decision stream (decision 224).
//!
//! Written and read as JSON, a decision cost the Wasm filter ~21 k instructions (Envoy alone's
//! whole request is ~150 k): the request's encoding and, mostly, the answer's parse — field names
//! matched one by one, escapes looked for in every string. A compact message says the same in a
//! few length-prefixed strings and integers. The filter sends compact messages only on a stream
//! whose answer head says the sidecar reads them ([`FORMAT_HEADER`]); the sidecar answers each
//! message in the format it came in, so a filter older than this one (JSON only) is served as
//! before.
//!
//! **The format.** A message is [`MAGIC`] (never the first byte of JSON text, nor of UTF-8), then
//! fields in any order. A field is a key varint `number << 1 | kind`, then its value: kind 0 an
//! unsigned LEB128 varint (at most 10 bytes), kind 1 a varint length and that many bytes. Strings
//! are UTF-8; a header list is bytes holding `len name len value` pairs; a field that is rare on
//! the hot path and deep (an idempotency ask, an LLM ask, a ticket, a replay, a store ticket) is
//! bytes holding its JSON. A field number the reader does not know is skipped (a later writer may
//! add fields); a known one twice, of the wrong kind, or missing when required is an error, and
//! so is a field of the other verdict.

use crate::llm::LlmAsk;
use crate::responses::IdempotencyRequest;
use crate::stream::{StreamAnswer, StreamItem};
use crate::{DecideRequest, DecideResponse, Header, Lease, LeaseAsk};

/// A compact message's first byte.
pub const MAGIC: u8 = 0xC1;
/// The answer-head header by which the sidecar says it reads compact messages on this stream.
pub const FORMAT_HEADER: &str = "x-tollgate-stream-format";
/// Its value.
pub const FORMAT_COMPACT: &str = "compact";
/// The media type of a compact answer to a decision call (`POST /v1/decide`): a call that
/// `accept`s it is answered, when allowed, with [`encode_answer`] of its decision (`seq` 0) by a
/// sidecar that writes compact answers, and in JSON by an older one.
pub const COMPACT_MEDIA_TYPE: &str = "application/x-tollgate-compact";

/// Most headers in one list of a compact message: far above what a filter sends (one per
/// configured `forwardHeaders` name, at most 64) or a sidecar answers, and a bound on what a
/// message of empty names and values makes the reader allocate.
pub const MAX_HEADERS: usize = 1024;

/// Whether `message` is compact (else it is JSON).
pub fn is_compact(message: &[u8]) -> bool {
    message.first() == Some(&MAGIC)
}

// ---- fields of a decision message (StreamItem) ----
const I_SEQ: u32 = 1;
const I_TRACEPARENT: u32 = 2;
const I_KEY_HASH: u32 = 3;
const I_METHOD: u32 = 4;
const I_AUTHORITY: u32 = 5;
const I_PATH: u32 = 6;
const I_REQUEST_ID: u32 = 7;
const I_DECISION_ID: u32 = 8;
const I_CLIENT_IP: u32 = 9;
const I_HEADERS: u32 = 10;
const I_TOKEN_ESTIMATE: u32 = 11;
const I_ROUTE: u32 = 12;
const I_CACHE_KEY: u32 = 13;
const I_IDEMPOTENCY: u32 = 14;
const I_LEASE_WANT: u32 = 15;
const I_LEASE_RENEWAL: u32 = 16;
const I_LLM: u32 = 17;

// ---- fields of an answer (StreamAnswer) ----
const A_SEQ: u32 = 1;
const A_STATUS: u32 = 2;
const A_ERROR: u32 = 3;
/// The decision's verdict: 1 allow, 2 deny; absent, no decision.
const A_VERDICT: u32 = 4;
const A_TENANT: u32 = 5;
const A_KEY_ID: u32 = 6;
const A_PLAN: u32 = 7;
const A_REQUEST_HEADERS: u32 = 8;
const A_RESPONSE_HEADERS: u32 = 9;
const A_CACHE_FOR_MS: u32 = 10;
const A_TICKET: u32 = 11;
const A_REPLAY: u32 = 12;
const A_STORE: u32 = 13;
/// Bytes holding fields 1 units, 2 ttl (ms), 3 response headers.
const A_LEASE: u32 = 14;
const A_NO_LEASE: u32 = 15;
const A_MODEL: u32 = 16;
const A_DENY_STATUS: u32 = 17;
const A_DENY_ERROR: u32 = 18;
const A_MESSAGE: u32 = 19;
const A_LIMIT: u32 = 20;
/// The fields only an allow may carry, and only a deny.
const ALLOW_ONLY: &[u32] = &[A_TENANT, A_KEY_ID, A_PLAN, A_REQUEST_HEADERS, A_CACHE_FOR_MS, A_TICKET, A_REPLAY, A_STORE, A_LEASE, A_NO_LEASE, A_MODEL];
const DENY_ONLY: &[u32] = &[A_DENY_STATUS, A_DENY_ERROR, A_MESSAGE, A_LIMIT];

const VERDICT_ALLOW: u64 = 1;
const VERDICT_DENY: u64 = 2;

/// Appends fields to a message.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn uint(&mut self, field: u32, v: u64) {
        self.varint(u64::from(field) << 1);
        self.varint(v);
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.varint(u64::from(field) << 1 | 1);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn str(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    fn opt_str(&mut self, field: u32, s: Option<&str>) {
        if let Some(s) = s {
            self.str(field, s);
        }
    }

    fn opt_uint(&mut self, field: u32, v: Option<u64>) {
        if let Some(v) = v {
            self.uint(field, v);
        }
    }

    fn headers(&mut self, field: u32, headers: &[Header]) {
        if headers.is_empty() {
            return;
        }
        let mut pairs = Vec::with_capacity(headers.iter().map(|h| h.name.len() + h.value.len() + 4).sum());
        let mut w = Writer(&mut pairs);
        for h in headers {
            w.varint(h.name.len() as u64);
            w.0.extend_from_slice(h.name.as_bytes());
            w.varint(h.value.len() as u64);
            w.0.extend_from_slice(h.value.as_bytes());
        }
        self.bytes(field, &pairs);
    }

    fn json<T: serde::Serialize>(&mut self, field: u32, value: Option<&T>) -> Result<(), String> {
        if let Some(v) = value {
            let json = serde_json::to_vec(v).map_err(|e| format!("cannot encode field {field}: {e}"))?;
            self.bytes(field, &json);
        }
        Ok(())
    }
}

/// A field's value as read.
#[derive(Clone, Copy)]
enum Value<'a> {
    Uint(u64),
    Bytes(&'a [u8]),
}

/// Reads fields off a message, refusing a known field twice.
struct Reader<'a> {
    buf: &'a [u8],
    seen: u32,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, seen: 0 }
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for (i, b) in self.buf.iter().take(10).enumerate() {
            let bits = u64::from(b & 0x7f);
            if i == 9 && bits > 1 {
                return Err("a varint past 64 bits".into());
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                self.buf = &self.buf[i + 1..];
                return Ok(v);
            }
        }
        Err("a varint cut short or past 10 bytes".into())
    }

    fn take(&mut self, len: u64) -> Result<&'a [u8], String> {
        let len = usize::try_from(len).ok().filter(|l| *l <= self.buf.len()).ok_or("a length past the message's end")?;
        let (b, rest) = self.buf.split_at(len);
        self.buf = rest;
        Ok(b)
    }

    /// The next field whose number is in `known` (others are skipped); `None` at the end.
    fn next(&mut self, known: u32) -> Result<Option<(u32, Value<'a>)>, String> {
        while !self.buf.is_empty() {
            let key = self.varint()?;
            let value = match key & 1 {
                0 => Value::Uint(self.varint()?),
                _ => {
                    let len = self.varint()?;
                    Value::Bytes(self.take(len)?)
                }
            };
            let field = u32::try_from(key >> 1).unwrap_or(u32::MAX);
            if field >= 32 || known & (1 << field) == 0 {
                continue;
            }
            if self.seen & (1 << field) != 0 {
                return Err(format!("field {field} twice"));
            }
            self.seen |= 1 << field;
            return Ok(Some((field, value)));
        }
        Ok(None)
    }

    fn has(&self, field: u32) -> bool {
        self.seen & (1 << field) != 0
    }
}

/// The field numbers `first..=last`, as a [`Reader::next`] mask.
const fn span(first: u32, last: u32) -> u32 {
    ((1u64 << (last + 1)) - (1u64 << first)) as u32
}
const ITEM_FIELDS: u32 = span(I_SEQ, I_LLM);
const ANSWER_FIELDS: u32 = span(A_SEQ, A_LIMIT);
const LEASE_FIELDS: u32 = span(1, 3);

fn uint(field: u32, v: Value<'_>) -> Result<u64, String> {
    match v {
        Value::Uint(n) => Ok(n),
        Value::Bytes(_) => Err(format!("field {field} is bytes, not a number")),
    }
}

fn bytes<'a>(field: u32, v: Value<'a>) -> Result<&'a [u8], String> {
    match v {
        Value::Bytes(b) => Ok(b),
        Value::Uint(_) => Err(format!("field {field} is a number, not bytes")),
    }
}

fn string(field: u32, v: Value<'_>) -> Result<String, String> {
    let b = bytes(field, v)?;
    std::str::from_utf8(b).map(str::to_owned).map_err(|_| format!("field {field} is not UTF-8"))
}

fn json<T: serde::de::DeserializeOwned>(field: u32, v: Value<'_>) -> Result<Box<T>, String> {
    serde_json::from_slice(bytes(field, v)?).map_err(|e| format!("field {field}: {e}"))
}

fn headers(field: u32, v: Value<'_>) -> Result<Vec<Header>, String> {
    let mut r = Reader::new(bytes(field, v)?);
    let mut out = Vec::new();
    while !r.buf.is_empty() {
        let mut text = || -> Result<String, String> {
            let len = r.varint()?;
            let b = r.take(len)?;
            std::str::from_utf8(b).map(str::to_owned).map_err(|_| format!("a header of field {field} is not UTF-8"))
        };
        let name = text()?;
        let value = text()?;
        if out.len() == MAX_HEADERS {
            return Err(format!("field {field} holds more than {MAX_HEADERS} headers"));
        }
        out.push(Header { name, value });
    }
    Ok(out)
}

fn required<T>(value: Option<T>, field: u32) -> Result<T, String> {
    value.ok_or_else(|| format!("field {field} is missing"))
}

fn body(message: &[u8]) -> Result<&[u8], String> {
    match message.split_first() {
        Some((&MAGIC, rest)) => Ok(rest),
        _ => Err("not a compact message".into()),
    }
}

/// Appends the compact message of one decision to `out` (the filter's side).
pub fn encode_item(out: &mut Vec<u8>, seq: u64, traceparent: Option<&str>, request: &DecideRequest) -> Result<(), String> {
    // every field named: a field added to DecideRequest fails to compile here until it is sent
    let DecideRequest { key_hash, method, authority, path, request_id, decision_id, client_ip, headers, token_estimate, route, cache_key, idempotency, lease, llm } = request;
    out.push(MAGIC);
    let mut w = Writer(out);
    w.uint(I_SEQ, seq);
    w.opt_str(I_TRACEPARENT, traceparent);
    w.str(I_KEY_HASH, key_hash);
    w.str(I_METHOD, method);
    w.str(I_AUTHORITY, authority);
    w.str(I_PATH, path);
    w.opt_str(I_REQUEST_ID, request_id.as_deref());
    w.opt_str(I_DECISION_ID, decision_id.as_deref());
    w.opt_str(I_CLIENT_IP, client_ip.as_deref());
    w.headers(I_HEADERS, headers);
    w.opt_uint(I_TOKEN_ESTIMATE, *token_estimate);
    w.opt_str(I_ROUTE, route.as_deref());
    w.opt_str(I_CACHE_KEY, cache_key.as_deref());
    w.json(I_IDEMPOTENCY, idempotency.as_ref())?;
    if let Some(LeaseAsk { want, renewal }) = lease {
        w.uint(I_LEASE_WANT, *want);
        if *renewal {
            w.uint(I_LEASE_RENEWAL, 1);
        }
    }
    w.json(I_LLM, llm.as_ref())
}

/// Reads one compact decision message (the sidecar's side).
pub fn decode_item(message: &[u8]) -> Result<StreamItem, String> {
    let mut r = Reader::new(body(message)?);
    let (mut seq, mut traceparent, mut req) = (None, None, DecideRequest::default());
    let (mut key_hash, mut method, mut authority, mut path) = (None, None, None, None);
    let (mut want, mut renewal) = (None, false);
    while let Some((field, v)) = r.next(ITEM_FIELDS)? {
        match field {
            I_SEQ => seq = Some(uint(field, v)?),
            I_TRACEPARENT => traceparent = Some(string(field, v)?),
            I_KEY_HASH => key_hash = Some(string(field, v)?),
            I_METHOD => method = Some(string(field, v)?),
            I_AUTHORITY => authority = Some(string(field, v)?),
            I_PATH => path = Some(string(field, v)?),
            I_REQUEST_ID => req.request_id = Some(string(field, v)?),
            I_DECISION_ID => req.decision_id = Some(string(field, v)?),
            I_CLIENT_IP => req.client_ip = Some(string(field, v)?),
            I_HEADERS => req.headers = headers(field, v)?,
            I_TOKEN_ESTIMATE => req.token_estimate = Some(uint(field, v)?),
            I_ROUTE => req.route = Some(string(field, v)?),
            I_CACHE_KEY => req.cache_key = Some(string(field, v)?),
            I_IDEMPOTENCY => req.idempotency = Some(*json::<IdempotencyRequest>(field, v)?),
            I_LEASE_WANT => want = Some(uint(field, v)?),
            I_LEASE_RENEWAL => renewal = flag(field, v)?,
            _ => req.llm = Some(*json::<LlmAsk>(field, v)?),
        }
    }
    if renewal && want.is_none() {
        return Err(format!("field {I_LEASE_RENEWAL} without field {I_LEASE_WANT}"));
    }
    req.lease = want.map(|want| LeaseAsk { want, renewal });
    req.key_hash = required(key_hash, I_KEY_HASH)?;
    req.method = required(method, I_METHOD)?;
    req.authority = required(authority, I_AUTHORITY)?;
    req.path = required(path, I_PATH)?;
    Ok(StreamItem { seq: required(seq, I_SEQ)?, traceparent, request: req })
}

fn flag(field: u32, v: Value<'_>) -> Result<bool, String> {
    match uint(field, v)? {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(format!("field {field} is {n}, not 0 or 1")),
    }
}

/// The compact message of one answer (the sidecar's side).
pub fn encode_answer(answer: &StreamAnswer) -> Result<Vec<u8>, String> {
    let mut out = vec![MAGIC];
    let mut w = Writer(&mut out);
    w.uint(A_SEQ, answer.seq);
    w.uint(A_STATUS, u64::from(answer.status));
    w.opt_str(A_ERROR, answer.error.as_deref());
    match &answer.decision {
        None => {}
        Some(DecideResponse::Allow { tenant, key_id, plan, request_headers, response_headers, cache_for_ms, ticket, replay, store, lease, no_lease, model }) => {
            w.uint(A_VERDICT, VERDICT_ALLOW);
            w.str(A_TENANT, tenant);
            w.str(A_KEY_ID, key_id);
            w.str(A_PLAN, plan);
            w.headers(A_REQUEST_HEADERS, request_headers);
            w.headers(A_RESPONSE_HEADERS, response_headers);
            w.opt_uint(A_CACHE_FOR_MS, *cache_for_ms);
            w.json(A_TICKET, ticket.as_ref())?;
            w.json(A_REPLAY, replay.as_deref())?;
            w.json(A_STORE, store.as_deref())?;
            if let Some(Lease { units, ttl_ms, response_headers }) = lease {
                let mut inner = Vec::new();
                let mut l = Writer(&mut inner);
                l.uint(1, *units);
                l.uint(2, *ttl_ms);
                l.headers(3, response_headers);
                w.bytes(A_LEASE, &inner);
            }
            if *no_lease {
                w.uint(A_NO_LEASE, 1);
            }
            w.opt_str(A_MODEL, model.as_deref());
        }
        Some(DecideResponse::Deny { status, error, message, limit, response_headers }) => {
            w.uint(A_VERDICT, VERDICT_DENY);
            w.uint(A_DENY_STATUS, u64::from(*status));
            w.str(A_DENY_ERROR, error);
            w.str(A_MESSAGE, message);
            w.opt_str(A_LIMIT, limit.as_deref());
            w.headers(A_RESPONSE_HEADERS, response_headers);
        }
    }
    Ok(out)
}

fn status(field: u32, v: Value<'_>) -> Result<u16, String> {
    u16::try_from(uint(field, v)?).map_err(|_| format!("field {field} is past 65535"))
}

fn lease(field: u32, v: Value<'_>) -> Result<Lease, String> {
    let mut r = Reader::new(bytes(field, v)?);
    let (mut units, mut ttl_ms, mut response_headers) = (None, None, Vec::new());
    while let Some((f, v)) = r.next(LEASE_FIELDS)? {
        match f {
            1 => units = Some(uint(f, v)?),
            2 => ttl_ms = Some(uint(f, v)?),
            _ => response_headers = headers(f, v)?,
        }
    }
    Ok(Lease { units: required(units, 1)?, ttl_ms: required(ttl_ms, 2)?, response_headers })
}

/// Reads one compact answer (the filter's side).
pub fn decode_answer(message: &[u8]) -> Result<StreamAnswer, String> {
    let mut r = Reader::new(body(message)?);
    let (mut seq, mut status_code, mut error, mut verdict) = (None, None, None, None);
    let (mut tenant, mut key_id, mut plan, mut request_headers, mut response_headers) = (None, None, None, Vec::new(), Vec::new());
    let (mut cache_for_ms, mut ticket, mut replay, mut store, mut lease_, mut no_lease, mut model) = (None, None, None, None, None, false, None);
    let (mut deny_status, mut deny_error, mut message_, mut limit) = (None, None, None, None);
    while let Some((field, v)) = r.next(ANSWER_FIELDS)? {
        match field {
            A_SEQ => seq = Some(uint(field, v)?),
            A_STATUS => status_code = Some(status(field, v)?),
            A_ERROR => error = Some(string(field, v)?),
            A_VERDICT => verdict = Some(uint(field, v)?),
            A_TENANT => tenant = Some(string(field, v)?),
            A_KEY_ID => key_id = Some(string(field, v)?),
            A_PLAN => plan = Some(string(field, v)?),
            A_REQUEST_HEADERS => request_headers = headers(field, v)?,
            A_RESPONSE_HEADERS => response_headers = headers(field, v)?,
            A_CACHE_FOR_MS => cache_for_ms = Some(uint(field, v)?),
            A_TICKET => ticket = Some(*json(field, v)?),
            A_REPLAY => replay = Some(json(field, v)?),
            A_STORE => store = Some(json(field, v)?),
            A_LEASE => lease_ = Some(lease(field, v)?),
            A_NO_LEASE => no_lease = flag(field, v)?,
            A_MODEL => model = Some(string(field, v)?),
            A_DENY_STATUS => deny_status = Some(status(field, v)?),
            A_DENY_ERROR => deny_error = Some(string(field, v)?),
            A_MESSAGE => message_ = Some(string(field, v)?),
            _ => limit = Some(string(field, v)?),
        }
    }
    let misplaced = |fields: &[u32]| match fields.iter().find(|f| r.has(**f)) {
        Some(f) => Err(format!("field {f} does not go with this verdict")),
        None => Ok(()),
    };
    let decision = match verdict {
        None => {
            misplaced(ALLOW_ONLY)?;
            misplaced(DENY_ONLY)?;
            misplaced(&[A_RESPONSE_HEADERS])?;
            None
        }
        Some(VERDICT_ALLOW) => {
            misplaced(DENY_ONLY)?;
            let (tenant, key_id, plan) = (required(tenant, A_TENANT)?, required(key_id, A_KEY_ID)?, required(plan, A_PLAN)?);
            Some(DecideResponse::Allow { tenant, key_id, plan, request_headers, response_headers, cache_for_ms, ticket, replay, store, lease: lease_, no_lease, model })
        }
        Some(VERDICT_DENY) => {
            misplaced(ALLOW_ONLY)?;
            let status = required(deny_status, A_DENY_STATUS)?;
            Some(DecideResponse::Deny { status, error: required(deny_error, A_DENY_ERROR)?, message: required(message_, A_MESSAGE)?, limit, response_headers })
        }
        Some(v) => return Err(format!("verdict {v} is neither allow (1) nor deny (2)")),
    };
    Ok(StreamAnswer { seq: required(seq, A_SEQ)?, status: required(status_code, A_STATUS)?, decision, error })
}

#[cfg(test)]
#[path = "compact_tests.rs"]
mod tests;
