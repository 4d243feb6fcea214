//! What a usage event says of an LLM call (issue 42, event schema v2): the model asked for, the
//! model that answered, and the tokens apart — input, output, and the part of the input read
//! from the provider's prompt cache.
//!
//! Normalized across providers (decision 290): `inputTokens` is every input token (OpenAI's
//! `prompt_tokens`/`input_tokens`, Anthropic's `input_tokens` + `cache_read_input_tokens` +
//! `cache_creation_input_tokens`, Gemini's `promptTokenCount`), `cachedTokens` the part of it
//! read from a cache (so `cachedTokens ≤ inputTokens`), `outputTokens` every generated token
//! (Gemini's thoughts included, as its `totalTokenCount` counts them).
//!
//! Every field is optional: a provider may report some and not others, and a body that could
//! not be read reports none. Model names come from clients and upstreams: a name that is not
//! [`model_name`]-valid is left out, never refused (the request is still metered).

use serde::{Deserialize, Serialize};

/// Longest model name kept.
pub const MAX_MODEL: usize = 128;

/// The LLM facts of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LlmUsage {
    /// The model the client asked for (the request body's `model`, or a Gemini path's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_model: Option<String>,
    /// The model the upstream says answered (`model`, Gemini's `modelVersion`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Of the input tokens, those read from the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// What the call cost, in micro-units of the deployment's currency: written by the sidecar
    /// that took the event, at the price in effect at the request's arrival (absent: unpriced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_micros: Option<u64>,
}

impl LlmUsage {
    /// Nothing known.
    pub fn is_empty(&self) -> bool {
        *self == LlmUsage::default()
    }

    /// The model to bill under: the one that answered, else the one asked for.
    pub fn billed_model(&self) -> Option<&str> {
        self.model.as_deref().or(self.requested_model.as_deref())
    }

    /// Why the facts cannot be stored as they are (a sidecar or consumer reading another
    /// gateway's events checks them again), `None` when they can.
    pub fn invalid_reason(&self) -> Option<&'static str> {
        let bad_model = |m: &Option<String>| m.as_deref().is_some_and(|m| model_name(m).is_none());
        if bad_model(&self.requested_model) || bad_model(&self.model) {
            return Some("llm model: 1-128 of [A-Za-z0-9._:/@+-]");
        }
        let max = crate::usage::MAX_TOKENS;
        if [self.input_tokens, self.output_tokens, self.cached_tokens, self.cost_micros].into_iter().flatten().any(|n| n > max) {
            return Some("llm tokens or cost: above 2^53");
        }
        if let (Some(cached), Some(input)) = (self.cached_tokens, self.input_tokens) {
            if cached > input {
                return Some("llm cachedTokens: more than inputTokens");
            }
        }
        None
    }
}

/// What a money budget (`spend_budget`, issue 42 item 3) needs to know of an LLM request when it
/// is decided: the most it may cost is its input (estimated from its size) and the most output
/// it lets the model write, priced at the model's rates. Sent by the filter on LLM routes only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LlmAsk {
    /// The model the request asks for (body `model`, or a Gemini path's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The request body's size in bytes (as read, else as announced by `content-length`): the
    /// sidecar estimates the input at one token per 4 bytes, rounded up.
    #[serde(default)]
    pub input_bytes: u64,
    /// The output the request allows: its `max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens` or Gemini's `generationConfig.maxOutputTokens` (absent: the limit's
    /// configured default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// When the filter took the request (ms since the epoch): the moment its usage event is
    /// priced at, so its reservation and its reconciliation use the same prices as its bill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ms: Option<u64>,
}

/// `name` as a model name when it is one: 1-[`MAX_MODEL`] bytes of ASCII letters, digits and
/// `._:/@+-` (every provider's names: `gpt-4o-mini`, `claude-3-5-sonnet-20241022`,
/// `models/gemini-1.5-pro-002`, `meta-llama/Llama-3-8b@v2`). Anything else is no name.
pub fn model_name(name: &str) -> Option<&str> {
    let ok = |b: u8| b.is_ascii_alphanumeric() || b".:/@+-_".contains(&b);
    (!name.is_empty() && name.len() <= MAX_MODEL && name.bytes().all(ok)).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names() {
        for good in ["gpt-4o-mini", "claude-3-5-sonnet-20241022", "models/gemini-1.5-pro-002", "meta-llama/Llama-3-8b@v2", "a_b+c:d"] {
            assert_eq!(model_name(good), Some(good));
        }
        for bad in ["", "gpt 4", "gpt\n4", "é", "a\"b", "{x}"] {
            assert_eq!(model_name(bad), None, "{bad:?}");
        }
        assert!(model_name(&"m".repeat(MAX_MODEL)).is_some());
        assert!(model_name(&"m".repeat(MAX_MODEL + 1)).is_none());
    }

    #[test]
    fn validation_and_json() {
        let u = LlmUsage {
            requested_model: Some("fast".into()),
            model: Some("gpt-4o-mini".into()),
            input_tokens: Some(10),
            output_tokens: Some(5),
            cached_tokens: Some(4),
            cost_micros: None,
        };
        assert_eq!(u.invalid_reason(), None);
        assert_eq!(u.billed_model(), Some("gpt-4o-mini"));
        let s = serde_json::to_string(&u).unwrap();
        assert_eq!(s, r#"{"requestedModel":"fast","model":"gpt-4o-mini","inputTokens":10,"outputTokens":5,"cachedTokens":4}"#);
        assert_eq!(serde_json::from_str::<LlmUsage>(&s).unwrap(), u);
        assert!(LlmUsage { cached_tokens: Some(11), ..u.clone() }.invalid_reason().is_some());
        assert!(LlmUsage { model: Some("a b".into()), ..u.clone() }.invalid_reason().is_some());
        assert!(LlmUsage { output_tokens: Some((1 << 53) + 1), ..u }.invalid_reason().is_some());
        assert!(LlmUsage::default().is_empty());
        assert_eq!(LlmUsage { requested_model: Some("x".into()), ..LlmUsage::default() }.billed_model(), Some("x"));
    }
}
