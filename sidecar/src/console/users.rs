//! Tenant users, sessions, invites and sign-in failures in Redis (docs/redis-keys.md, the
//! `console:` family). Redis is where they live, as the API keys' hot copy does: every replica
//! signs in and checks sessions against the same records.

use super::auth::Session;
use crate::keys::{ConsoleFailuresKey, ConsoleInviteKey, ConsoleSessionKey, ConsoleUserKey, ConsoleUsersKey, Id, Login, SecretHash};
use crate::store::{Store, StoreError};
use redis::AsyncCommands;
use std::collections::HashMap;
use std::time::Duration;

/// A person waits on these, not a request: the admin path's deadline.
const DEADLINE: Duration = Duration::from_secs(5);

/// A tenant user as stored (`console:user:{login}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub tenant: Id,
    pub name: String,
    /// The plan of the keys this user creates (set by the operator: a tenant cannot pick one).
    pub plan: Id,
    /// argon2id PHC string.
    pub password: String,
}

impl User {
    fn to_fields(&self) -> Vec<(&'static str, String)> {
        vec![("tenant", self.tenant.to_string()), ("name", self.name.clone()), ("plan", self.plan.to_string()), ("password", self.password.clone())]
    }
    fn from_fields(f: &HashMap<String, String>) -> Option<User> {
        Some(User {
            tenant: Id::parse(f.get("tenant")?)?,
            name: f.get("name").cloned().unwrap_or_default(),
            plan: Id::parse(f.get("plan")?)?,
            password: f.get("password")?.clone(),
        })
    }
}

/// An invite (`console:invite:{sha256(token)}`): who the user will be once a password is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invite {
    pub tenant: Id,
    pub login: Login,
    pub name: String,
    pub plan: Id,
}

async fn run<T, F, Fut>(store: &Store, op: &'static str, f: F) -> Result<T, StoreError>
where
    F: FnOnce(crate::store::Conn) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    store.run_with_deadline(op, DEADLINE, f).await
}

/// Creates a user; `Ok(false)` when the login is taken.
pub async fn create_user(store: &Store, login: &Login, user: &User) -> Result<bool, StoreError> {
    let key = ConsoleUserKey::new(login);
    let fields = user.to_fields();
    let (k, tenant) = (key.clone(), user.tenant.to_string());
    // HSETNX of the first field claims the login: two creations of one login, one wins
    let claimed: bool = run(store, "console_user_claim", |mut c| async move { c.hset_nx(k, "tenant", tenant).await }).await?;
    if !claimed {
        return Ok(false);
    }
    let index = ConsoleUsersKey::new(&user.tenant);
    let login_s = login.to_string();
    run(store, "console_user_create", |mut c| async move {
        c.hset_multiple::<_, _, _, ()>(key, &fields).await?;
        c.sadd::<_, _, ()>(index, login_s).await
    })
    .await?;
    Ok(true)
}

pub async fn user(store: &Store, login: &Login) -> Result<Option<User>, StoreError> {
    let key = ConsoleUserKey::new(login);
    let f: HashMap<String, String> = run(store, "console_user", |mut c| async move { c.hgetall(key).await }).await?;
    Ok(User::from_fields(&f))
}

/// The users of one tenant, by login.
pub async fn users(store: &Store, tenant: &Id) -> Result<Vec<(Login, User)>, StoreError> {
    let index = ConsoleUsersKey::new(tenant);
    let mut logins: Vec<String> = run(store, "console_users", |mut c| async move { c.smembers(index).await }).await?;
    logins.sort();
    let mut out = Vec::new();
    for l in logins.iter().filter_map(|l| Login::parse(l)) {
        if let Some(u) = user(store, &l).await?.filter(|u| &u.tenant == tenant) {
            out.push((l, u));
        }
    }
    Ok(out)
}

/// Deletes a user of `tenant` (its sessions end with it: [`session`] checks the user); false
/// when there is no such user of that tenant.
pub async fn delete_user(store: &Store, tenant: &Id, login: &Login) -> Result<bool, StoreError> {
    if user(store, login).await?.is_none_or(|u| &u.tenant != tenant) {
        return Ok(false);
    }
    let (key, index, l) = (ConsoleUserKey::new(login), ConsoleUsersKey::new(tenant), login.to_string());
    run(store, "console_user_delete", |mut c| async move {
        c.del::<_, ()>(key).await?;
        c.srem::<_, _, ()>(index, l).await
    })
    .await?;
    Ok(true)
}

pub async fn set_password(store: &Store, login: &Login, phc: &str) -> Result<(), StoreError> {
    let (key, phc) = (ConsoleUserKey::new(login), phc.to_string());
    run(store, "console_password", |mut c| async move { c.hset::<_, _, _, ()>(key, "password", phc).await }).await
}

