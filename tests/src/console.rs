//! A browser-less client of the web console (sidecar/src/console): forms posted as a browser
//! posts them, the session cookie kept by hand, redirects not followed (a test sees each 303 and
//! its `Set-Cookie`). The isolation tests (tests/tests/console.rs) attack the console with it.

use crate::http::Resp;
use std::time::Duration;

/// The session cookie's name (sidecar/src/console/auth.rs).
pub const COOKIE: &str = "tollgate_console";

/// One browser: a base URL and the session cookie it holds.
#[derive(Clone)]
pub struct ConsoleClient {
    pub base: String,
    /// The session token of the cookie, when signed in.
    pub session: Option<String>,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).timeout_global(Some(Duration::from_secs(30))).build().into()
}

/// `application/x-www-form-urlencoded` of `fields`.
pub fn form(fields: &[(&str, &str)]) -> String {
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                b' ' => "+".into(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    fields.iter().map(|(k, v)| format!("{}={}", enc(k), enc(v))).collect::<Vec<_>>().join("&")
}

/// The CSRF token in a page's forms (`name="csrf" value="…"`).
pub fn csrf_of(page: &str) -> Option<String> {
    let at = page.find(r#"name="csrf" value=""#)? + r#"name="csrf" value=""#.len();
    Some(page[at..].split('"').next()?.to_string())
}

impl ConsoleClient {
    pub fn new(base: &str) -> ConsoleClient {
        ConsoleClient { base: base.to_string(), session: None }
    }

    fn send(&mut self, method: &str, path: &str, body: Option<String>) -> Resp {
        let mut req = ureq::http::Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(s) = &self.session {
            req = req.header("cookie", format!("{COOKIE}={s}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/x-www-form-urlencoded");
        }
        let result = match body {
            None => req.body(()).map(|r| agent().run(r)),
            Some(b) => req.body(b).map(|r| agent().run(r)),
        };
        let resp = match result {
            Ok(Ok(mut r)) => {
                let status = r.status().as_u16();
                let headers: Vec<(String, String)> =
                    r.headers().iter().map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned())).collect();
                let body = r.body_mut().read_to_string().unwrap_or_default();
                Resp { status, headers, body }
            }
            Ok(Err(e)) => Resp { status: 0, headers: vec![], body: e.to_string() },
            Err(e) => Resp { status: 0, headers: vec![], body: e.to_string() },
        };
        // a Set-Cookie replaces (or clears) the session, as a browser's jar does
        if let Some(c) = resp.header("set-cookie") {
            let value = c.split(';').next().and_then(|kv| kv.strip_prefix(&format!("{COOKIE}="))).unwrap_or_default();
            self.session = (!value.is_empty()).then(|| value.to_string());
        }
        resp
    }

    pub fn get(&mut self, path: &str) -> Resp {
        self.send("GET", path, None)
    }

    /// POSTs a form as is (no CSRF token added).
    pub fn post_raw(&mut self, path: &str, fields: &[(&str, &str)]) -> Resp {
        self.send("POST", path, Some(form(fields)))
    }

    /// POSTs a form with `csrf` added.
    pub fn post(&mut self, path: &str, csrf: &str, fields: &[(&str, &str)]) -> Resp {
        let mut all = vec![("csrf", csrf)];
        all.extend_from_slice(fields);
        self.post_raw(path, &all)
    }

    /// Signs in as the operator; the session's CSRF token.
    pub fn operator(base: &str, token: &str) -> (ConsoleClient, String) {
        let mut c = ConsoleClient::new(base);
        let r = c.post_raw("/console/operator/signin", &[("token", token)]);
        assert_eq!(r.status, 303, "operator sign-in: {}", r.body);
        assert!(c.session.is_some(), "no session cookie");
        let page = c.get("/console/operator");
        assert_eq!(page.status, 200, "{}", page.body);
        let csrf = csrf_of(&page.body).expect("a CSRF token on the overview");
        (c, csrf)
    }

    /// Signs in as a tenant user; the session's CSRF token, or the refusal.
    pub fn tenant(base: &str, login: &str, password: &str) -> Result<(ConsoleClient, String), Resp> {
        let mut c = ConsoleClient::new(base);
        let r = c.post_raw("/console/signin", &[("login", login), ("password", password)]);
        if r.status != 303 {
            return Err(r);
        }
        let page = c.get("/console/portal");
        assert_eq!(page.status, 200, "{}", page.body);
        let csrf = csrf_of(&page.body).expect("a CSRF token on the portal");
        Ok((c, csrf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_tokens() {
        assert_eq!(form(&[("a", "x y"), ("b", "{\"k\":1}&")]), "a=x+y&b=%7B%22k%22%3A1%7D%26");
        assert_eq!(csrf_of(r#"<input type="hidden" name="csrf" value="abc123">"#).as_deref(), Some("abc123"));
        assert_eq!(csrf_of("no form"), None);
    }
}
