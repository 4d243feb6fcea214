//! Signing in and out: the operator with the admin token, a tenant user with a login and a
//! password (argon2id; `console.lockout_after` wrong ones in a row lock it for
//! `console.lockout_for`), an invite link that sets a user's password once. And the guards every
//! other page uses: [`operator`] and [`tenant`] find the session of the request's cookie.

use super::auth::{self, Role, Session};
use super::users::{self, User};
use super::view::{self, Nav};
use super::shared::{see_other, Shared};
use crate::keys::Login;
use crate::store::StoreError;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::{html, Markup};
use std::collections::HashMap;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/console", get(home))
        .route("/console/", get(home))
        .route("/console/signin", get(signin_page).post(tenant_signin))
        .route("/console/operator/signin", post(operator_signin))
        .route("/console/signout", post(signout))
        .route("/console/invite/{token}", get(invite_page).post(accept_invite))
}

/// An HTML answer.
pub fn html(status: StatusCode, m: Markup) -> Response {
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], m.into_string()).into_response()
}

/// The page of a store that does not answer: nothing can be signed in or checked without it.
pub fn store_down(e: &StoreError) -> Response {
    let body = html! {
        (view::note("error", &format!("Redis does not answer ({e}). Sessions and tenant users live there: the console cannot check who you are until it is back. Requests through the gateway follow their failure modes meanwhile.")))
        p { a href="/console" { "Try again" } }
    };
    html(StatusCode::SERVICE_UNAVAILABLE, view::page("Redis is unavailable", Nav::None, body))
}

fn forbidden(text: &str) -> Response {
    html(StatusCode::FORBIDDEN, view::page("Not allowed", Nav::None, html! { (view::note("error", text)) p { a href="/console" { "Back" } } }))
}

/// The cookie's session token and its session, if signed in.
pub async fn current(c: &Shared, headers: &HeaderMap) -> Result<Option<(String, Session)>, StoreError> {
    let Some(token) = headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).find_map(auth::cookie_token) else {
        return Ok(None);
    };
    Ok(users::session(&c.app.store, token).await?.map(|s| (token.to_string(), s)))
}

/// The operator's session, or the answer to give instead (sign in first; 403 for a tenant).
#[allow(clippy::result_large_err)] // the refusal is the reply itself
pub async fn operator(c: &Shared, headers: &HeaderMap) -> Result<Session, Response> {
    match current(c, headers).await {
        Ok(Some((_, s))) if s.role == Role::Operator => Ok(s),
        Ok(Some(_)) => Err(forbidden("This page is the operator's.")),
        Ok(None) => Err(see_other("/console/signin")),
        Err(e) => Err(store_down(&e)),
    }
}

/// A tenant user's session, its tenant and login, or the answer to give instead.
#[allow(clippy::result_large_err)]
pub async fn tenant(c: &Shared, headers: &HeaderMap) -> Result<(Session, crate::keys::Id, Login), Response> {
    match current(c, headers).await {
        Ok(Some((_, s))) if matches!(s.role, Role::Tenant { .. }) => match s.role.clone() {
            Role::Tenant { tenant, login } => Ok((s, tenant, login)),
            Role::Operator => Err(forbidden("This page is a tenant's.")),
        },
        Ok(Some(_)) => Err(forbidden("This page is a tenant's: sign out and sign in as a tenant user.")),
        Ok(None) => Err(see_other("/console/signin")),
        Err(e) => Err(store_down(&e)),
    }
}

/// Refuses a write whose form lacks the session's CSRF token.
#[allow(clippy::result_large_err)]
pub fn check_csrf(s: &Session, form: &HashMap<String, String>) -> Result<(), Response> {
    if s.csrf_ok(form.get("csrf").map(String::as_str)) {
        Ok(())
    } else {
        Err(forbidden("This form is stale or did not come from this console (its CSRF token is missing or wrong). Reload the page and try again."))
    }
}

async fn home(State(c): State<Shared>, headers: HeaderMap) -> Response {
    match current(&c, &headers).await {
        Ok(Some((_, s))) if s.role == Role::Operator => see_other("/console/operator"),
        Ok(Some(_)) => see_other("/console/portal"),
        Ok(None) => see_other("/console/signin"),
        Err(e) => store_down(&e),
    }
}

