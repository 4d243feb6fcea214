//! One CSV cell as every CSV the project writes makes it (the billing export and invoice, the
//! console's usage download): RFC 4180 quoting, and a text a spreadsheet would run as a formula
//! defused with a leading `'` (hosts, paths and ids can come from clients).

/// `cell` quoted when it holds a comma, quote, CR or LF; one starting with `=`, `+`, `-`, `@`,
/// tab or CR that is not a number gets a leading `'`.
pub fn cell(cell: &str) -> String {
    let safe = match cell.as_bytes().first() {
        Some(b'=' | b'+' | b'-' | b'@' | b'\t' | b'\r') if cell.parse::<f64>().is_err() => format!("'{cell}"),
        _ => cell.to_string(),
    };
    if safe.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", safe.replace('"', "\"\""))
    } else {
        safe
    }
}
