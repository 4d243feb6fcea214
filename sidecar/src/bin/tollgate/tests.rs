//! The CLI's argument parsing (no admin API needed).

use super::*;

#[test]
fn model_limits_parse_from_the_command_line() {
    assert_eq!(parse_model_limit("gpt-4o*=60:90000").unwrap(), json!({"model": "gpt-4o*", "requests_per_minute": 60, "tokens_per_minute": 90000}));
    assert_eq!(parse_model_limit("ft:gpt-4o:org=:500").unwrap(), json!({"model": "ft:gpt-4o:org", "tokens_per_minute": 500}));
    for bad in ["gpt-4o", "m=60", "m=x:1"] {
        assert!(parse_model_limit(bad).is_err(), "{bad}");
    }
    let cli = Cli::try_parse_from(["tollgate", "plans", "set", "p", "--model", "gpt-4o*,claude*", "--alias", "fast=gpt-4o-mini", "--model-limit", "gpt-4o*=60:"]).unwrap();
    assert!(matches!(&cli.command, Command::Plans { action: PlanAction::Set { models, aliases, .. } } if models.len() == 2 && aliases == &["fast=gpt-4o-mini"]));
}

#[test]
fn keys_take_the_global_json_flag() {
    let cli = Cli::try_parse_from(["tollgate", "keys", "list", "--json"]).unwrap();
    assert!(cli.json && matches!(cli.command, Command::Keys { action: KeyCommand::List { tenant: None } }));
    let cli = Cli::try_parse_from(["tollgate", "keys", "create", "--tenant", "t", "--plan", "p", "--route", "a,b", "--method", "GET", "--method", "POST"]).unwrap();
    assert!(matches!(&cli.command, Command::Keys { action: KeyCommand::Create { scope, .. } } if scope.routes == ["a", "b"] && scope.methods == ["GET", "POST"]));
    assert!(Cli::try_parse_from(["tollgate", "keys", "update", "key_a", "--no-scopes", "--route", "a"]).is_err(), "clearing and setting at once");
    let cli = Cli::try_parse_from(["tollgate", "keys", "create", "--tenant", "t", "--plan", "p", "--model", "gpt-4o*,claude-3-haiku"]).unwrap();
    assert!(matches!(&cli.command, Command::Keys { action: KeyCommand::Create { scope, .. } } if scope.models == ["gpt-4o*", "claude-3-haiku"] && scope.scopes_json()["models"][1] == "claude-3-haiku"));
    assert!(Cli::try_parse_from(["tollgate", "keys", "update", "key_a", "--no-scopes", "--model", "a"]).is_err());
    let cli = Cli::try_parse_from(["tollgate", "keys", "rotate", "key_a", "--overlap", "2s"]).unwrap();
    assert!(matches!(cli.command, Command::Keys { action: KeyCommand::Rotate { key_id, overlap: Some(o) } } if key_id == "key_a" && o == "2s"));
    <Cli as clap::CommandFactory>::command().debug_assert();
}

#[test]
fn the_token_comes_from_the_environment_or_a_file() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "from-the-file-0123456789\n").unwrap();
    assert_eq!(admin_token(None, Some(&file)).unwrap(), "from-the-file-0123456789");
    assert_eq!(admin_token(Some("given".into()), Some(&file)).unwrap(), "given");
    assert!(admin_token(None, None).unwrap_err().to_string().contains("TOLLGATE_ADMIN_TOKEN"));
    std::fs::write(&file, "  \n").unwrap();
    assert!(admin_token(None, Some(&file)).is_err());
    let cli = Cli::try_parse_from(["tollgate", "--token-file", "/x", "version"]).unwrap();
    assert_eq!(cli.token_file.as_deref(), Some(std::path::Path::new("/x")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prices_take_integer_rates_only() {
    let cli = Cli::try_parse_from(["tollgate", "prices", "set", "mini", "--model", "gpt-4o-mini*", "--input", "150000", "--output", "600000", "--from", "2026-03-01"]).unwrap();
    assert!(matches!(cli.command, Command::Prices { action: PriceAction::Set { input: 150000, cached: None, .. } }));
    for bad in ["0.15", "-1", "1e3"] {
        assert!(Cli::try_parse_from(["tollgate", "prices", "set", "m", "--model", "m", "--input", bad, "--output", "1"]).is_err(), "{bad}");
    }
    assert!(Cli::try_parse_from(["tollgate", "prices", "list", "--json"]).unwrap().json);
}

#[test]
fn limits_parse_from_the_short_form() {
    assert_eq!(parse_limit("pm:fixed_window:10:60s").unwrap(), json!({"name": "pm", "algorithm": "fixed_window", "limit": 10, "window": "60s"}));
    assert_eq!(parse_limit("c:concurrency:2::header:x-user").unwrap()["subject"], "header:x-user");
    assert!(parse_limit("pm:fixed_window").is_err());
    assert!(parse_limit("pm:fixed_window:many").is_err());
}

#[test]
fn tables_render_cells() {
    let v = json!({"id": "r", "match": {"path_prefix": "/a", "method": "GET"}, "products": ["a", "b"], "x": null});
    assert_eq!(cell(&v, "match"), "method=GET path_prefix=/a");
    assert_eq!(cell(&v, "products"), "a,b");
    assert_eq!(cell(&v, "x"), "-");
}
