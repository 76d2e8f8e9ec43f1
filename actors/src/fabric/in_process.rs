//! The in-process fabric: one mailbox per actor, shared buffers, no serialization.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use archipelago_dataflow::ActorId;

use super::{Fabric, FabricError, LinkBytes, SharedBuffers, Tag};
use crate::typed_tensor::TypedTensor;

#[derive(Default)]
struct Mailbox {
    messages: Mutex<HashMap<(ActorId, Tag), VecDeque<TypedTensor>>>,
    arrived: Condvar,
}

/// Actors of one process exchanging `Arc` buffers through mailboxes.
pub struct InProcessFabric {
    mailboxes: Vec<Mailbox>,
    aborted: Mutex<Option<String>>,
    patience: Duration,
    links: LinkBytes,
    /// Where groups of members of this process meet at each other's buffers (`None`: they
    /// exchange messages only).
    shared: Option<SharedBuffers>,
}

impl InProcessFabric {
    /// A fabric for `actors` actors whose receives give up after `patience` (the hang watchdog).
    /// Groups of its actors may meet at each other's buffers ([`SharedBuffers`], with the same
    /// patience): their collectives then run without messages.
    pub fn new(actors: usize, patience: Duration) -> InProcessFabric {
        Self::with_shared_buffers(actors, patience, true)
    }

    /// A fabric that offers its groups [`SharedBuffers`] when `offered`; without them, every
    /// collective runs as messages, as between processes.
    pub fn with_shared_buffers(actors: usize, patience: Duration, offered: bool) -> InProcessFabric {
        InProcessFabric {
            mailboxes: (0..actors).map(|_| Mailbox::default()).collect(),
            aborted: Mutex::new(None),
            patience,
            links: LinkBytes::default(),
            shared: offered.then(|| SharedBuffers::new(patience)),
        }
    }

    /// Why the fabric was aborted, if it was.
    pub fn abort_reason(&self) -> Option<String> {
        self.aborted.lock().expect("abort flag").clone()
    }
}

impl Fabric for InProcessFabric {
    fn actors(&self) -> usize {
        self.mailboxes.len()
    }

    fn send(&self, from: ActorId, to: ActorId, tag: Tag, tensor: TypedTensor) -> Result<(), FabricError> {
        if let Some(reason) = self.abort_reason() {
            return Err(FabricError::Aborted(reason));
        }
        let mailbox = self.mailboxes.get(to).ok_or(FabricError::NoSuchActor(to))?;
        self.links.record(from, to, tensor.byte_len() as u64);
        mailbox
            .messages
            .lock()
            .expect("mailbox")
            .entry((from, tag))
            .or_default()
            .push_back(tensor);
        mailbox.arrived.notify_all();
        Ok(())
    }

    fn recv(&self, me: ActorId, from: ActorId, tag: Tag) -> Result<TypedTensor, FabricError> {
        let mailbox = self.mailboxes.get(me).ok_or(FabricError::NoSuchActor(me))?;
        let started = Instant::now();
        let mut messages = mailbox.messages.lock().expect("mailbox");
        loop {
            if let Some(queue) = messages.get_mut(&(from, tag))
                && let Some(tensor) = queue.pop_front()
            {
                if queue.is_empty() {
                    messages.remove(&(from, tag));
                }
                super::read_count::count_from(from, tensor.byte_len() as u64);
                return Ok(tensor);
            }
            if let Some(reason) = self.abort_reason() {
                return Err(FabricError::Aborted(reason));
            }
            let waited = started.elapsed();
            if waited >= self.patience {
                return Err(FabricError::Timeout {
                    me,
                    from,
                    tag,
                    waited,
                });
            }
            let slice = (self.patience - waited).min(Duration::from_millis(200));
            messages = mailbox.arrived.wait_timeout(messages, slice).expect("mailbox").0;
        }
    }

    fn link_bytes(&self) -> &LinkBytes {
        &self.links
    }

    fn abort(&self, reason: &str) {
        self.aborted
            .lock()
            .expect("abort flag")
            .get_or_insert_with(|| reason.to_string());
        for mailbox in &self.mailboxes {
            let _guard = mailbox.messages.lock().expect("mailbox");
            mailbox.arrived.notify_all();
        }
        if let Some(shared) = &self.shared {
            shared.abort(reason);
        }
    }

    fn shared_buffers(&self, group: &[ActorId]) -> Option<&SharedBuffers> {
        let all_here = group.iter().all(|&a| a < self.mailboxes.len());
        self.shared.as_ref().filter(|_| all_here)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn messages_match_by_sender_and_tag_and_move_without_copy() {
        let fabric = InProcessFabric::new(2, Duration::from_secs(5));
        let a = TypedTensor::flat(vec![1.0, 2.0]);
        let ptr = a.bytes().as_ptr();
        fabric.send(0, 1, Tag { edge: 2, seq: 0 }, a).unwrap();
        fabric
            .send(0, 1, Tag { edge: 1, seq: 0 }, TypedTensor::scalar(9.0))
            .unwrap();
        assert_eq!(fabric.recv(1, 0, Tag { edge: 1, seq: 0 }).unwrap().f32s()[0], 9.0);
        let got = fabric.recv(1, 0, Tag { edge: 2, seq: 0 }).unwrap();
        assert_eq!(got.bytes().as_ptr(), ptr);
        assert_eq!(fabric.link_bytes().between(0, 1), 12);
        assert_eq!(fabric.link_bytes().between(1, 0), 0);
    }

    #[test]
    fn timeout_names_the_peer_and_abort_wakes_waiters() {
        let fabric = Arc::new(InProcessFabric::new(2, Duration::from_millis(50)));
        let err = fabric.recv(1, 0, Tag { edge: 7, seq: 3 }).unwrap_err();
        assert!(err.to_string().contains("actor 0"), "{err}");
        let patient = Arc::new(InProcessFabric::new(2, Duration::from_secs(60)));
        let waiter = {
            let f = patient.clone();
            std::thread::spawn(move || f.recv(0, 1, Tag { edge: 1, seq: 0 }))
        };
        std::thread::sleep(Duration::from_millis(20));
        patient.abort("actor 1 failed");
        assert_eq!(
            waiter.join().unwrap().unwrap_err(),
            FabricError::Aborted("actor 1 failed".into())
        );
    }
}
