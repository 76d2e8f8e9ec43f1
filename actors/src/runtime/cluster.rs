//! A runtime connected to a cluster: the slots (devices of the hosts running the program's
//! binary) it places actors on, the connections to those hosts' actor ports, spawning there by
//! registered type name, and the actors' figures gathered from every host.
//!
//! Restarts across hosts (Ray's `max_restarts` after a node dies): when the host of an actor
//! spawned here with restarts left is lost, its calls pending there fail with the host-lost
//! error (they are not retried) and the driver spawns it again — same registered type, same
//! encoded parameters, same name — on a live slot of the same kind of device on another host,
//! chosen by its [`Placement`](super::Placement). Calls and casts sent meanwhile wait, in order,
//! and go to the new incarnation, as do later ones, through every clone of its [`ActorRef`].
//! With no live host of that kind, or its constructor failing there, the actor ends saying so.
//! References that other actors hold (sent in messages) and compiled programs recorded before
//! keep the lost incarnation.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use archipelago_dataflow::DeviceSpec;

use super::actor::Actor;
use super::actor_ref::ActorRef;
use super::call::Pending;
use super::placement::Placement;
use super::remote::connection::OnLost;
use super::remote::registry::Registry;
use super::remote::wire::Frame;
use super::remote::{HostConnection, Liveness};
use super::supervision::{ActorEnd, ActorShared, ActorStats, Incarnation, RemoteActor, SpawnOptions};
use super::system::{NEXT_KEY, RuntimeInner, SpawnError};
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
                        kind(device),
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
        let respawn = Respawn::of(actor_type, &params, &options, &self.inner);
        let connection = cluster.connections[&slot.addr].clone();
        let answer = connection.spawn(|request| Frame::Spawn {
            request,
            actor_type: actor_type.to_string(),
            device: slot.device,
            params,
            name: options.name,
            max_restarts: options.max_restarts,
            detached: options.detached,
        });
        let detached = options.detached;
        let (job, key) = (self.inner.job.clone(), NEXT_KEY.fetch_add(1, Ordering::Relaxed));
        let spawned_driver = driver.clone();
        Pending::new(
            async move {
                match answer.await {
                    Ok(Ok(info)) => {
                        let shared = Arc::new(ActorShared::new(info, job));
                        let remote = RemoteActor::new(Incarnation::new(connection, shared), respawn);
                        follow(&remote, remote.first());
                        let actor = ActorRef::following(remote, key, spawned_driver);
                        Ok(if detached { actor } else { actor.keeping() })
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

/// `CPU` or `GPU`: the kind of device `device` names.
fn kind(device: DeviceSpec) -> &'static str {
    if device.cuda_ordinal().is_some() {
        "GPU"
    } else {
        "CPU"
    }
}

/// The error of a remote spawn that did not happen.
fn spawn_failed(actor_type: &str, host: &str, reason: String) -> SpawnError {
    SpawnError::Constructor {
        actor: format!("an actor of type `{actor_type}` on host {host}"),
        reason,
    }
}

/// What the driver needs to spawn an actor again when its host is lost.
pub(crate) struct Respawn {
    actor_type: &'static str,
    /// Its parameters, encoded (kept from the first spawn).
    params: Vec<u8>,
    max_restarts: u32,
    placement: Placement,
    detached: bool,
    runtime: Weak<RuntimeInner>,
    /// Where the re-placing runs (the runtime's driver executor).
    driver: tokio::runtime::Handle,
}

/// Follows `incarnation` of `remote` on its host's connection; if the host is lost, the actor
/// is re-placed when it has restarts left.
fn follow(remote: &Arc<RemoteActor>, incarnation: &Incarnation) {
    let on_lost = remote.respawn.as_ref().map(|_| {
        let (remote, lost) = (Arc::downgrade(remote), Arc::downgrade(&incarnation.shared));
        Box::new(move |why: &str| match (remote.upgrade(), lost.upgrade()) {
            (Some(remote), Some(lost)) => replace(remote, lost, why),
            _ => false,
        }) as OnLost
    });
    let _ = incarnation.connection.track(&incarnation.shared, on_lost);
}

/// Takes over `remote`'s actor whose incarnation `lost` was on a host lost (`why`): with a
/// restart left (and the program's runtime up), starts re-placing it and gives `true`; else it
/// ends with its host.
fn replace(remote: Arc<RemoteActor>, lost: Arc<ActorShared>, why: &str) -> bool {
    let Some(respawn) = &remote.respawn else {
        return false;
    };
    let spent = lost.restarts.load(Ordering::Relaxed) >= respawn.max_restarts;
    if spent || respawn.runtime.strong_count() == 0 || !remote.begin_replacing(&lost) {
        return false;
    }
    let driver = respawn.driver.clone();
    driver.spawn(re_place(remote, lost, why.to_string()));
    true
}

/// Re-places `remote`'s actor whose incarnation `lost` was on a lost host (`why`): links the
/// new incarnation, or ends the actor saying why there is none.
async fn re_place(remote: Arc<RemoteActor>, lost: Arc<ActorShared>, why: String) {
    let started = Instant::now();
    match respawn_elsewhere(&remote, &lost).await {
        Ok(next) => {
            let (host, after) = (&next.shared.info.host, started.elapsed());
            tracing::warn!(actor = %lost.info, %host, ?after, "actor re-placed after its host was lost");
            follow(&remote, &next);
            remote.replaced(Some(next), ActorEnd::Failed(lost.host_lost("running", &why)));
        }
        Err(reason) => {
            let why = format!("{why}; it could not be re-placed: {reason}");
            let failure = lost.host_lost("being re-placed", &why);
            tracing::error!("{failure}");
            remote.replaced(None, ActorEnd::Failed(failure));
        }
    }
}

/// Spawns `remote`'s actor again as its incarnation `lost` was (type, parameters, name), on a
/// live slot of the same kind of device on another host; a host lost meanwhile is skipped.
async fn respawn_elsewhere(remote: &RemoteActor, lost: &ActorShared) -> Result<Arc<Incarnation>, String> {
    let respawn = remote.respawn.as_ref().ok_or("it was spawned without restarts")?;
    let restarts_left = (respawn.max_restarts).saturating_sub(lost.restarts.load(Ordering::Relaxed) + 1);
    let mut excluded = vec![lost.info.host.clone()];
    loop {
        let (slot, connection) = respawn.choose(&excluded, lost.info.device)?;
        let answer = connection.spawn(|request| Frame::Spawn {
            request,
            actor_type: respawn.actor_type.to_string(),
            device: slot.device,
            params: respawn.params.clone(),
            name: Some(lost.info.name.clone()),
            max_restarts: restarts_left,
            detached: respawn.detached,
        });
        match answer.await {
            Ok(Ok(info)) => {
                let shared = Arc::new(ActorShared::new(info, lost.job.clone()));
                return Ok(Incarnation::new(connection, shared));
            }
            Ok(Err(reason)) if connection.usable() => {
                return Err(format!("its constructor failed on host {}: {reason}", slot.host));
            }
            _ => excluded.push(slot.host),
        }
    }
}

impl Respawn {
    /// How to re-place an actor spawned with `options` from `params` (`None`: no restarts).
    fn of(
        actor_type: &'static str,
        params: &[u8],
        options: &SpawnOptions,
        runtime: &Arc<RuntimeInner>,
    ) -> Option<Respawn> {
        (options.max_restarts > 0).then(|| Respawn {
            actor_type,
            params: params.to_vec(),
            max_restarts: options.max_restarts,
            placement: options.placement,
            detached: options.detached,
            runtime: Arc::downgrade(runtime),
            driver: runtime.driver.clone(),
        })
    }

    /// A live slot of `device`'s kind on a host not `excluded` (counted as placed there), with
    /// its host's connection; or why there is none.
    fn choose(&self, excluded: &[String], device: DeviceSpec) -> Result<(Slot, Arc<HostConnection>), String> {
        let runtime = self.runtime.upgrade().ok_or("the program's runtime shut down")?;
        let cluster = (runtime.cluster.as_ref()).ok_or("the program's runtime drives no cluster")?;
        let Some((slot, connection)) = live_slot(cluster, excluded, device, self.placement) else {
            return Err(no_room(cluster, excluded, device));
        };
        cluster.placed.lock().expect("placed actors")[slot] += 1;
        Ok((cluster.slots[slot].clone(), connection))
    }
}

/// The slot (and its host's connection) for an actor on a device of `device`'s kind, on a live
/// host not `excluded`, chosen by `placement` among those.
fn live_slot(
    cluster: &Cluster,
    excluded: &[String],
    device: DeviceSpec,
    placement: Placement,
) -> Option<(usize, Arc<HostConnection>)> {
    let connection = |slot: &Slot| cluster.connections.get(&slot.addr).filter(|c| c.usable());
    let live: Vec<usize> = (0..cluster.slots.len())
        .filter(|&i| !excluded.contains(&cluster.slots[i].host) && connection(&cluster.slots[i]).is_some())
        .collect();
    let slots: Vec<Slot> = live.iter().map(|&i| cluster.slots[i].clone()).collect();
    let placed = cluster.placed.lock().expect("placed actors");
    let placed: Vec<usize> = live
        .iter()
        .map(|&i| placed.get(i).copied().unwrap_or(0))
        .collect();
    let chosen = live[super::placement::choose_slot(&slots, &placed, device, placement)?];
    Some((chosen, connection(&cluster.slots[chosen])?.clone()))
}

/// Why an actor on a device of `device`'s kind has nowhere to go: every host of that kind lost.
fn no_room(cluster: &Cluster, excluded: &[String], device: DeviceSpec) -> String {
    let mut lost: Vec<&str> = excluded.iter().map(String::as_str).collect();
    lost.extend(
        cluster
            .connections
            .values()
            .filter(|c| !c.usable())
            .map(|c| c.host()),
    );
    lost.sort_unstable();
    lost.dedup();
    let kind = kind(device);
    format!(
        "no live host has a {kind} device for it (slots: {}; lost: {}); start a host with a {kind} device and spawn the actor again",
        slot_list(&cluster.slots),
        lost.join(", ")
    )
}
