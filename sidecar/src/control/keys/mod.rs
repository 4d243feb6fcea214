//! API-key management as people drive it, one implementation for both command lines —
//! `tollgate-sidecar keys …` (straight to Redis, the file source's store of record) and
//! `tollgate keys …` (through the admin API): the commands, the lifetime rule of a new key (the
//! admin API applies it too), and how an issued key is printed (its raw value alone on the last
//! line, where scripts read it).

pub mod ops;

pub use ops::{create, expiry, get, revoke, rotate, update, BadLifetime, KeyChange, KeyError};

use crate::apikey::KeyPage;
use crate::keys::Id;
use axum::http::Uri;

/// `keys create | revoke | rotate | list`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Subcommand)]
pub enum KeyCommand {
    /// Issue a key: prints its id, then the raw key alone on the last line (shown only now).
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        plan: String,
        /// Lifetime, e.g. "30d" or "12h"; default: never expires.
        #[arg(long)]
        expires_in: Option<String>,
        #[command(flatten)]
        scope: ScopeArgs,
    },
    /// Change a key's label and scopes (only those given; the scopes given replace all of them).
    Update {
        key_id: String,
        #[command(flatten)]
        scope: ScopeArgs,
        /// Remove every scope: the key may reach whatever its tenant subscribes to.
        #[arg(long, conflicts_with_all = ["routes", "products", "methods", "networks", "models"])]
        no_scopes: bool,
    },
    /// Revoke a key by its id.
    Revoke { key_id: String },
    /// Rotate a key: prints its successor's id, then the successor's raw key alone on the last
    /// line (shown only now); the old key keeps working for the overlap, then expires.
    Rotate {
        key_id: String,
        /// How long the old key keeps working, e.g. "24h" (the default) or "2s"; at most 30d.
        #[arg(long)]
        overlap: Option<String>,
    },
    /// List keys (never their hashes or raw values).
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
}

/// A key's label and scopes on the command line (each list comma-separated or repeated).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ScopeArgs {
    /// What the key is for, shown in listings.
    #[arg(long)]
    pub label: Option<String>,
    /// Routes (ids) the key may be used on; default: any.
    #[arg(long = "route", value_delimiter = ',')]
    pub routes: Vec<String>,
    /// API products (ids) the key may be used for; default: any its tenant subscribes to.
    #[arg(long = "product", value_delimiter = ',')]
    pub products: Vec<String>,
    /// HTTP methods (upper case) the key may be used with; default: any.
    #[arg(long = "method", value_delimiter = ',')]
    pub methods: Vec<String>,
    /// Client networks (CIDRs or addresses) the key may be used from; default: any.
    #[arg(long = "network", value_delimiter = ',')]
    pub networks: Vec<String>,
    /// Models (names, or prefixes ending in '*') the key may ask for on LLM routes, within its
    /// plan's; default: any its plan allows.
    #[arg(long = "model", value_delimiter = ',')]
    pub models: Vec<String>,
}

impl ScopeArgs {
    /// Whether any scope list was given.
    pub fn any_scope(&self) -> bool {
        !(self.routes.is_empty() && self.products.is_empty() && self.methods.is_empty() && self.networks.is_empty() && self.models.is_empty())
    }

    /// The scopes as the admin API takes them.
    pub fn scopes_json(&self) -> serde_json::Value {
        serde_json::json!({"routes": self.routes, "products": self.products, "methods": self.methods, "networks": self.networks, "models": self.models})
    }
}

/// What is printed when a key is issued; `expires` is printed when given.
pub fn issued_text(key_id: &str, tenant: &str, plan: &str, expires: Option<&str>, raw: &str) -> String {
    let mut out = format!("key id:  {key_id}\ntenant:  {tenant}\nplan:    {plan}\n");
    if let Some(e) = expires {
        out.push_str(&format!("expires: {e}\n"));
    }
    out.push_str("The raw key is shown only now; store it safely:\n");
    out.push_str(raw);
    out
}

