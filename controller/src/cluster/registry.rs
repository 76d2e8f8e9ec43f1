//! The controller's registry of hosts: who offers which devices, when each was last heard of,
//! what its actors were running, and the channel to its session. The running job subscribes to
//! the hosts' messages and to their loss (session closed, or silent past the host timeout).
//! [`ClusterConfig`] says how long a host may be silent and a job may wait for hosts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tonic::Status;

use archipelago_actors::proto::{ActorState, ControllerMessage, controller_message};
use archipelago_dataflow::DeviceSpec;

use crate::dashboard::{Dashboard, HostView};

/// How the controller treats its hosts.
#[derive(Clone)]
pub struct ClusterConfig {
    /// A host silent this long is declared lost.
    pub host_timeout: Duration,
    /// How long a job waits for enough devices to register.
    pub wait_for_hosts: Duration,
    /// A dashboard to feed with the cluster and its jobs.
    pub dashboard: Option<Arc<Dashboard>>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            host_timeout: Duration::from_secs(5),
            wait_for_hosts: Duration::from_secs(60),
            dashboard: None,
        }
    }
}

/// A registered host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostInfo {
    /// Registry id.
    pub id: u32,
    /// Its name (unique among live hosts).
    pub name: String,
    /// Its island (devices with a fast interconnect among them).
    pub island: String,
    /// Its devices.
    pub devices: Vec<DeviceSpec>,
    /// Memory per device in bytes (0: not given).
    pub device_memory: u64,
    /// Where its gRPC fabric listens.
    pub fabric_addr: String,
    /// Where its raw-TCP tensor port listens.
    pub tcp_addr: String,
    /// Its process id.
    pub pid: u32,
    /// Where its actor port listens (every host: a program's own binary serving as a host,
    /// and `archipelago host`, where the controller spawns a job's host part).
    pub actor_addr: String,
}

impl HostInfo {
    /// Whether it is a program's own binary serving as a host (its actor port only), not an
    /// `archipelago host` running training actors (with fabric ports).
    pub fn serves_actors(&self) -> bool {
        !self.actor_addr.is_empty() && self.fabric_addr.is_empty()
    }
}

/// What the running job (and every serving job) hears from the hosts' sessions.
#[derive(Debug, Clone)]
pub enum HostEvent {
    /// A host is lost: its info, why, and its actors' last known states.
    Gone(HostInfo, String, Vec<ActorState>),
}

struct HostEntry {
    info: HostInfo,
    to_host: UnboundedSender<Result<ControllerMessage, Status>>,
    last_seen: Instant,
    actors: Vec<ActorState>,
    /// Heartbeats received so far.
    heartbeats: u64,
}

#[derive(Default)]
struct Inner {
    hosts: BTreeMap<u32, HostEntry>,
    next_id: u32,
    job: Option<UnboundedSender<HostEvent>>,
    /// The serving jobs' ears (each hears every loss; closed ones are dropped).
    watchers: Vec<UnboundedSender<HostEvent>>,
}

/// The hosts of the cluster.
#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
    changed: Notify,
    dashboard: Option<Arc<Dashboard>>,
}

impl Registry {
    /// An empty registry that shows its hosts on `dashboard`.
    pub fn new(dashboard: Option<Arc<Dashboard>>) -> Registry {
        Registry {
            dashboard,
            ..Registry::default()
        }
    }

