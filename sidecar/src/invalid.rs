//! Why a configuration value was refused: the field, and what is wrong with it. Every section's
//! validation (crate::config), the plans (crate::decision::limits) and the configuration model
//! (crate::control::model) answer with it; the admin API names the field in its 400s.

/// A refused value; `field` names it as the operator wrote it (`plans.gold.limits[0].limit`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct Invalid {
    pub field: String,
    pub reason: String,
}

/// An [`Invalid`] for `field`.
pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
    Invalid { field: field.into(), reason: reason.into() }
}

/// An id of the configuration (`field` names it): 1–64 of letters, digits, `_`, `-`, `.`.
pub fn check_id(field: &str, id: &str) -> Result<(), Invalid> {
    crate::keys::Id::parse(id).map(|_| ()).ok_or_else(|| invalid(field, "use 1-64 of letters, digits, '_', '-', '.'"))
}
