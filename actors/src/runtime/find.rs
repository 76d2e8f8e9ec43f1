//! Named actors found from anywhere in the cluster (Ray's `ray.get_actor(name)`):
//! [`RuntimeHandle::find`] looks among this process's live actors, then asks every other host
//! (a driver its cluster's hosts; a host the hosts its [`PeerHosts`] lists — the controller's
//! current hosts) for a live actor of that type and name that other processes can reach (one a
//! caller spawned over its actor port). A found reference does not keep the actor alive: spawn
//! the actor [`detached`](super::SpawnOptions::detached) to keep it past its creator's handles.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::future::BoxFuture;

use super::remote::links;
use super::remote::wire::Frame;
use super::supervision::ActorShared;
use super::system::{NEXT_KEY, short_name};
use super::{Actor, ActorRef, Pending, RuntimeHandle};

/// Lists the other hosts of the cluster as `(host name, actor port)`, for a host's lookups.
pub type PeerHosts = Arc<dyn Fn() -> BoxFuture<'static, Result<Vec<(String, String)>, String>> + Send + Sync>;

/// Why no actor was found by a name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FindError {
    /// No live actor of that type has that name where the lookup searched.
    #[error(
        "no live actor `{actor_type}` is named `{name}` (searched: {searched}); spawn it with SpawnOptions::named(\"{name}\") — and .detached() to keep it after its creator's handles are dropped"
    )]
    NotFound {
        /// The name.
        name: String,
        /// The actor type.
        actor_type: String,
        /// Where the lookup searched.
        searched: String,
    },
    /// Several actors have that name.
    #[error("{count} live actors `{actor_type}` are named `{name}` ({found}); give each a name of its own")]
    Ambiguous {
        /// The name.
        name: String,
        /// The actor type.
        actor_type: String,
        /// How many.
        count: usize,
        /// Who they are.
        found: String,
    },
}

impl RuntimeHandle {
    /// Sets how this host lists the cluster's other hosts for [`find`](Self::find) (a host
    /// process's role sets it to ask the controller); the first setting stays.
    pub fn set_peer_hosts(&self, peers: PeerHosts) {
        let _ = self.inner.peer_hosts.set(peers);
    }

    /// The live actor of type `A` named `name`: this process's own, else one on another host
    /// of the cluster (see the module's words for which are found).
    pub fn find<A: Actor>(&self, name: &str) -> Pending<Result<ActorRef<A>, FindError>> {
        let runtime = self.clone();
        let name = name.to_string();
        Pending::new(
            async move { runtime.find_now::<A>(name).await },
            self.driver().clone(),
        )
    }

    async fn find_now<A: Actor>(self, name: String) -> Result<ActorRef<A>, FindError> {
        let actor_type = std::any::type_name::<A>();
        let mut found: Vec<ActorRef<A>> = self.find_local::<A>(&name);
        let peers = self.peers().await;
        let mut searched = vec![format!("this process ({})", self.host())];
        let (job, cluster, driver) = (&self.inner.job, self.inner.cluster.as_ref(), self.driver());
        let asks = (peers.iter()).map(|(host, addr)| {
            let name = name.clone();
            async move {
                // A driver asks over its own connections, so that what it sends a found actor
                // keeps its order with what it sends through the references its spawns gave.
                let own = cluster.and_then(|c| c.connections.get(addr).cloned());
                let (connection, executor) = match own {
                    Some(connection) => (connection, driver.clone()),
                    None => links::actor_port(host, addr).ok()?,
                };
                let answer = connection.spawn(|request| Frame::Find {
                    request,
                    actor_type: actor_type.to_string(),
                    name,
                });
                let info = answer.await.ok()?.ok()?;
                let shared = Arc::new(ActorShared::new(info, job.clone()));
                let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
                Some(ActorRef::<A>::remote(connection, shared, key, executor))
            }
        });
        found.extend(futures::future::join_all(asks).await.into_iter().flatten());
        searched.extend(peers.iter().map(|(host, _)| format!("host {host}")));
        let actor_type = short_name(actor_type).to_string();
        match found.len() {
            0 => Err(FindError::NotFound {
                name,
                actor_type,
                searched: searched.join(", "),
            }),
            1 => Ok(found.remove(0)),
            count => Err(FindError::Ambiguous {
                name,
                actor_type,
                count,
                found: (found.iter().map(|a| a.info().to_string()))
                    .collect::<Vec<_>>()
                    .join("; "),
            }),
        }
    }

    /// This process's live actors of type `A` named `name`.
    fn find_local<A: Actor>(&self, name: &str) -> Vec<ActorRef<A>> {
        let live = self.inner.live.lock().expect("live actors");
        (live.values())
            .filter(|a| a.shared.info.name == name && a.type_key == std::any::type_name::<A>())
            .map(|a| {
                let port = ractor::ActorRef::from(a.cell.clone());
                ActorRef::new(port, a.shared.clone(), a.key, self.driver().clone())
            })
            .collect()
    }

    /// The other hosts to ask: the driver's cluster, or what a host's [`PeerHosts`] lists
    /// (without this host itself).
    async fn peers(&self) -> Vec<(String, String)> {
        if let Some(cluster) = &self.inner.cluster {
            let mut hosts: Vec<(String, String)> = (cluster.slots.iter())
                .map(|s| (s.host.clone(), s.addr.clone()))
                .collect();
            hosts.sort();
            hosts.dedup();
            return hosts;
        }
        let Some(list) = self.inner.peer_hosts.get() else {
            return Vec::new();
        };
        let own = self.inner.tensors.inner.home.get().map(|(_, addr)| addr.clone());
        match list().await {
            Ok(mut hosts) => {
                hosts.sort();
                hosts.dedup();
                hosts.retain(|(_, addr)| Some(addr) != own.as_ref());
                hosts
            }
            Err(e) => {
                tracing::warn!("a lookup by name could not list the cluster's hosts: {e}");
                Vec::new()
            }
        }
    }
}
