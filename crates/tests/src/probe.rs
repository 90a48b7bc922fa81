//! What the tests read of a running cluster from outside: who leads, as a peer sees it, and
//! a process's memory and open files.

use serde_json::Value;

use crate::get;

/// The leader's id as peer `url` itself sees it (`?local=true`: not forwarded), and its
/// view of the cluster.
pub fn leader_seen_by(url: &str) -> Option<(u64, Value)> {
    let (status, view) = get(&format!("{url}/v1/cluster?local=true")).ok()?;
    if status != 200 {
        return None;
    }
    let peers = view["peers"].as_array()?;
    let leaders: Vec<u64> = peers
        .iter()
        .filter(|p| p["role"] == "leader")
        .filter_map(|p| p["id"].as_u64())
        .collect();
    match leaders[..] {
        [one] => Some((one, view)),
        _ => None,
    }
}

/// A process's resident memory in bytes (0 when it is gone).
pub fn rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// How many file descriptors a process has open (0 when it is gone).
pub fn open_fds(pid: i32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}
