//! The facts of an LLM call (issue 42): the model a request asks for, and what its response
//! says of the model that answered and of its tokens — input, output and cached input apart —
//! in the shapes of OpenAI (chat completions, responses), Anthropic (messages) and Gemini
//! (`generateContent`), from a JSON document or an event stream.
//!
//! Only the response's own objects are read, never content: a JSON document's top-level
//! `model`/`usage`/`modelVersion`/`usageMetadata`, the same at the top of an event stream's
//! `data:` frames, and the `message` of Anthropic's `message_start` frame. A count written in a
//! tool call's arguments or an echoed prompt is content a client could choose (decision 134).
//! A field of an unexpected type leaves that document's facts unread, never fails the request.
//!
//! Normalization is [`tollgate_wire::llm`]'s (decision 290). An event stream's frames are read
//! in order and later counts replace earlier ones (Anthropic's `message_delta` carries the
//! cumulative output count; OpenAI's last chunk the whole usage).

use crate::usage::Tokens;
use serde::Deserialize;
use tollgate_wire::llm::{model_name, LlmUsage};

/// A string field that may be of another type in a hostile document: that is no value, not a
/// failed document.
#[derive(Deserialize)]
#[serde(untagged)]
enum Loose {
    Text(String),
    Other(serde::de::IgnoredAny),
}

impl Loose {
    fn model(self) -> Option<String> {
        match self {
            Loose::Text(s) => model_name(&s).map(str::to_string),
            Loose::Other(_) => None,
        }
    }
}

/// A count: a JSON number, clamped as token counts are ([`Tokens`]); another type is none.
#[derive(Deserialize)]
#[serde(untagged)]
enum Count {
    Number(serde_json::Number),
    Other(serde::de::IgnoredAny),
}

impl Count {
    fn get(c: &Option<Count>) -> Option<u64> {
        match c {
            Some(Count::Number(n)) => Some(Tokens::of_number(n).count),
            _ => None,
        }
    }
}

/// The top of a response document, or of one event-stream frame.
#[derive(Deserialize)]
struct Doc {
    #[serde(rename = "type")]
    kind: Option<Loose>,
    model: Option<Loose>,
    #[serde(rename = "modelVersion")]
    model_version: Option<Loose>,
    usage: Option<Usage>,
    #[serde(rename = "usageMetadata")]
    usage_metadata: Option<GeminiUsage>,
    /// Anthropic's `message_start` frame: the message, with its model and input usage.
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    model: Option<Loose>,
    usage: Option<Usage>,
}

/// `usage` of OpenAI (chat: `prompt_tokens`…; responses: `input_tokens`…) and Anthropic.
#[derive(Deserialize)]
struct Usage {
    prompt_tokens: Option<Count>,
    completion_tokens: Option<Count>,
    input_tokens: Option<Count>,
    output_tokens: Option<Count>,
    prompt_tokens_details: Option<Details>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<Count>,
    cache_creation_input_tokens: Option<Count>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<Count>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct GeminiUsage {
    prompt_token_count: Option<Count>,
    candidates_token_count: Option<Count>,
    thoughts_token_count: Option<Count>,
    cached_content_token_count: Option<Count>,
}

/// Input, output and cached input of one usage object, normalized.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Split {
    input: Option<u64>,
    output: Option<u64>,
    cached: Option<u64>,
}

impl Usage {
    fn split(&self) -> Split {
        let details = self.prompt_tokens_details.as_ref().or(self.input_tokens_details.as_ref());
        let (read, created) = (Count::get(&self.cache_read_input_tokens), Count::get(&self.cache_creation_input_tokens));
        // Anthropic's input_tokens leave out what was read from or written to its cache
        let anthropic = read.is_some() || created.is_some();
        let input = match Count::get(&self.prompt_tokens) {
            Some(n) => Some(n),
            None if anthropic => Count::get(&self.input_tokens).map(|n| n.saturating_add(read.unwrap_or(0)).saturating_add(created.unwrap_or(0))),
            None => Count::get(&self.input_tokens),
        };
        let cached = if anthropic { read } else { details.and_then(|d| Count::get(&d.cached_tokens)) };
        Split { input, output: Count::get(&self.completion_tokens).or(Count::get(&self.output_tokens)), cached }
    }
}