    fn show_cluster(&self) {
        if let Some(d) = &self.dashboard {
            let hosts = self
                .hosts()
                .into_iter()
                .map(|h| HostView {
                    name: h.name,
                    island: h.island,
                    devices: h.devices.iter().map(|d| d.to_string()).collect(),
                    device_memory: h.device_memory,
                })
                .collect();
            d.set_cluster(hosts);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a host (a new registration under a live host's name is refused).
    pub fn register(
        &self,
        mut info: HostInfo,
        to_host: UnboundedSender<Result<ControllerMessage, Status>>,
    ) -> Result<u32, String> {
        let mut inner = self.lock();
        if inner.hosts.values().any(|h| h.info.name == info.name) {
            return Err(format!(
                "a live host is already registered as `{}`; give each host its own --name",
                info.name
            ));
        }
        inner.next_id += 1;
        let id = inner.next_id;
        info.id = id;
        tracing::info!(host = %info.name, island = %info.island, devices = ?info.devices, "host registered");
        inner.hosts.insert(
            id,
            HostEntry {
                info,
                to_host,
                last_seen: Instant::now(),
                actors: Vec::new(),
                heartbeats: 0,
            },
        );
        drop(inner);
        self.changed.notify_waiters();
        self.show_cluster();
        Ok(id)
    }

    /// Records a heartbeat.
    pub fn heartbeat(&self, id: u32, actors: Vec<ActorState>) {
        if let Some(h) = self.lock().hosts.get_mut(&id) {
            h.last_seen = Instant::now();
            h.actors = actors;
            h.heartbeats += 1;
        }
    }

    /// The actors' states of `hosts` as their last heartbeats told them, with the number of
    /// heartbeats each host has sent (hosts no longer registered are left out).
    pub fn heartbeat_states(&self, hosts: &[u32]) -> (Vec<ActorState>, Vec<u64>) {
        let inner = self.lock();
        let known = hosts.iter().filter_map(|id| inner.hosts.get(id));
        let (mut states, mut counts) = (Vec::new(), Vec::new());
        for h in known {
            states.extend(h.actors.iter().cloned());
            counts.push(h.heartbeats);
        }
        (states, counts)
    }

    /// Removes a lost host (closing its session) and tells the running job.
    pub fn gone(&self, id: u32, why: &str) {
        let mut inner = self.lock();
        let Some(h) = inner.hosts.remove(&id) else {
            return;
        };
        tracing::error!(host = %h.info.name, "host lost: {why}");
        if let Some(d) = &self.dashboard {
            d.host_lost(
                &h.info.name,
                &format!("host `{}` (pid {}) lost: {why}", h.info.name, h.info.pid),
            );
        }
        let event = HostEvent::Gone(h.info, why.to_string(), h.actors);
        inner.watchers.retain(|w| w.send(event.clone()).is_ok());
        if let Some(job) = &inner.job {
            let _ = job.send(event);
        }
        drop(inner);
        self.changed.notify_waiters();
        self.show_cluster();
    }

    /// Declares lost every host silent for longer than `timeout`.
    pub fn expire(&self, timeout: Duration) {
        let silent: Vec<(u32, f64)> = self
            .lock()
            .hosts
            .iter()
            .filter(|(_, h)| h.last_seen.elapsed() > timeout)
            .map(|(&id, h)| (id, h.last_seen.elapsed().as_secs_f64()))
            .collect();
        for (id, s) in silent {
            self.gone(
                id,
                &format!("silent for {s:.1} s (no heartbeat; the host timeout is {timeout:?})"),
            );
        }
    }

    /// The live hosts, ordered by island, then registration.
    pub fn hosts(&self) -> Vec<HostInfo> {
        let mut hosts: Vec<HostInfo> = self.lock().hosts.values().map(|h| h.info.clone()).collect();
        hosts.sort_by(|a, b| (&a.island, a.id).cmp(&(&b.island, b.id)));
        hosts
    }

    /// Sends a message to a host's session.
    pub fn send(&self, id: u32, kind: controller_message::Kind) -> Result<(), String> {
        let inner = self.lock();
        let h = inner.hosts.get(&id).ok_or_else(|| format!("host {id} is gone"))?;
        h.to_host
            .send(Ok(ControllerMessage { kind: Some(kind) }))
            .map_err(|_| format!("the session of host `{}` is closed", h.info.name))
    }

    /// Routes the hosts' messages and losses to the caller (the one running job) from now on.
    pub fn subscribe(&self) -> UnboundedReceiver<HostEvent> {
        let (tx, rx) = unbounded_channel();
        self.lock().job = Some(tx);
        rx
    }

    /// Hears every host lost from now on, beside the running job (a serving job watches its
    /// host); dropping the receiver ends it.
    pub fn watch(&self) -> UnboundedReceiver<HostEvent> {
        let (tx, rx) = unbounded_channel();
        let mut inner = self.lock();
        inner.watchers.retain(|w| !w.is_closed());
        inner.watchers.push(tx);
        rx
    }

    /// Waits until the live hosts of one kind (serving actor ports when `actor_hosts`, else
    /// training hosts) offer at least `devices` devices, or `timeout` passes; returns those
    /// hosts then live.
    pub async fn wait_for_devices(
        &self,
        devices: usize,
        timeout: Duration,
        actor_hosts: bool,
    ) -> Vec<HostInfo> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            let mut hosts = self.hosts();
            hosts.retain(|h| h.serves_actors() == actor_hosts);
            let offered: usize = hosts.iter().map(|h| h.devices.len()).sum();
            let left = deadline.saturating_duration_since(Instant::now());
            if offered >= devices || left.is_zero() {
                return hosts;
            }
            let _ = tokio::time::timeout(left.min(Duration::from_millis(500)), notified).await;
        }
    }
}
