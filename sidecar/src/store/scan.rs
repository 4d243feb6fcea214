//! Listing keys by pattern over the whole keyspace: `SCAN` in steps of [`STEP`] names, each step
//! a command of its own with its own deadline (a keyspace of millions is many steps, never one
//! deadline for all of them), on every primary of a Cluster (a `SCAN` without routing reaches one
//! node at random, which listed a third of a 3-master Cluster's keys).

use super::{Backend, Conn, Store, StoreError};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;
use std::time::Duration;

/// Names a `SCAN` step asks for (`COUNT`): the keys it looks at, not a bound on its answer.
const STEP: usize = 1000;

impl Store {
    /// Every key name matching `pattern`, in no order (a name may repeat if the keyspace was
    /// resized during the scan: `SCAN`'s guarantee). Each step within `step_deadline`.
    pub(crate) async fn scan_names(&self, op: &'static str, pattern: &str, step_deadline: Duration) -> Result<Vec<String>, StoreError> {
        let nodes: Vec<Option<(String, u16)>> = match self.backend.as_ref() {
            Backend::Cluster(_) => {
                let text: String = self
                    .run_with_deadline(op, step_deadline, |mut c| async move { redis::cmd("CLUSTER").arg("NODES").query_async(&mut c).await })
                    .await?;
                let primaries = primaries(&text);
                if primaries.is_empty() {
                    return Err(StoreError::Malformed("CLUSTER NODES named no primary".into()));
                }
                primaries.into_iter().map(Some).collect()
            }
            _ => vec![None],
        };
        let mut names = Vec::new();
        for node in nodes {
            let mut cursor = 0u64;
            loop {
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(STEP);
                let node = node.clone();
                let reply: Value = self
                    .run_with_deadline(op, step_deadline, |c| async move {
                        match (c, node) {
                            (Conn::Cluster(mut cc), Some((host, port))) => {
                                cc.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port })).await
                            }
                            (mut c, _) => cmd.query_async(&mut c).await,
                        }
                    })
                    .await?;
                let (next, batch): (u64, Vec<String>) =
                    redis::from_redis_value(reply).map_err(|e| StoreError::Malformed(format!("a SCAN reply: {e}")))?;
                names.extend(batch);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(names)
    }
}

/// The `host:port` of every primary `CLUSTER NODES` lists that is not marked failed.
fn primaries(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?.split(',').collect::<Vec<_>>();
            if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail") || *f == "noaddr") {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let addr = fields.get(1)?.split(['@', ',']).next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_string(), port.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::primaries;

    #[test]
    fn primaries_are_read_from_cluster_nodes() {
        let text = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host-a slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001,host-b myself,master - 0 0 1 connected 0-5460
6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 master,fail - 1426238316232 0 5 disconnected
";
        assert_eq!(
            primaries(text),
            vec![("127.0.0.1".to_string(), 30002), ("127.0.0.1".to_string(), 30003), ("127.0.0.1".to_string(), 30001)]
        );
        assert!(primaries("").is_empty());
        assert!(primaries("garbage\n\u{0}\n").is_empty());
    }
}
