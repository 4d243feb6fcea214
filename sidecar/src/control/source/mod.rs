//! Where the configuration comes from, behind one trait ([`ConfigSource`]): the TOML file
//! ([`FileSource`], fixed for the life of the process) or PostgreSQL ([`postgres::PgSource`], the
//! store of record, changed through the admin API). Either answers a validated [`Snapshot`]; the
//! one in use is a [`crate::control::Source`].

pub mod postgres;

use super::model::{Invalid, Snapshot};
use super::salvage::Unusable;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::Duration;

/// Why a source could not answer.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("PostgreSQL unreachable: {0}")]
    Unreachable(String),
    #[error("stored configuration is invalid: {0}")]
    Invalid(#[from] Invalid),
    #[error("stored configuration is unreadable: {0}")]
    Corrupt(String),
    #[error("the file source is read-only: change the TOML file and restart, or use the PostgreSQL source")]
    ReadOnly,
    /// A delete refused: keys still name the object (decision 174).
    #[error("{0}")]
    InUse(String),
    /// A key refused: the object it names (`tenant`, `plan`) is not stored.
    #[error("{1}")]
    Missing(&'static str, String),
}

/// A source of configuration snapshots.
pub trait ConfigSource: Send + Sync {
    /// The configuration as stored now — not validated: what the objects name may be missing —
    /// and the stored objects that could not be read (decision 206;
    /// [`crate::control::salvage`] makes the configuration to put in force of both).
    fn load(&self) -> impl Future<Output = Result<(Snapshot, Vec<Unusable>), SourceError>> + Send;
}

/// The TOML file's configuration, fixed for the life of the process.
pub struct FileSource(Snapshot);

impl FileSource {
    pub fn new(snapshot: Snapshot) -> FileSource {
        FileSource(snapshot)
    }
}

impl ConfigSource for FileSource {
    async fn load(&self) -> Result<(Snapshot, Vec<Unusable>), SourceError> {
        Ok((self.0.clone(), Vec::new()))
    }
}

/// `[source]`: where tenants, products, plans and routes come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    /// `file` (default: this TOML file) or `postgres`.
    pub kind: SourceKind,
    /// `postgres://user@host:port/db` when `kind = "postgres"`.
    pub postgres_url: String,
    /// Deadline for connecting to PostgreSQL (at start and on admin writes).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    File,
    Postgres,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig { kind: SourceKind::File, postgres_url: String::new(), connect_timeout: Duration::from_secs(5) }
    }
}
