//! The operator console: an overview (connections, breakers, live figures per tenant) and the
//! collections — tenants, products, plans, routes — listed with search and pages, created,
//! edited and deleted through the admin API's own handlers (so with its validation and errors).
//! Keys and tenant users are [`super::operator_keys`].

use super::auth::Session;
use super::figures;
use super::signin::{check_csrf, html, operator};
use super::view::{self, csrf_field, note, Nav};
use super::shared::{see_other, Shared};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::{html, Markup};
use serde_json::{json, Value};
use std::collections::HashMap;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/console/operator", get(overview))
        .route("/console/operator/{kind}", get(list).post(create))
        .route("/console/operator/{kind}/{id}", get(edit).post(save))
        .route("/console/operator/{kind}/{id}/delete", post(delete))
        .merge(super::operator_keys::routes())
}

const KINDS: [&str; 4] = ["tenants", "products", "plans", "routes"];

fn singular(kind: &str) -> &str {
    kind.strip_suffix('s').unwrap_or(kind)
}

/// What a new object of each kind looks like (the API's JSON; docs/openapi.json).
fn template(kind: &str) -> Value {
    match kind {
        "tenants" => json!({"id": "", "name": "", "products": []}),
        "products" => json!({"id": "", "name": ""}),
        "plans" => json!({"id": "", "limits": [{"name": "per_minute", "algorithm": "fixed_window", "subject": "key", "limit": 60, "window": "1m"}]}),
        _ => json!({"id": "", "priority": 100, "match": {"path_prefix": "/"}, "cluster": "upstream", "product": null}),
    }
}

/// A one-line summary of an object for its row.
fn summary(kind: &str, v: &Value) -> String {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    match kind {
        "tenants" => {
            let products: Vec<&str> = v.get("products").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
            format!("{} · products: {}", s("name"), if products.is_empty() { "none".into() } else { products.join(", ") })
        }
        "products" => s("name"),
        "plans" => {
            let limits: Vec<String> = v.get("limits").and_then(Value::as_array).map(|a| {
                a.iter().map(|l| format!("{} {} {}", l["name"].as_str().unwrap_or("?"), l["limit"], l["window"].as_str().unwrap_or(""))).collect()
            }).unwrap_or_default();
            limits.join("; ")
        }
        _ => format!("{} → {}", v["match"], s("cluster")),
    }
}

async fn overview(State(c): State<Shared>, headers: HeaderMap) -> Response {
    let session = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let samples = figures::parse(&c.app.prometheus.render());
    // every replica's figures from Prometheus when it is configured and answers; else this one's
    let (tenants, figures_from, prometheus_error) = match c.config.prometheus_url.clone() {
        Some(url) => match tokio::task::spawn_blocking(move || figures::query_prometheus(&url)).await {
            Ok(Ok(t)) => (t, "Prometheus (every replica's series, since each started)", None),
            Ok(Err(e)) => (figures::per_tenant(&samples), "this replica's own counters since it started", Some(e)),
            Err(e) => (figures::per_tenant(&samples), "this replica's own counters since it started", Some(e.to_string())),
        },
        None => (figures::per_tenant(&samples), "this replica's own counters since it started (console.prometheus_url is not set)", None),
    };
    let version = c.api.get("/v1/version").await;
    let store = &c.app.store;
    let redis = if store.is_failing_fast() { "down (failing fast, probing)" } else if store.is_up() { "up" } else { "down" };
    let source = match &c.control.source {
        crate::control::Source::Postgres(_) => "PostgreSQL",
        crate::control::Source::File(_) => "configuration file",
    };
    let hints = c.app.hints.list(store).await.hints;
    let usage_on = c.app.usage.is_some();
    let body = html! {
        section aria-labelledby="conn-h" {
            h2 #conn-h { "Connections" }
            table.kv {
                tr { th scope="row" { "Redis" } td.state { (redis) } }
                tr { th scope="row" { "Configuration source" } td { (source) ": " @if version.ok() {
                    "version " (version.body["version"]) ", this replica loaded " (version.body["loaded"])
                    @let unusable = version.body["unusable"].as_array().map(Vec::len).unwrap_or(0);
                    @if unusable > 0 { ", " (unusable) " objects set aside (unusable)" }
                } @else { "unknown: " (version.error()) } } }
                tr { th scope="row" { "Usage pipeline (broker)" } td { @if usage_on {
                    "on · spool " (figures::total(&samples, crate::metrics::USAGE_SPOOL_BYTES) as u64) " bytes · broker errors " (figures::total(&samples, crate::metrics::USAGE_KAFKA_ERRORS) as u64)
                } @else { "off (usage.enabled = false)" } } }
                tr { th scope="row" { "Usage store (PostgreSQL)" } td { @if c.usage.configured() { "configured (console.usage_url)" } @else { "not configured" } } }
                tr { th scope="row" { "Redis errors since start" } td { (figures::total(&samples, crate::metrics::REDIS_ERRORS) as u64) } }
            }
        }
        section aria-labelledby="breakers-h" {
            h2 #breakers-h { "Circuit breakers" }
            @if hints.is_empty() { (note("empty", "No breaker is open or half-open anywhere (no hint shared).")) }
            @else {
                table { thead { tr { th scope="col" { "Hint" } } } tbody { @for h in &hints { tr { td { code { (serde_json::to_string(h).unwrap_or_default()) } } } } } }
            }
        }
        section aria-labelledby="figures-h" {
            h2 #figures-h { "Requests per tenant" }
            p.hint #figures-source { "From " (figures_from) "." }
            @if let Some(e) = &prometheus_error { (note("error", &format!("Prometheus did not answer ({e}): showing this replica's own counters."))) }
            @if tenants.is_empty() { (note("empty", "No request seen yet.")) }
            @else {
                table {
                    thead { tr { th scope="col" { "Tenant" } th scope="col" { "Requests" } th scope="col" { "Allowed" } th scope="col" { "429 (limits)" } th scope="col" { "Other denials" } th scope="col" { "Tokens" } } }
                    tbody {
                        @for (t, f) in &tenants {
                            @let allowed = f.outcomes.get("allowed").copied().unwrap_or(0);
                            tr { th scope="row" { (t) } td { (f.requests()) } td { (allowed) } td { (f.throttled()) } td { (f.requests() - allowed - f.throttled()) } td { (f.tokens) } }
                        }
                    }
                }
            }
        }
    };
    html(StatusCode::OK, view::page("Overview", Nav::Operator { csrf: &session.csrf }, body))
}

