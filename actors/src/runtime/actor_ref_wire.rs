//! Actor references that travel: an [`ActorRef<A>`] in a message (or a reply) is sent as its
//! actor's identity and the actor port of its host, and rebuilt on arrival — as a reference to
//! this process's actor when it comes home, else as a reference over a connection to that host
//! (made on first use). So actors on different hosts can call each other directly, as Monarch's
//! and Ray's actor handles can be passed around. Only actors of a runtime that serves an actor
//! port (a host) can be referred to from another process.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::actor::Actor;
use super::actor_ref::ActorRef;
use super::remote::links;
use super::supervision::{ActorInfo, ActorShared};
use super::system::NEXT_KEY;

/// An actor reference on the wire.
#[derive(Serialize, Deserialize)]
struct WireActor {
    info: ActorInfo,
    job: String,
    /// The actor's full Rust type name (checked on arrival).
    type_key: String,
    /// Its host's actor port.
    addr: String,
}

impl<A: Actor> Serialize for ActorRef<A> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let shared = self.shared();
        let addr = match self.remote_addr() {
            Some(addr) => addr.to_string(),
            None if super::dry_run::is_dry_run() => String::new(),
            None => shared
                .home
                .get()
                .and_then(std::sync::Weak::upgrade)
                .and_then(|runtime| runtime.tensors.inner.home.get().map(|(_, addr)| addr.clone()))
                .ok_or_else(|| {
                    serde::ser::Error::custom(format!(
                        "a reference to {} cannot leave its process: its runtime serves no actor port (only actors of hosts can be referred to from elsewhere)",
                        shared.info
                    ))
                })?,
        };
        WireActor {
            info: shared.info.clone(),
            job: shared.job.clone(),
            type_key: std::any::type_name::<A>().to_string(),
            addr,
        }
        .serialize(serializer)
    }
}

impl<'de, A: Actor> Deserialize<'de> for ActorRef<A> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ActorRef<A>, D::Error> {
        let wire = WireActor::deserialize(deserializer)?;
        let expected = std::any::type_name::<A>();
        if wire.type_key != expected {
            return Err(serde::de::Error::custom(format!(
                "a reference to {} (`{}`) arrived where an `ActorRef<{expected}>` was expected",
                wire.info, wire.type_key
            )));
        }
        if let Some(runtime) = links::home_runtime(&wire.addr) {
            // Home: the actor of this process (if it still runs).
            let live = runtime.live.lock().expect("live actors");
            return match live.get(&wire.info.id).filter(|l| l.type_key == expected) {
                Some(actor) => Ok(ActorRef::new(
                    ractor::ActorRef::from(actor.cell.clone()),
                    actor.shared.clone(),
                    actor.key,
                    runtime.driver.clone(),
                )),
                None => Err(serde::de::Error::custom(format!("{} has ended", wire.info))),
            };
        }
        let (connection, executor) =
            links::actor_port(&wire.info.host, &wire.addr).map_err(serde::de::Error::custom)?;
        let shared = Arc::new(ActorShared::new(wire.info, wire.job));
        let key = NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(ActorRef::remote(connection, shared, key, executor))
    }
}