pub async fn create_session(store: &Store, token: &str, s: &Session, ttl: Duration) -> Result<(), StoreError> {
    let key = ConsoleSessionKey::new(&SecretHash::of(token));
    let fields = s.to_fields();
    let secs = ttl.as_secs().max(1) as i64;
    run(store, "console_session_create", |mut c| async move {
        redis::pipe().atomic().hset_multiple(&key, &fields).ignore().expire(&key, secs).ignore().query_async::<()>(&mut c).await
    })
    .await
}

/// The session of a cookie's token: `None` when there is none (expired, signed out), or when
/// its tenant user was deleted or moved to another tenant since.
pub async fn session(store: &Store, token: &str) -> Result<Option<Session>, StoreError> {
    let key = ConsoleSessionKey::new(&SecretHash::of(token));
    let f: HashMap<String, String> = run(store, "console_session", |mut c| async move { c.hgetall(key).await }).await?;
    let Some(s) = Session::from_fields(&f) else { return Ok(None) };
    if let super::auth::Role::Tenant { tenant, login } = &s.role {
        if user(store, login).await?.is_none_or(|u| &u.tenant != tenant) {
            return Ok(None);
        }
    }
    Ok(Some(s))
}

pub async fn delete_session(store: &Store, token: &str) -> Result<(), StoreError> {
    let key = ConsoleSessionKey::new(&SecretHash::of(token));
    run(store, "console_session_delete", |mut c| async move { c.del::<_, ()>(key).await }).await
}

pub async fn create_invite(store: &Store, token: &str, i: &Invite, ttl: Duration) -> Result<(), StoreError> {
    let key = ConsoleInviteKey::new(&SecretHash::of(token));
    let fields = vec![("tenant", i.tenant.to_string()), ("login", i.login.to_string()), ("name", i.name.clone()), ("plan", i.plan.to_string())];
    let secs = ttl.as_secs().max(1) as i64;
    run(store, "console_invite_create", |mut c| async move {
        redis::pipe().atomic().hset_multiple(&key, &fields).ignore().expire(&key, secs).ignore().query_async::<()>(&mut c).await
    })
    .await
}

fn invite_of(f: &HashMap<String, String>) -> Option<Invite> {
    Some(Invite {
        tenant: Id::parse(f.get("tenant")?)?,
        login: Login::parse(f.get("login")?)?,
        name: f.get("name").cloned().unwrap_or_default(),
        plan: Id::parse(f.get("plan")?)?,
    })
}

/// The invite of a link's token, without using it.
pub async fn invite(store: &Store, token: &str) -> Result<Option<Invite>, StoreError> {
    let key = ConsoleInviteKey::new(&SecretHash::of(token));
    let f: HashMap<String, String> = run(store, "console_invite", |mut c| async move { c.hgetall(key).await }).await?;
    Ok(invite_of(&f))
}

/// Uses an invite: read and deleted; `None` when it is gone or another use took it first (only
/// the caller whose DEL removed it gets it: single use under concurrency too).
pub async fn take_invite(store: &Store, token: &str) -> Result<Option<Invite>, StoreError> {
    let key = ConsoleInviteKey::new(&SecretHash::of(token));
    let (f, deleted): (HashMap<String, String>, i64) =
        run(store, "console_invite_take", |mut c| async move { redis::pipe().atomic().hgetall(&key).del(&key).query_async(&mut c).await }).await?;
    Ok(if deleted == 1 { invite_of(&f) } else { None })
}

/// Wrong passwords in a row for `login`.
pub async fn failures(store: &Store, login: &Login) -> Result<u64, StoreError> {
    let key = ConsoleFailuresKey::new(login);
    let n: Option<u64> = run(store, "console_failures", |mut c| async move { c.get(key).await }).await?;
    Ok(n.unwrap_or(0))
}

/// Counts one more wrong password; the count lives `lock_for` after the last one.
pub async fn fail(store: &Store, login: &Login, lock_for: Duration) -> Result<u64, StoreError> {
    let key = ConsoleFailuresKey::new(login);
    let secs = lock_for.as_secs().max(1) as i64;
    let (n,): (u64,) = run(store, "console_fail", |mut c| async move {
        redis::pipe().atomic().incr(&key, 1).expire(&key, secs).ignore().query_async(&mut c).await
    })
    .await?;
    Ok(n)
}

pub async fn clear_failures(store: &Store, login: &Login) -> Result<(), StoreError> {
    let key = ConsoleFailuresKey::new(login);
    run(store, "console_fail_clear", |mut c| async move { c.del::<_, ()>(key).await }).await
}