/// An operator's write to a collection: the session, its CSRF token checked, the collection known.
async fn write_session(c: &Shared, headers: &HeaderMap, form: &HashMap<String, String>, kind: &str) -> Result<Session, Response> {
    let session = operator(c, headers).await?;
    check_csrf(&session, form)?;
    match bad_kind(kind) {
        Some(r) => Err(r),
        None => Ok(session),
    }
}

fn bad_kind(kind: &str) -> Option<Response> {
    (!KINDS.contains(&kind)).then(|| html(StatusCode::NOT_FOUND, view::page("Not found", Nav::None, note("error", &format!("No collection '{kind}'.")))))
}

fn object_form(kind: &str, action: &str, csrf: &str, text: &str, button: &str) -> Markup {
    html! {
        form method="post" action=(action) {
            (csrf_field(csrf))
            label for="json" { "The " (singular(kind)) " as JSON (the admin API's format)" }
            textarea #json name="json" rows="14" spellcheck="false" { (text) }
            button type="submit" #save { (button) }
        }
    }
}

async fn list(State(c): State<Shared>, headers: HeaderMap, Path(kind): Path<String>, Query(q): Query<HashMap<String, String>>) -> Response {
    let session = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(r) = bad_kind(&kind) {
        return r;
    }
    list_page(&c, &session.csrf, &kind, &q, None, StatusCode::OK, None).await
}

async fn list_page(c: &Shared, csrf: &str, kind: &str, q: &HashMap<String, String>, error: Option<&str>, status: StatusCode, text: Option<&str>) -> Response {
    let reply = c.api.get(&format!("/v1/{kind}")).await;
    let search = q.get("q").cloned().unwrap_or_default();
    let (items, next) = view::paged(reply.items(), &search, q.get("after").map(String::as_str), super::shared::PAGE);
    let template = view::pretty(&template(kind));
    let body = html! {
        @if let Some(done) = q.get("done") { (note("ok", done)) }
        @if !reply.ok() { (note("error", &format!("The {kind} could not be read: {}", reply.error()))) }
        form.search method="get" action={ "/console/operator/" (kind) } role="search" {
            label for="q" { "Search " (kind) }
            input #q name="q" type="search" value=(search);
            button type="submit" { "Search" }
        }
        @if items.is_empty() && reply.ok() { (note("empty", if search.is_empty() { "None yet." } else { "Nothing matches." })) }
        @else {
            table {
                thead { tr { th scope="col" { "Id" } th scope="col" { "Summary" } } }
                tbody { @for v in &items {
                    @let id = v["id"].as_str().unwrap_or_default();
                    tr { th scope="row" { a href={ "/console/operator/" (kind) "/" (view::q(id)) } { (id) } } td { (summary(kind, v)) } }
                } }
            }
        }
        @if let Some(n) = next { p.pager { a rel="next" href={ "/console/operator/" (kind) "?q=" (view::q(&search)) "&after=" (view::q(&n)) } { "Next page →" } } }
        section aria-labelledby="new-h" {
            h2 #new-h { "New " (singular(kind)) }
            @if let Some(e) = error { (note("error", e)) }
            (object_form(kind, &format!("/console/operator/{kind}"), csrf, text.unwrap_or(&template), "Create"))
        }
    };
    html(status, view::page(&view_title(kind), Nav::Operator { csrf }, body))
}

