//! The console's routes, merged into the admin router (lib.rs).

use super::config::ConsoleConfig;
use super::shared::{css, security_headers, Console};
use super::{api, operator, portal, signin, usage};
use crate::control::Control;
use crate::secret::Secret;
use crate::server::AppState;
use axum::middleware;
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

/// The console's routes, to merge into the admin router: `admin` is that router itself (the
/// console calls its handlers in-process).
pub fn router(config: ConsoleConfig, admin: Router, token: Secret, control: Arc<Control>, app: Arc<AppState>) -> Router {
    let usage = usage::UsageDb::new(config.usage_url.clone());
    let console = Arc::new(Console { config, api: api::Api::new(admin, token.clone()), token, control, app, usage });
    Router::new()
        .route("/console/assets/console.css", get(css))
        .merge(signin::routes())
        .merge(operator::routes())
        .merge(portal::routes())
        .with_state(console)
        .layer(middleware::from_fn(security_headers))
}

