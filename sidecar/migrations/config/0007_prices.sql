-- Prices of LLM calls (issue 42 item 2, decision 337): one row per price, its document the admin
-- API's (`/v1/prices`, docs/openapi.json), validated by the sidecar before it is written. Read
-- with the other kinds in one statement; a row a sidecar cannot use is reported and left out
-- (decision 206).
CREATE TABLE prices (
    id          text PRIMARY KEY,
    doc         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