impl GeminiUsage {
    fn split(&self) -> Split {
        let output = match (Count::get(&self.candidates_token_count), Count::get(&self.thoughts_token_count)) {
            (None, None) => None,
            (c, t) => Some(c.unwrap_or(0).saturating_add(t.unwrap_or(0))),
        };
        Split { input: Count::get(&self.prompt_token_count), output, cached: Count::get(&self.cached_content_token_count) }
    }
}

/// What a response said of its LLM call, as it is read (documents, then frames in order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseFacts {
    pub model: Option<String>,
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub cached: Option<u64>,
}

impl ResponseFacts {
    /// Takes what `doc` says; what it says replaces what was known.
    fn take(&mut self, doc: Doc) {
        let started = doc.kind.and_then(Loose::model).as_deref() == Some("message_start");
        let mut split = Split::default();
        if let Some(u) = &doc.usage {
            split = u.split();
        }
        if let Some(g) = &doc.usage_metadata {
            split = g.split();
        }
        if let (true, Some(m)) = (started, doc.message) {
            if let Some(model) = m.model.and_then(Loose::model) {
                self.model = Some(model);
            }
            if let Some(u) = &m.usage {
                split = u.split();
            }
        }
        if let Some(model) = doc.model.and_then(Loose::model).or_else(|| doc.model_version.and_then(Loose::model)) {
            self.model = Some(model);
        }
        self.input = split.input.or(self.input);
        self.output = split.output.or(self.output);
        self.cached = split.cached.or(self.cached);
    }

    /// Adds what `other` (read later) says.
    pub fn then(&mut self, other: ResponseFacts) {
        self.model = other.model.or(self.model.take());
        self.input = other.input.or(self.input);
        self.output = other.output.or(self.output);
        self.cached = other.cached.or(self.cached);
    }

    /// The total tokens, for a response that reports none itself (Anthropic, Gemini without
    /// `totalTokenCount` read): input + output, when both are known.
    pub fn total(&self) -> Option<u64> {
        Some(self.input?.saturating_add(self.output?).min(tollgate_wire::usage::MAX_TOKENS))
    }

    /// The facts as a usage event carries them, with the model the request asked for.
    pub fn into_usage(self, requested_model: Option<String>) -> Option<LlmUsage> {
        // cached input is part of the input: without the input it says nothing billable
        let cached = match (self.cached, self.input) {
            (Some(c), Some(i)) => Some(c.min(i)),
            _ => None,
        };
        let u = LlmUsage {
            requested_model,
            model: self.model,
            input_tokens: self.input,
            output_tokens: self.output,
            cached_tokens: cached,
            cost_micros: None,
        };
        (!u.is_empty()).then_some(u)
    }
}

/// Whether a document or frame may hold usage or a model: one scan before any parsing.
fn names_facts(bytes: &[u8]) -> bool {
    bytes.windows(6).any(|w| w == b"\"usage" || w == b"\"model")
}

/// What a response body says: a JSON document's top-level facts, or — in an event stream —
/// those of every `data:` frame, in order.
pub fn response_facts(body: &[u8], event_stream: bool) -> ResponseFacts {
    let mut facts = ResponseFacts::default();
    if !names_facts(body) {
        return facts;
    }
    if let Ok(doc) = serde_json::from_slice::<Doc>(body) {
        facts.take(doc);
        return facts;
    }
    if event_stream {
        for data in body.split(|b| *b == b'\n').filter_map(|line| line.strip_prefix(b"data:")) {
            if names_facts(data) {
                if let Ok(doc) = serde_json::from_slice::<Doc>(data) {
                    facts.take(doc);
                }
            }
        }
    }
    facts
}

/// The facts of an event stream's front, which the filter drops to keep only its tail
/// (Anthropic's `message_start`, with the model and the input tokens, is the first frame):
/// read from the complete lines of `front` only.
pub fn stream_front_facts(front: &[u8]) -> ResponseFacts {
    let whole = match front.iter().rposition(|b| *b == b'\n') {
        Some(end) => &front[..end],
        None => return ResponseFacts::default(),
    };
    response_facts(whole, true)
}

/// The model a request body asks for: its top-level `model` (OpenAI, Anthropic and most
/// OpenAI-compatible APIs), when it is a [`model_name`].
pub fn request_model(body: &[u8]) -> Option<String> {
    request_ask(body).0
}

