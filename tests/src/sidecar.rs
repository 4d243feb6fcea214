//! The real sidecar binary as a guard, configured through its environment (`TOLLGATE_SIDECAR_*`)
//! and an optional TOML file, and the keys it issues through its CLI.
//!
//! Every harness sidecar serves on loopback TCP (what tests call) and on a unix socket in its own
//! directory; the socket is recorded by TCP port so that an Envoy started for that port can reach
//! it by a unix transport.

use crate::http::get;
use crate::process::{free_port, poll_until, service_guard, sidecar_bin, Service};
use std::fs;
use std::path::PathBuf;
use std::process::Output;
use std::sync::Mutex;
use std::time::Duration;

/// A key issued through `tollgate-sidecar keys create`.
#[derive(Debug, Clone)]
pub struct IssuedKey {
    pub id: String,
    pub raw: String,
}

/// Unix sockets of the sidecars this process started, by their TCP port: what lets
/// `EnvoyOptions::new(upstream, sidecar.port)` point Envoy at a harness sidecar's socket.
static SIDECAR_SOCKETS: Mutex<Vec<(u16, PathBuf)>> = Mutex::new(Vec::new());

/// The filter secrets of the sidecars this process started, by their TCP port: what
/// `EnvoyOptions::new` puts in the plugin configuration (`sidecar.secret`).
static SIDECAR_SECRETS: Mutex<Vec<(u16, String)>> = Mutex::new(Vec::new());

/// The unix socket of the harness sidecar listening on TCP `port`, if any.
pub fn sidecar_socket(port: u16) -> Option<PathBuf> {
    let sockets = SIDECAR_SOCKETS.lock().unwrap_or_else(|p| p.into_inner());
    sockets.iter().rev().find(|(p, _)| *p == port).map(|(_, path)| path.clone())
}

/// The filter secret of the harness sidecar listening on TCP `port`, if any.
pub fn sidecar_secret(port: u16) -> Option<String> {
    let secrets = SIDECAR_SECRETS.lock().unwrap_or_else(|p| p.into_inner());
    secrets.iter().rev().find(|(p, _)| *p == port).map(|(_, s)| s.clone())
}

/// The setting that carries the filter secret.
pub const SECRET_ENV: &str = "TOLLGATE_SIDECAR_SERVER__SECRET";

