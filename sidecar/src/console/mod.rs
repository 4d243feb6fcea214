//! The web console (issue 43; docs/console.md): an operator console and a tenant portal, served
//! by the admin listener under `/console` when `console.enabled` (off by default).
//!
//! A plane like the others: its routes ([`operator`], [`portal`], [`signin`]), its sessions and
//! tenant users ([`auth`], [`users`]), its pages ([`view`], server-rendered HTML with maud, charts
//! as SVG) and its one stylesheet, all embedded in the binary. No script runs in the browser: the
//! Content-Security-Policy says `script-src 'none'` and every page works with plain forms.
//!
//! Invariants:
//! - every change goes through the admin API's own handlers, called in-process ([`api`]): the
//!   console has no validation of its own, so its errors are the API's;
//! - a tenant session names its tenant, and every portal read or write is checked against it
//!   before anything is asked of the API (a key id of another tenant is "not found");
//! - every POST of a signed-in session carries the session's CSRF token (a synchronizer token in
//!   the form), compared in constant time; a missing or wrong one is refused with 403.

pub mod api;
pub mod auth;
pub mod config;
pub mod figures;
pub mod operator;
pub mod operator_keys;
pub mod portal;
pub mod router;
pub mod shared;
pub mod signin;
pub mod usage;
pub mod users;
pub mod view;