/// The model a request body asks for ([`request_model`]) and the output it allows: its
/// top-level `max_tokens` (OpenAI chat, Anthropic), `max_completion_tokens` (OpenAI chat),
/// `max_output_tokens` (OpenAI responses) or Gemini's `generationConfig.maxOutputTokens` — the
/// first present, a count as token counts are read (clamped; another type is none).
pub fn request_ask(body: &[u8]) -> (Option<String>, Option<u64>) {
    #[derive(Deserialize)]
    struct Asked {
        model: Option<Loose>,
        max_tokens: Option<Count>,
        max_completion_tokens: Option<Count>,
        max_output_tokens: Option<Count>,
        #[serde(rename = "generationConfig")]
        generation_config: Option<GenerationConfig>,
    }
    #[derive(Deserialize)]
    struct GenerationConfig {
        #[serde(rename = "maxOutputTokens")]
        max_output_tokens: Option<Count>,
    }
    if !body.windows(4).any(|w| w == b"\"max" || w == b"\"mod" || w == b"\"gen") {
        return (None, None);
    }
    let Ok(a) = serde_json::from_slice::<Asked>(body) else { return (None, None) };
    let gemini = a.generation_config.as_ref().and_then(|g| Count::get(&g.max_output_tokens));
    let max = Count::get(&a.max_tokens).or(Count::get(&a.max_completion_tokens)).or(Count::get(&a.max_output_tokens)).or(gemini);
    (a.model.and_then(Loose::model), max)
}

/// The model a Gemini-style path names: `…/models/{model}:generateContent` (and
/// `:streamGenerateContent`, Vertex AI's `…/publishers/google/models/{model}:…`).
pub fn path_model(path: &str) -> Option<String> {
    let path = path.split(['?', '#']).next()?;
    let (_, rest) = path.rsplit_once("/models/")?;
    let (model, _verb) = rest.split_once(':')?;
    model_name(model).map(str::to_string)
}

