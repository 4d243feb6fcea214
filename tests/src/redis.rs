//! Real Redis servers for tests, each on free ports in its own directory, killed on drop: a
//! single [`Redis`], a 3-master [`RedisCluster`] and a [`RedisSentinel`] setup (master, replica,
//! three sentinels). Readiness is polled (`PING`, `cluster_state:ok`, replica sync, sentinels
//! knowing each other), never assumed. Also the inspection helpers the tests assert with: raw
//! commands, `INFO commandstats` counts, the TTL invariant, a leak check for raw API keys.

use crate::process::{free_port, poll_until, redis_server_bin, Proc};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A redis-server on `port` (loopback, no persistence) with `dir` as its working directory.
fn server_command(port: u16, dir: &Path) -> Command {
    let mut cmd = Command::new(redis_server_bin());
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir);
    cmd
}

fn connection(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?.get_connection_with_timeout(Duration::from_secs(2)).ok()
}

fn ping(port: u16) -> bool {
    connection(port).and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok()).is_some()
}

/// `field` of `INFO section` on the server at `port`.
fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    let mut c = connection(port)?;
    let info: String = redis::cmd("INFO").arg(section).query(&mut c).ok()?;
    info.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).map(|v| v.trim().to_string())
}

/// Calls of command `name` (lowercase, e.g. `evalsha`) in an `INFO commandstats` text (0 when
/// absent). Commands run inside a script are counted too.
pub fn command_calls(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
        .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A real redis-server on a free port, in its own directory.
pub struct Redis {
    pub port: u16,
    proc: Proc,
    dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Redis {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let proc = Self::spawn(port, dir.path());
        let r = Redis { port, proc, dir };
        poll_until("redis PING", Duration::from_secs(20), || ping(port));
        r
    }

    fn spawn(port: u16, dir: &Path) -> Proc {
        static STARTS: AtomicUsize = AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, Ordering::Relaxed);
        Proc::spawn("redis", server_command(port, dir), dir.join(format!("redis-{n}.log")))
    }

    /// Starts the server again on the same port (empty: no persistence), after [`Redis::kill`].
    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, self.dir.path());
        let port = self.port;
        poll_until("redis PING after restart", Duration::from_secs(20), || ping(port));
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn connection(&self) -> Option<redis::Connection> {
        connection(self.port)
    }

    /// Runs one command (`args[0]` and its arguments); panics on any error.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.connection().expect("redis connection");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut c).unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// The key names matching `pattern` (`KEYS`).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        self.cmd(&["KEYS", pattern])
    }

    /// `INFO commandstats` (read it with [`command_calls`]).
    pub fn commandstats(&self) -> String {
        self.cmd(&["INFO", "commandstats"])
    }

    /// Stops the server (SIGKILL: an outage, not a shutdown).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Freezes the server (SIGSTOP): it keeps its connections and accepts new ones, and answers
    /// nothing until [`Redis::resume`] — a hung Redis, not a dead one. Dropping the guard still
    /// kills it (SIGKILL works on a stopped process).
    pub fn pause(&self) {
        self.proc.signal("-STOP");
    }

    /// Lets a [`Redis::pause`]d server run again (SIGCONT).
    pub fn resume(&self) {
        self.proc.signal("-CONT");
    }

    /// Every key name and every value in the database, rendered as text, for leak checks.
    pub fn dump(&self) -> Vec<String> {
        let mut c = self.connection().expect("redis connection");
        let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).expect("KEYS");
        // KEYS order follows the hash table, which can be mid-rehash: sorted, two dumps compare
        keys.sort();
        let mut out = Vec::new();
        for k in keys {
            let kind: String = redis::cmd("TYPE").arg(&k).query(&mut c).expect("TYPE");
            let value: Vec<String> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&k).query(&mut c).expect("GET")],
                "hash" => redis::cmd("HGETALL").arg(&k).query(&mut c).expect("HGETALL"),
                "set" => redis::cmd("SMEMBERS").arg(&k).query(&mut c).expect("SMEMBERS"),
                "zset" => redis::cmd("ZRANGE").arg(&k).arg(0).arg(-1).query(&mut c).expect("ZRANGE"),
                "list" => redis::cmd("LRANGE").arg(&k).arg(0).arg(-1).query(&mut c).expect("LRANGE"),
                other => vec![format!("<{other}>")],
            };
            out.push(k);
            out.extend(value);
        }
        out
    }

    /// Seed 004's invariant: every key carries a TTL, except the store-of-record families
    /// (`apikey:{sha256}`, `apikey-id:`, `apikey-index:`) and the config generation counter
    /// `cfg:routing:version` (seed 000: no TTL). Returns how many keys were checked.
    pub fn assert_ttl_invariant(&self) -> usize {
        let mut c = self.connection().expect("redis connection");
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).expect("KEYS");
        for k in &keys {
            let store_of_record = k == "cfg:routing:version"
                || k.starts_with("apikey-id:")
                || k.starts_with("apikey-index:")
                || (k.starts_with("apikey:") && !k.starts_with("apikey:authfail:"));
            let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut c).expect("PTTL");
            if store_of_record {
                assert_eq!(ttl, -1, "store-of-record key {k} must not expire");
            } else {
                assert!(ttl > 0, "key {k} has no TTL ({ttl})");
            }
        }
        keys.len()
    }

    /// Panics if any key or value contains one of `raw_keys`.
    pub fn assert_no_raw_keys(&self, raw_keys: &[&str]) {
        let dump = self.dump();
        assert!(!dump.is_empty(), "expected some keys in Redis");
        for raw in raw_keys {
            assert!(!raw.is_empty());
            for item in &dump {
                assert!(!item.contains(raw), "a raw API key is stored in Redis: {item}");
            }
        }
    }
}

