//! What the Tollgate sidecar and the billing consumer share, and nothing else: the typed Redis
//! keys ([`keys`], the only place a key name is built), the usage aggregate message format
//! ([`aggregate`], how a spool segment's marked events become `tollgate.usage.aggregate.v1`
//! messages with content-derived ids) and how a librdkafka client's properties are put together
//! ([`kafka`]), what a usage event must be to be counted ([`events`]), and how both binaries read their configuration ([`settings`]: defaults, file,
//! environment). No runtime, and no I/O but reading a configuration file: billing depends on
//! this crate instead of the whole sidecar (axum, rdkafka, the Redis client).

pub mod aggregate;
pub mod csv;
pub mod events;
pub mod kafka;
pub mod keys;
pub mod settings;
