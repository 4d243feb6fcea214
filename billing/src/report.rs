//! Reading a tenant's usage per day (the `report` command): the PostgreSQL rollup and the
//! gateway's Redis meter, each day taken as the larger of the two, field by field (seed 004).

use tollgate_wire::usage::UsageClass;

/// Days from `from` to `to` (inclusive, `yyyy-MM-dd`), at most 366.
pub fn days(from: &str, to: &str) -> Option<Vec<String>> {
    let parse = |s: &str| -> Option<u64> {
        let mut it = s.split('-');
        let (y, m, d): (i64, u32, u32) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
        if it.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
            return None;
        }
        // days_from_civil (Howard Hinnant)
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let mm = i64::from(m);
        let doy = (153 * (if mm > 2 { mm - 3 } else { mm + 9 }) + 2) / 5 + i64::from(d) - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        u64::try_from(era * 146_097 + doe - 719_468).ok()
    };
    let (a, b) = (parse(from)?, parse(to)?);
    if b < a || b - a > 366 {
        return None;
    }
    Some((a..=b).map(|d| tollgate_wire::usage::Day::of_ms(d * 86_400_000).iso()).collect())
}

/// The larger of a rollup day and a meter hash, field by field.
pub fn larger(rollup: ([i64; 5], i64), meter: &std::collections::HashMap<String, i64>) -> ([i64; 5], i64) {
    let (mut c, mut t) = rollup;
    for (i, class) in UsageClass::ALL.iter().enumerate() {
        c[i] = c[i].max(meter.get(class.name()).copied().unwrap_or(0));
    }
    t = t.max(meter.get("tokens").copied().unwrap_or(0));
    (c, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn day_ranges() {
        assert_eq!(days("2025-11-29", "2025-12-01").unwrap(), ["2025-11-29", "2025-11-30", "2025-12-01"]);
        assert_eq!(days("2024-02-28", "2024-03-01").unwrap().len(), 3);
        assert!(days("2025-12-01", "2025-11-01").is_none());
        assert!(days("2025-13-01", "2025-13-02").is_none());
    }

    #[test]
    fn each_field_takes_the_larger() {
        let meter = [("ok".to_string(), 7), ("4xx".to_string(), 1), ("tokens".to_string(), 3)].into_iter().collect();
        assert_eq!(larger(([5, 2, 0, 0, 0], 10), &meter), ([7, 2, 0, 0, 0], 10));
    }
}
