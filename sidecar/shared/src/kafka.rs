//! librdkafka client properties, as the sidecar's producer and billing's consumer build them.

use std::collections::BTreeMap;

/// The properties a client sets (`ours`), then the operator's `extra` ones over them (the
/// operator's value wins; callers refuse the names they must own), sorted by name.
pub fn client_properties(ours: &[(&str, String)], extra: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut all: BTreeMap<String, String> = ours.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    all.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    all.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operator_adds_and_overrides_and_the_result_is_sorted() {
        let extra = BTreeMap::from([("linger.ms".to_string(), "5".to_string()), ("a.b".to_string(), "x".to_string())]);
        let got = client_properties(&[("linger.ms", "20".into()), ("acks", "all".into())], &extra);
        let want = [("a.b", "x"), ("acks", "all"), ("linger.ms", "5")].map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(got, want);
    }
}