/// `GET /v1/keys`' query: `tenant=<id>`, and a page (`limit`, 1..=10 000; `after=<key id>`,
/// only with a limit). Ids need no percent-decoding: they are plain ASCII. Other parameters, a
/// parameter twice, or a value out of its bounds are refused, naming the field.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub tenant: Option<Id>,
    pub page: Option<KeyPage>,
}

pub fn list_query(uri: &Uri) -> Result<ListQuery, (&'static str, String)> {
    let (mut tenant, mut limit, mut after) = (None, None, None);
    for pair in uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (slot, field) = match name {
            "tenant" => (&mut tenant, "tenant"),
            "limit" => (&mut limit, "limit"),
            "after" => (&mut after, "after"),
            _ => return Err(("query", format!("unknown query parameter '{pair}'"))),
        };
        if slot.replace(value).is_some() {
            return Err((field, format!("'{field}' given twice")));
        }
    }
    let tenant = tenant.map(|t| Id::parse(t).ok_or(("tenant", "not a tenant id".to_string()))).transpose()?;
    let after = after.map(|a| Id::parse(a).ok_or(("after", "not a key id".to_string()))).transpose()?;
    let page = match limit {
        None if after.is_some() => return Err(("after", "'after' pages a listing: give 'limit' too".into())),
        None => None,
        Some(l) => match l.parse::<usize>() {
            Ok(limit @ 1..=KeyPage::MAX_LIMIT) if l.bytes().all(|b| b.is_ascii_digit()) => Some(KeyPage { after, limit }),
            _ => return Err(("limit", format!("a page is 1 to {} keys (digits only)", KeyPage::MAX_LIMIT))),
        },
    };
    Ok(ListQuery { tenant, page })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lifetime_is_at_least_a_second_and_above_zero() {
        assert_eq!(expiry(None, 100).unwrap(), None);
        assert_eq!(expiry(Some("30d"), 100).unwrap(), Some(100 + 30 * 86_400));
        assert_eq!(expiry(Some("10ms"), 100).unwrap(), Some(101));
        assert!(matches!(expiry(Some("0s"), 100), Err(BadLifetime::Zero)));
        assert!(matches!(expiry(Some("soon"), 100), Err(BadLifetime::Unreadable(_))));
        // a lifetime that would overflow `now + secs` (and its milliseconds) is refused
        assert!(matches!(expiry(Some("500000000y"), 100), Err(BadLifetime::TooLong)));
        assert!(matches!(expiry(Some("101y"), 100), Err(BadLifetime::TooLong)));
        assert!(expiry(Some("99y"), 100).unwrap().is_some());
    }

    #[test]
    fn the_raw_key_is_alone_on_the_last_line() {
        let text = issued_text("key_1", "acme", "gold", Some("never"), "tg_x");
        assert_eq!(text.lines().last(), Some("tg_x"));
        assert_eq!(text.lines().next(), Some("key id:  key_1"));
        assert!(text.contains("expires: never\n"));
        assert!(!issued_text("key_1", "acme", "gold", None, "tg_x").contains("expires"));
    }

    #[test]
    fn a_key_listings_query_is_checked_field_by_field() {
        let q = |s: &str| list_query(&format!("/v1/keys{s}").parse::<Uri>().unwrap());
        assert_eq!(q(""), Ok(ListQuery::default()));
        let page = q("?tenant=acme&limit=2&after=key_b").unwrap();
        assert_eq!(page.tenant, Id::parse("acme"));
        assert_eq!(page.page, Some(KeyPage { after: Id::parse("key_b"), limit: 2 }));
        for (query, field) in [
            ("?limit=0", "limit"),
            ("?limit=10001", "limit"),
            ("?limit=-1", "limit"),
            ("?limit=x", "limit"),
            ("?limit=+5", "limit"),
            ("?after=key_a", "after"),
            ("?limit=5&after=a%20b", "after"),
            ("?tenant=a&tenant=b", "tenant"),
            ("?limit=1&limit=2", "limit"),
            ("?tenant=%00", "tenant"),
            ("?page=2", "query"),
        ] {
            assert_eq!(q(query).map_err(|e| e.0), Err(field), "{query}");
        }
    }

}
