//! The functional-test harness: RAII guards for real processes (Redis, the sidecar, Envoy) and
//! in-process servers (an echo upstream, a black hole), each on its own free port.
//!
//! Rules: readiness is polled with a deadline, never assumed after a sleep; every guard kills its
//! process on drop; when a test panics, each guard prints its process's log so the failure
//! explains itself. Binaries come from `TOLLGATE_*` variables (set by build.sh) or default to the
//! workspace's build outputs.

pub mod echo;
/// HTTP/1.1 over a raw socket, for bytes no client library sends (hostile-client tests).
pub mod raw;
pub mod postgres;
/// A real Kafka-compatible broker (tansu) and a topic reader (usage tests).
pub mod broker;
/// The billing consumer binary as a guard (usage tests).
pub mod billing;

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use echo::Echoed;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn bin(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

pub fn envoy_bin() -> PathBuf {
    bin("TOLLGATE_ENVOY_BIN", root().join(".tollgate/tools/venv/lib/python3.11/site-packages/envoy/_bin/envoy"))
}
pub fn wasm_path() -> PathBuf {
    bin("TOLLGATE_WASM", root().join("target/wasm32-wasip1/release/tollgate_filter.wasm"))
}
pub fn sidecar_bin() -> PathBuf {
    bin("TOLLGATE_SIDECAR_BIN", root().join("target/release/tollgate-sidecar"))
}
pub fn redis_server_bin() -> PathBuf {
    bin("TOLLGATE_REDIS_SERVER_BIN", PathBuf::from("redis-server"))
}

/// A free loopback port, never handed out twice by this process.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    loop {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("bind :0");
        if given.insert(port) {
            return port;
        }
    }
}

/// Polls `ready` until it returns true or `deadline` passes (then panics naming `what`).
/// The short pause between polls is the poll interval, not a wait for readiness.
pub fn poll_until(what: &str, deadline: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    let mut pause = Duration::from_millis(2);
    while !ready() {
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// A child process that is killed on drop and whose log is printed if the test failed.
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Proc {
        let out = fs::File::create(&log).expect("create log");
        let err = out.try_clone().expect("clone log");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc { name: name.to_string(), child: Some(child), log }
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits up to `deadline` for a clean exit; returns the exit status.
    pub fn terminate(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
        let start = Instant::now();
        loop {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(s);
            }
            if start.elapsed() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: String = log.lines().rev().take(80).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            eprintln!("----- {} log ({}) -----\n{}\n----- end of {} log -----", self.name, self.log.display(), tail, self.name);
        }
        self.kill();
    }
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
        poll_until("redis PING", Duration::from_secs(20), || r.ping());
        r
    }

    fn spawn(port: u16, dir: &Path) -> Proc {
        let mut cmd = Command::new(redis_server_bin());
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .args(["--daemonize", "no"]);
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Proc::spawn("redis", cmd, dir.join(format!("redis-{n}.log")))
    }

    /// Starts the server again on the same port (empty: no persistence), after [`Redis::kill`].
    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, self.dir.path());
        poll_until("redis PING after restart", Duration::from_secs(20), || self.ping());
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn ping(&self) -> bool {
        self.connection().and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok()).is_some()
    }

    pub fn connection(&self) -> Option<redis::Connection> {
        let client = redis::Client::open(self.url()).ok()?;
        client.get_connection_with_timeout(Duration::from_secs(2)).ok()
    }

    /// Stops the server (SIGKILL: an outage, not a shutdown).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Every key name and every value in the database, rendered as text, for leak checks.
    pub fn dump(&self) -> Vec<String> {
        let mut c = self.connection().expect("redis connection");
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).expect("KEYS");
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

/// A key issued through `tollgate-sidecar keys create`.
#[derive(Debug, Clone)]
pub struct IssuedKey {
    pub id: String,
    pub raw: String,
}

/// Unix sockets of the sidecars this process started, by their TCP port: what lets
/// `EnvoyOptions::new(upstream, sidecar.port)` point Envoy at a harness sidecar's socket.
static SIDECAR_SOCKETS: Mutex<Vec<(u16, PathBuf)>> = Mutex::new(Vec::new());

