//! The decision lab of the limits engine's integration tests (limits, leases, refunds): a real
//! redis-server, a [`Decider`] over it with a clock the test drives, and an API key. Each test
//! file adds its own ways of calling it (`impl Lab` there).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;
use tollgate_sidecar::apikey;
use tollgate_sidecar::clock::ManualClock;
use tollgate_sidecar::config::Config;
use tollgate_sidecar::decision::limits::Plans;
use tollgate_sidecar::decision::Decider;
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::store::Store;
use tollgate_tests::Redis;

/// 2026-11-29T12:00:00Z — the middle of a minute-aligned hour.
pub const T0: u64 = 1_795_953_600_000;

pub struct Lab {
    pub redis: Redis,
    pub clock: Arc<ManualClock>,
    pub decider: Decider,
    pub store: Store,
    /// The hash of the key issued by [`Lab::key`] (empty before).
    pub key_hash: String,
    key_id: Option<Id>,
    /// Requests made so far, for the tests to number theirs.
    pub n: u32,
}

impl Lab {
    /// A lab deciding by the plans of `toml` (each Redis call bounded at 500 ms, a decision's
    /// Redis time at 2 s), its clock at `now`; `tune` adjusts the configuration before the
    /// decider is made. The 2 s replaces the production default of 20 ms: a first call connects
    /// and loads its script, which on a loaded 2-core machine can take longer than 20 ms, and
    /// the limit's failure mode (open) would then answer instead of the script under test.
    pub fn start(toml: &str, now: u64, tune: impl FnOnce(&mut Config)) -> Lab {
        let redis = Redis::start();
        let mut cfg = Config::from_toml(toml).unwrap();
        cfg.redis.url = redis.url();
        cfg.redis.timeout = Duration::from_millis(500);
        cfg.redis.decision_timeout = Duration::from_secs(2);
        tune(&mut cfg);
        let store = Store::new(&cfg.redis).unwrap();
        let clock = Arc::new(ManualClock::new(now));
        let decider = Decider::new(store.clone(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), clock.clone());
        Lab { redis, clock, decider, store, key_hash: String::new(), key_id: None, n: 0 }
    }

    /// Issues a key of tenant `acme` on `plan`: the lab's key from now on.
    pub async fn key(mut self, plan: &str) -> Lab {
        let issued = apikey::issue(Id::parse("acme").unwrap(), Id::parse(plan).unwrap(), 1, None);
        self.store.create_key(&issued.hash, &issued.record).await.unwrap();
        self.key_hash = issued.hash.as_str().to_string();
        self.key_id = Some(issued.record.key_id);
        self
    }

    /// A command to the lab's Redis, its reply as `T`.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.redis.cmd(args)
    }

    /// The id of the key issued by [`Lab::key`].
    pub fn key_id(&self) -> &Id {
        self.key_id.as_ref().expect("no key issued")
    }
}
