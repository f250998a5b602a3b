//! The machine's memory, which bounds what one model, cache or batch may take, and byte counts
//! as people read them.

/// Used when `/proc/meminfo` cannot be read: 64 GiB.
pub const FALLBACK_MEMORY_LIMIT: u64 = 64 << 30;

/// The most memory one model, cache or batch may take: the machine's total memory
/// (`MemTotal` of `/proc/meminfo`), or [`FALLBACK_MEMORY_LIMIT`] where that is not available.
pub fn memory_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| mem_total(&t))
            .unwrap_or(FALLBACK_MEMORY_LIMIT)
    })
}

/// `MemTotal` in bytes from the text of `/proc/meminfo`.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then(|| kib.checked_mul(1024)).flatten().filter(|&b| b > 0)
}

/// A byte count for people: `14.7 TB`, `512.0 MB`, `12 bytes` (decimal units).
pub fn format_bytes(bytes: u128) -> String {
    let units = ["KB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} bytes");
    }
    let mut x = bytes as f64 / 1000.0;
    let mut unit = 0;
    while x >= 1000.0 && unit + 1 < units.len() {
        x /= 1000.0;
        unit += 1;
    }
    format!("{x:.1} {}", units[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_total_and_byte_counts() {
        assert_eq!(mem_total("MemTotal:       16318480 kB\nMemFree: 1 kB\n"), Some(16710123520));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: lots kB\n"), None);
        assert!(memory_limit() > 0);
        assert_eq!(format_bytes(999), "999 bytes");
        assert_eq!(format_bytes(14_700_000_000_000), "14.7 TB");
    }
}
