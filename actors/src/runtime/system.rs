//! The runtime: the devices of this process, each run by one OS thread with its own
//! single-threaded async executor (actors of a device share its thread, so compute never
//! blocks other devices and kernels stay single-threaded), a small driver executor for timers
//! and for blocking waits from plain threads, and the registry of live actors.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry, Runtime};
//! use archipelago_dataflow::DeviceSpec;
//!
//! struct Echo;
//! impl Actor for Echo {
//!     type Params = ();
//!     async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> { Ok(Echo) }
//! }
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Ping(u32);
//! impl Message for Ping { type Reply = u32; }
//! impl Handler<Ping> for Echo {
//!     async fn handle(&mut self, Ping(n): Ping, _ctx: &Context<Self>) -> u32 { n + 1 }
//! }
//!
//! // What may cross processes (strict mode checks it here too, as a cluster would).
//! Registry::new().actor::<Echo>().handles::<Echo, Ping>().install();
//! let runtime = Runtime::local(DeviceSpec::cpus(1));
//! let echo = runtime.spawn::<Echo>(DeviceSpec::Cpu(0), ()).get().unwrap();
//! assert_eq!(echo.call(Ping(41)).get().unwrap(), 42);
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use archipelago_dataflow::{ActorId, DeviceSpec};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::actor::Actor;
use super::actor_ref::ActorRef;
use super::call::{Call, Pending, Waited, wait};
use super::cell::{Cell, CellArgs};
use super::cluster::Cluster;
use super::supervision::{ActorInfo, ActorShared, ActorStats, SpawnOptions};
use super::tensor_store::TensorStores;

/// How many ended actors a runtime remembers (for the dashboard).
const ENDED_KEPT: usize = 256;

/// How long a runtime's shutdown lets busy actors finish their message before killing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Process-unique keys of actors (ids are unique per runtime only).
pub(crate) static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// Why an actor or a mesh could not be spawned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpawnError {
    /// The device is not one of the runtime's.
    #[error(
        "device {device} is not in this runtime (it has {devices}); spawn on one of those, or start the runtime with that device"
    )]
    NoSuchDevice {
        /// The device asked for.
        device: DeviceSpec,
        /// The runtime's devices.
        devices: String,
    },
    /// The mesh needs more devices than the runtime has.
    #[error(
        "a mesh {mesh} needs {needed} devices but this runtime has {available}; make the mesh smaller or add devices (hosts) to the cluster"
    )]
    MeshTooLarge {
        /// The mesh.
        mesh: String,
        /// Its size.
        needed: usize,
        /// The devices there are.
        available: usize,
    },
    /// The placement asked for cannot be met by the runtime's slots.
    #[error("{what} cannot be placed: {reason}")]
    Placement {
        /// What was to be spawned.
        what: String,
        /// Why, with the fix.
        reason: String,
    },
    /// The constructor returned an error or panicked.
    #[error("{actor} could not start: {reason}")]
    Constructor {
        /// The actor.
        actor: String,
        /// Its constructor's error.
        reason: String,
    },
}

/// One device's thread and its executor.
struct DeviceThread {
    device: DeviceSpec,
    executor: Handle,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DeviceThread {
    fn start(device: DeviceSpec) -> DeviceThread {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("runtime-{device}"))
            .spawn(move || {
                let executor = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a device's executor");
                let _ = handle_tx.send(executor.handle().clone());
                executor.block_on(async {
                    let _ = stop_rx.await;
                });
            })
            .expect("a device thread");
        let executor = handle_rx.recv().expect("the device thread's executor");
        DeviceThread {
            device,
            executor,
            stop: Mutex::new(Some(stop_tx)),
            thread: Mutex::new(Some(thread)),
        }
    }
}

impl RuntimeInner {
    /// This process's devices.
    pub(crate) fn local_devices(&self) -> Vec<DeviceSpec> {
        self.devices.iter().map(|d| d.device).collect()
    }

