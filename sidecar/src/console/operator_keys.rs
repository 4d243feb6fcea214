//! The operator's keys and tenant users: keys listed a page at a time (the admin API's pages,
//! by tenant), issued (the raw key shown once) and revoked; tenant users created with a
//! password or invited with a single-use link, listed and deleted.

use super::auth;
use super::signin::{check_csrf, html, operator, store_down};
use super::users::{self, Invite, User};
use super::view::{self, csrf_field, note, Nav};
use super::shared::{see_other, Shared};
use crate::keys::{Id, Login};
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
        .route("/console/operator/keys", get(keys).post(create_key))
        .route("/console/operator/keys/{id}/revoke", post(revoke_key))
        .route("/console/operator/keys/{id}/rotate", post(rotate_key))
        .route("/console/operator/users", get(users_page).post(create_user))
        .route("/console/operator/invites", post(create_invite))
        .route("/console/operator/users/{login}/delete", post(delete_user))
}

/// The ids of a collection, for the forms' choices.
async fn ids(c: &Shared, kind: &str) -> Vec<String> {
    c.api.get(&format!("/v1/{kind}")).await.items().iter().filter_map(|v| v["id"].as_str().map(str::to_string)).collect()
}

fn select(id: &str, label: &str, options: &[String], chosen: &str) -> Markup {
    let name = id.rsplit('-').next().unwrap_or(id);
    html! {
        label for=(id) { (label) }
        select #(id) name=(name) required {
            @for o in options { option value=(o) selected[o == chosen] { (o) } }
        }
    }
}

/// A table of key records (the API's JSON), with rotate and revoke buttons on each active one
/// when `revoke` names the forms' action prefix.
pub fn key_table(keys: &[Value], csrf: &str, revoke: Option<&str>) -> Markup {
    html! {
        table.keys {
            thead { tr { th scope="col" { "Key id" } th scope="col" { "Tenant" } th scope="col" { "Plan" } th scope="col" { "Status" } th scope="col" { "Created" } th scope="col" { "Expires" } th scope="col" { "" } } }
            tbody { @for k in keys {
                @let id = k["key_id"].as_str().unwrap_or_default();
                @let status = shown_status(k, crate::decision::unix_now());
                tr {
                    th scope="row" { code { (id) } }
                    td data-label="Tenant" { (k["tenant"].as_str().unwrap_or_default()) }
                    td data-label="Plan" { (k["plan"].as_str().unwrap_or_default()) }
                    td data-label="Status" class={ "status " (status) } { (status) }
                    td data-label="Created" { (view::time(k["created_at"].as_u64())) }
                    td data-label="Expires" { (view::time(k["expires_at"].as_u64())) }
                    td.actions {
                        @if let (Some(prefix), "active") = (revoke, status) {
                            form.rotate method="post" action={ (prefix) (view::q(id)) "/rotate" } {
                                (csrf_field(csrf))
                                label.inline for={ "overlap-" (id) } { "Overlap" }
                                input id={ "overlap-" (id) } name="overlap" type="text" placeholder="24h" size="5";
                                button type="submit" aria-label={ "Rotate " (id) } { "Rotate" }
                            }
                            form method="post" action={ (prefix) (view::q(id)) "/revoke" } {
                                (csrf_field(csrf))
                                button type="submit" aria-label={ "Revoke " (id) } { "Revoke" }
                            }
                        }
                    }
                }
            } }
        }
    }
}

/// A key's status as a person reads it: an active key past its expiry (a rotated key after its
/// overlap) is `expired`, as the gateway treats it.
pub fn shown_status(k: &Value, now: u64) -> &str {
    match (k["status"].as_str().unwrap_or_default(), k["expires_at"].as_u64()) {
        ("active", Some(e)) if e <= now => "expired",
        (s, _) => s,
    }
}

