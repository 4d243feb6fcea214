//! Plans as configured, validated (super::Plans::compile), and the lease policy.

use super::*;

/// decide.lua's `LEASE_EPOCH` is the longest a lease lives (decision 187): a lease outliving
/// it would be forgotten by its bucket while still spendable.
#[test]
fn the_scripts_lease_epoch_is_the_longest_lease() {
    let script = include_str!("../../../lua/decide.lua");
    assert!(script.contains(&format!("local LEASE_EPOCH = {LEASE_MAX_TTL_MS}\n")));
}
use tollgate_tests::fixtures::limit_toml;

/// `toml_text` is refused with an error that mentions `needle`.
fn refused(toml_text: &str, needle: &str) {
    let err = plans(toml_text).unwrap_err();
    assert!(err.contains(needle), "{err} should mention {needle}");
}

fn plans(toml_text: &str) -> Result<Plans, String> {
    #[derive(Deserialize)]
    struct W {
        plans: BTreeMap<String, PlanConfig>,
    }
    let w: W = toml::from_str(toml_text).map_err(|e| e.to_string())?;
    Plans::compile(&w.plans).map_err(|e| e.to_string())
}

#[test]
fn plans_compile_with_defaults_and_refuse_bad_limits() {
    let p = plans(
        &[
            limit_toml("gold", "per-min", "fixed_window", 10, ""),
            limit_toml("gold", "conc", "concurrency", 2, "subject = \"tenant\""),
            limit_toml("gold", "by-user", "sliding_log", 5, "subject = \"header:X-User\"\nclass = \"auth\""),
        ]
        .concat(),
    )
    .unwrap();
    let l = p.limits("gold");
    assert_eq!(l.len(), 3);
    assert_eq!(l[0].window_ms, 60_000);
    assert_eq!(l[1].window_ms, 300_000);
    assert_eq!(l[0].failure_mode, LimitFailureMode::Open);
    assert!(l[2].auth_class);
    assert_eq!(p.subject_headers(), vec!["x-user"]);
    assert!(p.limits("unknown").is_empty());

    for (bad, needle) in [
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 0", "limit"),
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nsubject = \"nobody\"", "subject"),
        ("name = \"a b\"\nalgorithm = \"fixed_window\"\nlimit = 1", "name"),
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nclass = \"auth\"", "class"),
        ("name = \"a\"\nalgorithm = \"leaky\"\nlimit = 1", "unknown variant"),
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nlimt = 2", "unknown field"),
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 9007199254740993", "limit: must be at most 9007199254740992"),
        ("name = \"a\"\nalgorithm = \"token_budget\"\nlimit = 10\nestimate = 9007199254740993", "estimate"),
        ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 5\ncost = 6", "cost: must be at most the limit (5)"),
        ("name = \"a\"\nalgorithm = \"sliding_log\"\nlimit = 1000000000", "use sliding_window"),
        ("name = \"a\"\nalgorithm = \"sliding_log\"\nlimit = 50000\ncost = 2000", "use sliding_window"),
        ("name = \"a\"\nalgorithm = \"concurrency\"\nlimit = 10\ncost = 5", "cost must be 1"),
    ] {
        refused(&format!("[[plans.p.limits]]\n{bad}"), needle);
    }
    let err = plans("[[plans.p.limits]]\nname=\"a\"\nalgorithm=\"fixed_window\"\nlimit=1\n[[plans.p.limits]]\nname=\"a\"\nalgorithm=\"token_bucket\"\nlimit=1").unwrap_err();
    assert!(err.contains("twice"), "{err}");
}

#[test]
fn local_failure_mode_is_for_windows_logs_and_buckets() {
    for a in ["fixed_window", "sliding_window", "sliding_log", "token_bucket"] {
        let p = plans(&format!("[[plans.p.limits]]\nname = \"a\"\nalgorithm = \"{a}\"\nlimit = 9\nfailure_mode = \"local\"")).unwrap();
        assert_eq!(p.limits("p")[0].failure_mode, LimitFailureMode::Local, "{a}");
    }
    for a in ["token_budget", "concurrency"] {
        let err = plans(&format!("[[plans.p.limits]]\nname = \"tok\"\nalgorithm = \"{a}\"\nlimit = 9\nfailure_mode = \"local\"")).unwrap_err();
        assert!(err.contains("plans.p.limits[0].failure_mode") && err.contains("'tok'") && err.contains("open or closed"), "{err}");
    }
}