    /// The executor of this process's device thread `thread` when known, else of the first
    /// thread of `device`.
    pub(crate) fn executor_of(&self, thread: Option<usize>, device: DeviceSpec) -> Option<Handle> {
        match thread.and_then(|t| self.devices.get(t)) {
            Some(d) if d.device == device => Some(d.executor.clone()),
            _ => self.executor(device),
        }
    }

    /// The executor of this process's device `device` (its first thread).
    pub(crate) fn executor(&self, device: DeviceSpec) -> Option<Handle> {
        self.devices
            .iter()
            .find(|d| d.device == device)
            .map(|d| d.executor.clone())
    }
}

pub(crate) struct LiveActor {
    pub(crate) shared: Arc<ActorShared>,
    pub(crate) cell: ractor::ActorCell,
    /// Its process-unique key.
    pub(crate) key: u64,
    /// Its Rust type's full name (checked before a reference is rebuilt from the wire).
    pub(crate) type_key: &'static str,
}

pub(crate) struct RuntimeInner {
    pub(crate) job: String,
    pub(crate) host: String,
    devices: Vec<DeviceThread>,
    pub(crate) driver: Handle,
    pub(crate) next_id: AtomicUsize,
    pub(crate) live: Mutex<HashMap<ActorId, LiveActor>>,
    /// The last actors that ended, as they ended (for the dashboard).
    pub(crate) ended: Mutex<std::collections::VecDeque<ActorStats>>,
    pub(crate) tensors: TensorStores,
    /// The cluster's hosts, when the program drives actors on other hosts.
    pub(crate) cluster: Option<Cluster>,
    /// What runs when the runtime shuts down (`None` once it has begun).
    shutdown_hooks: Mutex<Option<Vec<ShutdownHook>>>,
    /// Strict registration mode: see [`RuntimeHandle::set_strict_registry`].
    pub(crate) strict: std::sync::atomic::AtomicBool,
    /// The other hosts a host asks when an actor is looked up by name (see `find`).
    pub(crate) peer_hosts: std::sync::OnceLock<super::find::PeerHosts>,
}

/// The environment variable that turns strict registration mode on (`1`) or off (`0`) for every
/// runtime of the process (see [`RuntimeHandle::set_strict_registry`]).
pub const STRICT_REGISTRY_VAR: &str = "ARCHIPELAGO_STRICT_REGISTRY";

/// Strict mode as [`STRICT_REGISTRY_VAR`] sets it, if it does.
pub fn strict_registry_from_env() -> Option<bool> {
    match std::env::var(STRICT_REGISTRY_VAR).ok()?.trim() {
        "1" | "true" | "on" => Some(true),
        "0" | "false" | "off" => Some(false),
        _ => None,
    }
}

/// Work to do when a runtime shuts down (see [`RuntimeHandle::on_shutdown`]).
type ShutdownHook = Box<dyn FnOnce() + Send>;

/// A handle to a runtime, as actors hold it (cheap to clone; does not keep the runtime up).
#[derive(Clone)]
pub struct RuntimeHandle {
    pub(crate) inner: Arc<RuntimeInner>,
}

/// The runtime of this process. Dropping it stops every actor (each finishes the message it
/// is handling) and the device threads.
pub struct Runtime {
    handle: RuntimeHandle,
    driver: Option<tokio::runtime::Runtime>,
}

impl Runtime {
    /// The embedded runtime: `devices` of this process, host name `local`.
    pub fn local(devices: Vec<DeviceSpec>) -> Runtime {
        Runtime::new("local", "local", devices)
    }

    /// A runtime for job `job` on host `host` with `devices`.
    pub fn new(job: &str, host: &str, devices: Vec<DeviceSpec>) -> Runtime {
        let driver = Runtime::driver_executor().expect("the runtime's driver executor");
        Runtime::assemble(job, host, devices, driver, None)
    }

