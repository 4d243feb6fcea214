//! Child processes for tests: where the binaries are, free ports, polling with a deadline, and
//! two guards. [`Proc`] is one child, killed on drop, whose log is printed when the test failed.
//! [`Service`] is a binary configured by its environment (the sidecar, the billing consumer) that
//! can be restarted with the same settings and run as a CLI with them.
//!
//! Invariant: nothing here waits by sleeping for readiness; [`poll_until`] polls a condition with
//! a deadline and its short pause is the poll interval.

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// `$var` if set, else `default` (build.sh sets the `TOLLGATE_*_BIN` variables).
pub fn bin(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

/// The project's Python (build.sh's venv, with the official `openai` client installed).
pub fn python_bin() -> PathBuf {
    bin("TOLLGATE_PYTHON", root().join(".tollgate/tools/venv/bin/python"))
}
pub fn envoy_bin() -> PathBuf {
    bin("TOLLGATE_ENVOY_BIN", root().join(".tollgate/tools/venv/lib/python3.11/site-packages/envoy/_bin/envoy"))
}
pub fn wasm_path() -> PathBuf {
    bin("TOLLGATE_WASM", root().join("target/wasm32-wasip1/release/tollgate_filter.wasm"))
}
/// Which filter host the functional tests' Envoy loads: `TOLLGATE_HOST=native` for the Envoy
/// dynamic module (`filters/native`), anything else (or unset) for the Wasm filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterHost {
    Wasm,
    Native,
}

pub fn filter_host() -> FilterHost {
    match std::env::var("TOLLGATE_HOST").as_deref() {
        Ok("native") => FilterHost::Native,
        _ => FilterHost::Wasm,
    }
}

/// Under the native host, whether its calls to the sidecar go on the module's own connection
/// (`TOLLGATE_NATIVE_CALLS=direct`, decision 219) rather than as Envoy callouts.
pub fn native_direct() -> bool {
    std::env::var("TOLLGATE_NATIVE_CALLS").as_deref() == Ok("direct")
}

/// Whether a test of a behaviour only the Wasm host has should run: `false` under the native
/// host, saying why on stderr (the decision that records the difference).
pub fn wasm_host_only(why: &str) -> bool {
    if filter_host() == FilterHost::Native {
        eprintln!("skipped under the native host: {why}");
        return false;
    }
    true
}

/// The native host's module (`libtollgate_native.so`): `TOLLGATE_NATIVE_MODULE`, else the release
/// build's. Envoy finds it by name in its folder (`ENVOY_DYNAMIC_MODULES_SEARCH_PATH`).
pub fn native_module() -> PathBuf {
    bin("TOLLGATE_NATIVE_MODULE", root().join("target/release/libtollgate_native.so"))
}

/// A native binary of the workspace: `$var` if set, else the test build's (`target/ci`, the
/// profile `./build.sh test` builds with).
pub fn native_bin(var: &str, name: &str) -> PathBuf {
    bin(var, root().join("target/ci").join(name))
}
pub fn sidecar_bin() -> PathBuf {
    native_bin("TOLLGATE_SIDECAR_BIN", "tollgate-sidecar")
}
pub fn redis_server_bin() -> PathBuf {
    bin("TOLLGATE_REDIS_SERVER_BIN", PathBuf::from("redis-server"))
}