fn view_title(kind: &str) -> String {
    let mut t = kind.to_string();
    if let Some(f) = t.get_mut(0..1) {
        f.make_ascii_uppercase();
    }
    t
}

/// The form's JSON, or the API's own refusal of a body that is not JSON.
fn form_json(form: &HashMap<String, String>) -> Result<Value, String> {
    let text = form.get("json").map(String::as_str).unwrap_or_default();
    serde_json::from_str(text).map_err(|e| format!("body: not JSON: {e}"))
}

async fn create(State(c): State<Shared>, headers: HeaderMap, Path(kind): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    let session = match write_session(&c, &headers, &form, &kind).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let text = form.get("json").cloned().unwrap_or_default();
    let reply = match form_json(&form) {
        Ok(v) => c.api.send(Method::POST, &format!("/v1/{kind}"), &v).await,
        Err(e) => return list_page(&c, &session.csrf, &kind, &HashMap::new(), Some(&e), StatusCode::BAD_REQUEST, Some(&text)).await,
    };
    if reply.ok() {
        let id = reply.body["id"].as_str().unwrap_or_default();
        return see_other(&format!("/console/operator/{kind}?done={}", view::q(&format!("Created {} '{id}'.", singular(&kind)))));
    }
    list_page(&c, &session.csrf, &kind, &HashMap::new(), Some(&reply.error()), reply.status, Some(&text)).await
}

async fn edit(State(c): State<Shared>, headers: HeaderMap, Path((kind, id)): Path<(String, String)>) -> Response {
    let session = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(r) = bad_kind(&kind) {
        return r;
    }
    edit_page(&c, &session.csrf, &kind, &id, None, StatusCode::OK, None).await
}

async fn edit_page(c: &Shared, csrf: &str, kind: &str, id: &str, error: Option<&str>, status: StatusCode, text: Option<&str>) -> Response {
    let reply = c.api.get(&format!("/v1/{kind}/{}", view::q(id))).await;
    let title = format!("{} {id}", singular(kind));
    if !reply.ok() {
        return html(reply.status, view::page(&title, Nav::Operator { csrf }, note("error", &reply.error())));
    }
    let current = view::pretty(&reply.body);
    let body = html! {
        @if let Some(e) = error { (note("error", e)) }
        (object_form(kind, &format!("/console/operator/{kind}/{}", view::q(id)), csrf, text.unwrap_or(&current), "Save"))
        form.danger method="post" action={ "/console/operator/" (kind) "/" (view::q(id)) "/delete" } {
            (csrf_field(csrf))
            button type="submit" #delete { "Delete " (singular(kind)) " " (id) }
        }
        p { a href={ "/console/operator/" (kind) } { "← All " (kind) } }
    };
    html(status, view::page(&title, Nav::Operator { csrf }, body))
}

async fn save(State(c): State<Shared>, headers: HeaderMap, Path((kind, id)): Path<(String, String)>, Form(form): Form<HashMap<String, String>>) -> Response {
    let session = match write_session(&c, &headers, &form, &kind).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let text = form.get("json").cloned().unwrap_or_default();
    let reply = match form_json(&form) {
        Ok(v) => c.api.send(Method::PUT, &format!("/v1/{kind}/{}", view::q(&id)), &v).await,
        Err(e) => return edit_page(&c, &session.csrf, &kind, &id, Some(&e), StatusCode::BAD_REQUEST, Some(&text)).await,
    };
    if reply.ok() {
        return see_other(&format!("/console/operator/{kind}?done={}", view::q(&format!("Saved {} '{id}'.", singular(&kind)))));
    }
    edit_page(&c, &session.csrf, &kind, &id, Some(&reply.error()), reply.status, Some(&text)).await
}

async fn delete(State(c): State<Shared>, headers: HeaderMap, Path((kind, id)): Path<(String, String)>, Form(form): Form<HashMap<String, String>>) -> Response {
    let session = match write_session(&c, &headers, &form, &kind).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let reply = c.api.send(Method::DELETE, &format!("/v1/{kind}/{}", view::q(&id)), &Value::Null).await;
    if reply.ok() {
        return see_other(&format!("/console/operator/{kind}?done={}", view::q(&format!("Deleted {} '{id}'.", singular(&kind)))));
    }
    edit_page(&c, &session.csrf, &kind, &id, Some(&reply.error()), reply.status, None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_objects_with_an_id() {
        for k in KINDS {
            assert!(template(k)["id"].is_string(), "{k}");
        }
        assert_eq!(summary("products", &json!({"id": "p", "name": "Search"})), "Search");
        assert_eq!(summary("tenants", &json!({"id": "t", "name": "Acme", "products": ["a", "b"]})), "Acme · products: a, b");
    }
}
