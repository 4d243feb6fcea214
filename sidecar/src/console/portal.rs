//! The tenant portal: a signed-in tenant user sees and changes only its own tenant's keys
//! (issue, rotate, revoke; the raw key shown once), its limits and how much of each it has used, and its
//! usage by day and by key (chart, numbers, CSV). Every key id a request names is checked
//! against the session's tenant first: another tenant's key is "not found", whatever the form
//! or URL says.

use super::figures;
use super::operator_keys::{issued, key_table, rotation};
use super::signin::{check_csrf, html, store_down, tenant};
use super::usage::{self, UsageError};
use super::users;
use super::view::{self, csrf_field, note, Nav};
use super::shared::{see_other, Shared};
use crate::keys::{Id, Login};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::html;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/console/portal", get(home))
        .route("/console/portal/keys", post(create_key))
        .route("/console/portal/keys/{id}/revoke", post(revoke_key))
        .route("/console/portal/keys/{id}/rotate", post(rotate_key))
        .route("/console/portal/usage", get(usage_page))
        .route("/console/portal/usage.csv", get(usage_csv))
}

/// The tenant's keys (every one: the ownership check needs them all), or the API's error.
async fn tenant_keys(c: &Shared, t: &Id) -> Result<Vec<Value>, String> {
    let r = c.api.get(&format!("/v1/keys?tenant={}", view::q(t.as_str()))).await;
    if !r.ok() {
        return Err(r.error());
    }
    // the API filtered by tenant; checked again here, as a belt to those braces
    Ok(r.items().into_iter().filter(|k| k["tenant"].as_str() == Some(t.as_str())).collect())
}

async fn home(State(c): State<Shared>, headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    let (s, t, login) = match tenant(&c, &headers).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    render_home(&c, &s, &t, &login, q.get("done").map(String::as_str), None, StatusCode::OK).await
}

async fn render_home(c: &Shared, s: &super::auth::Session, t: &Id, login: &Login, done: Option<&str>, error: Option<&str>, status: StatusCode) -> Response {
    let keys = tenant_keys(c, t).await;
    let user = match users::user(&c.app.store, login).await {
        Ok(u) => u,
        Err(e) => return store_down(&e),
    };
    // the plans in force for this tenant: its active keys' and its new keys'
    let mut plans: BTreeSet<String> = keys.iter().flatten().filter(|k| k["status"] == "active").filter_map(|k| k["plan"].as_str().map(str::to_string)).collect();
    if let Some(u) = &user {
        plans.insert(u.plan.to_string());
    }
    let samples = figures::parse(&c.app.prometheus.render());
    let used = figures::per_tenant(&samples).remove(t.as_str()).map(|f| f.used).unwrap_or_default();
    let mut limits = Vec::new();
    for p in &plans {
        let r = c.api.get(&format!("/v1/plans/{}", view::q(p))).await;
        for l in r.body["limits"].as_array().cloned().unwrap_or_default() {
            limits.push((p.clone(), l));
        }
    }
    let body = html! {
        @if let Some(d) = done { (note("ok", d)) }
        @if let Some(e) = error { (note("error", e)) }
        section aria-labelledby="keys-h" {
            h2 #keys-h { "Your API keys" }
            @match &keys {
                Err(e) => (note("error", &format!("Your keys could not be read: {e}"))),
                Ok(k) if k.is_empty() => (note("empty", "No key yet: issue one below.")),
                Ok(k) => (key_table(k, &s.csrf, Some("/console/portal/keys/"))),
            }
            form method="post" action="/console/portal/keys" {
                (csrf_field(&s.csrf))
                label for="expires_in" { "Lifetime of a new key (e.g. 30d; empty: no expiry)" }
                input #expires_in name="expires_in" type="text";
                button type="submit" #new-key { "Issue a new key" }
            }
        }
        section aria-labelledby="limits-h" {
            h2 #limits-h { "Your limits" }
            p.hint { "Used: the share of each limit taken after your last request that ran it (this gateway replica's view); left is the rest, now." }
            @if limits.is_empty() { (note("empty", "No limit applies (no plan yet).")) }
            @else {
                table {
                    thead { tr { th scope="col" { "Plan" } th scope="col" { "Limit" } th scope="col" { "Allows" } th scope="col" { "Used" } th scope="col" { "Left" } } }
                    tbody { @for (p, l) in &limits {
                        @let name = l["name"].as_str().unwrap_or_default();
                        @let per = l["window"].as_str().map(|w| format!(" per {w}")).unwrap_or_default();
                        tr {
                            td { (p) } th scope="row" { (name) } td { (l["limit"]) " (" (l["algorithm"].as_str().unwrap_or_default()) (per) ")" }
                            @match used.get(name) {
                                Some(u) => { td { (format!("{:.0}%", u * 100.0)) } td { (format!("{:.0}%", (1.0 - u).max(0.0) * 100.0)) } }
                                None => { td { "—" } td { "all (no request counted yet)" } }
                            }
                        }
                    } }
                }
            }
        }
    };
    html(status, view::page("Your keys", Nav::Tenant { csrf: &s.csrf, tenant: t.as_str() }, body))
}