/// The page that shows a new raw key, the only time it is shown.
pub fn issued(title: &str, nav: Nav, key: &Value, back: &str) -> Response {
    let rotated = key["rotated_from"].as_str().map(|old| format!(" It replaces {old}, which keeps working until the overlap ends (then it is refused); usage stays counted per key."));
    let body = html! {
        (note("ok", &format!("Key created. Copy it now: it is shown this once and never stored (only its hash is).{}", rotated.unwrap_or_default())))
        label for="rawkey" { "API key" }
        input #rawkey type="text" readonly value=(key["key"].as_str().unwrap_or_default());
        table.kv {
            tr { th scope="row" { "Key id" } td { code #newkeyid { (key["key_id"].as_str().unwrap_or_default()) } } }
            tr { th scope="row" { "Plan" } td { (key["plan"].as_str().unwrap_or_default()) } }
            tr { th scope="row" { "Expires" } td { (view::time(key["expires_at"].as_u64())) } }
        }
        p { a href=(back) { "Done" } }
    };
    html(StatusCode::CREATED, view::page(title, nav, body))
}

async fn keys(State(c): State<Shared>, headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    keys_page(&c, &s.csrf, &q, None, StatusCode::OK).await
}

async fn keys_page(c: &Shared, csrf: &str, q: &HashMap<String, String>, error: Option<&str>, status: StatusCode) -> Response {
    let tenant = q.get("tenant").cloned().unwrap_or_default();
    let mut path = format!("/v1/keys?limit={}", super::shared::PAGE);
    if !tenant.is_empty() {
        path.push_str(&format!("&tenant={}", view::q(&tenant)));
    }
    if let Some(a) = q.get("after") {
        path.push_str(&format!("&after={}", view::q(a)));
    }
    let reply = c.api.get(&path).await;
    let (tenants, plans) = (ids(c, "tenants").await, ids(c, "plans").await);
    let body = html! {
        @if let Some(done) = q.get("done") { (note("ok", done)) }
        @if let Some(e) = error { (note("error", e)) }
        form.search method="get" action="/console/operator/keys" role="search" {
            label for="tenant-filter" { "Tenant" }
            input #tenant-filter name="tenant" type="search" value=(tenant) placeholder="every tenant";
            button type="submit" { "Filter" }
        }
        @if !reply.ok() { (note("error", &format!("Keys could not be listed: {}", reply.error()))) }
        @else if reply.items().is_empty() { (note("empty", "No key yet.")) }
        @else { (key_table(&reply.items(), csrf, Some("/console/operator/keys/"))) }
        @if let Some(n) = &reply.next { p.pager { a rel="next" href={ "/console/operator/keys?tenant=" (view::q(&tenant)) "&after=" (view::q(n)) } { "Next page →" } } }
        section aria-labelledby="new-key-h" {
            h2 #new-key-h { "Issue a key" }
            form method="post" action="/console/operator/keys" {
                (csrf_field(csrf))
                (select("tenant", "Tenant", &tenants, &tenant))
                (select("plan", "Plan", &plans, ""))
                label for="expires_in" { "Lifetime (e.g. 30d; empty: no expiry)" }
                input #expires_in name="expires_in" type="text";
                button type="submit" #issue { "Issue key" }
            }
        }
    };
    html(status, view::page("Keys", Nav::Operator { csrf }, body))
}

async fn create_key(State(c): State<Shared>, headers: HeaderMap, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let mut body = json!({"tenant": form.get("tenant").cloned().unwrap_or_default(), "plan": form.get("plan").cloned().unwrap_or_default()});
    if let Some(e) = form.get("expires_in").filter(|e| !e.trim().is_empty()) {
        body["expires_in"] = json!(e.trim());
    }
    let reply = c.api.send(Method::POST, "/v1/keys", &body).await;
    if reply.ok() {
        return issued("Key issued", Nav::Operator { csrf: &s.csrf }, &reply.body, "/console/operator/keys");
    }
    keys_page(&c, &s.csrf, &HashMap::new(), Some(&reply.error()), reply.status).await
}

async fn revoke_key(State(c): State<Shared>, headers: HeaderMap, Path(id): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let reply = c.api.send(Method::POST, &format!("/v1/keys/{}/revoke", view::q(&id)), &json!({})).await;
    if reply.ok() {
        return see_other(&format!("/console/operator/keys?done={}", view::q(&format!("Revoked {id}."))));
    }
    keys_page(&c, &s.csrf, &HashMap::new(), Some(&reply.error()), reply.status).await
}

/// The rotation request of a form: its overlap when one was typed (the API's default else).
pub fn rotation(form: &HashMap<String, String>) -> Value {
    match form.get("overlap").map(|o| o.trim()).filter(|o| !o.is_empty()) {
        Some(o) => json!({"overlap": o}),
        None => json!({}),
    }
}

async fn rotate_key(State(c): State<Shared>, headers: HeaderMap, Path(id): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let reply = c.api.send(Method::POST, &format!("/v1/keys/{}/rotate", view::q(&id)), &rotation(&form)).await;
    if reply.ok() {
        return issued("Key rotated", Nav::Operator { csrf: &s.csrf }, &reply.body, "/console/operator/keys");
    }
    keys_page(&c, &s.csrf, &HashMap::new(), Some(&reply.error()), reply.status).await
}

async fn users_page(State(c): State<Shared>, headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    render_users(&c, &s.csrf, &q, None, StatusCode::OK).await
}

async fn render_users(c: &Shared, csrf: &str, q: &HashMap<String, String>, extra: Option<Markup>, status: StatusCode) -> Response {
    let (tenants, plans) = (ids(c, "tenants").await, ids(c, "plans").await);
    let tenant = q.get("tenant").cloned().or_else(|| tenants.first().cloned()).unwrap_or_default();
    let listed = match Id::parse(&tenant) {
        Some(t) => match users::users(&c.app.store, &t).await {
            Ok(u) => Some(u),
            Err(e) => return store_down(&e),
        },
        None => None,
    };
    let body = html! {
        @if let Some(done) = q.get("done") { (note("ok", done)) }
        @if let Some(x) = extra { (x) }
        form.search method="get" action="/console/operator/users" {
            (select("users-tenant", "Tenant", &tenants, &tenant))
            button type="submit" { "Show users" }
        }
        @match &listed {
            None => (note("empty", "No tenant yet: create one first.")),
            Some(l) if l.is_empty() => (note("empty", "This tenant has no console user yet.")),
            Some(l) => table {
                thead { tr { th scope="col" { "Login" } th scope="col" { "Name" } th scope="col" { "Plan of new keys" } th scope="col" { "" } } }
                tbody { @for (login, u) in l {
                    tr { th scope="row" { (login) } td { (u.name) } td { (u.plan) } td.actions {
                        form method="post" action={ "/console/operator/users/" (view::q(login.as_str())) "/delete" } {
                            (csrf_field(csrf)) input type="hidden" name="tenant" value=(u.tenant);
                            button type="submit" { "Delete" }
                        }
                    } }
                } }
            },
        }
        div.cards {
            section.card aria-labelledby="new-user-h" {
                h2 #new-user-h { "Create a tenant user" }
                form method="post" action="/console/operator/users" {
                    (csrf_field(csrf))
                    (user_fields("u", &tenants, &plans, &tenant))
                    label for="u-password" { "Password (at least " (auth::MIN_PASSWORD) " characters)" }
                    input #u-password name="password" type="password" autocomplete="new-password" required;
                    button type="submit" #create-user { "Create user" }
                }
            }
            section.card aria-labelledby="invite-h" {
                h2 #invite-h { "Invite a tenant user" }
                p.hint { "A link that sets the password, usable once, for " (humantime::format_duration(c.config.invite_ttl)) "." }
                form method="post" action="/console/operator/invites" {
                    (csrf_field(csrf))
                    (user_fields("i", &tenants, &plans, &tenant))
                    button type="submit" #invite { "Make invite link" }
                }
            }
        }
    };
    html(status, view::page("Tenant users", Nav::Operator { csrf }, body))
}

fn user_fields(prefix: &str, tenants: &[String], plans: &[String], tenant: &str) -> Markup {
    html! {
        (select(&format!("{prefix}-tenant"), "Tenant", tenants, tenant))
        label for={ (prefix) "-login" } { "Email or user name" }
        input id={ (prefix) "-login" } name="login" type="text" required;
        label for={ (prefix) "-name" } { "Display name" }
        input id={ (prefix) "-name" } name="name" type="text";
        (select(&format!("{prefix}-plan"), "Plan of the keys this user creates", plans, ""))
    }
}

/// The user a form describes, checked against the configuration in force.
fn user_of(c: &Shared, form: &HashMap<String, String>) -> Result<(Login, Id, Id, String), String> {
    let get = |k: &str| form.get(k).cloned().unwrap_or_default();
    let login = Login::parse(&get("login")).ok_or("login: 3-128 of letters, digits and . _ - + @")?;
    let snapshot = c.control.live.get();
    let tenant = Id::parse(&get("tenant")).filter(|t| snapshot.tenants.contains_key(t.as_str())).ok_or("tenant: no such tenant")?;
    let plan = Id::parse(&get("plan")).filter(|p| snapshot.plans.contains_key(p.as_str())).ok_or("plan: no such plan")?;
    Ok((login, tenant, plan, get("name").trim().chars().take(200).collect()))
}

async fn create_user(State(c): State<Shared>, headers: HeaderMap, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let (c2, csrf) = (c.clone(), s.csrf.clone());
    let refused = |m: String| async move { render_users(&c2, &csrf, &HashMap::new(), Some(note("error", &m)), StatusCode::BAD_REQUEST).await };
    let (login, tenant, plan, name) = match user_of(&c, &form) {
        Ok(u) => u,
        Err(m) => return refused(m).await,
    };
    let password = form.get("password").cloned().unwrap_or_default();
    if let Some(p) = auth::password_problem(&password) {
        return refused(format!("password: {p}")).await;
    }
    let Ok(Ok(phc)) = tokio::task::spawn_blocking(move || auth::hash_password(&password)).await else {
        return refused("password: could not be hashed".into()).await;
    };
    match users::create_user(&c.app.store, &login, &User { tenant: tenant.clone(), name, plan, password: phc }).await {
        Ok(true) => see_other(&format!("/console/operator/users?tenant={}&done={}", view::q(tenant.as_str()), view::q(&format!("Created user {login}.")))),
        Ok(false) => refused(format!("login: '{login}' exists already")).await,
        Err(e) => store_down(&e),
    }
}

async fn create_invite(State(c): State<Shared>, headers: HeaderMap, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let (login, tenant, plan, name) = match user_of(&c, &form) {
        Ok(u) => u,
        Err(m) => return render_users(&c, &s.csrf, &HashMap::new(), Some(note("error", &m)), StatusCode::BAD_REQUEST).await,
    };
    let token = auth::token();
    if let Err(e) = users::create_invite(&c.app.store, &token, &Invite { tenant, login: login.clone(), name, plan }, c.config.invite_ttl).await {
        return store_down(&e);
    }
    let link = format!("/console/invite/{token}");
    let shown = html! {
        (note("ok", &format!("Invite for {login} made. Send this link (usable once; shown only now): the sidecar's admin address followed by")))
        label for="invite-link" { "Invite link (path)" }
        input #invite-link type="text" readonly value=(link);
    };
    render_users(&c, &s.csrf, &HashMap::new(), Some(shown), StatusCode::CREATED).await
}

async fn delete_user(State(c): State<Shared>, headers: HeaderMap, Path(login): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    let s = match operator(&c, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(r) = check_csrf(&s, &form) {
        return r;
    }
    let (Some(login), Some(tenant)) = (Login::parse(&login), form.get("tenant").and_then(|t| Id::parse(t))) else {
        return see_other("/console/operator/users");
    };
    match users::delete_user(&c.app.store, &tenant, &login).await {
        Ok(_) => see_other(&format!("/console/operator/users?tenant={}&done={}", view::q(tenant.as_str()), view::q(&format!("Deleted user {login}; its sessions ended with it.")))),
        Err(e) => store_down(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_past_its_expiry_shows_as_expired() {
        let k = json!({"status": "active", "expires_at": 100});
        assert_eq!(shown_status(&k, 99), "active");
        assert_eq!(shown_status(&k, 100), "expired");
        assert_eq!(shown_status(&json!({"status": "revoked", "expires_at": 100}), 200), "revoked");
        assert_eq!(shown_status(&json!({"status": "active"}), 200), "active");
    }
}
