//! How the sidecar and the billing consumer read their configuration, the same way: the
//! defaults, then the TOML file when one is given (a file that does not exist is an error, never
//! the defaults in silence), then the environment, `<PREFIX>SECTION__FIELD=value`. Each binary
//! names the variables under its prefix that are not settings (the config file's path, the
//! binary's path that the scripts export beside them), so they are not refused as unknown fields.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::Serialize;
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// The layers to extract a configuration from; `Err` is the given file that does not exist.
/// `secrets` (dotted keys): settings whose environment value is taken as text as it is, never
/// parsed — a secret of digits would otherwise read as a number, refused as one with its value
/// in the error a binary prints at start.
pub fn layers<T: Serialize>(
    defaults: T,
    file: Option<&Path>,
    prefix: &str,
    not_settings: &'static [&'static str],
    secrets: &'static [&'static str],
) -> Result<Figment, PathBuf> {
    let mut fig = Figment::from(Serialized::defaults(defaults));
    if let Some(path) = file {
        if !path.exists() {
            return Err(path.to_path_buf());
        }
        fig = fig.merge(Toml::file(path));
    }
    let env_key = |dotted: &str| dotted.replace('.', "__");
    let env = Env::prefixed(prefix)
        .filter(move |k| !not_settings.iter().chain(secrets).any(|n| k.as_str().eq_ignore_ascii_case(&env_key(n))))
        .split("__");
    fig = fig.merge(env);
    for key in secrets {
        let var = format!("{prefix}{}", env_key(key));
        // vars_os: a variable that is not Unicode (anyone's) must not stop the start
        let value = std::env::vars_os().find(|(k, _)| k.to_str().is_some_and(|k| k.eq_ignore_ascii_case(&var))).and_then(|(_, v)| v.into_string().ok());
        if let Some(value) = value {
            fig = fig.merge(Serialized::global(key, value));
        }
    }
    Ok(fig)
}

/// A configuration a binary cannot start with: the reason on stderr, exit status 2.
pub fn or_exit<T, E: Display>(loaded: Result<T, E>) -> T {
    loaded.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}