#[test]
fn a_spend_budget_has_a_period_an_output_bound_and_a_zone() {
    let p = plans("[[plans.p.limits]]\nname = \"d\"\nalgorithm = \"spend_budget\"\nlimit = 5\nperiod = \"day\"\nmax_output_tokens = 64\nunpriced = \"refuse\"\nutc_offset = \"-08:00\"\n").unwrap();
    let l = &p.limits("p")[0];
    let spend = SpendSpec { period: Period::Day, max_output_tokens: 64, unpriced: Unpriced::Refuse, offset_min: -480 };
    assert_eq!((l.spend, l.window_ms), (Some(spend), 86_400_000));
    let month = plans("[[plans.p.limits]]\nname = \"m\"\nalgorithm = \"spend_budget\"\nlimit = 5\n").unwrap();
    assert_eq!((month.limits("p")[0].spend, month.limits("p")[0].window_ms), (Some(SpendSpec::default()), 30 * 86_400_000));
    for (bad, needle) in [
        ("algorithm = \"fixed_window\"\nlimit = 1\nperiod = \"day\"", "spend_budget limits only"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nestimate = 5", "max_output_tokens"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nmax_output_tokens = 0", "max_output_tokens"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nutc_offset = \"CET\"", "utc_offset"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nperiod = \"week\"", "unknown variant"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nfailure_mode = \"local\"", "open or closed"),
        ("algorithm = \"spend_budget\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
        ("algorithm = \"spend_budget\"\nlimit = 9007199254740993", "2^53"),
    ] {
        refused(&format!("[[plans.p.limits]]\nname = \"a\"\n{bad}"), needle);
    }
}

/// Issue 42 item 4: a plan's models, aliases and per-model limits, each bad entry named.
#[test]
fn a_model_policy_compiles_into_patterns_aliases_and_limits_per_model() {
    let p = plans(
        "[plans.p]\nmodels = [\"gpt-4o*\", \"claude-3-haiku\"]\nmodel_aliases = { fast = \"gpt-4o-mini\" }\n\
         [[plans.p.limits]]\nname = \"all\"\nalgorithm = \"fixed_window\"\nlimit = 9\n\
         [[plans.p.model_limits]]\nmodel = \"gpt-4o*\"\nrequests_per_minute = 60\ntokens_per_minute = 90000\nsubject = \"tenant\"\n\
         [[plans.p.model_limits]]\nmodel = \"*\"\nrequests_per_minute = 5\nfailure_mode = \"local\"\n\
         [[plans.p.model_limits]]\nmodel = \"gpt-4o-mini\"\nname = \"mini\"\ntokens_per_minute = 100\nmax_output_tokens = 64\n\
         [plans.q]\n",
    )
    .unwrap();
    let m = p.models("p").unwrap();
    assert_eq!((m.allow.len(), m.aliases["fast"].as_str()), (2, "gpt-4o-mini"));
    let names = |model: &str| m.limits_for(model).iter().map(|l| (l.name.to_string(), l.algorithm, l.limit)).collect::<Vec<_>>();
    assert_eq!(names("gpt-4o"), vec![("gpt-4o_.rpm".into(), Algorithm::SlidingWindow, 60), ("gpt-4o_.tpm".into(), Algorithm::TokensPerMinute, 90000)]);
    assert_eq!(names("gpt-4o-mini"), vec![("mini.tpm".into(), Algorithm::TokensPerMinute, 100)], "the exact entry");
    assert_eq!(names("llama"), vec![("all.rpm".into(), Algorithm::SlidingWindow, 5)]);
    let mini = &m.limits_for("gpt-4o-mini")[0];
    assert_eq!((mini.estimate, mini.window_ms, mini.subject.clone()), (64, 60_000, SubjectKind::Key));
    assert_eq!(m.limits_for("gpt-4o")[0].subject, SubjectKind::Tenant);
    assert!(p.any_local(), "a per-model limit counts as the plan's");
    assert!(p.models("q").is_none() && p.models("nope").is_none());
    // written back as given (admin JSON), absent when unset
    let cfg: PlanConfig = toml::from_str("models = [\"a\"]").unwrap();
    assert_eq!(serde_json::to_value(&cfg).unwrap(), serde_json::json!({"limits": [], "models": ["a"]}));
    for (bad, needle) in [
        ("models = [\"gpt 4\"]", "plans.p.models[0]"),
        ("model_aliases = { fast = \"x*\" }", "plans.p.model_aliases.fast"),
        ("model_aliases = { a = \"b\", b = \"c\" }", "plans.p.model_aliases.a"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"", "plans.p.model_limits[0]: give requests_per_minute"),
        ("[[plans.p.model_limits]]\nmodel = \"m*x\"\nrequests_per_minute = 1", "plans.p.model_limits[0].model"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 0", "plans.p.model_limits[0].requests_per_minute"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\ntokens_per_minute = 9007199254740993", "plans.p.model_limits[0].tokens_per_minute"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 1\nmax_output_tokens = 5", "plans.p.model_limits[0].max_output_tokens"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\ntokens_per_minute = 1\nfailure_mode = \"local\"", "plans.p.model_limits[0].failure_mode"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 1\nsubject = \"who\"", "plans.p.model_limits[0].subject"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 1\n[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 2", "plans.p.model_limits[1].model"),
        ("[[plans.p.model_limits]]\nmodel = \"a*\"\nrequests_per_minute = 1\n[[plans.p.model_limits]]\nmodel = \"a_\"\nrequests_per_minute = 2", "plans.p.model_limits[1].name: 'a_.rpm' is used twice"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nname = \"a b\"\nrequests_per_minute = 1", "plans.p.model_limits[0].name"),
        (&format!("[[plans.p.model_limits]]\nmodel = \"{}\"\nrequests_per_minute = 1", "m".repeat(61)), "give the entry a name"),
        ("[[plans.p.model_limits]]\nmodel = \"m\"\nrequests_per_minute = 1\nwindow = \"1s\"", "unknown field"),
    ] {
        refused(&format!("[plans.p]\n{bad}"), needle);
    }
    let many: String = (0..=MAX_MODEL_LIMITS).map(|i| format!("[[plans.p.model_limits]]\nmodel = \"m{i}\"\nrequests_per_minute = 1\n")).collect();
    refused(&many, "plans.p.model_limits: at most 256");
}

#[test]
fn leased_mode_is_for_fixed_windows_and_buckets_per_key_tenant_or_product() {
    let p = plans(
        "[[plans.p.limits]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 9\nmode = \"leased\"\n\
         [[plans.p.limits]]\nname = \"b\"\nalgorithm = \"token_bucket\"\nlimit = 9\nmode = \"leased\"\nsubject = \"tenant\"\n\
         [[plans.q.limits]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 9\nmode = \"leased\"\n\
         [[plans.q.limits]]\nname = \"b\"\nalgorithm = \"fixed_window\"\nlimit = 9\n",
    )
    .unwrap();
    assert!(leasable(p.limits("p")));
    assert!(!leasable(p.limits("q")), "one exact limit makes every request exact");
    assert!(!leasable(&[]));
    assert_eq!(p.limits("q")[1].mode, LimitMode::Exact);
    for (bad, needle) in [
        ("algorithm = \"sliding_window\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
        ("algorithm = \"sliding_log\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
        ("algorithm = \"concurrency\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
        ("algorithm = \"token_budget\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
        ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"leased\"\nsubject = \"client_ip\"", "per key"),
        ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"leased\"\nshadow = true", "shadow"),
        ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"sometimes\"", "unknown variant"),
    ] {
        refused(&format!("[[plans.p.limits]]\nname = \"a\"\n{bad}"), needle);
    }
    // exact is the default and is not written back (admin JSON stays as it was)
    let cfg = LimitConfig {
        name: "a".into(),
        algorithm: Algorithm::FixedWindow,
        subject: "key".into(),
        limit: 1,
        window: None,
        cost: 1,
        estimate: None,
        shadow: false,
        failure_mode: LimitFailureMode::Open,
        class: None,
        mode: LimitMode::Exact,
        period: None,
        max_output_tokens: None,
        unpriced: None,
        utc_offset: None,
    };
    assert!(!serde_json::to_string(&cfg).unwrap().contains(r#""mode""#));
    let leased = LimitConfig { mode: LimitMode::Leased, ..cfg };
    assert!(serde_json::to_string(&leased).unwrap().contains(r#""mode":"leased""#));
}

#[test]
fn lease_lifetime_is_bounded_by_the_window_the_key_and_the_maximum() {
    let mut fixed = Limit::example(Algorithm::FixedWindow, SubjectKind::Key);
    fixed.window_ms = 1_000;
    let bucket = Limit::example(Algorithm::TokenBucket, SubjectKind::Key);
    let t = 1_000_000u64;
    assert_eq!(lease_ttl_ms(std::slice::from_ref(&bucket), t, u64::MAX), LEASE_MAX_TTL_MS);
    assert_eq!(lease_ttl_ms(std::slice::from_ref(&bucket), t, 200), 200, "the key expires first");
    assert_eq!(lease_ttl_ms(&[bucket.clone(), fixed.clone()], t + 700, u64::MAX), 300, "the window ends first");
    assert_eq!(lease_ttl_ms(&[fixed.clone()], t + 960, u64::MAX), 0, "too short to be worth units");
    assert_eq!(lease_ttl_ms(&[fixed], t + 999, u64::MAX), 0);
}
