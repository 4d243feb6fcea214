//! Sessions and passwords, pure: argon2id hashing, random tokens, the session cookie, the CSRF
//! check and the lockout rule. Storage is [`super::users`]; the routes are [`super::signin`].

use crate::keys::{Id, Login};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use rand::distr::{Alphanumeric, SampleString};
use std::collections::HashMap;

/// The session cookie's name.
pub const COOKIE: &str = "tollgate_console";

/// Shortest password a tenant user may set.
pub const MIN_PASSWORD: usize = 12;
/// Longest (argon2 takes any length; a bound keeps a request's hashing work bounded).
pub const MAX_PASSWORD: usize = 256;

/// Who a session is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Operator,
    Tenant { tenant: Id, login: Login },
}

/// A signed-in session as stored (`console:session:{sha256(token)}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub role: Role,
    /// The synchronizer token every write of this session must carry.
    pub csrf: String,
}

impl Session {
    pub fn new(role: Role) -> Session {
        Session { role, csrf: token() }
    }

    pub fn to_fields(&self) -> Vec<(&'static str, String)> {
        let mut f = vec![("csrf", self.csrf.clone())];
        match &self.role {
            Role::Operator => f.push(("role", "operator".into())),
            Role::Tenant { tenant, login } => {
                f.push(("role", "tenant".into()));
                f.push(("tenant", tenant.to_string()));
                f.push(("login", login.to_string()));
            }
        }
        f
    }

    /// `None` for anything but a whole, well-formed session (an empty hash: no session).
    pub fn from_fields(f: &HashMap<String, String>) -> Option<Session> {
        let csrf = f.get("csrf").filter(|c| c.len() >= 32)?.clone();
        let role = match f.get("role")?.as_str() {
            "operator" => Role::Operator,
            "tenant" => Role::Tenant { tenant: Id::parse(f.get("tenant")?)?, login: Login::parse(f.get("login")?)? },
            _ => return None,
        };
        Some(Session { role, csrf })
    }

    /// Whether `given` is this session's CSRF token (constant time).
    pub fn csrf_ok(&self, given: Option<&str>) -> bool {
        given.is_some_and(|g| crate::secret::same(g.as_bytes(), self.csrf.as_bytes()))
    }
}

/// A fresh random secret: 43 alphanumerics (~256 bits), for session, CSRF and invite tokens.
pub fn token() -> String {
    Alphanumeric.sample_string(&mut rand::rng(), 43)
}

/// The `Set-Cookie` of a new session: HttpOnly, Secure, SameSite=Strict, the console's path.
pub fn session_cookie(token: &str, max_age_secs: u64) -> String {
    format!("{COOKIE}={token}; Path=/console; HttpOnly; Secure; SameSite=Strict; Max-Age={max_age_secs}")
}

/// The `Set-Cookie` that clears it.
pub fn cleared_cookie() -> String {
    format!("{COOKIE}=; Path=/console; HttpOnly; Secure; SameSite=Strict; Max-Age=0")
}

/// The session token in a `Cookie` header, if any (the last of several wins nothing: the first).
pub fn cookie_token(cookie_header: &str) -> Option<&str> {
    cookie_header.split(';').filter_map(|p| p.trim().split_once('=')).find(|(k, _)| *k == COOKIE).map(|(_, v)| v).filter(|v| !v.is_empty() && v.len() <= 128)
}

/// Why a password cannot be set.
pub fn password_problem(password: &str) -> Option<String> {
    let n = password.chars().count();
    if n < MIN_PASSWORD {
        return Some(format!("at least {MIN_PASSWORD} characters"));
    }
    if password.len() > MAX_PASSWORD {
        return Some(format!("at most {MAX_PASSWORD} bytes"));
    }
    None
}

/// The argon2id PHC string of `password` (the crate's default parameters: m = 19 MiB, t = 2,
/// p = 1, OWASP's minimum), with a random salt.
pub fn hash_password(password: &str) -> Result<String, String> {
    let salt_bytes: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt_bytes).map_err(|e| e.to_string())?;
    Argon2::default().hash_password(password.as_bytes(), &salt).map(|h| h.to_string()).map_err(|e| e.to_string())
}

/// Whether `password` matches the PHC string `stored` (false for a malformed one).
pub fn verify_password(password: &str, stored: &str) -> bool {
    if password.len() > MAX_PASSWORD {
        return false;
    }
    PasswordHash::new(stored).is_ok_and(|h| Argon2::default().verify_password(password.as_bytes(), &h).is_ok())
}

/// A hash no password matches, verified for unknown logins so that their answer takes as long
/// as a known one's (no telling which logins exist by timing).
pub fn decoy_hash() -> &'static str {
    static DECOY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DECOY.get_or_init(|| hash_password(&token()).unwrap_or_default())
}

/// Whether a login with `failures` wrong passwords in a row is locked (`lockout_after` of them).
pub fn locked(failures: u64, lockout_after: u32) -> bool {
    failures >= u64::from(lockout_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_hash_with_argon2id_and_verify() {
        let h = hash_password("correct horse battery").unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password("correct horse battery", &h));
        assert!(!verify_password("correct horse batterY", &h));
        assert!(!verify_password("x", "not a phc string"));
        assert_ne!(hash_password("correct horse battery").unwrap(), h, "a salt of its own");
        assert!(!verify_password("anything", decoy_hash()));
    }

    #[test]
    fn sessions_round_trip_and_check_csrf() {
        let s = Session::new(Role::Tenant { tenant: Id::parse("acme").unwrap(), login: Login::parse("ana@acme.io").unwrap() });
        let map: HashMap<String, String> = s.to_fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(Session::from_fields(&map), Some(s.clone()));
        assert!(s.csrf_ok(Some(&s.csrf)));
        assert!(!s.csrf_ok(None));
        assert!(!s.csrf_ok(Some("")));
        assert!(!s.csrf_ok(Some(&token())));
        assert_eq!(Session::from_fields(&HashMap::new()), None, "no session");
        let mut bad = map.clone();
        bad.insert("role".into(), "root".into());
        assert_eq!(Session::from_fields(&bad), None);
        let op = Session::new(Role::Operator);
        let map: HashMap<String, String> = op.to_fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(Session::from_fields(&map), Some(op));
    }

    #[test]
    fn cookies_are_strict_and_found() {
        let c = session_cookie("abc", 60);
        for part in ["HttpOnly", "Secure", "SameSite=Strict", "Path=/console"] {
            assert!(c.contains(part), "{c}");
        }
        assert_eq!(cookie_token("a=1; tollgate_console=tok; b=2"), Some("tok"));
        assert_eq!(cookie_token("tollgate_console="), None);
        assert_eq!(cookie_token("other=1"), None);
    }

    #[test]
    fn lockout_and_password_rules() {
        assert!(!locked(19, 20));
        assert!(locked(20, 20));
        assert!(password_problem("short").is_some());
        assert!(password_problem("long enough pass").is_none());
        assert!(password_problem(&"x".repeat(300)).is_some());
        assert_eq!(token().len(), 43);
    }
}