/// The unix socket of the harness sidecar listening on TCP `port`, if any.
pub fn sidecar_socket(port: u16) -> Option<PathBuf> {
    let sockets = SIDECAR_SOCKETS.lock().unwrap_or_else(|p| p.into_inner());
    sockets.iter().rev().find(|(p, _)| *p == port).map(|(_, path)| path.clone())
}

/// The real sidecar binary, configured through its environment. It serves the same API on TCP
/// (`port`: what tests call) and on a unix socket in its own directory (`unix_path`), both
/// HTTP/1.1 and HTTP/2 (h2c); Envoy reaches it by whichever `EnvoyOptions::sidecar_transport`
/// says.
pub struct Sidecar {
    pub port: u16,
    env: Vec<(String, String)>,
    proc: Proc,
    starts: u32,
    _dir: tempfile::TempDir,
}

impl Sidecar {
    /// Starts a sidecar on a free port talking to `redis_url`; `extra` are more
    /// `TOLLGATE_SIDECAR_*` settings. Waits for `/healthz`.
    pub fn start(redis_url: &str, extra: &[(&str, &str)]) -> Sidecar {
        Self::start_with_config(redis_url, "", extra)
    }

    /// As [`Sidecar::start`], with a TOML configuration file (e.g. plans) under the environment.
    pub fn start_with_config(redis_url: &str, toml: &str, extra: &[(&str, &str)]) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let config_path = dir.path().join("sidecar.toml");
        fs::write(&config_path, toml).expect("write sidecar.toml");
        let port = free_port();
        let socket = dir.path().join("sidecar.sock");
        let mut env = vec![
            ("TOLLGATE_SIDECAR_LISTEN".to_string(), format!("127.0.0.1:{port}")),
            ("TOLLGATE_SIDECAR_LISTEN_UNIX".to_string(), socket.display().to_string()),
            ("TOLLGATE_SIDECAR_REDIS__URL".to_string(), redis_url.to_string()),
            // Generous on a noisy 2-core machine; tests that need a short one say so.
            ("TOLLGATE_SIDECAR_REDIS__TIMEOUT".to_string(), "500ms".to_string()),
            ("TOLLGATE_SIDECAR_LOG__FORMAT".to_string(), "text".to_string()),
            ("TOLLGATE_SIDECAR_LOG__LEVEL".to_string(), "info,tollgate_sidecar=debug".to_string()),
            ("TOLLGATE_SIDECAR_CONFIG".to_string(), config_path.display().to_string()),
        ];
        for (k, v) in extra {
            env.retain(|(ek, _)| ek != k);
            env.push((k.to_string(), v.to_string()));
        }
        let mut cmd = Command::new(sidecar_bin());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let proc = Proc::spawn("sidecar", cmd, dir.path().join("sidecar.log"));
        let s = Sidecar { port, env, proc, starts: 1, _dir: dir };
        let url = s.url("/healthz");
        poll_until("sidecar /healthz", Duration::from_secs(20), || get(&url, &[]).status == 200);
        if let Some(path) = s.unix_path() {
            // Bound before TCP answers (the sidecar binds both, then serves).
            assert!(path.exists(), "the sidecar did not create its unix socket {}", path.display());
            SIDECAR_SOCKETS.lock().unwrap_or_else(|p| p.into_inner()).push((port, path));
        }
        s
    }

    /// The unix socket the sidecar listens on (`TOLLGATE_SIDECAR_LISTEN_UNIX`).
    pub fn unix_path(&self) -> Option<PathBuf> {
        self.env
            .iter()
            .find(|(k, _)| k == "TOLLGATE_SIDECAR_LISTEN_UNIX")
            .map(|(_, v)| PathBuf::from(v))
            .filter(|p| !p.as_os_str().is_empty())
    }

    /// Kills the sidecar (a crash: SIGKILL) and starts it again with the same settings on the
    /// same port (where Envoy's cluster points); waits for `/healthz`. The log is the new one's.
    pub fn restart(&mut self) {
        self.proc.kill();
        let mut cmd = Command::new(sidecar_bin());
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        self.proc = Proc::spawn("sidecar", cmd, self._dir.path().join(format!("sidecar-{}.log", self.starts)));
        self.starts += 1;
        let url = self.url("/healthz");
        poll_until("restarted sidecar /healthz", Duration::from_secs(20), || get(&url, &[]).status == 200);
    }

    /// The value of one Prometheus sample of `/metrics` (e.g.
    /// `tollgate_sidecar_usage_events_total{outcome="spooled"}`), 0 when absent.
    pub fn metric(&self, sample: &str) -> u64 {
        get(&self.url("/metrics"), &[])
            .body
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// Runs `tollgate-sidecar <args>` with this sidecar's configuration.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(sidecar_bin())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .args(args)
            .output()
            .expect("run tollgate-sidecar")
    }

    /// `keys create`; the raw key is the last line of stdout, the id is on the `key id:` line.
    pub fn create_key(&self, tenant: &str, plan: &str, extra: &[&str]) -> IssuedKey {
        let mut args = vec!["keys", "create", "--tenant", tenant, "--plan", plan];
        args.extend_from_slice(extra);
        let out = self.cli(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "keys create failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        let raw = stdout.lines().last().unwrap_or_default().trim().to_string();
        let id = stdout
            .lines()
            .find_map(|l| l.strip_prefix("key id:"))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        assert!(raw.starts_with("tg_") && id.starts_with("key_"), "unexpected keys create output: {stdout}");
        IssuedKey { id, raw }
    }

    pub fn revoke_key(&self, id: &str) {
        let out = self.cli(&["keys", "revoke", id]);
        assert!(out.status.success(), "keys revoke failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn kill(&mut self) {
        self.proc.kill();
    }

    pub fn terminate(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        self.proc.terminate(deadline)
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }
}

/// An in-process server on its own runtime thread, stopped on drop.
pub struct InProcess {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The echo upstream (see [`echo`]).
pub fn start_echo() -> InProcess {
    start_counting_echo().0
}

/// The echo upstream and the count of requests that reached it.
pub fn start_counting_echo() -> (InProcess, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = seen.clone();
    let server = start_in_process(move |listener, stop| async move {
        let _ = echo::serve_counted(
            listener,
            async move {
                let _ = stop.await;
            },
            counter,
        )
        .await;
    });
    (server, seen)
}

/// A server that accepts connections and never answers: a hung sidecar.
pub fn start_black_hole() -> InProcess {
    start_in_process(|listener, stop| async move {
        let mut held = Vec::new();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Ok((s, _)) = listener.accept() => held.push(s),
            }
        }
    })
}

