//! Model policy (issue 42 item 4): the models a plan and a key allow (allow-lists of names and
//! `prefix*` patterns) and a plan's aliases (a name a client asks for → the model the upstream
//! is asked for). Pure: parsing, matching, the verdict. A plan's per-model rate limits are
//! limits ([`crate::decision::limits`]) chosen by [`best`] on the resolved model.
//!
//! Order (decision 307): the alias is resolved first; the allow-lists (plan, then key), the
//! per-model limits, money budgets' prices and the answer's `model` all use the resolved name.
//! A request whose model cannot be read while an allow-list applies is refused (`model_required`):
//! a policy is never skipped for want of a name.

use std::collections::BTreeMap;
use tollgate_wire::llm::{model_name, MAX_MODEL};

/// The most entries of one allow-list (a plan's or a key's) and of a plan's alias map.
pub const MAX_MODELS: usize = 256;

/// A model name, or a prefix of names (`gpt-4o*`; `*` alone matches every model), as pricing
/// names dated models.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ModelPattern(String);

impl ModelPattern {
    /// A model name ([`model_name`]: 1–128 of `[A-Za-z0-9._:/@+-]`) with an optional trailing `*`.
    pub fn parse(s: &str) -> Option<ModelPattern> {
        if s.len() > MAX_MODEL {
            return None;
        }
        let ok = match s.strip_suffix('*') {
            Some("") => true,
            Some(prefix) => model_name(prefix).is_some(),
            None => model_name(s).is_some(),
        };
        ok.then(|| ModelPattern(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The prefix of a `prefix*` pattern.
    fn prefix(&self) -> Option<&str> {
        self.0.strip_suffix('*')
    }

    pub fn matches(&self, model: &str) -> bool {
        match self.prefix() {
            Some(p) => model.starts_with(p),
            None => self.0 == model,
        }
    }
}

/// The most specific of `items` whose pattern matches `model`: an exact name first, then the
/// longest prefix (of equals, the first) — as prices are chosen (decision 296).
pub fn best<'a, T>(items: &'a [T], pattern: impl Fn(&T) -> &ModelPattern, model: &str) -> Option<&'a T> {
    if let Some(exact) = items.iter().find(|x| pattern(x).prefix().is_none() && pattern(x).matches(model)) {
        return Some(exact);
    }
    items
        .iter()
        .filter(|x| pattern(x).prefix().is_some() && pattern(x).matches(model))
        .min_by_key(|x| std::cmp::Reverse(pattern(x).0.len()))
}

/// Whether an allow-list lets `model` through (an empty list allows every model).
pub fn allows(list: &[ModelPattern], model: &str) -> bool {
    list.is_empty() || list.iter().any(|p| p.matches(model))
}

/// A field that cannot be read: its path and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadModels {
    pub field: String,
    pub message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> BadModels {
    BadModels { field: field.into(), message: message.into() }
}

/// An allow-list as written (`field`: its path, for errors): at most [`MAX_MODELS`] patterns,
/// each checked; duplicates dropped, order kept.
pub fn parse_list(list: &[String], field: &str) -> Result<Vec<ModelPattern>, BadModels> {
    if list.len() > MAX_MODELS {
        return Err(bad(field, format!("at most {MAX_MODELS} models")));
    }
    let mut out: Vec<ModelPattern> = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let p = ModelPattern::parse(s).ok_or_else(|| bad(format!("{field}[{i}]"), format!("'{}' is not a model name or prefix: 1-{MAX_MODEL} of [A-Za-z0-9._:/@+-], with an optional trailing '*'", s.escape_debug())))?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

/// A plan's alias map as written: at most [`MAX_MODELS`] entries, each an exact model name to an
/// exact model name that is not itself an alias (one step: no chains, no loops).
pub fn parse_aliases(map: &BTreeMap<String, String>, field: &str) -> Result<BTreeMap<String, String>, BadModels> {
    if map.len() > MAX_MODELS {
        return Err(bad(field, format!("at most {MAX_MODELS} aliases")));
    }
    for (alias, model) in map {
        let at = format!("{field}.{}", alias.escape_debug());
        if model_name(alias).is_none() {
            return Err(bad(&at, format!("the alias is not a model name: 1-{MAX_MODEL} of [A-Za-z0-9._:/@+-]")));
        }
        if model_name(model).is_none() {
            return Err(bad(&at, format!("'{}' is not a model name: 1-{MAX_MODEL} of [A-Za-z0-9._:/@+-]", model.escape_debug())));
        }
        if map.contains_key(model) {
            return Err(bad(&at, format!("'{model}' is itself an alias: an alias names a real model")));
        }
    }
    Ok(map.clone())
}

/// Why a request's model is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// An allow-list applies and the request names no model the gateway could read: 400
    /// `model_required`.
    Required,
    /// The (resolved) model is outside the plan's allow-list (`by_key`: the key's): 403
    /// `model_not_allowed`. `asked` is the name the client sent, `model` the resolved one.
    NotAllowed { asked: String, model: String, by_key: bool },
}

impl Refusal {
    pub fn message(&self) -> String {
        match self {
            Refusal::Required => "this API key may use only some models, and this request names none the gateway can read: \
                                  name it in the JSON body's top-level \"model\" (a body of at most 1 MiB)"
                .into(),
            Refusal::NotAllowed { asked, model, by_key } => {
                let whose = if *by_key { "this API key" } else { "this API key's plan" };
                match asked == model {
                    true => format!("the model '{model}' is not allowed for {whose}"),
                    false => format!("the model '{asked}' (an alias of '{model}') is not allowed for {whose}"),
                }
            }
        }
    }
}

/// The verdict on a request asking for `asked`: the model it resolves to (`aliases` applied
/// once), or why it is refused — by the plan's allow-list `plan`, then the key's `key` (both
/// must allow; an empty list allows every model).
pub fn judge(asked: Option<&str>, aliases: &BTreeMap<String, String>, plan: &[ModelPattern], key: &[ModelPattern]) -> Result<Option<String>, Refusal> {
    let resolved = asked.map(|m| aliases.get(m).map_or(m, String::as_str).to_string());
    if plan.is_empty() && key.is_empty() {
        return Ok(resolved);
    }
    let Some(model) = resolved else { return Err(Refusal::Required) };
    let refuse = |by_key| Refusal::NotAllowed { asked: asked.unwrap_or_default().to_string(), model: model.clone(), by_key };
    if !allows(plan, &model) {
        return Err(refuse(false));
    }
    if !allows(key, &model) {
        return Err(refuse(true));
    }
    Ok(Some(model))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> ModelPattern {
        ModelPattern::parse(s).unwrap_or_else(|| panic!("{s}"))
    }

    fn list(v: &[&str]) -> Vec<ModelPattern> {
        v.iter().map(|s| p(s)).collect()
    }

    #[test]
    fn patterns_are_names_or_prefixes() {
        assert!(p("gpt-4o-mini").matches("gpt-4o-mini") && !p("gpt-4o-mini").matches("gpt-4o-mini-2024-07-18"));
        assert!(p("gpt-4o*").matches("gpt-4o-mini") && p("gpt-4o*").matches("gpt-4o") && !p("gpt-4o*").matches("gpt-4"));
        assert!(p("*").matches("anything") && p("models/gemini*").matches("models/gemini-2.5-pro"));
        for bad in ["", "**", "gpt*4", "*gpt", "gpt 4", "gpt\n", "é*", "a,b"] {
            assert_eq!(ModelPattern::parse(bad), None, "{bad:?}");
        }
        assert!(ModelPattern::parse(&"m".repeat(MAX_MODEL)).is_some());
        assert!(ModelPattern::parse(&format!("{}*", "m".repeat(MAX_MODEL))).is_none(), "128 bytes with the star");
        assert!(ModelPattern::parse(&"m".repeat(MAX_MODEL + 1)).is_none());
    }

    #[test]
    fn the_most_specific_pattern_wins() {
        let items = list(&["*", "gpt-4o*", "gpt-4o-mini*", "gpt-4o-mini"]);
        let b = |m: &str| best(&items, |x| x, m).map(ModelPattern::as_str);
        assert_eq!(b("gpt-4o-mini"), Some("gpt-4o-mini"));
        assert_eq!(b("gpt-4o-mini-2024-07-18"), Some("gpt-4o-mini*"));
        assert_eq!(b("gpt-4o"), Some("gpt-4o*"));
        assert_eq!(b("claude"), Some("*"));
        assert_eq!(best(&list(&["gpt*"]), |x| x, "claude"), None);
    }

    #[test]
    fn lists_are_bounded_and_name_the_bad_entry() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_list(&s(&["a", "b*", "a"]), "models").unwrap(), list(&["a", "b*"]));
        assert_eq!(parse_list(&s(&["a", "b c"]), "plans.p.models").unwrap_err().field, "plans.p.models[1]");
        let many: Vec<String> = (0..=MAX_MODELS).map(|i| format!("m{i}")).collect();
        assert_eq!(parse_list(&many, "models").unwrap_err().field, "models");
        assert!(parse_list(&many[..MAX_MODELS], "models").is_ok());
        let aliases = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<BTreeMap<_, _>>();
        assert!(parse_aliases(&aliases(&[("fast", "gpt-4o-mini"), ("smart", "gpt-4o")]), "a").is_ok());
        assert_eq!(parse_aliases(&aliases(&[("fast", "smart"), ("smart", "gpt-4o")]), "a").unwrap_err().field, "a.fast");
        assert_eq!(parse_aliases(&aliases(&[("fa st", "x")]), "a").unwrap_err().field, "a.fa st");
        assert_eq!(parse_aliases(&aliases(&[("f*", "x")]), "a").unwrap_err().field, "a.f*");
        assert_eq!(parse_aliases(&aliases(&[("f", "x*")]), "a").unwrap_err().field, "a.f");
        assert_eq!(parse_aliases(&aliases(&[("loop", "loop")]), "a").unwrap_err().field, "a.loop");
    }

    #[test]
    fn both_lists_must_allow_the_resolved_model() {
        let none = BTreeMap::new();
        let aliases: BTreeMap<String, String> = [("fast".to_string(), "gpt-4o-mini".to_string())].into();
        let plan = list(&["gpt-4o*", "claude-3-haiku"]);
        let key = list(&["gpt-4o-mini*"]);
        assert_eq!(judge(Some("gpt-4o"), &none, &plan, &[]), Ok(Some("gpt-4o".into())));
        assert_eq!(judge(Some("fast"), &aliases, &plan, &key), Ok(Some("gpt-4o-mini".into())), "the alias resolves first");
        assert_eq!(judge(Some("fast"), &none, &plan, &[]), Err(Refusal::NotAllowed { asked: "fast".into(), model: "fast".into(), by_key: false }));
        assert_eq!(judge(Some("gpt-4o"), &none, &plan, &key), Err(Refusal::NotAllowed { asked: "gpt-4o".into(), model: "gpt-4o".into(), by_key: true }));
        assert_eq!(judge(Some("claude-3-haiku"), &none, &[], &key), Err(Refusal::NotAllowed { asked: "claude-3-haiku".into(), model: "claude-3-haiku".into(), by_key: true }));
        assert_eq!(judge(None, &none, &plan, &[]), Err(Refusal::Required));
        assert_eq!(judge(None, &none, &[], &key), Err(Refusal::Required));
        // no allow-list: anything, or nothing, goes (aliases still resolve)
        assert_eq!(judge(None, &aliases, &[], &[]), Ok(None));
        assert_eq!(judge(Some("fast"), &aliases, &[], &[]), Ok(Some("gpt-4o-mini".into())));
        let m = Refusal::NotAllowed { asked: "fast".into(), model: "gpt-4o".into(), by_key: true }.message();
        assert!(m.contains("'fast'") && m.contains("'gpt-4o'") && m.contains("this API key"), "{m}");
    }
}
