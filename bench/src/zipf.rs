//! Many keys with skewed traffic (issue 16): `N` keys of one tenant's plan written straight into
//! Redis (the records `tollgate-sidecar keys create` writes: `apikey:{sha256}`), and a wrk script
//! that sends each request with a key drawn from a Zipf distribution over them (rank `r` with
//! weight `r^-s`), so a few keys are hot and most are seen rarely: the auth cache and the leases
//! meet what a real population of clients gives them instead of one key warm all along.

use std::path::PathBuf;
use tollgate_tests::fixtures::key_hash;
use tollgate_tests::{root, Redis};

/// Writes `n` active keys of `tenant` on `plan` into Redis and their raw values, most popular
/// first, to a file the wrk script reads. Returns that file.
pub fn seed_keys(redis: &Redis, n: usize, tenant: &str, plan: &str) -> PathBuf {
    let mut c = redis.connection().expect("redis connection");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut raws = String::with_capacity(n * 24);
    for chunk in (0..n).collect::<Vec<_>>().chunks(5_000) {
        let mut pipe = redis::pipe();
        for &i in chunk {
            let raw = format!("tgz_{i:07}_{:08x}", (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32);
            let hash = key_hash(&raw);
            let id = format!("key_z{i}");
            pipe.cmd("HSET")
                .arg(format!("apikey:{hash}"))
                .arg(&["key_id", id.as_str(), "tenant", tenant, "plan", plan, "status", "active"])
                .arg("created_at")
                .arg(now)
                .ignore();
            pipe.cmd("SET").arg(format!("apikey-id:{id}")).arg(&hash).ignore();
            pipe.cmd("SADD").arg(format!("apikey-index:{tenant}")).arg(&id).ignore();
            raws.push_str(&raw);
            raws.push('\n');
        }
        pipe.query::<()>(&mut c).expect("write key records");
    }
    let path = root().join("target/bench-zipf-keys.txt");
    std::fs::write(&path, raws).expect("write the key list");
    path
}

/// The wrk script: reads the key list (argument 1) and the exponent (argument 2), draws each
/// request's key by inverse CDF (binary search; seeded from the clock, so the measurement does not
/// replay the warm-up's sequence), and prints the percentiles `wrk()` reads.
pub fn wrk_script() -> PathBuf {
    let path = root().join("target/bench-zipf.lua");
    std::fs::write(
        &path,
        r#"local keys, cdf = {}, {}
init = function(args)
  for line in io.lines(args[1]) do keys[#keys + 1] = line end
  local s, total = tonumber(args[2]), 0
  for i = 1, #keys do total = total + i ^ (-s); cdf[i] = total end
  for i = 1, #keys do cdf[i] = cdf[i] / total end
  math.randomseed(os.time())
end
request = function()
  local u, lo, hi = math.random(), 1, #cdf
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return wrk.format(nil, nil, {["x-api-key"] = keys[lo]})
end
done = function(summary, latency, requests)
  io.write(string.format("P50 %d\nP99 %d\nP999 %d\nREQS %d\n", latency:percentile(50), latency:percentile(99), latency:percentile(99.9), summary.requests))
end
"#,
    )
    .expect("write the zipf wrk script");
    path
}
