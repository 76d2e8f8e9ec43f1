//! A runtime connected to a cluster: the slots (devices of the hosts running the program's
//! binary) it places actors on, the connections to those hosts' actor ports, spawning there by
//! registered type name, and the actors' figures gathered from every host.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use archipelago_dataflow::DeviceSpec;

use super::actor::Actor;
use super::actor_ref::ActorRef;
use super::call::Pending;
use super::remote::connection::spawn_failed;
use super::remote::registry::Registry;
use super::remote::wire::Frame;
use super::remote::{HostConnection, Liveness};
use super::supervision::{ActorShared, ActorStats, SpawnOptions};
use super::system::{NEXT_KEY, SpawnError};
use super::{Runtime, RuntimeHandle};

/// One device of the cluster a runtime places actors on: a host (by name and actor-port
/// address), its island and the device.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Slot {
    /// The host's name.
    pub host: String,
    /// Its island.
    pub island: String,
    /// Its actor port (empty for this process's own devices).
    pub addr: String,
    /// The device.
    pub device: DeviceSpec,
}

/// The hosts of a runtime connected to a cluster.
pub(crate) struct Cluster {
    pub(crate) slots: Vec<Slot>,
    pub(crate) connections: HashMap<String, Arc<HostConnection>>,
    /// Actors this program placed on each slot (what [`Placement`](super::Placement) balances).
    pub(crate) placed: std::sync::Mutex<Vec<usize>>,
}

impl Runtime {
    /// A runtime that places its actors on the cluster's `slots` (hosts running this program's
    /// binary, with the same [`Registry`](super::Registry) installed) and reaches them over
    /// their actor ports with the cluster's `credentials` (its token, a `&str`, or
    /// [`Credentials`](crate::trust::Credentials) with mutual TLS). Actors go to `slots` in order: a mesh's
    /// member `r` to `slots[r]`.
    pub fn on_cluster(
        job: &str,
        slots: Vec<Slot>,
        credentials: impl Into<crate::trust::Credentials>,
        liveness: Liveness,
    ) -> Result<Runtime, String> {
        let credentials = credentials.into();
        let driver = Runtime::driver_executor().map_err(|e| e.to_string())?;
        super::remote::links::know_hosts(
            slots.iter().map(|s| s.addr.as_str()),
            &credentials,
            driver.handle().clone(),
        );
        let mut connections = HashMap::new();
        for slot in &slots {
            if !connections.contains_key(&slot.addr) {
                let connection = driver.block_on(HostConnection::connect(
                    &slot.host,
                    &slot.addr,
                    &credentials,
                    liveness,
                ))?;
                connections.insert(slot.addr.clone(), connection);
            }
        }
        let placed = std::sync::Mutex::new(vec![0; slots.len()]);
        let cluster = Cluster {
            slots,
            connections,
            placed,
        };
        Ok(Runtime::assemble(
            job,
            "driver",
            Vec::new(),
            driver,
            Some(cluster),
        ))
    }
}

/// The slots as `host h1: cpu:0, cpu:1; host h2: cuda:0`.
pub(crate) fn slot_list(slots: &[Slot]) -> String {
    let mut hosts: Vec<(&str, Vec<String>)> = Vec::new();
    for slot in slots {
        let device = slot.device.to_string();
        match hosts.iter_mut().find(|(h, _)| *h == slot.host) {
            Some((_, devices)) => devices.push(device),
            None => hosts.push((&slot.host, vec![device])),
        }
    }
    let parts: Vec<String> = (hosts.iter())
        .map(|(host, devices)| format!("host {host}: {}", devices.join(", ")))
        .collect();
    parts.join("; ")
}

impl RuntimeHandle {
    /// Where actors can go, in placement order: this process's devices, or the cluster's.
    pub fn slots(&self) -> Vec<Slot> {
        match &self.inner.cluster {
            Some(cluster) => cluster.slots.clone(),
            None => self
                .inner
                .local_devices()
                .into_iter()
                .map(|device| Slot {
                    host: self.inner.host.clone(),
                    island: String::new(),
                    addr: String::new(),
                    device,
                })
                .collect(),
        }
    }