/// A fresh random filter secret (48 hex digits from the kernel's random source): one per
/// deployment.
pub fn new_secret() -> String {
    let mut bytes = [0u8; 24];
    use std::io::Read;
    fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).expect("read /dev/urandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The real sidecar binary, configured through its environment. It serves the same API on TCP
/// (`port`: what tests call) and on a unix socket in its own directory (`unix_path`), both
/// HTTP/1.1 and HTTP/2 (h2c); Envoy reaches it by whichever `EnvoyOptions::sidecar_transport`
/// says. Process control (`kill`, `terminate`, `log_text`, `pid`, `cli`) is the [`Service`]'s.
pub struct Sidecar {
    pub port: u16,
    service: Service,
}

service_guard!(Sidecar);

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
        fs::write(&config_path, with_unlimited_plans(toml)).expect("write sidecar.toml");
        let port = free_port();
        let socket = dir.path().join("sidecar.sock");
        let env = vec![
            ("TOLLGATE_SIDECAR_LISTEN".to_string(), format!("127.0.0.1:{port}")),
            ("TOLLGATE_SIDECAR_LISTEN_UNIX".to_string(), socket.display().to_string()),
            ("TOLLGATE_SIDECAR_REDIS__URL".to_string(), redis_url.to_string()),
            // Generous on a noisy 2-core machine; tests that need a short one say so.
            ("TOLLGATE_SIDECAR_REDIS__TIMEOUT".to_string(), "500ms".to_string()),
            // The whole decision's Redis budget too (20 ms by default): on a loaded machine a
            // starved Redis or sidecar must not turn a test's decisions into 503s.
            ("TOLLGATE_SIDECAR_REDIS__DECISION_TIMEOUT".to_string(), "500ms".to_string()),
            ("TOLLGATE_SIDECAR_LOG__FORMAT".to_string(), "text".to_string()),
            ("TOLLGATE_SIDECAR_LOG__LEVEL".to_string(), "info,tollgate_sidecar=debug".to_string()),
            ("TOLLGATE_SIDECAR_CONFIG".to_string(), config_path.display().to_string()),
            // Its own deployment's secret unless `extra` says which (a gateway's replicas share one).
            (SECRET_ENV.to_string(), new_secret()),
        ];
        let mut s = Sidecar { port, service: Service::start("sidecar", sidecar_bin(), dir, env, extra) };
        s.await_healthy("sidecar /healthz");
        if let Some(path) = s.unix_path() {
            // Bound before TCP answers (the sidecar binds both, then serves).
            assert!(path.exists(), "the sidecar did not create its unix socket {}", path.display());
            SIDECAR_SOCKETS.lock().unwrap_or_else(|p| p.into_inner()).push((port, path));
        }
        let secret = s.secret().to_string();
        SIDECAR_SECRETS.lock().unwrap_or_else(|p| p.into_inner()).push((port, secret));
        s
    }

    /// The deployment's filter secret this sidecar requires (empty if the test removed it).
    pub fn secret(&self) -> &str {
        self.env(SECRET_ENV).unwrap_or_default()
    }

    /// The header that authenticates a call as the filter's (`x-tollgate-secret`), to add to a
    /// test's direct calls to the sidecar.
    pub fn auth(&self) -> (&'static str, &str) {
        (tollgate_wire::SECRET_HEADER, self.secret())
    }

    /// Polls `/healthz`; a sidecar that exits instead (e.g. a configuration it refuses) fails at
    /// once, its log printed.
    fn await_healthy(&mut self, what: &str) {
        let url = self.url("/healthz");
        poll_until(what, Duration::from_secs(20), || {
            if let Some(status) = self.service.exited() {
                panic!("the sidecar exited ({status}) instead of becoming healthy:\n{}", self.log_text());
            }
            get(&url, &[]).status == 200
        });
    }

    /// The unix socket the sidecar listens on (`TOLLGATE_SIDECAR_LISTEN_UNIX`).
    pub fn unix_path(&self) -> Option<PathBuf> {
        self.env("TOLLGATE_SIDECAR_LISTEN_UNIX").map(PathBuf::from).filter(|p| !p.as_os_str().is_empty())
    }

    /// Kills the sidecar (a crash: SIGKILL) and starts it again with the same settings on the
    /// same port (where Envoy's cluster points); waits for `/healthz`. The log is the new one's.
    pub fn restart(&mut self) {
        self.service.restart();
        self.await_healthy("restarted sidecar /healthz");
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

    /// The TCP port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// `keys create`; the raw key is the last line of stdout, the id is on the `key id:` line.
    pub fn create_key(&self, tenant: &str, plan: &str, extra: &[&str]) -> IssuedKey {
        let mut args = vec!["keys", "create", "--tenant", tenant, "--plan", plan];
        args.extend_from_slice(extra);
        let out = self.cli(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "keys create failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        let (id, raw) = parse_issued(&stdout);
        assert!(raw.starts_with("tg_") && id.starts_with("key_"), "unexpected keys create output: {stdout}");
        IssuedKey { id, raw }
    }

    pub fn revoke_key(&self, id: &str) {
        let out: Output = self.cli(&["keys", "revoke", id]);
        assert!(out.status.success(), "keys revoke failed: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Plans tests name for keys that need no limits. A key is made only for a plan the
/// configuration defines (decision 174), so a test deployment declares these, without limits,
/// unless the test's own TOML defines them.
const UNLIMITED_PLANS: [&str; 6] = ["gold", "free", "two", "ip", "open", "big"];

/// `toml` with an empty `[plans.<name>]` for each of [`UNLIMITED_PLANS`] it does not define.
fn with_unlimited_plans(toml: &str) -> String {
    let mut out = toml.to_string();
    for plan in UNLIMITED_PLANS {
        if !toml.contains(&format!("plans.{plan}]")) && !toml.contains(&format!("plans.{plan}.")) {
            out.push_str(&format!("\n[plans.{plan}]\n"));
        }
    }
    out
}

/// (key id, raw key) of a `keys create` output (the sidecar's CLI and `tollgate`'s alike): the
/// id on the `key id:` line, the raw key alone on the last line. Empty strings when absent.
pub fn parse_issued(stdout: &str) -> (String, String) {
    let raw = stdout.lines().last().unwrap_or_default().trim().to_string();
    let id = stdout.lines().find_map(|l| l.strip_prefix("key id:")).map(|s| s.trim().to_string()).unwrap_or_default();
    (id, raw)
}