    /// The small executor for timers and for blocking waits from plain threads.
    pub(crate) fn driver_executor() -> std::io::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("runtime-driver")
            .enable_all()
            .build()
    }

    /// A runtime from its parts: this process's `devices` (a thread each), its driver executor
    /// and, for a program driving a cluster, the cluster.
    pub(crate) fn assemble(
        job: &str,
        host: &str,
        devices: Vec<DeviceSpec>,
        driver: tokio::runtime::Runtime,
        cluster: Option<Cluster>,
    ) -> Runtime {
        crate::allocator::keep_tensor_buffers();
        let inner = RuntimeInner {
            job: job.to_string(),
            host: host.to_string(),
            devices: devices.into_iter().map(DeviceThread::start).collect(),
            driver: driver.handle().clone(),
            next_id: AtomicUsize::new(0),
            live: Mutex::new(HashMap::new()),
            ended: Mutex::default(),
            tensors: TensorStores::default(),
            cluster,
            shutdown_hooks: Mutex::new(Some(Vec::new())),
            strict: std::sync::atomic::AtomicBool::new(strict_registry_from_env().unwrap_or(false)),
            peer_hosts: std::sync::OnceLock::new(),
        };
        Runtime {
            handle: RuntimeHandle {
                inner: Arc::new(inner),
            },
            driver: Some(driver),
        }
    }

    /// A handle to hand to other threads (it does not keep the runtime up).
    pub fn handle(&self) -> &RuntimeHandle {
        &self.handle
    }

    /// Runs `future` to completion on this thread (not from inside an async runtime).
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.handle.inner.driver.block_on(future)
    }

    /// Ray's `wait`, blocking: the first `k` of `calls` to complete (or those done when
    /// `timeout` passes), and the rest still pending.
    pub fn wait<R>(&self, calls: Vec<Call<R>>, k: usize, timeout: Option<Duration>) -> Waited<R> {
        self.block_on(wait(calls, k, timeout))
    }
}

impl std::ops::Deref for Runtime {
    type Target = RuntimeHandle;
    fn deref(&self) -> &RuntimeHandle {
        &self.handle
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let inner = &self.handle.inner;
        let hooks = inner.shutdown_hooks.lock().expect("shutdown hooks").take();
        hooks.into_iter().flatten().for_each(|hook| hook());
        let cells: Vec<ractor::ActorCell> = inner
            .live
            .lock()
            .expect("live actors")
            .values()
            .map(|a| a.cell.clone())
            .collect();
        let in_async = Handle::try_current().is_ok();
        if !in_async {
            // Each actor finishes the message it is handling; one still busy after the grace
            // period is killed.
            inner.driver.block_on(async {
                let reason = "its runtime shut down".to_string();
                let stops = cells.iter().map(|c| c.stop_and_wait(Some(reason.clone()), None));
                let grace = tokio::time::timeout(SHUTDOWN_GRACE, futures::future::join_all(stops));
                if grace.await.is_err() {
                    cells.iter().for_each(|c| c.kill());
                }
            });
        }
        // Actors killed (or never stopped, when dropped inside an async runtime) ran no
        // `post_stop`: their ends are published here, so nobody waits on `ended()` forever.
        let left: Vec<Arc<ActorShared>> = inner
            .live
            .lock()
            .expect("live actors")
            .drain()
            .map(|(_, a)| a.shared)
            .collect();
        for shared in left {
            shared.set_end(super::ActorEnd::Stopped {
                reason: "its runtime shut down".into(),
            });
            shared.publish_end();
        }
        let here = std::thread::current().id();
        for device in &inner.devices {
            if let Some(stop) = device.stop.lock().expect("device stop").take() {
                let _ = stop.send(());
            }
            let thread = device.thread.lock().expect("device thread").take();
            if let Some(thread) = thread
                && thread.thread().id() != here
                && !in_async
            {
                let _ = thread.join();
            }
        }
        if let Some(driver) = self.driver.take() {
            driver.shutdown_background();
        }
    }
}

impl RuntimeHandle {
    pub(crate) fn driver(&self) -> &Handle {
        &self.inner.driver
    }

    pub(crate) fn inner(&self) -> &RuntimeInner {
        &self.inner
    }

    /// The runtime's devices (on a cluster: every slot's, in placement order).
    pub fn devices(&self) -> Vec<DeviceSpec> {
        self.slots().iter().map(|s| s.device).collect()
    }

    /// The host this runtime runs on.
    pub fn host(&self) -> &str {
        &self.inner.host
    }