    /// The figures of every actor of the runtime: this process's, and on a cluster every
    /// host's (asked over their actor ports; a host that does not answer is left out).
    pub fn actor_stats(&self) -> Pending<Vec<ActorStats>> {
        let mut stats = self.local_actor_stats();
        let connections: Vec<Arc<HostConnection>> = match &self.inner.cluster {
            Some(cluster) => cluster.connections.values().cloned().collect(),
            None => Vec::new(),
        };
        Pending::new(
            async move {
                for connection in connections {
                    stats.extend(connection.stats().await.unwrap_or_default());
                }
                stats
            },
            self.inner.driver.clone(),
        )
    }

    /// On a cluster, spawns an actor on a device of `device`'s kind chosen by the options'
    /// [`Placement`](super::Placement).
    pub(crate) fn spawn_placed<A: Actor>(
        &self,
        cluster: &Cluster,
        device: DeviceSpec,
        params: A::Params,
        options: SpawnOptions,
    ) -> Pending<Result<ActorRef<A>, SpawnError>> {
        let placed = cluster.placed.lock().expect("placed actors").clone();
        match super::placement::choose_slot(&cluster.slots, &placed, device, options.placement) {
            Some(slot) => self.spawn_at(slot, params, options),
            None => {
                let error = SpawnError::NoSuchDevice {
                    device,
                    devices: format!(
                        "no {} device on any host: {}",
                        if device.cuda_ordinal().is_some() {
                            "GPU"
                        } else {
                            "CPU"
                        },
                        slot_list(&cluster.slots)
                    ),
                };
                Pending::new(std::future::ready(Err(error)), self.inner.driver.clone())
            }
        }
    }

    /// Spawns an actor on the `slot`-th of [`RuntimeHandle::slots`] (on a cluster, on that
    /// slot's host: `A` and its parameters must be registered).
    pub fn spawn_at<A: Actor>(
        &self,
        slot: usize,
        params: A::Params,
        options: SpawnOptions,
    ) -> Pending<Result<ActorRef<A>, SpawnError>> {
        let driver = self.inner.driver.clone();
        let Some(cluster) = &self.inner.cluster else {
            return self.spawn_on_thread(slot, params, options);
        };
        let Some(chosen) = cluster.slots.get(slot).cloned() else {
            let error = SpawnError::MeshTooLarge {
                mesh: format!("slot {slot}"),
                needed: slot + 1,
                available: cluster.slots.len(),
            };
            return Pending::new(std::future::ready(Err(error)), driver);
        };
        cluster.placed.lock().expect("placed actors")[slot] += 1;
        let slot = chosen;
        let actor_type = std::any::type_name::<A>();
        let failed = |reason: String| {
            let error = spawn_failed(actor_type, &slot.host, reason);
            Pending::new(std::future::ready(Err(error)), driver.clone())
        };
        let params = match Registry::encode_params::<A>(&params) {
            Ok(params) => params,
            Err(reason) => return failed(reason),
        };
        let connection = cluster.connections[&slot.addr].clone();
        let answer = connection.spawn(|request| Frame::Spawn {
            request,
            actor_type: actor_type.to_string(),
            device: slot.device,
            params,
            name: options.name,
            max_restarts: options.max_restarts,
        });
        let (job, key) = (self.inner.job.clone(), NEXT_KEY.fetch_add(1, Ordering::Relaxed));
        let spawned_driver = driver.clone();
        Pending::new(
            async move {
                match answer.await {
                    Ok(Ok(info)) => {
                        let shared = Arc::new(ActorShared::new(info, job));
                        Ok(ActorRef::remote(connection, shared, key, spawned_driver))
                    }
                    Ok(Err(reason)) => Err(spawn_failed(actor_type, &slot.host, reason)),
                    Err(_) => Err(spawn_failed(
                        actor_type,
                        &slot.host,
                        "the connection dropped".into(),
                    )),
                }
            },
            driver,
        )
    }
}