/// The `redis-cli` next to the configured `redis-server` (or on PATH).
fn redis_cli_bin() -> PathBuf {
    let server = redis_server_bin();
    match server.parent() {
        Some(dir) if dir.join("redis-cli").exists() => dir.join("redis-cli"),
        _ => PathBuf::from("redis-cli"),
    }
}

/// Servers of a topology and the directory they share; every process is killed on drop.
struct Processes {
    procs: Vec<Proc>,
    dir: tempfile::TempDir,
}

impl Processes {
    fn new() -> Processes {
        Processes { procs: Vec::new(), dir: tempfile::tempdir().expect("tempdir") }
    }

    /// A fresh subdirectory `name` for one server.
    fn subdir(&self, name: &str) -> PathBuf {
        let d = self.dir.path().join(name);
        fs::create_dir_all(&d).expect("server dir");
        d
    }

    fn spawn(&mut self, name: &str, cmd: Command, log: PathBuf) {
        self.procs.push(Proc::spawn(name, cmd, log));
    }
}

/// A real 3-master Redis Cluster (no replicas), each node on its own ports and directory.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    servers: Processes,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let mut servers = Processes::new();
        let mut ports = Vec::new();
        for i in 0..3 {
            let (port, bus) = (free_port(), free_port());
            let node_dir = servers.subdir(&format!("n{i}"));
            let mut cmd = server_command(port, &node_dir);
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]).args(["--cluster-port", &bus.to_string()]);
            servers.spawn(&format!("redis-cluster-{i}"), cmd, node_dir.join("redis.log"));
            ports.push(port);
        }
        for &p in &ports {
            poll_until("cluster node PING", Duration::from_secs(20), || ping(p));
        }
        let out = Command::new(redis_cli_bin())
            .args(["--cluster", "create"])
            .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(out.status.success(), "cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        for &p in &ports {
            poll_until("cluster_state:ok", Duration::from_secs(30), || cluster_state(p).as_deref() == Some("ok"));
        }
        RedisCluster { ports, servers }
    }

    pub fn nodes(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect()
    }

    /// Stops every node (SIGSTOP): a hung cluster, its connections open, nothing answered.
    pub fn pause(&self) {
        self.servers.procs.iter().for_each(|p| p.signal("-STOP"));
    }

    /// Lets [`RedisCluster::pause`]d nodes run again (SIGCONT).
    pub fn resume(&self) {
        self.servers.procs.iter().for_each(|p| p.signal("-CONT"));
    }
}

