//! The cluster table: live hosts as the cluster tells of them, lost hosts kept (marked lost,
//! with when and why) instead of vanishing, and each host's memory per device from the job's
//! step reports.

use std::collections::BTreeMap;

use archipelago_actors::executor::StepReport;
use archipelago_dataflow::Plan;

use super::views::{DeviceMemoryView, HostRow, HostView};

/// Lost hosts the table keeps (the newest).
const LOST_KEPT: usize = 64;

/// A live row of `host`.
fn live(host: HostView) -> HostRow {
    HostRow {
        host,
        state: "live".into(),
        lost_unix_s: None,
        lost_reason: None,
        memory: Vec::new(),
    }
}

/// Marks `row` lost at `unix_s` (a row already lost keeps its first time and reason).
fn lose(row: &mut HostRow, unix_s: f64, reason: &str) {
    if row.state != "lost" {
        row.state = "lost".into();
        row.lost_unix_s = Some(unix_s);
        row.lost_reason = Some(reason.to_string());
        row.memory.clear();
    }
}

/// The live hosts are now `hosts`: a live row missing from them is marked lost at `unix_s`
/// (rows lost before stay); a host of a lost row's name that registers again is live.
pub fn set_hosts(rows: &mut Vec<HostRow>, hosts: Vec<HostView>, unix_s: f64) {
    let mut memory: BTreeMap<String, Vec<DeviceMemoryView>> = BTreeMap::new();
    let mut lost = Vec::new();
    for mut row in std::mem::take(rows) {
        if hosts.iter().any(|h| h.name == row.host.name) {
            // Replaced by its live row below, which keeps the memory figures of a live one.
            if row.state == "live" {
                memory.insert(row.host.name, row.memory);
            }
            continue;
        }
        lose(&mut row, unix_s, "left the cluster");
        lost.push(row);
    }
    for host in hosts {
        let mut row = live(host);
        row.memory = memory.remove(&row.host.name).unwrap_or_default();
        rows.push(row);
    }
    let over = lost.len().saturating_sub(LOST_KEPT);
    rows.extend(lost.into_iter().skip(over));
}

/// Host `name` was lost at `unix_s` for `reason`.
pub fn mark_lost(rows: &mut [HostRow], name: &str, unix_s: f64, reason: &str) {
    for row in rows.iter_mut().filter(|r| r.host.name == name) {
        lose(row, unix_s, reason);
    }
}

/// The host of each actor of `plan`: `hosts` where given, else the one live host of `rows`
/// (a job in this process), else unknown (empty).
pub fn actor_hosts(plan: &Plan, hosts: &[String], rows: &[HostRow]) -> Vec<String> {
    let mut live = rows.iter().filter(|r| r.state == "live");
    let only = match (live.next(), live.next()) {
        (Some(row), None) => row.host.name.clone(),
        _ => String::new(),
    };
    (0..plan.actors.len())
        .map(|a| hosts.get(a).cloned().unwrap_or_else(|| only.clone()))
        .collect()
}

/// Each live host's memory per device from the step's `reports` (one per actor; `hosts`: each
/// actor's host). Actors sharing a device are summed.
pub fn set_memory(rows: &mut [HostRow], plan: &Plan, reports: &[StepReport], hosts: &[String]) {
    let mut by_host: BTreeMap<&str, BTreeMap<String, DeviceMemoryView>> = BTreeMap::new();
    for r in reports {
        let (Some(actor), Some(host)) = (plan.actors.get(r.actor), hosts.get(r.actor)) else {
            continue;
        };
        let device = actor.device.to_string();
        let m = (by_host.entry(host.as_str()).or_default().entry(device.clone())).or_insert_with(|| {
            DeviceMemoryView {
                device,
                ..DeviceMemoryView::default()
            }
        });
        m.state_bytes += r.metrics.model_state_bytes;
        m.peak_state_bytes += r.metrics.peak_model_state_bytes;
        m.planned_bytes += plan.memory.get(r.actor).map_or(0, |p| p.total());
        if let Some(pool) = &r.metrics.device_memory {
            m.pool_bytes = Some(pool.in_use);
        }
    }
    for row in rows.iter_mut().filter(|r| r.state == "live") {
        if let Some(devices) = by_host.remove(row.host.name.as_str()) {
            row.memory = devices.into_values().collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str) -> HostView {
        HostView {
            name: name.into(),
            island: "i".into(),
            devices: vec!["cpu:0".into()],
            device_memory: 0,
        }
    }

    #[test]
    fn a_lost_host_stays_marked_lost_until_it_registers_again() {
        let mut rows = Vec::new();
        set_hosts(&mut rows, vec![host("a"), host("b")], 1.0);
        mark_lost(&mut rows, "b", 2.0, "killed");
        set_hosts(&mut rows, vec![host("a")], 3.0);
        let names: Vec<(&str, &str)> = (rows.iter())
            .map(|r| (r.host.name.as_str(), r.state.as_str()))
            .collect();
        assert_eq!(names, [("a", "live"), ("b", "lost")]);
        assert_eq!(
            rows[1].lost_unix_s,
            Some(2.0),
            "lost when it was reported, not later"
        );
        assert_eq!(rows[1].lost_reason.as_deref(), Some("killed"));
        set_hosts(&mut rows, vec![host("a")], 4.0);
        assert_eq!(rows.len(), 2, "a lost host is kept once");
        set_hosts(&mut rows, vec![host("a"), host("b")], 5.0);
        assert!(rows.iter().all(|r| r.state == "live"), "{rows:?}");
        set_hosts(&mut rows, vec![host("b")], 6.0);
        assert_eq!(
            (rows[1].host.name.as_str(), rows[1].state.as_str()),
            ("a", "lost")
        );
        assert_eq!(rows[1].lost_reason.as_deref(), Some("left the cluster"));
    }
}
