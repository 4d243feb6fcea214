//! The configuration plane: tenants, products, plans and routes — their model and validation
//! ([`model`], [`routes`]), where they come from (the TOML file or PostgreSQL, [`postgres`]), the
//! admin HTTP API that changes them ([`admin`]), and how a change reaches every replica
//! ([`propagation`]). Nothing here is on the request path: the decision path only sees what
//! [`propagation::Control::install`] hands it (plans and routing).

pub mod admin;
pub mod model;
pub mod postgres;
pub mod propagation;
pub mod routes;
