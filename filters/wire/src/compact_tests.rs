use super::*;
use crate::responses::{Replay, StoreTicket};
use crate::Ticket;

fn full_request() -> DecideRequest {
    // every field set, named one by one: a field added to DecideRequest must be added here
    DecideRequest {
        key_hash: "ab".repeat(32),
        method: "POST".into(),
        authority: "api.example.com".into(),
        path: "/v1/chat?x=\"é\"".into(),
        request_id: Some("req-1".into()),
        decision_id: Some("0123456789abcdef0123456789abcdef".into()),
        client_ip: Some("10.0.0.7".into()),
        headers: vec![Header::new("x-team", "blue"), Header::new("x-empty", "")],
        token_estimate: Some(512),
        route: Some("chat".into()),
        cache_key: Some("cd".repeat(32)),
        idempotency: Some(IdempotencyRequest { key: "idem \"1\"".into(), digest: "ef".repeat(16) }),
        lease: Some(LeaseAsk { want: 40, renewal: true }),
        llm: Some(LlmAsk { model: Some("gpt-4o-mini".into()), input_bytes: 900, max_output_tokens: Some(256), start_ms: Some(1_700_000_000_000) }),
    }
}

fn item(seq: u64, traceparent: Option<&str>, request: &DecideRequest) -> Vec<u8> {
    let mut out = Vec::new();
    encode_item(&mut out, seq, traceparent, request).unwrap();
    out
}