fn start_in_process<F, Fut>(f: F) -> InProcess
where
    F: FnOnce(tokio::net::TcpListener, tokio::sync::oneshot::Receiver<()>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let std_listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let port = std_listener.local_addr().expect("addr").port();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
            f(listener, rx).await;
        });
    });
    InProcess { port, stop: Some(tx), thread: Some(thread) }
}

/// How Envoy's `tollgate_sidecar` cluster reaches the sidecar (the templates' `SIDECAR_PROTOCOL`
/// and `SIDECAR_ADDRESS`; docs/configuration.md, "Transport to the sidecar").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SidecarTransport {
    /// HTTP/1.1 keep-alive pool over loopback TCP.
    Http1Tcp,
    /// HTTP/2 (h2c, prior knowledge), multiplexed on one loopback TCP connection.
    Http2Tcp,
    /// HTTP/1.1 over the sidecar's unix socket.
    Http1Unix,
    /// HTTP/2 over the sidecar's unix socket.
    Http2Unix,
}

impl SidecarTransport {
    /// What the tests and `./build.sh up` render into `envoy/tollgate.yaml.tmpl`: the cheapest
    /// measured (docs/benchmarks.md, "Transport"; docs/decisions.md 55).
    pub const DEFAULT: SidecarTransport = SidecarTransport::Http2Tcp;

    pub fn is_unix(self) -> bool {
        matches!(self, SidecarTransport::Http1Unix | SidecarTransport::Http2Unix)
    }

    pub fn is_http2(self) -> bool {
        matches!(self, SidecarTransport::Http2Tcp | SidecarTransport::Http2Unix)
    }

    /// The same protocol over TCP.
    pub fn over_tcp(self) -> SidecarTransport {
        if self.is_http2() {
            SidecarTransport::Http2Tcp
        } else {
            SidecarTransport::Http1Tcp
        }
    }
}

