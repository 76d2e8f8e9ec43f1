//! The links from a host's compiled-program actors to other hosts: one connection per (device
//! thread, peer host), run on that device thread. A value an actor sends to another host is
//! then written to the socket by the actor's own thread right after its handler, instead of
//! being handed to the process's driver thread to write (one thread wake-up less per hop
//! between hosts). The link only carries values; the hosts' loss is watched by the program's
//! own connections, so a long computation blocking the thread never reads as a lost host.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use crate::runtime::RuntimeHandle;
use crate::runtime::remote::{HostConnection, Liveness, links};

/// Rare probes and no patience limit: silence on a link that only sends is no loss (a closed
/// socket still is).
const SEND_ONLY: Liveness = Liveness {
    ping_every: Duration::from_secs(60),
    patience: Duration::from_secs(365 * 24 * 3600),
};

/// A device thread of a runtime of this process, and a peer host's actor port.
type Key = (usize, Option<usize>, String, String);

static LINKS: LazyLock<Mutex<HashMap<Key, Arc<HostConnection>>>> = LazyLock::new(Mutex::default);

/// The link from `runtime`'s device thread `thread` (of `device`, running on `executor`) to
/// host `host`'s actor port at `addr`, made on first use and made again once unusable (the
/// peer lost, or the runtime it ran on ended).
pub(crate) fn from_device_thread(
    runtime: &RuntimeHandle,
    (thread, device): (Option<usize>, archipelago_dataflow::DeviceSpec),
    executor: &tokio::runtime::Handle,
    (host, addr): (&str, &str),
) -> Result<Arc<HostConnection>, String> {
    let key = (
        std::ptr::from_ref(runtime.inner()) as usize,
        thread,
        device.to_string(),
        addr.to_string(),
    );
    let mut known = LINKS.lock().expect("compiled programs' links");
    if let Some(link) = known.get(&key).filter(|link| link.usable()) {
        return Ok(link.clone());
    }
    known.retain(|_, link| link.usable());
    let link = links::own_actor_port(host, addr, executor, SEND_ONLY)?;
    known.insert(key, link.clone());
    Ok(link)
}
