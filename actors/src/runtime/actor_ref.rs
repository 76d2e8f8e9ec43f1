//! Typed references to actors: [`ActorRef<A>`] accepts exactly the messages `A` has handlers
//! for. Messages from one caller to one actor are handled in the order they were sent (one
//! mailbox per actor, first in, first out); messages from different callers interleave.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::actor::{Actor, Handler, Message};
use super::call::{Call, Pending};
use super::envelope::{Letter, Mail};
use super::supervision::{ActorEnd, ActorInfo, ActorShared, CallError};

tokio::task_local! {
    /// The actor whose handler runs on this task (its process-unique key).
    pub(crate) static CURRENT_ACTOR: u64;
}

/// A typed reference to an actor of type `A`; cheap to clone.
pub struct ActorRef<A: Actor> {
    port: ractor::ActorRef<Mail<A>>,
    shared: Arc<ActorShared>,
    key: u64,
    driver: Handle,
}

impl<A: Actor> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        ActorRef {
            port: self.port.clone(),
            shared: self.shared.clone(),
            key: self.key,
            driver: self.driver.clone(),
        }
    }
}

impl<A: Actor> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorRef({})", self.shared.info)
    }
}

impl<A: Actor> ActorRef<A> {
    pub(crate) fn new(
        port: ractor::ActorRef<Mail<A>>,
        shared: Arc<ActorShared>,
        key: u64,
        driver: Handle,
    ) -> Self {
        ActorRef {
            port,
            shared,
            key,
            driver,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<ActorShared> {
        &self.shared
    }

    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// Who the actor is (id, type, name, device, host).
    pub fn info(&self) -> &ActorInfo {
        &self.shared.info
    }

    /// Sends `message` and returns the future of its reply.
    pub fn call<M: Message>(&self, message: M) -> Call<M::Reply>
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        if CURRENT_ACTOR.try_with(|k| *k == self.key).unwrap_or(false) {
            let error = CallError::SelfCall {
                actor: self.shared.label(),
                message: message_type.to_string(),
            };
            return Call::failed(error, self.driver.clone());
        }
        let (tx, rx) = oneshot::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let letter = Letter {
            message: Some(message),
            reply: Some(tx),
            cancel: Some(cancel.clone()),
            seq: self.shared.sequence(),
        };
        if self.port.send_message(Box::new(letter)).is_err() {
            return Call::failed(self.shared.ended_error(message_type), self.driver.clone());
        }
        Call::waiting(rx, cancel, self.shared.clone(), message_type, self.driver.clone())
    }

    /// Sends `message` without waiting for (or getting) its reply. Fails only when the actor
    /// has already ended.
    pub fn cast<M: Message>(&self, message: M) -> Result<(), CallError>
    where
        A: Handler<M>,
    {
        let letter = Letter {
            message: Some(message),
            reply: None,
            cancel: None,
            seq: self.shared.sequence(),
        };
        self.port.send_message(Box::new(letter)).map_err(|_| {
            self.shared
                .ended_error(super::system::short_name(std::any::type_name::<M>()))
        })
    }

    /// Stops the actor after the message it is handling; messages still queued fail with
    /// [`CallError::Stopped`].
    pub fn stop(&self, reason: &str) {
        self.shared.set_end(ActorEnd::Stopped {
            reason: reason.to_string(),
        });
        self.port.stop(Some(reason.to_string()));
    }

    /// How the actor ended, once it has ended.
    pub fn end(&self) -> Option<ActorEnd> {
        self.shared.ended()
    }

    /// Resolves when the actor ends (stopped, or failed without a restart left).
    pub fn ended(&self) -> Pending<ActorEnd> {
        let mut watch = self.shared.subscribe_end();
        let future = async move {
            loop {
                if let Some(end) = watch.borrow_and_update().clone() {
                    return end;
                }
                if watch.changed().await.is_err() {
                    return ActorEnd::Stopped {
                        reason: "its runtime shut down".into(),
                    };
                }
            }
        };
        Pending::new(future, self.driver.clone())
    }

    /// How many times the actor was restarted after a panic.
    pub fn restarts(&self) -> u32 {
        self.shared.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Messages sent to it and not yet taken off its queue.
    pub fn queue_depth(&self) -> u64 {
        self.shared.queue_depth()
    }
}
