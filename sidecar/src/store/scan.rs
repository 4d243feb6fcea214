//! Listing keys by pattern over the whole keyspace: `SCAN` in steps of [`STEP`] names, each step
//! a command of its own with its own deadline (a keyspace of millions is many steps, never one
//! deadline for all of them), on every primary of a Cluster (a `SCAN` without routing reaches one
//! node at random, which listed a third of a 3-master Cluster's keys). A Cluster's primaries are
//! the owners of its slot ranges (`CLUSTER SLOTS`), each `SCAN` routed by a slot it owns, as the
//! client itself routes keys; a Cluster whose ranges do not cover every slot is an error, never a
//! partial listing. A key moved by a resharding during the scan may be missed or listed twice.

use super::{Backend, Conn, Store, StoreError};
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::Value;
use std::time::Duration;

/// Names a `SCAN` step asks for (`COUNT`): the keys it looks at, not a bound on its answer.
const STEP: usize = 1000;

/// A Cluster's slots.
const SLOTS: u32 = 16384;

impl Store {
    /// Every key name matching `pattern`, in no order (a name may repeat if the keyspace was
    /// resized during the scan: `SCAN`'s guarantee). Each step within `step_deadline`.
    pub(crate) async fn scan_names(&self, op: &'static str, pattern: &str, step_deadline: Duration) -> Result<Vec<String>, StoreError> {
        let nodes: Vec<Option<u16>> = match self.backend.as_ref() {
            Backend::Cluster(_) => {
                let reply: Value = self
                    .run_with_deadline(op, step_deadline, |mut c| async move { redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c).await })
                    .await?;
                shard_slots(&reply).map_err(StoreError::Malformed)?.into_iter().map(Some).collect()
            }
            _ => vec![None],
        };
        let mut names = Vec::new();
        for node in nodes {
            let mut cursor = 0u64;
            loop {
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(STEP);
                let reply: Value = self
                    .run_with_deadline(op, step_deadline, |c| async move {
                        match (c, node) {
                            (Conn::Cluster(mut cc), Some(slot)) => {
                                let route = Route::new(slot, SlotAddr::Master);
                                cc.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route))).await
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

/// One slot of each primary in a `CLUSTER SLOTS` reply (`[[start, end, [host, port, id, …],
/// replicas…], …]`): the slot a `SCAN` of that primary is routed by. An error unless the ranges
/// cover every slot.
fn shard_slots(reply: &Value) -> Result<Vec<u16>, String> {
    let Value::Array(ranges) = reply else { return Err("CLUSTER SLOTS: not an array".into()) };
    let mut covered = 0u32;
    let mut seen: Vec<Vec<u8>> = Vec::new();
    let mut slots = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else { return Err("CLUSTER SLOTS: a range is not an array".into()) };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) = (fields.first(), fields.get(1), fields.get(2)) else {
            return Err("CLUSTER SLOTS: a range without its bounds and primary".into());
        };
        let (start, end) = (u16::try_from(*start).ok().filter(|s| u32::from(*s) < SLOTS), u16::try_from(*end).ok().filter(|e| u32::from(*e) < SLOTS));
        let (Some(start), Some(end)) = (start, end) else { return Err("CLUSTER SLOTS: a slot out of range".into()) };
        if end < start {
            return Err("CLUSTER SLOTS: a range that ends before it starts".into());
        }
        covered += u32::from(end - start) + 1;
        // the primary by its id (Redis 4+), else its address
        let name: Vec<u8> = match (master.first(), master.get(1), master.get(2)) {
            (_, _, Some(Value::BulkString(id))) => id.clone(),
            (Some(Value::BulkString(host)), Some(Value::Int(port)), _) => [host.as_slice(), b":", port.to_string().as_bytes()].concat(),
            _ => return Err("CLUSTER SLOTS: a range without its primary".into()),
        };
        if !seen.contains(&name) {
            seen.push(name);
            slots.push(start);
        }
    }
    if covered != SLOTS {
        return Err(format!("the cluster serves {covered} of its {SLOTS} slots: not every key can be listed"));
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::shard_slots;
    use redis::Value;

    fn range(start: i64, end: i64, host: &str, port: i64, id: Option<&str>) -> Value {
        let mut node = vec![Value::BulkString(host.into()), Value::Int(port)];
        node.extend(id.map(|i| Value::BulkString(i.into())));
        Value::Array(vec![Value::Int(start), Value::Int(end), Value::Array(node)])
    }

    #[test]
    fn one_slot_per_primary_and_every_slot_covered() {
        let reply = Value::Array(vec![
            range(0, 5460, "10.0.0.1", 7000, Some("a")),
            range(5461, 10922, "node-b.example", 7001, Some("b")),
            range(10923, 12000, "10.0.0.3", 7002, Some("c")),
            range(12001, 16383, "10.0.0.1", 7000, Some("a")), // a second range of a
        ]);
        assert_eq!(shard_slots(&reply), Ok(vec![0, 5461, 10923]));
        // without ids (older servers): by address
        let reply = Value::Array(vec![range(0, 8191, "::1", 7000, None), range(8192, 16383, "::1", 7001, None)]);
        assert_eq!(shard_slots(&reply), Ok(vec![0, 8192]));
    }

    #[test]
    fn a_cluster_not_serving_every_slot_or_an_odd_reply_is_an_error() {
        let partial = Value::Array(vec![range(0, 5460, "h", 1, Some("a")), range(10923, 16383, "h", 3, Some("c"))]);
        assert!(shard_slots(&partial).unwrap_err().contains("10922 of its 16384"));
        assert!(shard_slots(&Value::Array(vec![])).is_err());
        assert!(shard_slots(&Value::Nil).is_err());
        assert!(shard_slots(&Value::Array(vec![range(0, 20000, "h", 1, Some("a"))])).is_err());
        assert!(shard_slots(&Value::Array(vec![range(9, 3, "h", 1, Some("a"))])).is_err());
        assert!(shard_slots(&Value::Array(vec![Value::Array(vec![Value::Int(0)])])).is_err());
    }
}
