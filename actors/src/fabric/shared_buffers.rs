//! Buffers shared between the actors of one process: where the members of a group meet to work
//! on each other's memory instead of exchanging messages.
//!
//! A member publishes a pointer to its buffer at a barrier ([`GroupRound::barrier`]) and gets
//! every member's published buffer back once all have arrived; a second barrier, without a
//! buffer, tells it that nobody reads its buffer any more. What is done between the barriers
//! (a reduction, a gather) is the business of whoever builds on it: the shared-buffer
//! collectives (`collectives::shared`). This module never reads or writes a published buffer;
//! it only hands the addresses around.
//!
//! A barrier waits at most the patience the [`SharedBuffers`] were made with: a member that never
//! arrives (stuck, dead, or at another collective) fails every waiting member with
//! [`FabricError::GroupTimeout`], naming who is missing, and the group stays broken;
//! [`SharedBuffers::abort`] wakes them with the job's failure. An
//! [`InProcessFabric`](super::InProcessFabric) owns one `SharedBuffers` for all its groups,
//! unless it was built without.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use archipelago_dataflow::ActorId;

use super::FabricError;

/// A member's published buffer, and the edge (collective) it brings it to.
#[derive(Debug, Clone, Copy)]
pub struct PublishedBuffer {
    /// The buffer's first byte.
    pub ptr: *mut u8,
    /// Its length in elements.
    pub len: usize,
    /// Its element type (members must agree on it).
    pub dtype: archipelago_dataflow::DType,
    /// The edge the member is at (members at different edges are out of step).
    pub edge: u64,
    /// What the member does with the buffers (its collective, as its user numbers them: members
    /// that disagree would read and write each other's buffers differently).
    pub work: u8,
}

// SAFETY: a `PublishedBuffer` is only an address and a length; this module never dereferences
// it, it only hands it to the members of the same round. Whoever dereferences one must do so only
// between the two barriers of one round, while its publisher is blocked in the same round (the
// shared-buffer collectives state how they keep to this).
unsafe impl Send for PublishedBuffer {}

/// The rendezvous of one group, reused round after round (a member takes part in its group's
/// rounds one at a time, in the order of its plan).
pub struct GroupRound {
    members: Vec<ActorId>,
    patience: Duration,
    state: Mutex<RoundState>,
    changed: Condvar,
}

struct RoundState {
    /// Completed barriers so far.
    generation: u64,
    /// Who has arrived at the current barrier.
    arrived: Vec<bool>,
    /// The buffers of the round in progress.
    buffers: Vec<Option<PublishedBuffer>>,
    /// Why the group is broken, once it is.
    broken: Option<FabricError>,
}

impl GroupRound {
    fn new(members: &[ActorId], patience: Duration) -> GroupRound {
        GroupRound {
            members: members.to_vec(),
            patience,
            state: Mutex::new(RoundState {
                generation: 0,
                arrived: vec![false; members.len()],
                buffers: vec![None; members.len()],
                broken: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Member `i` (its index in the group) waits until every member arrived, publishing `buffer`
    /// first when given; returns the published buffers of the current round, in member order.
    /// `edge` names the collective in a timeout.
    pub fn barrier(
        &self,
        i: usize,
        edge: u64,
        buffer: Option<PublishedBuffer>,
    ) -> Result<Vec<PublishedBuffer>, FabricError> {
        let mut state = self.state.lock().expect("shared buffer round");
        if let Some(broken) = &state.broken {
            return Err(broken.clone());
        }
        if let Some(published) = buffer {
            state.buffers[i] = Some(published);
        }
        state.arrived[i] = true;
        let generation = state.generation;
        if state.arrived.iter().all(|&a| a) {
            state.arrived.iter_mut().for_each(|a| *a = false);
            state.generation += 1;
            self.changed.notify_all();
        } else {
            let start = Instant::now();
            while state.generation == generation {
                if let Some(broken) = &state.broken {
                    return Err(broken.clone());
                }
                let waited = start.elapsed();
                if waited >= self.patience {
                    let error = self.timeout(&state, i, edge, waited);
                    state.broken = Some(error.clone());
                    self.changed.notify_all();
                    return Err(error);
                }
                state = self
                    .changed
                    .wait_timeout(state, self.patience - waited)
                    .expect("shared buffer round")
                    .0;
            }
        }
        Ok(state
            .buffers
            .iter()
            .map(|b| b.expect("published at the first barrier"))
            .collect())
    }

    /// The error of member `i` that waited `waited` for the members not yet arrived.
    fn timeout(&self, state: &RoundState, i: usize, edge: u64, waited: Duration) -> FabricError {
        let missing = (self.members.iter().zip(&state.arrived))
            .filter(|(_, arrived)| !**arrived)
            .map(|(&member, _)| member)
            .collect();
        FabricError::GroupTimeout {
            me: self.members[i],
            missing,
            edge,
            waited,
        }
    }

    fn abort(&self, reason: &str) {
        let mut state = self.state.lock().expect("shared buffer round");
        state
            .broken
            .get_or_insert(FabricError::Aborted(reason.to_string()));
        self.changed.notify_all();
    }
}

/// The rounds of every group of the actors of one process (one per fabric).
pub struct SharedBuffers {
    rounds: Mutex<HashMap<Vec<ActorId>, Arc<GroupRound>>>,
    aborted: Mutex<Option<String>>,
    patience: Duration,
}

impl SharedBuffers {
    /// Rounds whose barriers wait at most `patience` for a member.
    pub fn new(patience: Duration) -> SharedBuffers {
        SharedBuffers {
            rounds: Mutex::default(),
            aborted: Mutex::default(),
            patience,
        }
    }

    /// The round of `group` (the same one for every member and every collective of the group);
    /// [`FabricError::Aborted`] once the job was aborted.
    pub fn round(&self, group: &[ActorId]) -> Result<Arc<GroupRound>, FabricError> {
        if let Some(reason) = self.aborted.lock().expect("shared buffers").clone() {
            return Err(FabricError::Aborted(reason));
        }
        let mut rounds = self.rounds.lock().expect("shared buffers");
        Ok(rounds
            .entry(group.to_vec())
            .or_insert_with(|| Arc::new(GroupRound::new(group, self.patience)))
            .clone())
    }

    /// Fails every waiting and later round with [`FabricError::Aborted`].
    pub fn abort(&self, reason: &str) {
        self.aborted
            .lock()
            .expect("shared buffers")
            .get_or_insert(reason.to_string());
        for round in self.rounds.lock().expect("shared buffers").values() {
            round.abort(reason);
        }
    }
}