/// A JSON object's members in order, each value as its bytes in the document (duplicates kept:
/// the caller judges them).
struct Members<'a>(Vec<(std::borrow::Cow<'a, str>, &'a serde_json::value::RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut out = Vec::new();
                while let Some(member) = map.next_entry()? {
                    out.push(member);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// The request body with its top-level `model` — the string `asked` — replaced by `model`, every
/// other byte as it was (issue 42 item 4: an alias's real model for the upstream). `None` when
/// that cannot be done safely: a body that is not one UTF-8 JSON object, a `model` member absent,
/// present twice (however its name is escaped) or another value, or `model` not a model name. A
/// request that names an alias and cannot be rewritten is refused, never sent on with the alias.
pub fn rewrite_model(body: &[u8], asked: &str, model: &str) -> Option<Vec<u8>> {
    model_name(model)?;
    let text = std::str::from_utf8(body).ok()?;
    let Members(members) = serde_json::from_str(text).ok()?;
    let mut named = members.iter().filter(|(name, _)| name == "model");
    let (_, value) = named.next()?;
    if named.next().is_some() || serde_json::from_str::<String>(value.get()).ok()? != asked {
        return None;
    }
    // the value's bytes are a slice of `text`: where they start is where they are
    let start = (value.get().as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let end = start + value.get().len();
    let mut out = Vec::with_capacity(body.len() + model.len());
    out.extend_from_slice(text.get(..start)?.as_bytes());
    out.push(b'"');
    out.extend_from_slice(model.as_bytes());
    out.push(b'"');
    out.extend_from_slice(text.get(end..)?.as_bytes());
    Some(out)
}

/// The path with its Gemini-style model (`…/models/{asked}:verb`, as [`path_model`] reads it)
/// replaced by `model`; the query and everything else as they were.
pub fn rewrite_path_model(path: &str, asked: &str, model: &str) -> Option<String> {
    model_name(model)?;
    let cut = path.find(['?', '#']).unwrap_or(path.len());
    let (head, tail) = path.split_at(cut);
    let (before, rest) = head.rsplit_once("/models/")?;
    let (named, verb) = rest.split_once(':')?;
    (named == asked).then(|| format!("{before}/models/{model}:{verb}{tail}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn an_alias_is_rewritten_in_place_or_not_at_all() {
        let rw = |b: &[u8]| rewrite_model(b, "fast", "gpt-4o-mini").map(|v| String::from_utf8(v).unwrap());
        assert_eq!(rw(br#"{"model":"fast","messages":[{"content":"model: fast"}],"seed":123456789012345678901234567890}"#).as_deref(),
            Some(r#"{"model":"gpt-4o-mini","messages":[{"content":"model: fast"}],"seed":123456789012345678901234567890}"#), "every other byte kept");
        assert_eq!(rw(b"{ \"stream\" : true ,\n \"model\" :\t\"fast\" }").as_deref(), Some("{ \"stream\" : true ,\n \"model\" :\t\"gpt-4o-mini\" }"));
        assert_eq!(rw(br#"{"model":"f\u0061st"}"#).as_deref(), Some(r#"{"model":"gpt-4o-mini"}"#), "an escaped alias is the alias");
        for hostile in [
            &br#"{"model":"fast","model":"fast"}"#[..],
            br#"{"model":"fast","mod\u0065l":"o1"}"#,
            br#"{"model":"other"}"#,
            br#"{"model":["fast"]}"#,
            br#"{"messages":[]}"#,
            br#"["fast"]"#,
            br#"{"model":"fast"} trailing"#,
            b"{\"model\":\"fast\",\"x\":\"\xff\"}",
            b"",
        ] {
            assert_eq!(rw(hostile), None, "{}", String::from_utf8_lossy(hostile));
        }
        assert_eq!(rewrite_model(br#"{"model":"fast"}"#, "fast", "bad name"), None);
        let big = format!(r#"{{"model":"fast","pad":"{}"}}"#, "x".repeat(1 << 20));
        assert_eq!(rw(big.as_bytes()).map(|s| s.len()), Some(big.len() + 7));
    }

    #[test]
    fn a_gemini_alias_is_rewritten_in_the_path() {
        assert_eq!(rewrite_path_model("/v1beta/models/fast:generateContent?alt=sse&x=/models/fast:y", "fast", "gemini-2.5-flash").as_deref(),
            Some("/v1beta/models/gemini-2.5-flash:generateContent?alt=sse&x=/models/fast:y"));
        assert_eq!(rewrite_path_model("/v1beta/models/other:generateContent", "fast", "g"), None);
        assert_eq!(rewrite_path_model("/v1/chat/completions", "fast", "g"), None);
        assert_eq!(rewrite_path_model("/v1beta/models/fast:generateContent", "fast", "a b"), None);
    }

    fn facts(model: &str, input: u64, output: u64, cached: Option<u64>) -> ResponseFacts {
        ResponseFacts { model: Some(model.into()), input: Some(input), output: Some(output), cached }
    }

    #[test]
    fn openai_chat_and_responses_json() {
        let chat = br#"{"id":"c","model":"gpt-4o-mini-2024-07-18","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":7,"total_tokens":27,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        assert_eq!(response_facts(chat, false), facts("gpt-4o-mini-2024-07-18", 20, 7, Some(16)));
        let responses = br#"{"model":"gpt-4.1","output":[],"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":0},"output_tokens":9,"total_tokens":39}}"#;
        assert_eq!(response_facts(responses, false), facts("gpt-4.1", 30, 9, Some(0)));
    }

    #[test]
    fn anthropic_json_counts_cache_reads_and_writes_as_input() {
        let body = br#"{"type":"message","model":"claude-sonnet-4","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":5,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":12}}"#;
        let f = response_facts(body, false);
        assert_eq!(f, facts("claude-sonnet-4", 1105, 12, Some(1000)));
        assert_eq!(f.total(), Some(1117));
        let plain = br#"{"model":"claude-3-haiku","usage":{"input_tokens":9,"output_tokens":40}}"#;
        assert_eq!(response_facts(plain, false), facts("claude-3-haiku", 9, 40, None));
    }

    #[test]
    fn gemini_json() {
        let body = br#"{"candidates":[],"usageMetadata":{"promptTokenCount":11,"candidatesTokenCount":5,"thoughtsTokenCount":3,"totalTokenCount":19,"cachedContentTokenCount":4},"modelVersion":"gemini-2.5-flash"}"#;
        assert_eq!(response_facts(body, false), facts("gemini-2.5-flash", 11, 8, Some(4)));
    }

    #[test]
    fn openai_stream_with_include_usage() {
        let body = b"data: {\"model\":\"gpt-4o\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
data: {\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\ndata: [DONE]\n\n";
        assert_eq!(response_facts(body, true), facts("gpt-4o", 3, 2, None));
        // the same text outside an event stream is not read frame by frame
        assert_eq!(response_facts(body, false), ResponseFacts::default());
    }

    #[test]
    fn anthropic_stream_start_and_delta() {
        let body = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"model\":\"claude-opus-4\",\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"{\\\"usage\\\":{\\\"output_tokens\\\":0}}\"}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let f = response_facts(body, true);
        assert_eq!(f, facts("claude-opus-4", 35, 15, Some(10)));
        assert_eq!(f.total(), Some(50));
        // a tail that lost its front, then the front read apart: the same facts
        let cut = body.len() - 200;
        let mut front = stream_front_facts(&body[..cut]);
        front.then(response_facts(&body[cut..], true));
        assert_eq!(front, f);
    }

    #[test]
    fn content_never_counts() {
        // a `message` that is not a message_start's, a usage inside content or tool input
        let body = br#"{"content":[{"type":"tool_use","input":{"usage":{"input_tokens":0}}}],"message":{"model":"x","usage":{"input_tokens":1}}}"#;
        assert_eq!(response_facts(body, false), ResponseFacts::default());
        // a hostile model or count of another type: no value, the rest still read
        let body = br#"{"model":{"a":1},"usage":{"prompt_tokens":"9","completion_tokens":4}}"#;
        assert_eq!(response_facts(body, false), ResponseFacts { output: Some(4), ..ResponseFacts::default() });
        let body = br#"{"model":"has space","usage":{"prompt_tokens":-3,"completion_tokens":1e400}}"#;
        assert_eq!(response_facts(body, false), ResponseFacts::default(), "1e400 is no JSON number serde reads");
        let body = br#"{"model":"m","usage":{"prompt_tokens":-3,"completion_tokens":18446744073709551616}}"#;
        assert_eq!(response_facts(body, false), facts("m", 0, 1 << 53, None));
    }

    #[test]
    fn cached_is_within_input_in_the_event() {
        let f = ResponseFacts { model: None, input: Some(3), output: None, cached: Some(9) };
        assert_eq!(f.into_usage(None).unwrap().cached_tokens, Some(3));
        let f = ResponseFacts { model: None, input: None, output: Some(1), cached: Some(9) };
        assert_eq!(f.into_usage(None).unwrap().cached_tokens, None);
        assert_eq!(ResponseFacts::default().into_usage(None), None);
        assert_eq!(ResponseFacts::default().into_usage(Some("m".into())).unwrap().requested_model.as_deref(), Some("m"));
    }

    #[test]
    fn the_output_a_request_allows() {
        assert_eq!(request_ask(br#"{"model":"gpt-4o","max_tokens":50}"#), (Some("gpt-4o".into()), Some(50)));
        assert_eq!(request_ask(br#"{"max_completion_tokens":7,"model":"o1"}"#), (Some("o1".into()), Some(7)));
        assert_eq!(request_ask(br#"{"model":"gpt-4.1","max_output_tokens":9}"#).1, Some(9));
        assert_eq!(request_ask(br#"{"contents":[],"generationConfig":{"maxOutputTokens":64}}"#), (None, Some(64)));
        assert_eq!(request_ask(br#"{"model":"m","max_tokens":"many"}"#), (Some("m".into()), None), "another type is none");
        assert_eq!(request_ask(br#"{"model":"m","max_tokens":-3}"#).1, Some(0), "clamped as counts are");
        assert_eq!(request_ask(br#"{"messages":[{"content":"\"max_tokens\": 5"}]}"#), (None, None), "content is never read");
        assert_eq!(request_ask(b"max_tokens 5"), (None, None));
    }

    #[test]
    fn requested_models() {
        assert_eq!(request_model(br#"{"model":"gpt-4o","messages":[]}"#).as_deref(), Some("gpt-4o"));
        assert_eq!(request_model(br#"{"messages":[{"content":"\"model\":\"x\""}]}"#), None);
        assert_eq!(request_model(br#"{"model":7}"#), None);
        assert_eq!(request_model(br#"{"model":"a\nb"}"#), None);
        assert_eq!(request_model(b"not json \"model\""), None);
        assert_eq!(path_model("/v1beta/models/gemini-2.5-pro:generateContent").as_deref(), Some("gemini-2.5-pro"));
        assert_eq!(
            path_model("/v1/projects/p/locations/us/publishers/google/models/gemini-2.0-flash:streamGenerateContent?alt=sse").as_deref(),
            Some("gemini-2.0-flash")
        );
        assert_eq!(path_model("/v1/models"), None);
        assert_eq!(path_model("/v1/chat/completions"), None);
    }
}