fn signin_form(error: Option<&str>, login: &str) -> Markup {
    html! {
        @if let Some(e) = error { (view::note("error", e)) }
        div.cards {
            section.card aria-labelledby="tenant-h" {
                h2 #tenant-h { "Tenant sign-in" }
                form method="post" action="/console/signin" {
                    label for="login" { "Email or user name" }
                    input #login name="login" type="text" autocomplete="username" required value=(login);
                    label for="password" { "Password" }
                    input #password name="password" type="password" autocomplete="current-password" required;
                    button type="submit" #tenant-signin { "Sign in" }
                }
            }
            section.card aria-labelledby="operator-h" {
                h2 #operator-h { "Operator sign-in" }
                form method="post" action="/console/operator/signin" {
                    label for="token" { "Admin token" }
                    input #token name="token" type="password" autocomplete="off" required;
                    button type="submit" #operator-signin { "Sign in as operator" }
                }
            }
        }
    }
}

async fn signin_page() -> Response {
    html(StatusCode::OK, view::page("Sign in", Nav::None, signin_form(None, "")))
}

/// Starts a session: its cookie, then on to `to`.
async fn start(c: &Shared, role: Role, to: &str) -> Response {
    let token = auth::token();
    let session = Session::new(role);
    if let Err(e) = users::create_session(&c.app.store, &token, &session, c.config.session_ttl).await {
        return store_down(&e);
    }
    let mut r = see_other(to);
    if let Ok(v) = auth::session_cookie(&token, c.config.session_ttl.as_secs()).parse() {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn operator_signin(State(c): State<Shared>, Form(form): Form<HashMap<String, String>>) -> Response {
    let given = form.get("token").map(|t| t.trim()).unwrap_or_default();
    if !c.token.matches(given.as_bytes()) {
        tracing::info!("console: an operator sign-in with a wrong token");
        return html(StatusCode::UNAUTHORIZED, view::page("Sign in", Nav::None, signin_form(Some("That is not the admin token."), "")));
    }
    start(&c, Role::Operator, "/console/operator").await
}

async fn tenant_signin(State(c): State<Shared>, Form(form): Form<HashMap<String, String>>) -> Response {
    let raw_login = form.get("login").cloned().unwrap_or_default();
    let password = form.get("password").cloned().unwrap_or_default();
    let refused = |m: &str| html(StatusCode::UNAUTHORIZED, view::page("Sign in", Nav::None, signin_form(Some(m), &raw_login)));
    let wrong = "Wrong login or password.";
    let Some(login) = Login::parse(&raw_login) else { return refused(wrong) };
    let store = &c.app.store;
    match users::failures(store, &login).await {
        Ok(n) if auth::locked(n, c.config.lockout_after) => {
            let minutes = c.config.lockout_for.as_secs().div_ceil(60);
            return html(
                StatusCode::TOO_MANY_REQUESTS,
                view::page("Sign in", Nav::None, signin_form(Some(&format!("Too many wrong passwords: this sign-in is locked for {minutes} minutes after the last one. The operator can set a new password meanwhile.")), &raw_login)),
            );
        }
        Ok(_) => {}
        Err(e) => return store_down(&e),
    }
    let user = match users::user(store, &login).await {
        Ok(u) => u,
        Err(e) => return store_down(&e),
    };
    // verified off the async workers (argon2 takes tens of ms on purpose); an unknown login
    // verifies a decoy so that it answers as slowly as a known one
    let phc = user.as_ref().map(|u| u.password.clone()).unwrap_or_else(|| auth::decoy_hash().to_string());
    let ok = tokio::task::spawn_blocking(move || auth::verify_password(&password, &phc)).await.unwrap_or(false);
    match user {
        Some(u) if ok => {
            if let Err(e) = users::clear_failures(store, &login).await {
                return store_down(&e);
            }
            start(&c, Role::Tenant { tenant: u.tenant, login }, "/console/portal").await
        }
        _ => {
            if let Err(e) = users::fail(store, &login, c.config.lockout_for).await {
                return store_down(&e);
            }
            refused(wrong)
        }
    }
}

async fn signout(State(c): State<Shared>, headers: HeaderMap, Form(form): Form<HashMap<String, String>>) -> Response {
    let (token, session) = match current(&c, &headers).await {
        Ok(Some(ts)) => ts,
        Ok(None) => return see_other("/console/signin"),
        Err(e) => return store_down(&e),
    };
    if let Err(r) = check_csrf(&session, &form) {
        return r;
    }
    // the session ends here, on the server: a copy of the cookie is worth nothing after this
    if let Err(e) = users::delete_session(&c.app.store, &token).await {
        return store_down(&e);
    }
    let mut r = see_other("/console/signin");
    if let Ok(v) = auth::cleared_cookie().parse() {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

fn invite_form(token: &str, login: &str, tenant: &str, error: Option<&str>) -> Markup {
    html! {
        @if let Some(e) = error { (view::note("error", e)) }
        p { "You are invited as " strong { (login) } " of tenant " strong { (tenant) } ". Choose a password (at least " (auth::MIN_PASSWORD) " characters)." }
        form method="post" action={ "/console/invite/" (token) } {
            label for="password" { "Password" }
            input #password name="password" type="password" autocomplete="new-password" required minlength=(auth::MIN_PASSWORD);
            label for="password2" { "Password again" }
            input #password2 name="password2" type="password" autocomplete="new-password" required;
            button type="submit" { "Set password and sign in" }
        }
    }
}

fn invite_gone() -> Response {
    html(StatusCode::NOT_FOUND, view::page("Invite", Nav::None, html! {
        (view::note("error", "This invite link was used already or has expired. Ask the operator for a new one."))
        p { a href="/console/signin" { "Sign in" } }
    }))
}

async fn invite_page(State(c): State<Shared>, Path(token): Path<String>) -> Response {
    match users::invite(&c.app.store, &token).await {
        Ok(Some(i)) => html(StatusCode::OK, view::page("Accept the invite", Nav::None, invite_form(&token, i.login.as_str(), i.tenant.as_str(), None))),
        Ok(None) => invite_gone(),
        Err(e) => store_down(&e),
    }
}

async fn accept_invite(State(c): State<Shared>, Path(token): Path<String>, Form(form): Form<HashMap<String, String>>) -> Response {
    let store = &c.app.store;
    let invite = match users::invite(store, &token).await {
        Ok(Some(i)) => i,
        Ok(None) => return invite_gone(),
        Err(e) => return store_down(&e),
    };
    let password = form.get("password").cloned().unwrap_or_default();
    let problem = auth::password_problem(&password)
        .map(|p| format!("The password needs {p}."))
        .or_else(|| (form.get("password2") != Some(&password)).then(|| "The two passwords differ.".to_string()));
    if let Some(p) = problem {
        return html(StatusCode::BAD_REQUEST, view::page("Accept the invite", Nav::None, invite_form(&token, invite.login.as_str(), invite.tenant.as_str(), Some(&p))));
    }
    // used now: a second use (or a race with one) finds it gone
    let invite = match users::take_invite(store, &token).await {
        Ok(Some(i)) => i,
        Ok(None) => return invite_gone(),
        Err(e) => return store_down(&e),
    };
    let phc = match tokio::task::spawn_blocking(move || auth::hash_password(&password)).await {
        Ok(Ok(p)) => p,
        _ => return html(StatusCode::INTERNAL_SERVER_ERROR, view::page("Accept the invite", Nav::None, view::note("error", "The password could not be hashed."))),
    };
    let user = User { tenant: invite.tenant.clone(), name: invite.name.clone(), plan: invite.plan.clone(), password: phc };
    match users::create_user(store, &invite.login, &user).await {
        Ok(true) => start(&c, Role::Tenant { tenant: invite.tenant, login: invite.login }, "/console/portal").await,
        Ok(false) => html(StatusCode::CONFLICT, view::page("Accept the invite", Nav::None, view::note("error", "A user with this login exists already; ask the operator."))),
        Err(e) => store_down(&e),
    }
}
