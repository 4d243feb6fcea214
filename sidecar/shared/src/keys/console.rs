//! The console's keys (issue 43; docs/console.md): tenant users, sessions, invites and the
//! sign-in failure counters. None is read on the request path, and none is touched by a script
//! together with another, so they carry no hash tag. A session or an invite is named by the
//! sha256 of its secret ([`SecretHash`]): what Redis holds cannot be presented as a cookie or a
//! link.

use super::Id;
use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};

/// A tenant user's sign-in name: an e-mail address or a plain name, lowercased; 3-128 of
/// letters, digits and `.`, `_`, `-`, `+`, `@`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Login(String);

impl Login {
    pub fn parse(s: &str) -> Option<Login> {
        let s = s.trim().to_ascii_lowercase();
        let ok = (3..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+@".contains(&b));
        ok.then_some(Login(s))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The lowercase-hex sha256 of a session token or an invite token.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SecretHash(String);

impl SecretHash {
    pub fn of(secret: &str) -> SecretHash {
        use sha2::{Digest, Sha256};
        SecretHash(Sha256::digest(secret.as_bytes()).iter().map(|b| format!("{b:02x}")).collect())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

redis_key!(
    /// `console:user:{login}` — hash: a tenant user (`tenant`, `name`, `plan`, `password` as an
    /// argon2id PHC string, `created_at`). Store of record: no TTL.
    ConsoleUserKey
);
redis_key!(
    /// `console:users:{tenant}` — set of the logins of one tenant's users. Store of record.
    ConsoleUsersKey
);
redis_key!(
    /// `console:session:{sha256(token)}` — hash: a signed-in session (`role`, `tenant`, `login`,
    /// `csrf`); TTL `console.session_ttl`, deleted at sign-out.
    ConsoleSessionKey
);
redis_key!(
    /// `console:invite:{sha256(token)}` — hash: an invite (`tenant`, `login`, `name`, `plan`);
    /// TTL `console.invite_ttl`, deleted by its one use.
    ConsoleInviteKey
);
redis_key!(
    /// `console:failures:{login}` — string: wrong passwords in a row; TTL `console.lockout_for`,
    /// renewed by each failure, deleted by a sign-in.
    ConsoleFailuresKey
);

impl ConsoleUserKey {
    pub fn new(login: &Login) -> Self {
        Self(format!("console:user:{login}"))
    }
}

impl ConsoleUsersKey {
    pub fn new(tenant: &Id) -> Self {
        Self(format!("console:users:{tenant}"))
    }
}

impl ConsoleSessionKey {
    pub fn new(token: &SecretHash) -> Self {
        Self(format!("console:session:{}", token.as_str()))
    }
}

impl ConsoleInviteKey {
    pub fn new(token: &SecretHash) -> Self {
        Self(format!("console:invite:{}", token.as_str()))
    }
}

impl ConsoleFailuresKey {
    pub fn new(login: &Login) -> Self {
        Self(format!("console:failures:{login}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_key_formats() {
        let login = Login::parse(" Ana@Example.com ").unwrap();
        assert_eq!(login.as_str(), "ana@example.com");
        assert_eq!(ConsoleUserKey::new(&login).as_str(), "console:user:ana@example.com");
        assert_eq!(ConsoleFailuresKey::new(&login).as_str(), "console:failures:ana@example.com");
        assert_eq!(ConsoleUsersKey::new(&Id::parse("acme").unwrap()).as_str(), "console:users:acme");
        let h = SecretHash::of("abc");
        assert_eq!(h.as_str(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(ConsoleSessionKey::new(&h).as_str(), format!("console:session:{}", h.as_str()));
        assert_eq!(ConsoleInviteKey::new(&h).as_str(), format!("console:invite:{}", h.as_str()));
    }

    #[test]
    fn logins_are_checked() {
        for bad in ["", "ab", "a b c", "x:y", "a{b}c", &"a".repeat(129), "ana*"] {
            assert!(Login::parse(bad).is_none(), "{bad:?}");
        }
        assert!(Login::parse("dev-1.ops+x@acme.io").is_some());
    }
}
