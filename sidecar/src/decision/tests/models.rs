//! The model policy in the decision (issue 42 item 4).

use super::*;

/// Issue 42 item 4 (decisions 305-309): on an LLM request the model policy refuses before any
/// limit (403 `model_not_allowed`, 400 `model_required`), aliases resolve first, a key's models
/// narrow its plan's, the entry of `model_limits` matching the resolved model adds its limits to
/// the decision, and no answer under a model policy is ever reusable.
#[tokio::test]
async fn the_model_policy_refuses_before_the_limits_and_its_answers_are_never_reused() {
    let lab = Lab::new(Duration::from_secs(60));
    let with_models = |raw: &str, plan: &str, models: &[&str]| {
        let hash = lab.key(raw, plan, KeyStatus::Active);
        let mut r = lab.store.mem().records[hash.as_str()].clone();
        r.scopes = crate::scopes::KeyScopes::from_lists(&[], &[], &[], &[], &models.iter().map(|m| m.to_string()).collect::<Vec<_>>()).unwrap();
        lab.store.put(&hash, r);
        hash
    };
    let plan_key = lab.key("p", "models", KeyStatus::Active);
    let narrowed = with_models("n", "models", &["claude*"]);
    let free_scoped = with_models("f", "free", &["gpt-4o"]);
    let ask = |hash: &KeyHash, model: Option<&str>| DecideRequest {
        llm: Some(tollgate_wire::llm::LlmAsk { model: model.map(str::to_string), input_bytes: 400, max_output_tokens: None, start_ms: None }),
        ..req(hash)
    };
    let allowed_unreused = |r: DecideResponse| match r {
        DecideResponse::Allow { cache_for_ms, ticket, model, .. } => {
            assert_eq!(cache_for_ms, None, "never reused under a model policy");
            assert!(model.is_none() || model.as_deref() == Some("gpt-4o-mini"), "{model:?}");
            ticket
        }
        other => panic!("{other:?}"),
    };
    let calls = || lab.store.mem().calls.len();
    // the plan's list: a name by prefix, a model outside it, an alias of a model outside it
    allowed_unreused(lab.decide(&ask(&plan_key, Some("gpt-4o"))).await);
    let before = calls();
    assert_eq!(denied(&lab.decide(&ask(&plan_key, Some("gpt-3.5-turbo"))).await), (403, "model_not_allowed"));
    match lab.decide(&ask(&plan_key, Some("big"))).await {
        DecideResponse::Deny { status: 403, message, .. } => assert!(message.contains("'big'") && message.contains("'o1'"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(denied(&lab.decide(&ask(&plan_key, None)).await), (400, "model_required"));
    assert_eq!(calls(), before, "a refused model reached the limits");
    // an LLM route whose body was not read (no `llm` from the filter) names no model either
    let mut routes = HashMap::new();
    routes.insert("chat".to_string(), RouteEffect { product: None, plan: None, cache: None, llm: true });
    lab.decider.set_routing(Routing::new(Default::default(), routes, HashMap::new()));
    assert_eq!(denied(&lab.decide(&DecideRequest { route: Some("chat".into()), ..req(&plan_key) }).await), (400, "model_required"));
    // not an LLM request: no model to judge, and still no reusable answer for the plan
    allowed_unreused(lab.decide(&req(&plan_key)).await);
    // the key narrows the plan: both must allow
    assert_eq!(denied(&lab.decide(&ask(&narrowed, Some("gpt-4o"))).await), (403, "model_not_allowed"));
    allowed_unreused(lab.decide(&ask(&narrowed, Some("claude-3-haiku"))).await);
    assert_eq!(denied(&lab.decide(&ask(&narrowed, Some("claude-3-opus"))).await), (403, "model_not_allowed"), "the plan's list too");
    // a key's models on a plan without a policy
    assert_eq!(denied(&lab.decide(&ask(&free_scoped, Some("gpt-4o-mini"))).await), (403, "model_not_allowed"));
    allowed_unreused(lab.decide(&ask(&free_scoped, Some("gpt-4o"))).await);
    // the alias resolves to gpt-4o-mini, whose entry adds its two limits: requests (a sliding
    // window) and tokens per minute (reserved: 400 bytes / 4 + the entry's 100 out)
    let aliased = lab.decide(&ask(&plan_key, Some("fast"))).await;
    assert!(matches!(&aliased, DecideResponse::Allow { model: Some(m), .. } if m == "gpt-4o-mini"), "the answer names the real model: {aliased:?}");
    let ticket = allowed_unreused(aliased).expect("tokens per minute hold a reservation");
    match lab.decide(&ask(&plan_key, Some("gpt-4o"))).await {
        DecideResponse::Allow { model, .. } => assert_eq!(model, None, "no alias, nothing to rewrite"),
        other => panic!("{other:?}"),
    }
    let call = lab.store.last_call().unwrap();
    let (keys, _) = call.encode();
    let minute = T0 / 60_000;
    assert_eq!(keys[0], format!("rate:{{acme}}:gpt-4o-mini_.rpm:k.key_p:{minute}"));
    assert_eq!(keys[2], format!("q:tpm:{{acme}}:gpt-4o-mini_.tpm:k.key_p:{minute}"));
    assert_eq!(ticket.budgets, vec![BudgetHold { limit: "gpt-4o-mini_.tpm".into(), subject: "k.key_p".into(), period: minute as u32, reserved: 200, priced_at_ms: None }]);
    // completion reconciles the minute's counter to the tokens used
    lab.decider.complete(&Completion { ticket, status: 200, tokens: Some(57), llm: None }).await.unwrap();
    let done = lab.store.mem().completions.last().cloned().unwrap();
    assert_eq!((done.budget.map(|(c, _)| c.as_str().to_string()), done.actual, done.estimate), (Some(keys[2].clone()), 57, 200));
    // the dated model counts in the same entry; the third request of the minute is refused
    allowed_unreused(lab.decide(&ask(&plan_key, Some("gpt-4o-mini-2024-07-18"))).await);
    match lab.decide(&ask(&plan_key, Some("fast"))).await {
        DecideResponse::Deny { status: 429, error, limit, .. } => assert_eq!((error.as_str(), limit.as_deref()), ("rate_limited", Some("gpt-4o-mini_.rpm"))),
        other => panic!("{other:?}"),
    }
    // another model of the plan has no entry: no limits, no call
    let before = calls();
    allowed_unreused(lab.decide(&ask(&plan_key, Some("gpt-4o"))).await);
    assert_eq!(calls(), before);
}