/// How to start an Envoy.
#[derive(Clone)]
pub struct EnvoyOptions {
    pub upstream_port: u16,
    pub sidecar_port: u16,
    /// How Envoy reaches the sidecar. A unix transport needs `sidecar_unix`.
    pub sidecar_transport: SidecarTransport,
    /// The sidecar's unix socket (for the unix transports).
    pub sidecar_unix: Option<PathBuf>,
    /// The plugin configuration JSON (see docs/configuration.md).
    pub plugin_config: String,
    pub concurrency: u32,
    /// `envoy/tollgate.yaml.tmpl` (default) or `envoy/baseline.yaml.tmpl`.
    pub template: &'static str,
    /// Pin Envoy to this CPU (taskset), for benchmarks.
    pub cpu: Option<u32>,
    /// More `${NAME}` placeholders for templates that have them (e.g. `FALLBACK_PORT`); they
    /// override the harness's own (e.g. `WASM_PATH`: another build of the filter).
    pub vars: Vec<(&'static str, String)>,
}

impl EnvoyOptions {
    /// Envoy in front of `upstream_port`, calling the sidecar on `sidecar_port` by the default
    /// transport. When no harness sidecar listens there (a black hole, a dead port), or it has
    /// no unix socket, the default's protocol over TCP to that port.
    pub fn new(upstream_port: u16, sidecar_port: u16) -> EnvoyOptions {
        let sidecar_unix = sidecar_socket(sidecar_port);
        let default = SidecarTransport::DEFAULT;
        let sidecar_transport = if default.is_unix() && sidecar_unix.is_none() { default.over_tcp() } else { default };
        EnvoyOptions {
            upstream_port,
            sidecar_port,
            sidecar_transport,
            sidecar_unix,
            plugin_config: "{}".into(),
            concurrency: 1,
            template: "envoy/tollgate.yaml.tmpl",
            cpu: None,
            vars: Vec::new(),
        }
    }
    pub fn plugin_config(mut self, json: &str) -> Self {
        self.plugin_config = json.to_string();
        self
    }
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n;
        self
    }
    /// Reach the sidecar by `transport` (a unix one needs a harness sidecar on `sidecar_port`).
    pub fn sidecar_transport(mut self, transport: SidecarTransport) -> Self {
        assert!(
            !transport.is_unix() || self.sidecar_unix.is_some(),
            "no unix socket known for a sidecar on port {}",
            self.sidecar_port
        );
        self.sidecar_transport = transport;
        self
    }
    /// Envoy alone (router only): no filter, no sidecar.
    pub fn baseline(mut self) -> Self {
        self.template = "envoy/baseline.yaml.tmpl";
        self
    }
}

/// The `explicit_http_config` of the `tollgate_sidecar` cluster (`SIDECAR_PROTOCOL`).
pub fn sidecar_protocol_yaml(transport: SidecarTransport) -> &'static str {
    if transport.is_http2() {
        "{http2_protocol_options: {}}"
    } else {
        "{http_protocol_options: {}}"
    }
}

/// The `tollgate_sidecar` endpoint's address (`SIDECAR_ADDRESS`).
pub fn sidecar_address_yaml(transport: SidecarTransport, port: u16, unix: Option<&Path>) -> String {
    match (transport.is_unix(), unix) {
        (true, Some(path)) => format!("{{pipe: {{path: \"{}\"}}}}", path.display()),
        (true, None) => panic!("a unix transport to the sidecar needs its socket path"),
        (false, _) => format!("{{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}"),
    }
}

/// Fills `${NAME}` placeholders of an Envoy template.
pub fn render_template(template: &str, vars: &[(&str, String)]) -> String {
    let mut out = template.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("${{{k}}}"), v);
    }
    assert!(!out.contains("${"), "unfilled placeholder in envoy template");
    out
}

/// A real Envoy loading the Tollgate .wasm.
pub struct Envoy {
    pub port: u16,
    pub admin_port: u16,
    proc: Proc,
    opts: EnvoyOptions,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// How this Envoy was started (to start a twin, e.g. with another build of the filter).
    pub fn options(&self) -> &EnvoyOptions {
        &self.opts
    }

