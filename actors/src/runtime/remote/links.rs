//! Where references to other processes' tensors go. Each process keeps one ordered link per
//! owner host (by actor-port address): borrows, returns and fetches of every reference to that
//! host's tensors travel on it, in the order this process issued them. A process also knows its
//! own homes (the runtimes of it that serve an actor port), so a reference that comes back to
//! its owner's process is resolved there without the network.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use tokio::runtime::Handle;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use super::connection::{HostConnection, Liveness};
use super::wire::Frame;
use crate::runtime::system::RuntimeInner;
use crate::runtime::tensor_store::{BorrowKey, Meta, StoresInner, TensorError, TensorId};

/// This process, as the owner's balances name it (random per process start).
pub(crate) fn process_id() -> u64 {
    static ID: LazyLock<u64> = LazyLock::new(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        archipelago_dataflow::rng::SplitMix64::keyed(&[nanos, u64::from(std::process::id())]).next_u64()
    });
    *ID
}

/// A new in-flight key for a reference this process is about to send.
pub(crate) fn next_in_flight() -> BorrowKey {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    BorrowKey::InFlight(
        process_id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    )
}
use crate::trust::Credentials;
use crate::typed_tensor::TypedTensor;

#[derive(Default)]
struct Table {
    /// The cluster credentials (token, TLS) to use towards each actor-port address.
    credentials: HashMap<String, Credentials>,
    /// The credentials of this process's cluster, for addresses not seen yet.
    default_credentials: Option<Credentials>,
    /// Where the links' connections run.
    executor: Option<Handle>,
    /// This process's runtimes serving an actor port, by address.
    homes: HashMap<String, Weak<StoresInner>>,
    /// Links to owner hosts, by address.
    owners: HashMap<String, Arc<OwnerLink>>,
    /// This process's runtimes serving an actor port, by address (for actor references).
    runtimes: HashMap<String, Weak<RuntimeInner>>,
    /// Connections to other hosts' actor ports made for actor references that arrived in
    /// messages, by address.
    actor_ports: HashMap<String, Arc<HostConnection>>,
}

impl Table {
    /// The credentials to show the actor port at `addr`.
    fn credentials_for(&self, addr: &str) -> Option<Credentials> {
        self.credentials
            .get(addr)
            .or(self.default_credentials.as_ref())
            .cloned()
    }
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, Table> {
    TABLE.lock().expect("tensor links")
}

/// Records that `stores` (host `host`) serve tensors on the actor port `addr` under `credentials`.
pub(crate) fn serve_home(
    host: &str,
    addr: &str,
    runtime: &Arc<RuntimeInner>,
    credentials: &Credentials,
    executor: Handle,
) {
    let stores = &runtime.tensors.inner;
    let _ = stores.home.set((host.to_string(), addr.to_string()));
    let mut table = table();
    table.homes.insert(addr.to_string(), Arc::downgrade(stores));
    table.runtimes.insert(addr.to_string(), Arc::downgrade(runtime));
    table.credentials.insert(addr.to_string(), credentials.clone());
    table
        .default_credentials
        .get_or_insert_with(|| credentials.clone());
    // The newest driver: an earlier one may have shut down with its runtime (a controller
    // connects a runtime to its hosts for every launch).
    table.executor = Some(executor);
}

/// Records the hosts a driver talks to, and the credentials it shows them.
pub(crate) fn know_hosts<'a>(
    addrs: impl IntoIterator<Item = &'a str>,
    credentials: &Credentials,
    executor: Handle,
) {
    let mut table = table();
    for addr in addrs {
        table.credentials.insert(addr.to_string(), credentials.clone());
    }
    table
        .default_credentials
        .get_or_insert_with(|| credentials.clone());
    table.executor.get_or_insert(executor);
}

/// The stores of this process serving `addr`, if any.
pub(crate) fn home(addr: &str) -> Option<Weak<StoresInner>> {
    table().homes.get(addr).filter(|w| w.strong_count() > 0).cloned()
}

/// The runtime of this process serving `addr`, if any.
pub(crate) fn home_runtime(addr: &str) -> Option<Arc<RuntimeInner>> {
    table().runtimes.get(addr).and_then(Weak::upgrade)
}

/// A connection to the actor port at `addr` of host `host` (made on first use, connecting in
/// the background), with the executor that runs it.
pub(crate) fn actor_port(host: &str, addr: &str) -> Result<(Arc<HostConnection>, Handle), String> {
    actor_port_on(host, addr, None)
}

