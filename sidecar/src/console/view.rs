//! The pages' frame and shared pieces: the layout (one stylesheet, no script), messages, the
//! bar chart as SVG with its numbers beside it, and paging a list. Pure: tested without a server.

use maud::{html, Markup, DOCTYPE};
use serde_json::Value;

/// Who the page is for: picks the navigation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav<'a> {
    None,
    Operator { csrf: &'a str },
    Tenant { csrf: &'a str, tenant: &'a str },
}

/// A whole page.
pub fn page(title: &str, nav: Nav, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Tollgate console" }
                link rel="stylesheet" href="/console/assets/console.css";
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    span.brand { "Tollgate" }
                    @match nav {
                        Nav::None => {},
                        Nav::Operator { csrf } => {
                            nav aria-label="Operator" {
                                a href="/console/operator" { "Overview" }
                                @for k in ["tenants", "products", "plans", "routes", "keys", "users"] {
                                    a href={ "/console/operator/" (k) } { (capitalized(k)) }
                                }
                            }
                            (signout(csrf))
                        },
                        Nav::Tenant { csrf, tenant } => {
                            nav aria-label="Portal" {
                                a href="/console/portal" { "Keys" }
                                a href="/console/portal/usage" { "Usage" }
                                span.who { "Tenant " strong { (tenant) } }
                            }
                            (signout(csrf))
                        },
                    }
                }
                main #main { h1 { (title) } (body) }
            }
        }
    }
}

fn signout(csrf: &str) -> Markup {
    html! {
        form.signout method="post" action="/console/signout" {
            input type="hidden" name="csrf" value=(csrf);
            button type="submit" { "Sign out" }
        }
    }
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().chain(c).collect()).unwrap_or_default()
}

/// A message box: `kind` is `error`, `ok` or `empty`.
pub fn note(kind: &str, text: &str) -> Markup {
    let role = if kind == "error" { "alert" } else { "status" };
    html! { p class={ "note " (kind) } role=(role) { (text) } }
}

/// The hidden CSRF field of a form.
pub fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// A horizontal bar chart as inline SVG (no script, no style attribute: the CSP allows it), with
/// the same numbers in a table beside it — the chart is a picture, the table is the data.
pub fn bar_chart(caption: &str, unit: &str, rows: &[(String, u64)]) -> Markup {
    if rows.is_empty() {
        return note("empty", &format!("{caption}: no data yet."));
    }
    let max = rows.iter().map(|(_, v)| *v).max().unwrap_or(0).max(1);
    let (bar_h, gap, label_w, width) = (18u64, 6u64, 180u64, 560u64);
    let height = rows.len() as u64 * (bar_h + gap);
    html! {
        figure.chart {
            figcaption { (caption) }
            div.chart-body {
                svg role="img" aria-label=(format!("{caption}, as bars")) viewBox=(format!("0 0 {width} {height}")) width="100%" preserveAspectRatio="xMinYMin meet" {
                    @for (i, (label, v)) in rows.iter().enumerate() {
                        @let y = i as u64 * (bar_h + gap);
                        @let w = (width - label_w - 60) * v / max;
                        text x="0" y=(y + 13) class="axis" { (label) }
                        rect x=(label_w) y=(y) width=(w.max(1)) height=(bar_h) class="bar" {}
                        text x=(label_w + w + 4) y=(y + 13) class="value" { (v) }
                    }
                }
                table.numbers {
                    thead { tr { th scope="col" { "" } th scope="col" { (unit) } } }
                    tbody {
                        @for (label, v) in rows { tr { th scope="row" { (label) } td { (v) } } }
                    }
                }
            }
        }
    }
}

/// One page of `items` (objects with an `id`) whose JSON contains `q` (case-insensitive), in id
/// order, after the id `after`: the page and the id the next one starts after, if more follow.
pub fn paged(mut items: Vec<Value>, q: &str, after: Option<&str>, limit: usize) -> (Vec<Value>, Option<String>) {
    let id = |v: &Value| v.get("id").and_then(Value::as_str).unwrap_or_default().to_string();
    let q = q.trim().to_lowercase();
    items.retain(|v| q.is_empty() || v.to_string().to_lowercase().contains(&q));
    items.sort_by_key(|v| id(v));
    let start = after.map(|a| items.partition_point(|v| id(v).as_str() <= a)).unwrap_or(0);
    let rest: Vec<Value> = items.into_iter().skip(start).collect();
    let more = rest.len() > limit;
    let page: Vec<Value> = rest.into_iter().take(limit).collect();
    let next = if more { page.last().map(id) } else { None };
    (page, next)
}

/// A query-string value, escaped (ids and search text in links).
pub fn q(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Pretty JSON for a form's textarea.
pub fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// Unix seconds as a UTC date and time, `—` for none.
pub fn time(secs: Option<u64>) -> String {
    match secs {
        Some(s) if s > 0 => humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s)).to_string().replace('T', " ").replace('Z', " UTC"),
        _ => "—".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pages_follow_ids_and_search() {
        let items: Vec<Value> = (0..25).map(|i| json!({"id": format!("t{i:02}"), "name": if i % 2 == 0 { "Even" } else { "odd" }})).collect();
        let (p1, next) = paged(items.clone(), "", None, 10);
        assert_eq!(p1.len(), 10);
        assert_eq!(next.as_deref(), Some("t09"));
        let (p3, next) = paged(items.clone(), "", Some("t19"), 10);
        assert_eq!(p3.len(), 5);
        assert_eq!(next, None);
        let (even, _) = paged(items, "EVEN", None, 100);
        assert_eq!(even.len(), 13);
    }

    #[test]
    fn the_chart_shows_its_numbers_and_escapes_labels() {
        let html = bar_chart("Requests by day", "requests", &[("2026-12-01".into(), 7), ("<b>".into(), 3)]).into_string();
        assert!(html.contains("<svg") && html.contains(">7<") && html.contains(">3<"));
        assert!(html.contains("&lt;b&gt;") && !html.contains("<b>"));
        assert!(!html.contains("style="), "no inline style: the CSP forbids it");
        assert!(bar_chart("Requests", "n", &[]).into_string().contains("no data yet"));
    }

    #[test]
    fn page_has_no_script_and_escapes() {
        let html = page("<x>", Nav::Operator { csrf: "c" }, html! { p { "hi" } }).into_string();
        assert!(!html.contains("<script"));
        assert!(html.contains("&lt;x&gt;"));
        assert!(html.contains(r#"name="csrf" value="c""#));
        assert_eq!(q("a b&c"), "a%20b%26c");
        assert_eq!(time(Some(0)), "—");
        assert_eq!(time(Some(86_400)), "1970-01-02 00:00:00 UTC");
    }
}