    /// Starts Envoy and waits for admin `/ready`; panics (printing the log) if it does not come up.
    pub fn start(opts: EnvoyOptions) -> Envoy {
        match Envoy::try_start(opts) {
            Ok(e) => e,
            Err(why) => panic!("envoy did not start: {why}"),
        }
    }

    /// Starts Envoy; `Err` with its log when it exits instead of becoming ready.
    pub fn try_start(opts: EnvoyOptions) -> Result<Envoy, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, admin_port) = (free_port(), free_port());
        let template = fs::read_to_string(root().join(opts.template)).expect("read envoy template");
        // `opts.vars` first: the first value of a placeholder wins, so they override these.
        let mut vars = opts.vars.clone();
        vars.extend([
            ("ADMIN_PORT", admin_port.to_string()),
            ("LISTEN_PORT", port.to_string()),
            ("UPSTREAM_PORT", opts.upstream_port.to_string()),
            ("SIDECAR_PORT", opts.sidecar_port.to_string()),
            ("SIDECAR_PROTOCOL", sidecar_protocol_yaml(opts.sidecar_transport).to_string()),
            ("SIDECAR_ADDRESS", sidecar_address_yaml(opts.sidecar_transport, opts.sidecar_port, opts.sidecar_unix.as_deref())),
            ("WASM_PATH", wasm_path().display().to_string()),
            ("PLUGIN_CONFIG", opts.plugin_config.replace('\'', "''")),
        ]);
        let yaml = render_template(&template, &vars);
        let config = dir.path().join("envoy.yaml");
        fs::write(&config, yaml).expect("write envoy.yaml");
        let mut cmd = match opts.cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu.to_string()]).arg(envoy_bin());
                c
            }
            None => Command::new(envoy_bin()),
        };
        cmd.arg("-c")
            .arg(&config)
            .args(["--concurrency", &opts.concurrency.to_string()])
            .args(["--base-id", &admin_port.to_string(), "--disable-hot-restart"])
            .args(["-l", "info", "--component-log-level", "wasm:debug"]);
        let proc = Proc::spawn("envoy", cmd, dir.path().join("envoy.log"));
        let mut envoy = Envoy { port, admin_port, proc, opts: opts.clone(), _dir: dir };
        let ready_url = format!("http://127.0.0.1:{admin_port}/ready");
        let start = Instant::now();
        loop {
            if let Some(status) = envoy.proc.exited() {
                let log = envoy.proc.log_text();
                envoy.proc.child = None;
                return Err(format!("envoy exited ({status}):\n{log}"));
            }
            if get(&ready_url, &[]).status == 200 {
                return Ok(envoy);
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(format!("envoy not ready after 60s:\n{}", envoy.proc.log_text()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// The value of a counter from admin `/stats` (0 when absent).
    pub fn counter(&self, name: &str) -> u64 {
        let stats = get(&format!("http://127.0.0.1:{}/stats?filter={}", self.admin_port, name), &[]).body;
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }

    /// Every stat whose name contains `filter` (admin `/stats?filter=`), as text.
    pub fn stats(&self, filter: &str) -> String {
        get(&format!("http://127.0.0.1:{}/stats?filter={}", self.admin_port, filter), &[]).body
    }
}

/// A response, whatever its status.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// What the echo upstream saw (panics if the body is not an echo).
    pub fn echoed(&self) -> Echoed {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not an echo ({e}), status {}: {}", self.status, self.body))
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(15))).build().into()
}

/// GET `url` with `headers`; connection failures come back as status 0.
pub fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    let mut req = agent().get(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    into_resp(req.call())
}

/// POST `body` to `url` with `headers`; connection failures come back as status 0.
pub fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut req = agent().post(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    into_resp(req.send(body))
}

fn into_resp(result: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Resp {
    match result {
        Ok(mut r) => {
            let status = r.status().as_u16();
            let headers = r
                .headers()
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
            let body = r.body_mut().read_to_string().unwrap_or_default();
            Resp { status, headers, body }
        }
        Err(e) => Resp { status: 0, headers: vec![], body: e.to_string() },
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

fn sync_conn(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?.get_connection_with_timeout(Duration::from_secs(2)).ok()
}

fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    let mut c = sync_conn(port)?;
    let info: String = redis::cmd("INFO").arg(section).query(&mut c).ok()?;
    info.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).map(|v| v.trim().to_string())
}

/// A real 3-master Redis Cluster (no replicas), each node on its own ports and directory.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    _procs: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut ports = Vec::new();
        let mut procs = Vec::new();
        for i in 0..3 {
            let (port, bus) = (free_port(), free_port());
            let node_dir = dir.path().join(format!("n{i}"));
            fs::create_dir_all(&node_dir).expect("node dir");
            let mut cmd = Command::new(redis_server_bin());
            cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                .args(["--cluster-port", &bus.to_string(), "--daemonize", "no"])
                .arg("--dir")
                .arg(&node_dir);
            procs.push(Proc::spawn(&format!("redis-cluster-{i}"), cmd, node_dir.join("redis.log")));
            ports.push(port);
        }
        for &p in &ports {
            poll_until("cluster node PING", Duration::from_secs(20), || {
                sync_conn(p).and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok()).is_some()
            });
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
            poll_until("cluster_state:ok", Duration::from_secs(30), || {
                info_field_cluster(p).as_deref() == Some("ok")
            });
        }
        RedisCluster { ports, _procs: procs, _dir: dir }
    }

    pub fn nodes(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect()
    }
}