/// A free loopback port, never handed out twice by this process.
///
/// It is taken below the kernel's ephemeral range (`ip_local_port_range`), where neither an
/// outgoing connection nor another `bind(:0)` of the tests (an upstream, a relay) can take it
/// between this check and its user's bind: a port taken from `bind(:0)` once went to a test's
/// own stub sidecar in that gap, which answered Envoy's readiness probe for it (CI of stop 40).
/// The walk starts at an offset from the process id, so two test processes rarely meet.
pub fn free_port() -> u16 {
    static NEXT: Mutex<Option<(u16, HashSet<u16>)>> = Mutex::new(None);
    let (low, high) = fixed_port_range();
    let span = u32::from(high - low);
    let mut state = NEXT.lock().unwrap_or_else(|p| p.into_inner());
    let (next, given) = state.get_or_insert_with(|| ((u64::from(std::process::id()) * 7919 % u64::from(span)) as u16, HashSet::new()));
    for _ in 0..span {
        let port = low + *next;
        *next = ((u32::from(*next) + 1) % span) as u16;
        if given.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    panic!("no free loopback port in {low}..{high}");
}

/// The ports [`free_port`] hands out: from 10000 to the start of the ephemeral range.
fn fixed_port_range() -> (u16, u16) {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    assert!(ephemeral_low > 12000, "the ephemeral port range starts at {ephemeral_low}: no room below it for the tests' ports");
    (10000, ephemeral_low)
}

/// Polls `ready` until it returns true or `deadline` passes (then panics naming `what`).
/// The short pause between polls is the poll interval, not a wait for readiness.
pub fn poll_until(what: &str, deadline: Duration, ready: impl FnMut() -> bool) {
    if !poll_for(deadline, ready) {
        panic!("timed out after {deadline:?} waiting for {what}");
    }
}

/// Polls `ready` until it returns true (→ true) or `deadline` passes (→ false), for a caller
/// that reports what was missing itself.
pub fn poll_for(deadline: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut pause = Duration::from_millis(2);
    while !ready() {
        if start.elapsed() > deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    true
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

    /// Sends `sig` (`kill` syntax: `-STOP`, `-CONT`) to the running process; panics if it is not
    /// running or the signal fails. `-STOP` makes a hung server of it (it keeps its connections
    /// and answers nothing); dropping the guard still kills it (SIGKILL works on a stopped one).
    pub fn signal(&self, sig: &str) {
        let pid = self.pid().unwrap_or_else(|| panic!("{sig}: the process is not running"));
        let status = Command::new("kill").arg(sig).arg(pid.to_string()).status().expect("kill");
        assert!(status.success(), "kill {sig} {pid}: {status}");
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Forgets an exited child (its log stays readable), so that drop neither kills nor prints.
    pub fn forget(&mut self) {
        self.child = None;
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits up to `deadline` for a clean exit; returns the exit status.
    pub fn terminate(&mut self, deadline: Duration) -> Option<ExitStatus> {
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
            // the poll interval of a deadline-bounded wait for the exit, not a wait for readiness
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

/// A binary configured by its environment, in its own directory: started, restarted with the
/// same settings (a new log each time), and run as a CLI with them. Killed on drop.
pub struct Service {
    name: String,
    bin: PathBuf,
    env: Vec<(String, String)>,
    proc: Proc,
    starts: u32,
    dir: tempfile::TempDir,
}

impl Service {
    /// Starts `bin` with `env`, then `extra` over it (a variable in both takes `extra`'s value).
    /// `dir` is the service's own directory (its configuration files, its logs).
    pub fn start(name: &str, bin: PathBuf, dir: tempfile::TempDir, env: Vec<(String, String)>, extra: &[(&str, &str)]) -> Service {
        let mut env = env;
        for (k, v) in extra {
            env.retain(|(ek, _)| ek != k);
            env.push((k.to_string(), v.to_string()));
        }
        let proc = Proc::spawn(name, Self::command(&bin, &env), dir.path().join(format!("{name}.log")));
        Service { name: name.to_string(), bin, env, proc, starts: 1, dir }
    }

    fn command(bin: &Path, env: &[(String, String)]) -> Command {
        let mut cmd = Command::new(bin);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Kills the process (a crash: SIGKILL) and starts it again with the same settings. The log
    /// is the new one's.
    pub fn restart(&mut self) {
        self.proc.kill();
        let log = self.dir.path().join(format!("{}-{}.log", self.name, self.starts));
        self.proc = Proc::spawn(&self.name, Self::command(&self.bin, &self.env), log);
        self.starts += 1;
    }

    /// The value of a variable of its environment.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The service's own directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs the binary with `args` and this service's environment (its CLI).
    pub fn cli(&self, args: &[&str]) -> Output {
        Self::command(&self.bin, &self.env).args(args).output().unwrap_or_else(|e| panic!("run {}: {e}", self.bin.display()))
    }

    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.proc.exited()
    }

    pub fn terminate(&mut self, deadline: Duration) -> Option<ExitStatus> {
        self.proc.terminate(deadline)
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }

    /// Sends `sig` (`kill` syntax: `-STOP` freezes it — a hung service, its connections open —
    /// `-CONT` lets it run again) to the running service.
    pub fn signal(&self, sig: &str) {
        self.proc.signal(sig);
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }
}

/// Makes a guard that wraps a [`Service`] in its `service` field dereference to it: its process
/// control (`kill`, `restart`, `terminate`, `log_text`, `pid`, `cli`) is the service's, unless
/// the guard has its own (e.g. a restart that waits for readiness).
macro_rules! service_guard {
    ($guard:ty) => {
        impl std::ops::Deref for $guard {
            type Target = $crate::process::Service;
            fn deref(&self) -> &$crate::process::Service {
                &self.service
            }
        }
        impl std::ops::DerefMut for $guard {
            fn deref_mut(&mut self) -> &mut $crate::process::Service {
                &mut self.service
            }
        }
    };
}
pub(crate) use service_guard;
