//! A real PostgreSQL server (Debian's `postgresql` package) on a free port, in its own data
//! directory, for tests. As root the server runs as the `postgres` user (PostgreSQL refuses root).
//! Stopped on drop; [`Postgres::stop`] / [`Postgres::start_again`] simulate an outage.

use crate::process::{free_port, poll_until};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// The directory of `initdb` and `pg_ctl` (`TOLLGATE_PG_BIN`, else the newest under
/// /usr/lib/postgresql).
pub fn pg_bin_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("TOLLGATE_PG_BIN") {
        return PathBuf::from(p);
    }
    let mut versions: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).filter(|p| p.join("pg_ctl").exists()).collect())
        .unwrap_or_default();
    versions.sort();
    versions.pop().unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// Runs a PostgreSQL tool, as the `postgres` user when we are root.
fn pg_tool(tool: &str, args: &[&str]) -> Output {
    let bin = pg_bin_dir().join(tool);
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    cmd.args(args).stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {tool}: {e}"))
}

pub struct Postgres {
    pub port: u16,
    data: PathBuf,
    log: PathBuf,
    running: bool,
    _dir: tempfile::TempDir,
}

impl Postgres {
    pub fn start() -> Postgres {
        let dir = tempfile::tempdir().expect("tempdir");
        // the postgres user must reach and own its directory
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        let root = dir.path().join("pg");
        fs::create_dir_all(&root).expect("pg dir");
        if is_root() {
            let ok = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&root).status().map(|s| s.success());
            assert_eq!(ok.ok(), Some(true), "chown postgres {}", root.display());
        }
        let data = root.join("data");
        let out = pg_tool("initdb", &["-D", &data.to_string_lossy(), "-A", "trust", "-U", "postgres", "--no-sync"]);
        assert!(out.status.success(), "initdb failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let mut pg = Postgres { port: free_port(), log: root.join("postgres.log"), data, running: false, _dir: dir };
        pg.start_again();
        pg
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let mut all = vec!["-D", self.data.to_str().unwrap_or_default()];
        all.extend_from_slice(args);
        pg_tool("pg_ctl", &all)
    }

    /// Starts the server (again) on the same port and data.
    pub fn start_again(&mut self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off",
            self.port,
            self.data.parent().unwrap_or(Path::new("/tmp")).display()
        );
        let out = self.ctl(&["-o", &opts, "-l", self.log.to_str().unwrap_or_default(), "-w", "-t", "60", "start"]);
        assert!(out.status.success(), "pg_ctl start failed: {}\n{}", String::from_utf8_lossy(&out.stderr), self.log_text());
        self.running = true;
        let port = self.port;
        poll_until("postgres to accept connections", Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }

    /// Freezes the server and every backend of it (SIGSTOP): connections stay open and new ones
    /// are accepted by the kernel, but nothing answers until [`Postgres::resume`] — a hung
    /// PostgreSQL, not a dead one.
    pub fn pause(&self) {
        assert!(self.signal_all("-STOP"), "could not stop PostgreSQL's processes");
    }

    /// Lets a [`Postgres::pause`]d server run again (SIGCONT).
    pub fn resume(&self) {
        assert!(self.signal_all("-CONT"), "could not resume PostgreSQL's processes");
    }

    /// Sends `sig` to the postmaster (the first line of `postmaster.pid`), then to each of its
    /// children (one that exited meanwhile — a closing backend, an autovacuum worker — is no
    /// failure). Whether the postmaster got it.
    fn signal_all(&self, sig: &str) -> bool {
        let Ok(pidfile) = fs::read_to_string(self.data.join("postmaster.pid")) else { return false };
        let pid = pidfile.lines().next().unwrap_or_default().trim().to_string();
        let kill = |p: &str| Command::new("kill").arg(sig).arg(p).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        if !kill(&pid) {
            return false;
        }
        if let Ok(children) = Command::new("pgrep").args(["-P", &pid]).output() {
            for child in String::from_utf8_lossy(&children.stdout).split_whitespace() {
                kill(child);
            }
        }
        true
    }

    /// Stops the server (fast shutdown): an outage.
    pub fn stop(&mut self) {
        if self.running {
            // a paused server would not see pg_ctl's signal
            self.signal_all("-CONT");
            let _ = self.ctl(&["-m", "immediate", "-w", "stop"]);
            self.running = false;
        }
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("----- postgres log -----\n{}\n----- end of postgres log -----", self.log_text());
        }
        self.stop();
    }
}