fn info_field_cluster(port: u16) -> Option<String> {
    let mut c = sync_conn(port)?;
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut c).ok()?;
    info.lines().find_map(|l| l.strip_prefix("cluster_state:")).map(|v| v.trim().to_string())
}

/// A real Sentinel setup: a master, a replica and three sentinels monitoring `mymaster`.
pub struct RedisSentinel {
    pub master_port: u16,
    pub replica_port: u16,
    pub sentinel_ports: Vec<u16>,
    _procs: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl RedisSentinel {
    pub fn start() -> RedisSentinel {
        let dir = tempfile::tempdir().expect("tempdir");
        let (master_port, replica_port) = (free_port(), free_port());
        let mut procs = Vec::new();
        for (name, port, extra) in [
            ("redis-master", master_port, vec!["--repl-diskless-sync-delay".to_string(), "0".to_string()]),
            ("redis-replica", replica_port, vec!["--replicaof".to_string(), "127.0.0.1".to_string(), master_port.to_string()]),
        ] {
            let d = dir.path().join(name);
            fs::create_dir_all(&d).expect("dir");
            let mut cmd = Command::new(redis_server_bin());
            cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no"])
                .args(&extra)
                .arg("--dir")
                .arg(&d);
            procs.push(Proc::spawn(name, cmd, d.join("redis.log")));
        }
        poll_until("the replica to sync", Duration::from_secs(30), || {
            info_field(replica_port, "replication", "master_link_status").as_deref() == Some("up")
        });
        let mut sentinel_ports = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let d = dir.path().join(format!("sentinel-{i}"));
            fs::create_dir_all(&d).expect("dir");
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
            procs.push(Proc::spawn(&format!("sentinel-{i}"), cmd, d.join("sentinel.log")));
            sentinel_ports.push(port);
        }
        let s = RedisSentinel { master_port, replica_port, sentinel_ports, _procs: procs, _dir: dir };
        for &p in &s.sentinel_ports {
            poll_until("sentinels to know each other and the replica", Duration::from_secs(30), || {
                let Some(mut c) = sync_conn(p) else { return false };
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

    /// The port Sentinel names as master now.
    pub fn master(&self) -> Option<u16> {
        let mut c = sync_conn(self.sentinel_ports[0])?;
        let (_, port): (String, u16) =
            redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg("mymaster").query(&mut c).ok()?;
        Some(port)
    }

    /// `SENTINEL FAILOVER`, then waits until the replica is a writable master.
    pub fn failover(&self) {
        let mut c = sync_conn(self.sentinel_ports[0]).expect("sentinel connection");
        let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg("mymaster").query(&mut c).expect("SENTINEL FAILOVER");
        poll_until("the replica to become master", Duration::from_secs(30), || {
            self.master() == Some(self.replica_port)
                && info_field(self.replica_port, "replication", "role").as_deref() == Some("master")
        });
    }
}
/// An upstream that fails on command and counts what it sees (circuit-breaker tests).
pub mod flaky;
pub use flaky::{start_flaky, Flaky};
