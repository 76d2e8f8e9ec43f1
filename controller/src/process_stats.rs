//! Facts about this process and machine for reports: peak RSS, total memory and the load average.

/// Peak resident set size of this process in bytes (`VmHWM`), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    proc_kib_field("/proc/self/status", "VmHWM:")
}

/// Resident set size of this process now (`VmRSS`), 0 where unknown.
pub fn rss_bytes() -> u64 {
    proc_kib_field("/proc/self/status", "VmRSS:")
}

/// Total memory of this machine in bytes (`MemTotal`), 0 where unknown.
pub fn mem_total_bytes() -> u64 {
    proc_kib_field("/proc/meminfo", "MemTotal:")
}

/// Memory available for new allocations on this machine (`MemAvailable`), 0 where unknown.
pub fn mem_available_bytes() -> u64 {
    proc_kib_field("/proc/meminfo", "MemAvailable:")
}

/// The field `key` (in kB) of a `/proc` file, in bytes; 0 where unknown.
fn proc_kib_field(path: &str, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The 1, 5 and 15 minute load averages, zeros where unknown.
pub fn load_avg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut parts = text.split_whitespace().map(|p| p.parse::<f64>().unwrap_or(0.0));
    [
        parts.next().unwrap_or(0.0),
        parts.next().unwrap_or(0.0),
        parts.next().unwrap_or(0.0),
    ]
}