fn full_allow() -> DecideResponse {
    DecideResponse::Allow {
        tenant: "acme".into(),
        key_id: "k-1".into(),
        plan: "pro".into(),
        request_headers: vec![Header::new("x-tollgate-tenant", "acme")],
        response_headers: vec![Header::new("ratelimit", "\"exact\";r=4;t=60"), Header::new("ratelimit-policy", "\"exact\";q=5;w=60")],
        cache_for_ms: Some(250),
        ticket: Some(serde_json::from_str::<Ticket>(r#"{"tenant":"acme","requestId":"r","slots":[{"limit":"c","subject":"m"}],"expiresAtMs":9,"mac":"x"}"#).unwrap()),
        replay: Some(Box::new(serde_json::from_str::<Replay>(r#"{"kind":"cache","response":{"status":200,"headers":[{"name":"a","value":"b"}],"body":"hi","storedAtMs":3}}"#).unwrap())),
        store: Some(Box::new(serde_json::from_str::<StoreTicket>(r#"{"kind":"cache","tenant":"acme","plan":"pro","route":"r","hash":"h","id":"i","expiresAtMs":4,"mac":"m"}"#).unwrap())),
        lease: Some(Lease { units: 7, ttl_ms: 900, response_headers: vec![Header::new("ratelimit-policy", "5;w=60")] }),
        no_lease: true,
        model: Some("gpt-4o".into()),
    }
}

fn full_deny() -> DecideResponse {
    DecideResponse::Deny {
        status: 429,
        error: "rate_limited".into(),
        message: "slow down".into(),
        limit: Some("per-minute".into()),
        response_headers: vec![Header::new("retry-after", "3")],
    }
}

#[test]
fn a_decision_message_round_trips_with_every_field_and_with_none() {
    let full = full_request();
    let back = decode_item(&item(u64::MAX, Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), &full)).unwrap();
    assert_eq!(back, StreamItem { seq: u64::MAX, traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()), request: full });
    let bare = DecideRequest::new("ab", "GET", "h", "/");
    assert_eq!(decode_item(&item(0, None, &bare)).unwrap(), StreamItem { seq: 0, traceparent: None, request: bare.clone() });
    let unrenewed = DecideRequest { lease: Some(LeaseAsk { want: 3, renewal: false }), ..bare };
    assert_eq!(decode_item(&item(5, None, &unrenewed)).unwrap().request, unrenewed);
}

#[test]
fn answers_round_trip_with_either_verdict_or_none() {
    let answers = [
        StreamAnswer { seq: 1, status: 200, decision: Some(full_allow()), error: None },
        StreamAnswer { seq: 2, status: 200, decision: Some(DecideResponse::allow("t", "k", "p")), error: None },
        StreamAnswer { seq: 3, status: 200, decision: Some(full_deny()), error: None },
        StreamAnswer { seq: 4, status: 503, decision: None, error: Some("store_unavailable".into()) },
        StreamAnswer { seq: u64::MAX, status: 400, decision: None, error: None },
    ];
    for a in answers {
        let bytes = encode_answer(&a).unwrap();
        assert!(is_compact(&bytes));
        assert_eq!(decode_answer(&bytes).unwrap(), a);
    }
}

#[test]
fn an_exact_limits_answer_is_under_half_its_json() {
    let a = StreamAnswer {
        seq: 41,
        status: 200,
        decision: Some(DecideResponse::Allow {
            tenant: "demo".into(),
            key_id: "demo-key".into(),
            plan: "starter".into(),
            request_headers: vec![],
            response_headers: vec![Header::new("ratelimit", "\"exact\";r=4;t=60"), Header::new("ratelimit-policy", "\"exact\";q=5;w=60")],
            cache_for_ms: None,
            ticket: None,
            replay: None,
            store: None,
            lease: None,
            no_lease: true,
            model: None,
        }),
        error: None,
    };
    let (compact, json) = (encode_answer(&a).unwrap(), serde_json::to_vec(&a).unwrap());
    assert!(compact.len() * 2 < json.len(), "{} compact vs {} JSON", compact.len(), json.len());
}

#[test]
fn unknown_fields_of_either_kind_are_skipped() {
    let mut bytes = item(9, None, &DecideRequest::new("ab", "GET", "h", "/"));
    let mut w = Writer(&mut bytes);
    w.uint(31, 7); // a number this reader does not know
    w.bytes(30, b"later");
    w.uint(1000, 1); // past the reader's mask
    w.bytes(u32::MAX >> 1, &[0xff; 3]);
    assert_eq!(decode_item(&bytes).unwrap().seq, 9);
    let mut answer = encode_answer(&StreamAnswer { seq: 2, status: 200, decision: Some(DecideResponse::allow("t", "k", "p")), error: None }).unwrap();
    Writer(&mut answer).bytes(25, b"{}");
    assert_eq!(decode_answer(&answer).unwrap().seq, 2);
}

/// A message built field by field (after the magic byte).
fn raw(build: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut out = vec![MAGIC];
    build(&mut Writer(&mut out));
    out
}

fn item_error(build: impl FnOnce(&mut Writer)) -> String {
    decode_item(&raw(build)).unwrap_err()
}

fn answer_error(build: impl FnOnce(&mut Writer)) -> String {
    decode_answer(&raw(build)).unwrap_err()
}

fn required_item(w: &mut Writer) {
    w.uint(I_SEQ, 1);
    w.str(I_KEY_HASH, "ab");
    w.str(I_METHOD, "GET");
    w.str(I_AUTHORITY, "h");
    w.str(I_PATH, "/");
}

#[test]
fn a_malformed_decision_message_is_an_error_naming_what() {
    assert!(item_error(|w| w.uint(I_SEQ, 1)).contains("field 3 is missing"));
    assert!(item_error(|w| {
        required_item(w);
        w.str(I_ROUTE, "a");
        w.str(I_ROUTE, "b");
    })
    .contains("field 12 twice"));
    assert!(item_error(|w| {
        required_item(w);
        w.uint(I_ROUTE, 3);
    })
    .contains("not bytes"));
    assert!(item_error(|w| {
        required_item(w);
        w.str(I_TOKEN_ESTIMATE, "3");
    })
    .contains("not a number"));
    assert!(item_error(|w| {
        required_item(w);
        w.bytes(I_CLIENT_IP, &[0xff, 0xfe]);
    })
    .contains("not UTF-8"));
    assert!(item_error(|w| {
        required_item(w);
        w.uint(I_LEASE_RENEWAL, 1);
    })
    .contains("without field 15"));
    assert!(item_error(|w| {
        required_item(w);
        w.uint(I_LEASE_WANT, 1);
        w.uint(I_LEASE_RENEWAL, 2);
    })
    .contains("not 0 or 1"));
    assert!(item_error(|w| {
        required_item(w);
        w.bytes(I_LLM, b"{not json");
    })
    .contains("field 17"));
    assert!(item_error(|w| {
        required_item(w);
        w.bytes(I_HEADERS, &[3, b'a']);
    })
    .contains("past the message's end"));
    let many: Vec<Header> = (0..=MAX_HEADERS).map(|_| Header::new("", "")).collect();
    assert!(item_error(|w| {
        required_item(w);
        w.headers(I_HEADERS, &many);
    })
    .contains("more than 1024 headers"));
    // the length says more than is left
    let mut cut = raw(required_item);
    cut.extend_from_slice(&[(I_PATH << 1 | 1) as u8, 0x7f]);
    assert!(decode_item(&cut).unwrap_err().contains("past the message's end"));
    // a varint of eleven bytes, and one past 64 bits
    let mut long = vec![MAGIC, 2];
    long.extend_from_slice(&[0x80; 10]);
    long.push(0);
    assert!(decode_item(&long).unwrap_err().contains("varint"));
    let mut wide = vec![MAGIC, 2];
    wide.extend_from_slice(&[0xff; 9]);
    wide.push(0x02);
    assert!(decode_item(&wide).unwrap_err().contains("64 bits"));
    assert!(decode_item(br#"{"seq":1}"#).unwrap_err().contains("not a compact message"));
    assert!(decode_item(&[]).is_err());
}

#[test]
fn a_malformed_answer_is_an_error_naming_what() {
    let head = |w: &mut Writer| {
        w.uint(A_SEQ, 1);
        w.uint(A_STATUS, 200);
    };
    assert!(answer_error(|w| w.uint(A_SEQ, 1)).contains("field 2 is missing"));
    assert!(answer_error(|w| {
        w.uint(A_SEQ, 1);
        w.uint(A_STATUS, 65536);
    })
    .contains("past 65535"));
    assert!(answer_error(|w| {
        head(w);
        w.uint(A_VERDICT, 3);
    })
    .contains("neither allow"));
    assert!(answer_error(|w| {
        head(w);
        w.uint(A_VERDICT, VERDICT_ALLOW);
        w.str(A_TENANT, "t");
        w.str(A_PLAN, "p");
    })
    .contains("field 6 is missing"));
    assert!(answer_error(|w| {
        head(w);
        w.uint(A_VERDICT, VERDICT_ALLOW);
        w.str(A_TENANT, "t");
        w.str(A_KEY_ID, "k");
        w.str(A_PLAN, "p");
        w.str(A_LIMIT, "l");
    })
    .contains("field 20 does not go"));
    assert!(answer_error(|w| {
        head(w);
        w.uint(A_VERDICT, VERDICT_DENY);
        w.uint(A_DENY_STATUS, 429);
        w.str(A_DENY_ERROR, "e");
        w.str(A_MESSAGE, "m");
        w.uint(A_NO_LEASE, 1);
    })
    .contains("field 15 does not go"));
    assert!(answer_error(|w| {
        head(w);
        w.headers(A_RESPONSE_HEADERS, &[Header::new("a", "b")]);
    })
    .contains("field 9 does not go"));
    assert!(answer_error(|w| {
        head(w);
        w.uint(A_VERDICT, VERDICT_ALLOW);
        w.str(A_TENANT, "t");
        w.str(A_KEY_ID, "k");
        w.str(A_PLAN, "p");
        w.bytes(A_LEASE, &[2, 7]); // units without a ttl
    })
    .contains("field 2 is missing"));
}

#[test]
fn every_cut_of_a_message_reads_as_an_error_or_a_message_never_a_panic() {
    let bytes = item(3, Some("tp"), &full_request());
    for n in 0..bytes.len() {
        let _ = decode_item(&bytes[..n]);
    }
    let bytes = encode_answer(&StreamAnswer { seq: 3, status: 200, decision: Some(full_allow()), error: None }).unwrap();
    let cut_answers: Vec<_> = (0..bytes.len()).map(|n| decode_answer(&bytes[..n])).collect();
    // the full message's last field is the model: cut inside it, the answer cannot read
    assert!(cut_answers[bytes.len() - 1].is_err());
}