async fn create_key(State(c): State<Shared>, headers: HeaderMap, Form(form): Form<HashMap<String, String>>) -> Response {
    let (s, t, login) = match tenant(&c, &headers).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    // the plan is the operator's choice for this user, never the form's; the tenant is the session's
    let plan = match users::user(&c.app.store, &login).await {
        Ok(Some(u)) => u.plan,
        Ok(None) => return see_other("/console/signin"),
        Err(e) => return store_down(&e),
    };
    let mut body = json!({"tenant": t.as_str(), "plan": plan.as_str()});
    if let Some(e) = form.get("expires_in").filter(|e| !e.trim().is_empty()) {
        body["expires_in"] = json!(e.trim());
    }
    let reply = c.api.send(Method::POST, "/v1/keys", &body).await;
    if reply.ok() {
        return issued("Your new key", Nav::Tenant { csrf: &s.csrf, tenant: t.as_str() }, &reply.body, "/console/portal");
    }
    render_home(&c, &s, &t, &login, None, Some(&reply.error()), reply.status).await
}

async fn revoke_key(State(c): State<Shared>, headers: HeaderMap, Path(id): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    own_key_change(c, headers, id, form, Change::Revoke).await
}

async fn rotate_key(State(c): State<Shared>, headers: HeaderMap, Path(id): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    own_key_change(c, headers, id, form, Change::Rotate).await
}

enum Change {
    Revoke,
    Rotate,
}

/// Revokes or rotates a key of the session's tenant: any other id is "not found".
async fn own_key_change(c: Shared, headers: HeaderMap, id: String, form: HashMap<String, String>, change: Change) -> Response {
    let (s, t, login) = match tenant(&c, &headers).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let owned = match tenant_keys(&c, &t).await {
        Ok(k) => k.iter().any(|k| k["key_id"].as_str() == Some(id.as_str())),
        Err(e) => return render_home(&c, &s, &t, &login, None, Some(&e), StatusCode::SERVICE_UNAVAILABLE).await,
    };
    if !owned {
        // another tenant's key and no key at all look the same
        return render_home(&c, &s, &t, &login, None, Some(&format!("No key '{id}' of yours.")), StatusCode::NOT_FOUND).await;
    }
    if let Change::Rotate = change {
        let reply = c.api.send(Method::POST, &format!("/v1/keys/{}/rotate", view::q(&id)), &rotation(&form)).await;
        if reply.ok() {
            return issued("Your rotated key", Nav::Tenant { csrf: &s.csrf, tenant: t.as_str() }, &reply.body, "/console/portal");
        }
        return render_home(&c, &s, &t, &login, None, Some(&reply.error()), reply.status).await;
    }
    let reply = c.api.send(Method::POST, &format!("/v1/keys/{}/revoke", view::q(&id)), &json!({})).await;
    if reply.ok() {
        return see_other(&format!("/console/portal?done={}", view::q(&format!("Revoked {id}: it is refused from now on."))));
    }
    render_home(&c, &s, &t, &login, None, Some(&reply.error()), reply.status).await
}

async fn usage_page(State(c): State<Shared>, headers: HeaderMap) -> Response {
    let (s, t, _) = match tenant(&c, &headers).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let rows = c.usage.rows(&t).await;
    let models = c.usage.models(&t).await.unwrap_or_default();
    let currency = &c.config.currency;
    let body = html! {
        p.hint { "The last " (usage::DAYS) " days, from the billing rollup (requests of every outcome; the rollup follows the traffic by a few seconds)." }
        @match &rows {
            Err(UsageError::NotConfigured) => (note("empty", "No usage store is configured on this gateway (console.usage_url): usage cannot be shown. Ask the operator.")),
            Err(e) => (note("error", &e.to_string())),
            Ok(r) if r.is_empty() => (note("empty", "No usage recorded yet.")),
            Ok(r) => {
                (view::bar_chart("Requests by day", "requests", &usage::by_day(r)))
                (view::bar_chart("Requests by key", "requests", &usage::by_key(r)))
                @if !models.is_empty() {
                    (view::bar_chart(&format!("Cost by model (micro-units of {currency})"), "micro-units", &models.iter().map(|m| (model_name(&m.model), m.cost_micros)).collect::<Vec<_>>()))
                    table {
                        caption { "LLM calls by model" }
                        thead { tr { th scope="col" { "Model" } th scope="col" { "Calls" } th scope="col" { "Input tokens" } th scope="col" { "Output tokens" } th scope="col" { "Cached input" } th scope="col" { "Cost (" (currency) ")" } } }
                        tbody {
                            @for m in &models {
                                tr { td { (model_name(&m.model)) } td { (m.requests) } td { (m.input) } td { (m.output) } td { (m.cached) } td { (usage::money(m.cost_micros)) } }
                            }
                        }
                    }
                }
                p { a href="/console/portal/usage.csv" download="usage.csv" { "Download as CSV" } }
            },
        }
    };
    html(StatusCode::OK, view::page("Your usage", Nav::Tenant { csrf: &s.csrf, tenant: t.as_str() }, body))
}

async fn usage_csv(State(c): State<Shared>, headers: HeaderMap) -> Response {
    let (_, t, _) = match tenant(&c, &headers).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    match c.usage.rows(&t).await {
        Ok(rows) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()), (header::CONTENT_DISPOSITION, format!("attachment; filename=\"usage-{t}.csv\""))],
            usage::csv(&rows),
        )
            .into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], e.to_string()).into_response(),
    }
}

/// A model as the portal names it (`(unknown)` when no model was read).
fn model_name(m: &str) -> String {
    if m.is_empty() { "(unknown)".into() } else { m.to_string() }
}
