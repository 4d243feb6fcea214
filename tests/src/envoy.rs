//! A real Envoy loading the Tollgate .wasm, as a guard: how to start it ([`EnvoyOptions`]: the
//! template, the plugin configuration, the transport to the sidecar), the template rendering,
//! readiness (admin `/ready`, or the log when Envoy exits instead) and admin `/stats` counters.

use crate::http::get;
use crate::process::{envoy_bin, free_port, root, wasm_path, Proc};
use crate::sidecar::{sidecar_secret, sidecar_socket};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

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
    /// The filter secret put in the plugin configuration's `sidecar.secret` when it has none
    /// (default: the harness sidecar's on `sidecar_port`, if any).
    pub sidecar_secret: Option<String>,
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
            sidecar_secret: sidecar_secret(sidecar_port),
            concurrency: 1,
            template: "envoy/tollgate.yaml.tmpl",
            cpu: None,
            vars: Vec::new(),
        }
    }
    /// The plugin configuration: a `serde_json::Value` (build it with `json!`) or JSON text.
    pub fn plugin_config(mut self, json: impl ToString) -> Self {
        self.plugin_config = json.to_string();
        self
    }
    /// The filter secret for `sidecar.secret` (None: none is added).
    pub fn sidecar_secret(mut self, secret: Option<&str>) -> Self {
        self.sidecar_secret = secret.map(str::to_string);
        self
    }
    /// The plugin configuration Envoy gets: `plugin_config`, with `sidecar.secret` added when
    /// it is a JSON object without one and a secret is known.
    pub fn rendered_plugin_config(&self) -> String {
        let Some(secret) = &self.sidecar_secret else { return self.plugin_config.clone() };
        let Ok(serde_json::Value::Object(mut plugin)) = serde_json::from_str::<serde_json::Value>(&self.plugin_config) else {
            return self.plugin_config.clone();
        };
        let sidecar = plugin.entry("sidecar").or_insert_with(|| serde_json::json!({}));
        if let Some(s) = sidecar.as_object_mut() {
            s.entry("secret").or_insert_with(|| serde_json::json!(secret));
        }
        serde_json::Value::Object(plugin).to_string()
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
    /// `envoy/breaker.yaml.tmpl`: two upstream clusters, `upstream` and `upstream_b` (on
    /// `fallback_port`), for breaker fallbacks and routing.
    pub fn two_upstreams(mut self, fallback_port: u16) -> Self {
        self.template = "envoy/breaker.yaml.tmpl";
        self.vars.push(("FALLBACK_PORT", fallback_port.to_string()));
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
            ("PLUGIN_CONFIG", opts.rendered_plugin_config().replace('\'', "''")),
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
                envoy.proc.forget();
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

    /// A counter the filter counts per worker and flushes on its tick (`requests.allowed`,
    /// `auth_cache.hits`, `leases.hits`; decision 125), once it reaches `at_least` — or its value
    /// after 10 s, for the caller's assertion to report. `requests.allowed` is flushed last in a
    /// tick: once it is reached, the other batched counters of the same requests are in too.
    pub fn counter_reaching(&self, name: &str, at_least: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let value = self.counter(name);
            if value >= at_least || Instant::now() >= deadline {
                return value;
            }
            std::thread::sleep(Duration::from_millis(5)); // the poll interval of a deadline-bounded wait
        }
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }

    /// Every stat whose name contains `filter` (admin `/stats?filter=`), as text.
    pub fn stats(&self, filter: &str) -> String {
        get(&format!("http://127.0.0.1:{}/stats?filter={}", self.admin_port, filter), &[]).body
    }
}
