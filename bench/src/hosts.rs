//! The hosts `tollgate-bench instructions` runs each path on (`--hosts`), and how the harness is
//! told which one its next Envoys load.

/// Where the filter runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// The proxy-wasm filter in V8 (the default host).
    Wasm,
    /// The same core as an Envoy dynamic module (issue 41 parts 1–2, `filters/native`). The
    /// harness starts it when `TOLLGATE_HOST=native` and `TOLLGATE_NATIVE_MODULE` names the
    /// module: [`Host::prepare`] sets the first; a run without the second skips the host.
    Native,
    /// The native host with its calls on the module's own connection to the sidecar
    /// (`sidecar.address`, decision 219) instead of Envoy callouts: the harness adds the address
    /// when `TOLLGATE_NATIVE_CALLS=direct`.
    NativeDirect,
}

impl Host {
    pub fn name(self) -> &'static str {
        match self {
            Host::Wasm => "wasm",
            Host::Native => "native",
            Host::NativeDirect => "native-direct",
        }
    }

    pub fn parse(s: &str) -> Option<Host> {
        match s {
            "wasm" => Some(Host::Wasm),
            "native" => Some(Host::Native),
            "native-direct" => Some(Host::NativeDirect),
            _ => None,
        }
    }

    /// Makes the next Envoys the harness starts run this host; `Err` says why it cannot.
    /// NATIVE HOST HOOK: the harness reads `TOLLGATE_HOST` when it renders an Envoy.
    pub fn prepare(self) -> Result<(), String> {
        match self {
            Host::Wasm => {
                std::env::remove_var("TOLLGATE_HOST");
                std::env::remove_var("TOLLGATE_NATIVE_CALLS");
                Ok(())
            }
            Host::Native | Host::NativeDirect => {
                if std::env::var_os("TOLLGATE_NATIVE_MODULE").is_none() {
                    return Err("TOLLGATE_NATIVE_MODULE unset: no native module built in this tree".into());
                }
                std::env::set_var("TOLLGATE_HOST", "native");
                match self {
                    Host::NativeDirect => std::env::set_var("TOLLGATE_NATIVE_CALLS", "direct"),
                    _ => std::env::remove_var("TOLLGATE_NATIVE_CALLS"),
                }
                Ok(())
            }
        }
    }
}