fn cluster_state(port: u16) -> Option<String> {
    let mut c = connection(port)?;
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut c).ok()?;
    info.lines().find_map(|l| l.strip_prefix("cluster_state:")).map(|v| v.trim().to_string())
}

/// A real Sentinel setup: a master, a replica and three sentinels monitoring `mymaster`.
pub struct RedisSentinel {
    pub master_port: u16,
    pub replica_port: u16,
    pub sentinel_ports: Vec<u16>,
    /// The master first, then the replica and the sentinels.
    servers: Processes,
}

impl RedisSentinel {
    pub fn start() -> RedisSentinel {
        let mut servers = Processes::new();
        let (master_port, replica_port) = (free_port(), free_port());
        for (name, port, extra) in [
            ("redis-master", master_port, vec!["--repl-diskless-sync-delay".to_string(), "0".to_string()]),
            ("redis-replica", replica_port, vec!["--replicaof".to_string(), "127.0.0.1".to_string(), master_port.to_string()]),
        ] {
            let d = servers.subdir(name);
            let mut cmd = server_command(port, &d);
            cmd.args(&extra);
            servers.spawn(name, cmd, d.join("redis.log"));
        }
        poll_until("the replica to sync", Duration::from_secs(30), || {
            info_field(replica_port, "replication", "master_link_status").as_deref() == Some("up")
        });
        let mut sentinel_ports = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let d = servers.subdir(&format!("sentinel-{i}"));
            let conf = d.join("sentinel.conf");
            fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel resolve-hostnames no\n\
                     sentinel monitor mymaster 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds mymaster 2000\nsentinel failover-timeout mymaster 10000\n",
                    d.display()
                ),
            )
            .expect("sentinel.conf");
            let mut cmd = Command::new(redis_server_bin());
            cmd.arg(&conf).arg("--sentinel");
            servers.spawn(&format!("sentinel-{i}"), cmd, d.join("sentinel.log"));
            sentinel_ports.push(port);
        }
        let s = RedisSentinel { master_port, replica_port, sentinel_ports, servers };
        for &p in &s.sentinel_ports {
            poll_until("sentinels to know each other and the replica", Duration::from_secs(30), || {
                let Some(mut c) = connection(p) else { return false };
                let others: Vec<redis::Value> =
                    redis::cmd("SENTINEL").arg("SENTINELS").arg("mymaster").query(&mut c).unwrap_or_default();
                let replicas: Vec<redis::Value> =
                    redis::cmd("SENTINEL").arg("REPLICAS").arg("mymaster").query(&mut c).unwrap_or_default();
                others.len() == 2 && !replicas.is_empty()
            });
        }
        s
    }

    pub fn sentinels(&self) -> Vec<String> {
        self.sentinel_ports.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect()
    }

    /// Freezes the first master (SIGSTOP): it keeps its connections and answers nothing until
    /// [`RedisSentinel::resume_master`]. Shorter than `down-after-milliseconds` (2 s), a slow
    /// master, not a failover.
    pub fn pause_master(&self) {
        self.servers.procs[0].signal("-STOP");
    }

    /// Lets a [`RedisSentinel::pause_master`]ed master run again (SIGCONT).
    pub fn resume_master(&self) {
        self.servers.procs[0].signal("-CONT");
    }

    /// The port Sentinel names as master now.
    pub fn master(&self) -> Option<u16> {
        let mut c = connection(self.sentinel_ports[0])?;
        let (_, port): (String, u16) =
            redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg("mymaster").query(&mut c).ok()?;
        Some(port)
    }

    /// `SENTINEL FAILOVER`, then waits until the replica is a writable master.
    pub fn failover(&self) {
        let mut c = connection(self.sentinel_ports[0]).expect("sentinel connection");
        let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg("mymaster").query(&mut c).expect("SENTINEL FAILOVER");
        poll_until("the replica to become master", Duration::from_secs(30), || {
            self.master() == Some(self.replica_port)
                && info_field(self.replica_port, "replication", "role").as_deref() == Some("master")
        });
    }
}
