//! A real Envoy loading the Tollgate .wasm, as a guard: how to start it ([`EnvoyOptions`]: the
//! template, the plugin configuration, the transport to the sidecar), the template rendering,
//! readiness (admin `/ready`, or the log when Envoy exits instead) and admin `/stats` counters.

use crate::http::get;
use crate::process::{envoy_bin, filter_host, free_port, native_direct, native_module, root, wasm_path, FilterHost, Proc};
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
    /// The Wasm filter's configuration comes from a file Envoy watches (ECDS,
    /// [`Envoy::set_plugin_config`] changes it while Envoy runs) instead of the listener's.
    pub plugin_config_in_file: bool,
    /// Which host loads the filter: the Wasm filter or the native module (default: the
    /// `TOLLGATE_HOST` environment variable's, so every test runs against either; a benchmark
    /// comparing both sets it per Envoy with [`EnvoyOptions::host`]).
    pub host: FilterHost,
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
            plugin_config_in_file: false,
            host: filter_host(),
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
    ///
    /// Under the native host with `TOLLGATE_NATIVE_CALLS=direct`, `sidecar.address` is added too
    /// (when absent): the module's own connection to the same sidecar, by the transport's socket.
    pub fn rendered_plugin_config(&self) -> String {
        let address = (self.host == FilterHost::Native && native_direct()).then(|| match (&self.sidecar_unix, self.sidecar_transport.is_unix()) {
            (Some(path), true) => format!("unix:{}", path.display()),
            _ => format!("127.0.0.1:{}", self.sidecar_port),
        });
        if self.sidecar_secret.is_none() && address.is_none() {
            return self.plugin_config.clone();
        }
        let Ok(serde_json::Value::Object(mut plugin)) = serde_json::from_str::<serde_json::Value>(&self.plugin_config) else {
            return self.plugin_config.clone();
        };
        let sidecar = plugin.entry("sidecar").or_insert_with(|| serde_json::json!({}));
        if let Some(s) = sidecar.as_object_mut() {
            if let Some(secret) = &self.sidecar_secret {
                s.entry("secret").or_insert_with(|| serde_json::json!(secret));
            }
            if let Some(address) = address {
                s.entry("address").or_insert_with(|| serde_json::json!(address));
            }
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
    /// The Wasm filter's configuration in a file Envoy watches (extension config discovery), so
    /// that [`Envoy::set_plugin_config`] can change it while Envoy runs, as a control plane would.
    pub fn plugin_config_in_file(mut self) -> Self {
        self.plugin_config_in_file = true;
        self
    }
    /// Envoy alone (router only): no filter, no sidecar.
    /// Load the filter with `host` (the native module: `TOLLGATE_NATIVE_MODULE`, else
    /// `target/release/libtollgate_native.so`).
    pub fn host(mut self, host: FilterHost) -> Self {
        self.host = host;
        self
    }
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

/// Envoy's configuration for `opts` on these ports: its template with every placeholder filled.
fn render(opts: &EnvoyOptions, port: u16, admin_port: u16) -> String {
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
    // a template without the filter (Envoy alone, the peers' templates) stays as it is
    let has_filter = yaml.lines().any(|l| l.trim() == WASM_FILTER);
    match opts.host {
        FilterHost::Native if has_filter => native_filter(&yaml),
        _ => yaml,
    }
}

/// The line that opens the Wasm filter's entry in the templates, and the native host's.
const WASM_FILTER: &str = "- name: envoy.filters.http.wasm";
const NATIVE_FILTER: &str = "- name: envoy.filters.http.dynamic_modules";

/// The Wasm filter's lines in a rendered configuration: where its `- name:` line is, where its
/// body (`typed_config`'s lines) starts and ends, and its indent.
fn wasm_filter_span(lines: &[&str]) -> (usize, usize, usize, usize) {
    filter_span(lines, WASM_FILTER)
}

/// As [`wasm_filter_span`], for the filter entry opened by the line `opening`.
fn filter_span(lines: &[&str], opening: &str) -> (usize, usize, usize, usize) {
    let indent_of = |l: &str| l.len() - l.trim_start().len();
    let start = lines.iter().position(|l| l.trim() == opening).expect("the template has the filter");
    let indent = indent_of(lines[start]);
    assert_eq!(lines.get(start + 1).map(|l| l.trim()), Some("typed_config:"), "the Wasm filter's typed_config follows its name");
    let body = start + 2;
    let end = lines[body..]
        .iter()
        .position(|l| !l.trim().is_empty() && indent_of(l) <= indent + 2)
        .map_or(lines.len(), |i| body + i);
    (start, body, end, indent)
}

/// A rendered configuration with the native host in place of the Wasm filter: the same plugin
/// configuration given to `libtollgate_native.so` (docs/configuration.md, "The native host").
/// Its counters keep the Wasm filter's names (`metrics_namespace: wasmcustom`, decision 253).
pub fn native_filter(yaml: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let (start, body, end, indent) = wasm_filter_span(&lines);
    let config = lines[body..end]
        .iter()
        .find_map(|l| l.trim().strip_prefix("value: "))
        .expect("the Wasm filter's configuration value");
    let pad = " ".repeat(indent);
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.extend([
        format!("{pad}{NATIVE_FILTER}"),
        format!("{pad}  typed_config:"),
        format!("{pad}    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"),
        format!("{pad}    dynamic_module_config: {{name: tollgate_native, do_not_close: true, metrics_namespace: wasmcustom}}"),
        format!("{pad}    filter_name: tollgate"),
        format!("{pad}    filter_config:"),
        format!("{pad}      \"@type\": type.googleapis.com/google.protobuf.StringValue"),
        format!("{pad}      value: {config}"),
    ]);
    out.extend(lines[end..].iter().map(|l| l.to_string()));
    out.extend(NATIVE_RUNTIME.iter().map(|l| l.to_string()));
    out.join("\n") + "\n"
}

/// Envoy's runtime for the native host: its counters' namespace stripped in Prometheus names as
/// the Wasm filter's is (`tollgate_requests_allowed`, not `envoy_wasmcustom_tollgate_…`;
/// decision 253), and the admin layer Envoy has by default.
const NATIVE_RUNTIME: [&str; 6] = [
    "layered_runtime:",
    "  layers:",
    "  - name: tollgate_native",
    "    static_layer: {envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix: true}",
    "  - name: admin",
    "    admin_layer: {}",
];

/// The file, next to `envoy.yaml`, of the Wasm filter's configuration when Envoy reads it by
/// extension config discovery ([`EnvoyOptions::plugin_config_in_file`]), and the name of the
/// filter that reads it.
const FILTER_FILE: &str = "tollgate-filter.yaml";
const FILTER_BY_FILE: &str = "tollgate";
/// Envoy's count of the configurations it took from that file.
const FILTER_RELOADS: &str = "extension_config_discovery.http_filter.tollgate.config_reload";

/// Moves the Wasm filter's `typed_config` out of a rendered Envoy configuration into an extension
/// config discovery resource read from `file`: returns the configuration that names the file
/// instead, and the file's text.
pub fn filter_config_by_file(yaml: &str, file: &Path) -> (String, String) {
    let lines: Vec<&str> = yaml.lines().collect();
    // the Wasm filter, or the native host in its place
    let native = lines.iter().any(|l| l.trim() == NATIVE_FILTER);
    let (opening, type_url) = match native {
        true => (NATIVE_FILTER, "envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"),
        false => (WASM_FILTER, "envoy.extensions.filters.http.wasm.v3.Wasm"),
    };
    let (start, body, end, indent) = filter_span(&lines, opening);
    let pad = " ".repeat(indent);
    let mut listener: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    listener.extend([
        format!("{pad}- name: {FILTER_BY_FILE}"),
        format!("{pad}  config_discovery:"),
        format!("{pad}    config_source:"),
        format!("{pad}      path_config_source: {{path: \"{}\"}}", file.display()),
        format!("{pad}      resource_api_version: V3"),
        format!("{pad}    type_urls: [type.googleapis.com/{type_url}]"),
    ]);
    listener.extend(lines[end..].iter().map(|l| l.to_string()));
    let mut filter = vec![
        "resources:".to_string(),
        "- \"@type\": type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig".to_string(),
        format!("  name: {FILTER_BY_FILE}"),
        "  typed_config:".to_string(),
    ];
    // its body from `indent + 4` to 4, under `typed_config`
    filter.extend(lines[body..end].iter().map(|l| l.get(indent..).unwrap_or("").to_string()));
    (listener.join("\n") + "\n", filter.join("\n") + "\n")
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

    /// Gives the running Envoy another plugin configuration (JSON, as [`EnvoyOptions::plugin_config`]),
    /// as a control plane would: the filter's file is replaced at once (written aside, then
    /// renamed), and this returns once Envoy took it. Only for an Envoy started with
    /// [`EnvoyOptions::plugin_config_in_file`].
    pub fn set_plugin_config(&mut self, json: impl ToString) {
        assert!(self.opts.plugin_config_in_file, "this Envoy's plugin configuration is not in a file");
        let before = self.counter(FILTER_RELOADS);
        self.opts.plugin_config = json.to_string();
        let file = self._dir.path().join(FILTER_FILE);
        let (_, filter) = filter_config_by_file(&render(&self.opts, self.port, self.admin_port), &file);
        let aside = self._dir.path().join("tollgate-filter.yaml.new");
        fs::write(&aside, filter).expect("write the filter's new configuration");
        fs::rename(&aside, &file).expect("replace the filter's configuration");
        crate::poll_until("Envoy to take the new plugin configuration", Duration::from_secs(30), || {
            self.counter(FILTER_RELOADS) > before
        });
    }

    /// Starts Envoy and waits for admin `/ready`; panics (printing the log) if it does not come up.
    pub fn start(opts: EnvoyOptions) -> Envoy {
        match Envoy::try_start(opts) {
            Ok(e) => e,
            Err(why) => panic!("envoy did not start: {why}"),
        }
    }

    /// Starts Envoy; `Err` with its log when it exits instead of becoming ready. An Envoy that
    /// could not bind its ports (another process took one after [`free_port`] checked it) is
    /// started again on other ports, twice at most.
    pub fn try_start(opts: EnvoyOptions) -> Result<Envoy, String> {
        let mut attempt = 0;
        loop {
            match Envoy::start_once(opts.clone()) {
                Err(why) if attempt < 2 && why.contains("Address already in use") => attempt += 1,
                started => return started,
            }
        }
    }

    fn start_once(opts: EnvoyOptions) -> Result<Envoy, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, admin_port) = (free_port(), free_port());
        let mut yaml = render(&opts, port, admin_port);
        if opts.plugin_config_in_file {
            let file = dir.path().join(FILTER_FILE);
            let (listener, filter) = filter_config_by_file(&yaml, &file);
            fs::write(&file, filter).expect("write the filter's configuration");
            yaml = listener;
        }
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
            .args(["-l", "info", "--component-log-level", "wasm:debug,dynamic_modules:debug"]);
        if opts.plugin_config_in_file {
            // a subscription (even to a file) needs the node's identity
            cmd.args(["--service-node", "tollgate", "--service-cluster", "tollgate"]);
        }
        if opts.host == FilterHost::Native {
            let module = native_module();
            let folder = module.parent().expect("the native module's folder");
            cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", folder);
        }
        let proc = Proc::spawn("envoy", cmd, dir.path().join("envoy.log"));
        let mut envoy = Envoy { port, admin_port, proc, opts: opts.clone(), _dir: dir };
        let ready_url = format!("http://127.0.0.1:{admin_port}/ready");
        let info_url = format!("http://127.0.0.1:{admin_port}/server_info");
        // 60 s; longer for an Envoy under valgrind (`tollgate-bench instructions`: ~50× slower)
        let ready_within = Duration::from_secs(std::env::var("TOLLGATE_ENVOY_READY_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(60));
        let start = Instant::now();
        loop {
            if let Some(status) = envoy.proc.exited() {
                let log = envoy.proc.log_text();
                envoy.proc.forget();
                return Err(format!("envoy exited ({status}):\n{log}"));
            }
            // Ready, and this Envoy: `/server_info` names the configuration file it was given.
            if get(&ready_url, &[]).status == 200 && get(&info_url, &[]).body.contains(&*config.to_string_lossy()) {
                return Ok(envoy);
            }
            if start.elapsed() > ready_within {
                return Err(format!("envoy not ready after {ready_within:?}:\n{}", envoy.proc.log_text()));
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

    /// Sends SIGTERM and waits up to `deadline` for Envoy to exit; its exit status, or `None`
    /// when it is still running (then it is killed at drop).
    pub fn terminate(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        self.proc.terminate(deadline)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_native_host_takes_the_wasm_filters_place_with_the_same_plugin_configuration() {
        let plain = EnvoyOptions::new(1, 2).plugin_config(r#"{"failureMode":"closed"}"#).host(FilterHost::Wasm);
        for opts in [plain.clone(), plain.two_upstreams(5)] {
            let wasm = render(&opts, 3, 4);
            let native = native_filter(&wasm);
            let t = opts.template;
            assert!(!native.contains("envoy.filters.http.wasm") && !native.contains("vm_config"), "{t}: the Wasm filter is gone");
            assert!(native.contains("dynamic_module_config: {name: tollgate_native, do_not_close: true, metrics_namespace: wasmcustom}"), "{t}");
            assert!(native.contains(r#"value: '{"failureMode":"closed"}'"#), "{t}: the same plugin configuration");
            assert!(native.contains("dynamic_modules_strip_custom_stat_prefix: true"), "{t}: Prometheus names as the Wasm filter's");
            // everything before the filters and after the router is untouched
            let head = |y: &str| y.split("http_filters:").next().map(str::to_string);
            let tail = |y: &str| y.split("envoy.filters.http.router").nth(1).and_then(|t| t.split("layered_runtime").next()).map(|t| t.trim_end().to_string());
            assert_eq!(head(&native), head(&wasm), "{t}");
            assert_eq!(tail(&native), tail(&wasm), "{t}");
            // and with the native host chosen, the harness renders exactly this
            assert_eq!(render(&EnvoyOptions { host: FilterHost::Native, ..opts.clone() }, 3, 4), native, "{t}");
        }
        // a template without the filter (Envoy alone) is left as it is
        let baseline = EnvoyOptions::new(1, 2).baseline().host(FilterHost::Native);
        assert!(!render(&baseline, 3, 4).contains("dynamic_modules"));
    }
}