/// [`actor_port`], a new connection running on `executor` when given (the caller's runtime,
/// where a process holds several).
pub(crate) fn actor_port_on(
    host: &str,
    addr: &str,
    executor: Option<Handle>,
) -> Result<(Arc<HostConnection>, Handle), String> {
    let mut table = table();
    let executor = executor.or_else(|| table.executor.clone());
    if let (Some(connection), Some(executor)) = (table.actor_ports.get(addr), executor.clone())
        && connection.usable()
    {
        return Ok((connection.clone(), executor));
    }
    let credentials = table.credentials_for(addr);
    let (Some(credentials), Some(executor)) = (credentials, executor) else {
        return Err(format!(
            "a reference to an actor of host {host} arrived in a process that is not part of a cluster"
        ));
    };
    let connection = HostConnection::lazy(host, addr, &credentials, Liveness::default(), &executor);
    table.actor_ports.insert(addr.to_string(), connection.clone());
    Ok((connection, executor))
}

/// A connection of its own to the actor port at `addr` of host `host` (connecting in the
/// background, remembered nowhere), run on `executor` and watched with `liveness`: for a sender
/// that writes on its own thread, such as a compiled program's actor sending to another host.
pub(crate) fn own_actor_port(
    host: &str,
    addr: &str,
    executor: &Handle,
    liveness: Liveness,
) -> Result<Arc<HostConnection>, String> {
    let credentials = table().credentials_for(addr).ok_or_else(|| {
        format!("a connection to host {host} was asked for in a process that is not part of a cluster")
    })?;
    Ok(HostConnection::lazy(host, addr, &credentials, liveness, executor))
}

/// The link to the owner host at `addr` (made on first use).
pub(crate) fn owner_link(host: &str, addr: &str) -> Result<Arc<OwnerLink>, String> {
    let mut table = table();
    if let Some(link) = table.owners.get(addr) {
        return Ok(link.clone());
    }
    let credentials = table.credentials_for(addr);
    let (Some(credentials), Some(executor)) = (credentials, table.executor.clone()) else {
        return Err(format!(
            "a reference to a tensor of host {host} arrived in a process that is not part of a cluster"
        ));
    };
    let link = Arc::new(OwnerLink::start(host, addr, credentials, &executor));
    table.owners.insert(addr.to_string(), link.clone());
    Ok(link)
}

enum LinkOp {
    Send(Frame),
    Fetch(Meta, oneshot::Sender<Result<TypedTensor, TensorError>>),
}

/// This process's ordered link to one owner host.
pub(crate) struct OwnerLink {
    host: String,
    addr: String,
    ops: UnboundedSender<LinkOp>,
}

impl OwnerLink {
    fn start(host: &str, addr: &str, credentials: Credentials, executor: &Handle) -> OwnerLink {
        let (ops, mut queue) = unbounded_channel::<LinkOp>();
        let (host_name, address) = (host.to_string(), addr.to_string());
        executor.spawn(async move {
            let connection =
                HostConnection::connect(&host_name, &address, &credentials, Liveness::default()).await;
            while let Some(op) = queue.recv().await {
                match (&connection, op) {
                    (Ok(c), LinkOp::Send(frame)) => c.send(frame),
                    (Ok(c), LinkOp::Fetch(meta, reply)) => c.fetch(meta, reply),
                    (Err(reason), LinkOp::Fetch(meta, reply)) => {
                        let _ = reply.send(Err(unreachable(&meta, &host_name, reason)));
                    }
                    (Err(_), LinkOp::Send(_)) => {}
                }
            }
        });
        OwnerLink {
            host: host.to_string(),
            addr: addr.to_string(),
            ops,
        }
    }

    /// The owner host's name.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// Its actor port.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// Changes the owner's balances for `tensor`, in this process's order.
    pub(crate) fn change(&self, tensor: TensorId, changes: Vec<(BorrowKey, i64)>) {
        let _ = self.ops.send(LinkOp::Send(Frame::Borrows { tensor, changes }));
    }

    /// Fetches the tensor `meta` describes from its owner.
    pub(crate) async fn fetch(&self, meta: &Meta) -> Result<TypedTensor, TensorError> {
        let (tx, rx) = oneshot::channel();
        let _ = self.ops.send(LinkOp::Fetch(meta.clone(), tx));
        rx.await
            .unwrap_or_else(|_| Err(unreachable(meta, &self.host, "the link to it closed")))
    }
}

/// The error of a fetch whose owner host cannot be reached.
pub(crate) fn unreachable(meta: &Meta, host: &str, reason: &str) -> TensorError {
    TensorError::OwnerGone {
        tensor: meta.id,
        owner: format!("actor {} of host {host}", meta.id.owner),
        reason: format!("its host cannot be reached: {reason}"),
    }
}
