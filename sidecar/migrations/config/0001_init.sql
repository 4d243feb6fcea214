-- Tollgate configuration schema, version 1 (issue 4). Applied by the sidecar on start, in one
-- transaction under an advisory lock, recorded in config_schema_version.
-- Documents are the admin API's JSON objects (docs/openapi.json), validated by the sidecar
-- before they are written; ids are the admin API's ids.
CREATE TABLE tenants (
    id          text PRIMARY KEY,
    doc         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE products (
    id          text PRIMARY KEY,
    doc         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE plans (
    id          text PRIMARY KEY,
    doc         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE routes (
    id          text PRIMARY KEY,
    doc         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
-- Which API products a tenant is subscribed to (kept in step with tenants.doc->'products').
CREATE TABLE subscriptions (
    tenant_id   text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    product_id  text NOT NULL REFERENCES products (id),
    PRIMARY KEY (tenant_id, product_id)
);
-- API keys: the store of record. Only the sha256 of a key is kept; Redis apikey:{sha256} is the
-- hot copy the request path reads.
CREATE TABLE api_keys (
    key_id      text PRIMARY KEY,
    key_hash    text NOT NULL UNIQUE,
    tenant_id   text NOT NULL,
    plan_id     text NOT NULL,
    status      text NOT NULL CHECK (status IN ('active', 'revoked')),
    created_at  bigint NOT NULL,
    expires_at  bigint,
    revoked_at  bigint
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);