    /// The job this runtime runs actors for.
    pub fn job(&self) -> &str {
        &self.inner.job
    }

    /// Strict registration mode, for actors spawned from now on in this process: every spawn
    /// and every message that would cross a process on a cluster is checked against the
    /// installed [`Registry`](super::Registry) (and encoded) here too, so a missing `.actor`,
    /// `.handles` or `.compiled` line fails on the first local run with the cluster's error,
    /// not on the first cluster run. Off unless the environment sets [`STRICT_REGISTRY_VAR`] to
    /// `1` (or this is called).
    pub fn set_strict_registry(&self, on: bool) {
        self.inner.strict.store(on, Ordering::Relaxed);
    }

    /// Whether strict registration mode is on.
    pub fn strict_registry(&self) -> bool {
        self.inner.strict.load(Ordering::Relaxed)
    }

    /// Whether `self` and `other` are handles to the same runtime.
    pub fn same_runtime(&self, other: &RuntimeHandle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Runs `hook` when the runtime shuts down (its [`Runtime`] is dropped), before its actors
    /// stop — e.g. a last export of their figures. Added after the shutdown began, it runs at
    /// once.
    pub fn on_shutdown(&self, hook: impl FnOnce() + Send + 'static) {
        let mut hooks = self.inner.shutdown_hooks.lock().expect("shutdown hooks");
        match hooks.as_mut() {
            Some(hooks) => hooks.push(Box::new(hook)),
            None => {
                drop(hooks);
                hook();
            }
        }
    }

    /// The live actors (spawned, not yet ended).
    pub fn actors(&self) -> Vec<ActorInfo> {
        let live = self.inner.live.lock().expect("live actors");
        let mut infos: Vec<ActorInfo> = live.values().map(|a| a.shared.info.clone()).collect();
        infos.sort_by_key(|i| i.id);
        infos
    }

    /// The figures of this process's actors: the live ones, then the last that ended.
    pub fn local_actor_stats(&self) -> Vec<ActorStats> {
        let live = self.inner.live.lock().expect("live actors");
        let mut stats: Vec<ActorStats> = live.values().map(|a| a.shared.stats()).collect();
        drop(live);
        stats.sort_by_key(|s| s.info.id);
        stats.extend(self.inner.ended.lock().expect("ended actors").iter().cloned());
        stats
    }

    pub(crate) fn actor_ended(&self, shared: &ActorShared) {
        let id = shared.info.id;
        self.inner.live.lock().expect("live actors").remove(&id);
        let mut ended = self.inner.ended.lock().expect("ended actors");
        if ended.len() == ENDED_KEPT {
            ended.pop_front();
        }
        ended.push_back(shared.stats());
        drop(ended);
        let reason = match shared.end() {
            Some(super::ActorEnd::Failed(failure)) => failure.message.clone(),
            Some(super::ActorEnd::Stopped { reason }) => format!("stopped: {reason}"),
            None => "stopped".into(),
        };
        self.inner.tensors.owner_ended_with(id, shared.label(), reason);
    }

    /// Spawns an actor of type `A` on `device`, built from `params`.
    pub fn spawn<A: Actor>(
        &self,
        device: DeviceSpec,
        params: A::Params,
    ) -> Pending<Result<ActorRef<A>, SpawnError>> {
        self.spawn_with(device, params, SpawnOptions::default())
    }

    /// Spawns an actor with a name, a restart policy and a placement: locally on `device`
    /// itself; on a cluster on a device of its kind (CPU or GPU) that the options'
    /// [`Placement`](super::Placement) picks (spread across hosts by default). To place on one
    /// slot exactly, use [`spawn_at`](Self::spawn_at) with an index into
    /// [`slots`](Self::slots).
    pub fn spawn_with<A: Actor>(
        &self,
        device: DeviceSpec,
        params: A::Params,
        options: SpawnOptions,
    ) -> Pending<Result<ActorRef<A>, SpawnError>> {
        let driver = self.inner.driver.clone();
        if let Some(cluster) = &self.inner.cluster {
            return self.spawn_placed(cluster, device, params, options);
        }
        match self.inner.devices.iter().position(|d| d.device == device) {
            Some(thread) => self.spawn_on_thread(thread, params, options),
            None => {
                let error = SpawnError::NoSuchDevice {
                    device,
                    devices: self
                        .devices()
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                Pending::new(std::future::ready(Err(error)), driver)
            }
        }
    }

    /// Spawns an actor on this process's `index`-th device thread (a runtime started with one
    /// device twice has a thread for each: placing by slot keeps their actors apart).
    pub(crate) fn spawn_on_thread<A: Actor>(
        &self,
        index: usize,
        params: A::Params,
        options: SpawnOptions,
    ) -> Pending<Result<ActorRef<A>, SpawnError>> {
        let driver = self.inner.driver.clone();
        let Some(thread) = self.inner.devices.get(index) else {
            let error = SpawnError::MeshTooLarge {
                mesh: format!("slot {index}"),
                needed: index + 1,
                available: self.inner.devices.len(),
            };
            return Pending::new(std::future::ready(Err(error)), driver);
        };
        let device = thread.device;
        let detached = options.detached;
        let strict = self.strict_registry();
        let encodes = || super::dry_run::dry_run(|| super::Registry::encode_params::<A>(&params));
        if strict && let Err(reason) = encodes() {
            let error = SpawnError::Constructor {
                actor: format!(
                    "an actor of type `{}` (strict registration mode)",
                    short_type_name::<A>()
                ),
                reason,
            };
            return Pending::new(std::future::ready(Err(error)), driver);
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let type_name = short_type_name::<A>();
        let info = ActorInfo {
            id,
            name: options.name.unwrap_or_else(|| format!("{type_name}-{id}")),
            type_name,
            device,
            host: self.inner.host.clone(),
        };
        let shared = Arc::new(ActorShared::new(info, self.inner.job.clone()));
        let _ = shared.home.set(Arc::downgrade(&self.inner));
        let _ = shared.thread.set(index);
        shared.strict.store(strict, Ordering::Relaxed);
        let args = CellArgs::<A> {
            params,
            shared: shared.clone(),
            key,
            runtime: self.clone(),
            max_restarts: options.max_restarts,
        };
        let runtime = self.clone();
        let spawned_driver = driver.clone();
        // The reference is made (with its keeper) in the task: a spawn whose `Pending` is dropped
        // before it resolves drops it there, and the actor ends instead of living unheld.
        let task = thread.executor.spawn(async move {
            let (port, _) = <Cell<A> as ractor::Actor>::spawn(None, Cell::new(), args).await?;
            let live = LiveActor {
                shared: shared.clone(),
                cell: port.get_cell(),
                key,
                type_key: std::any::type_name::<A>(),
            };
            runtime.inner.live.lock().expect("live actors").insert(id, live);
            let actor = ActorRef::new(port, shared, key, spawned_driver);
            Ok::<_, ractor::SpawnErr>(if detached { actor } else { actor.keeping() })
        });
        Pending::new(
            async move {
                match task.await {
                    Ok(Ok(actor)) => Ok(actor),
                    Ok(Err(e)) => Err(SpawnError::Constructor {
                        actor: format!("actor {id} (`{}`) on {device}", short_type_name::<A>()),
                        reason: match e {
                            ractor::SpawnErr::StartupFailed(reason) => reason.to_string(),
                            other => other.to_string(),
                        },
                    }),
                    Err(join) => Err(SpawnError::Constructor {
                        actor: format!("actor {id} (`{}`) on {device}", short_type_name::<A>()),
                        reason: join.to_string(),
                    }),
                }
            },
            driver,
        )
    }
}

/// `Counter` for `my_crate::actors::Counter` (generic arguments kept whole).
pub(crate) fn short_type_name<A>() -> String {
    short_name(std::any::type_name::<A>()).to_string()
}

/// A Rust type's name without its module path (generic arguments kept whole).
pub(crate) fn short_name(full: &str) -> &str {
    let base = &full[..full.find('<').unwrap_or(full.len())];
    base.rfind("::").map_or(full, |at| &full[at + 2..])
}
