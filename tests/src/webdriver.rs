//! A headless Chromium driven over WebDriver (W3C, JSON over HTTP) by its own chromedriver, as
//! RAII guards: [`Chromedriver`] is killed on drop, a [`Browser`]'s session is deleted on drop.
//! Elements are polled for with a deadline (a page on a loaded machine may take seconds); no
//! sleeps. Binaries: `TOLLGATE_CHROMEDRIVER_BIN` and `TOLLGATE_CHROMIUM_BIN`, else Debian's
//! `chromium-driver` and `chromium` (`./build.sh deps` installs them).

use crate::process::{free_port, poll_for};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long an element may take to appear.
pub const ELEMENT_DEADLINE: Duration = Duration::from_secs(60);

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(120))).build().into()
}

fn bin(env: &str, candidates: &[&str]) -> Option<PathBuf> {
    if let Ok(p) = std::env::var(env) {
        return Some(PathBuf::from(p));
    }
    candidates.iter().map(PathBuf::from).find(|p| p.exists())
}

/// The chromedriver binary, if installed.
pub fn chromedriver_bin() -> Option<PathBuf> {
    bin("TOLLGATE_CHROMEDRIVER_BIN", &["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"])
}

/// The Chromium binary, if installed.
pub fn chromium_bin() -> Option<PathBuf> {
    bin("TOLLGATE_CHROMIUM_BIN", &["/usr/bin/chromium", "/usr/lib/chromium/chromium"])
}

/// A chromedriver of this test's own, on a free port.
pub struct Chromedriver {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Chromedriver {
    pub fn start() -> Chromedriver {
        let bin = chromedriver_bin().expect("chromedriver is not installed (./build.sh deps installs Debian's chromium-driver)");
        let port = free_port();
        let dir = tempfile::tempdir().expect("tempdir");
        let log = std::fs::File::create(dir.path().join("chromedriver.log")).expect("log file");
        let child = Command::new(bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start chromedriver");
        let mut d = Chromedriver { child, port, _dir: dir };
        let url = format!("http://127.0.0.1:{port}/status");
        let ready = poll_for(Duration::from_secs(60), || {
            agent().get(&url).call().ok().and_then(|mut r| r.body_mut().read_to_string().ok().and_then(|t| serde_json::from_str::<Value>(&t).ok())).is_some_and(|v| v["value"]["ready"] == true)
        });
        if !ready {
            let _ = d.child.kill();
            panic!("chromedriver did not get ready on port {port}");
        }
        d
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One browser window (a WebDriver session).
pub struct Browser<'d> {
    base: String,
    _driver: &'d Chromedriver,
    _profile: tempfile::TempDir,
}

impl<'d> Browser<'d> {
    /// A headless Chromium `width` × `height` pixels.
    pub fn start(driver: &'d Chromedriver, width: u32, height: u32) -> Browser<'d> {
        let chromium = chromium_bin().expect("chromium is not installed (./build.sh deps installs Debian's chromium)");
        let profile = tempfile::tempdir().expect("tempdir");
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": chromium.display().to_string(),
            "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                     format!("--window-size={width},{height}"), format!("--user-data-dir={}", profile.path().display())]
        }}}});
        let url = format!("http://127.0.0.1:{}/session", driver.port);
        let v = call(&url, "POST", Some(caps)).unwrap_or_else(|e| panic!("no browser session: {e}"));
        let id = v["sessionId"].as_str().expect("a session id").to_string();
        Browser { base: format!("{url}/{id}"), _driver: driver, _profile: profile }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        call(&format!("{}{path}", self.base), method, body)
    }

    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({"url": url}))).unwrap_or_else(|e| panic!("goto {url}: {e}"));
    }

    pub fn url(&self) -> String {
        self.cmd("GET", "/url", None).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
    }

    /// The page's HTML now.
    pub fn source(&self) -> String {
        self.cmd("GET", "/source", None).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
    }

    /// The element `css` selects, polled for until [`ELEMENT_DEADLINE`].
    pub fn find(&self, css: &str) -> Element<'_, 'd> {
        let mut found = None;
        let ok = poll_for(ELEMENT_DEADLINE, || {
            found = self.cmd("POST", "/element", Some(json!({"using": "css selector", "value": css}))).ok().and_then(|v| {
                v.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).map(str::to_string)
            });
            found.is_some()
        });
        if !ok {
            panic!("no element {css:?} on {} within {ELEMENT_DEADLINE:?}; the page:\n{}", self.url(), self.source());
        }
        Element { browser: self, id: found.unwrap_or_default() }
    }

    /// Waits until the page's HTML contains `text`.
    pub fn wait_for_text(&self, text: &str) {
        if !poll_for(ELEMENT_DEADLINE, || self.source().contains(text)) {
            panic!("{text:?} never appeared on {}; the page:\n{}", self.url(), self.source());
        }
    }

    /// A PNG of the window, written to `path`.
    pub fn screenshot(&self, path: &Path) {
        let v = self.cmd("GET", "/screenshot", None).unwrap_or_else(|e| panic!("screenshot: {e}"));
        let png = base64_decode(v.as_str().unwrap_or_default());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write the screenshot");
    }

    pub fn set_window(&self, width: u32, height: u32) {
        let _ = self.cmd("POST", "/window/rect", Some(json!({"width": width, "height": height})));
    }
}

impl Drop for Browser<'_> {
    fn drop(&mut self) {
        let _ = self.cmd("DELETE", "", None);
    }
}

/// An element of the page.
pub struct Element<'b, 'd> {
    browser: &'b Browser<'d>,
    id: String,
}

impl Element<'_, '_> {
    pub fn click(&self) {
        self.browser.cmd("POST", &format!("/element/{}/click", self.id), Some(json!({}))).unwrap_or_else(|e| panic!("click: {e}"));
    }
    /// Replaces the element's value with `text`, as typed.
    pub fn fill(&self, text: &str) {
        let _ = self.browser.cmd("POST", &format!("/element/{}/clear", self.id), Some(json!({})));
        self.browser.cmd("POST", &format!("/element/{}/value", self.id), Some(json!({"text": text}))).unwrap_or_else(|e| panic!("type: {e}"));
    }
    pub fn text(&self) -> String {
        self.browser.cmd("GET", &format!("/element/{}/text", self.id), None).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
    }
    pub fn value(&self) -> String {
        self.browser.cmd("GET", &format!("/element/{}/property/value", self.id), None).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
    }
}

/// One WebDriver command: its `value`, or the error WebDriver gave.
fn call(url: &str, method: &str, body: Option<Value>) -> Result<Value, String> {
    let req = ureq::http::Request::builder().method(method).uri(url).header("content-type", "application/json");
    let built = match body {
        Some(b) => req.body(b.to_string()).map(|r| agent().run(r)),
        None if method == "POST" => req.body("{}".to_string()).map(|r| agent().run(r)),
        None => req.body(String::new()).map(|r| agent().run(r)),
    };
    let mut r = built.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let text = r.body_mut().with_config().limit(64 * 1024 * 1024).read_to_string().map_err(|e| format!("{status}: {e}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{status}: {e}"))?;
    if status >= 400 {
        return Err(format!("{status}: {}", v["value"]));
    }
    Ok(v["value"].clone())
}

/// Standard base64 (WebDriver's screenshots).
pub fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes() {
        assert_eq!(base64_decode("aGVsbG8="), b"hello");
        assert_eq!(base64_decode("aGk="), b"hi");
        assert_eq!(base64_decode("iVBORw0KGgo="), b"\x89PNG\r\n\x1a\n");
    }
}
