//! Collectives between members of one process without messages: every member publishes its
//! buffer, then reduces or copies its own slice of the work straight from the others' buffers.
//!
//! All-reduce is the reduce-scatter + all-gather of the ring (Patarasuk & Yuan, JPDC 2009)
//! without the ring, fused into one pass: member `i` sums shard `i` over every member's buffer,
//! a cache-sized block at a time (in member order, so every element is summed once and in the
//! same order on every run), and writes each block's total straight into shard `i` of every
//! member's buffer — it reads and writes the buffer's bytes once, as a memcpy does, and the
//! members' shards proceed in parallel. Reduce-scatter writes the total into the member's own
//! buffer only; all-gather copies each other member's shard from its owner. A collective is a
//! barrier (buffers published), the pass, and a barrier (nobody reuses its buffer while
//! another still reads it); nothing is copied into a message and nothing is allocated. This is what NCCL's
//! and gloo's shared-memory paths do inside a node, reduced to what threads of one process need.
//!
//! A barrier waits at most the fabric's patience: a member that never arrives (stuck, dead, or
//! calling another collective) fails every waiting member with [`FabricError::GroupTimeout`],
//! naming who is missing, and the group stays broken; [`SharedCollectives::abort`] wakes them
//! with the job's failure. This is the one module of the crate with `unsafe` code: each block
//! says why it is sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use archipelago_dataflow::ActorId;

use super::ring_all_reduce::shard_range;
use crate::fabric::FabricError;

/// Elements summed per block of the first phase (16 KiB of accumulator: stays in L1).
const BLOCK: usize = 4096;

/// A member's published buffer, and the collective (edge) it brings it to.
#[derive(Clone, Copy)]
struct Published {
    ptr: *mut f32,
    len: usize,
    edge: u64,
}

// SAFETY: a `Published` is only an address; it is dereferenced only between the barriers of
// one collective, while the member that published it is blocked inside the same collective
// and accesses its buffer through this same pointer, never through its `&mut` (see `run`).
unsafe impl Send for Published {}

/// The rendezvous of one group, reused collective after collective (a member runs its
/// collectives one at a time, in the order of its plan, as the ring needs too).
struct Round {
    members: Vec<ActorId>,
    state: Mutex<RoundState>,
    changed: Condvar,
}

struct RoundState {
    /// Completed barriers so far.
    generation: u64,
    /// Who has arrived at the current barrier.
    arrived: Vec<bool>,
    /// The buffers of the collective in progress.
    buffers: Vec<Option<Published>>,
    /// Why the group is broken, once it is.
    broken: Option<FabricError>,
}

impl Round {
    fn new(members: &[ActorId]) -> Round {
        Round {
            members: members.to_vec(),
            state: Mutex::new(RoundState {
                generation: 0,
                arrived: vec![false; members.len()],
                buffers: vec![None; members.len()],
                broken: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Waits until every member arrived (publishing `buffer` first, when given); returns the
    /// published buffers of the current collective.
    fn barrier(
        &self,
        i: usize,
        edge: u64,
        buffer: Option<Published>,
        patience: Duration,
    ) -> Result<Vec<Published>, FabricError> {
        let mut state = self.state.lock().expect("shared collective round");
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
                if waited >= patience {
                    let missing = (self.members.iter().zip(&state.arrived))
                        .filter(|(_, arrived)| !**arrived)
                        .map(|(&member, _)| member)
                        .collect();
                    let error = FabricError::GroupTimeout {
                        me: self.members[i],
                        missing,
                        edge,
                        waited,
                    };
                    state.broken = Some(error.clone());
                    self.changed.notify_all();
                    return Err(error);
                }
                state = self
                    .changed
                    .wait_timeout(state, patience - waited)
                    .expect("shared collective round")
                    .0;
            }
        }
        Ok(state
            .buffers
            .iter()
            .map(|b| b.expect("published at the first barrier"))
            .collect())
    }

    fn abort(&self, reason: &str) {
        let mut state = self.state.lock().expect("shared collective round");
        state
            .broken
            .get_or_insert(FabricError::Aborted(reason.to_string()));
        self.changed.notify_all();
    }
}

/// What a collective does between its barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phases {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// The shared-buffer collectives of the members of one process (one per fabric).
pub struct SharedCollectives {
    rounds: Mutex<HashMap<Vec<ActorId>, Arc<Round>>>,
    aborted: Mutex<Option<String>>,
    patience: Duration,
}

impl SharedCollectives {
    /// Collectives whose barriers wait at most `patience` for a member.
    pub fn new(patience: Duration) -> SharedCollectives {
        SharedCollectives {
            rounds: Mutex::default(),
            aborted: Mutex::default(),
            patience,
        }
    }

    /// Sums `data` over `group` in place, as [`super::ring_all_reduce()`] does; every member of
    /// `group` calls it from its own thread with the same `edge` and length.
    pub fn all_reduce(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [f32],
    ) -> Result<(), FabricError> {
        self.run(Phases::AllReduce, me, group, edge, data)
    }

    /// Reduce-scatter (sum) in place: afterwards member `i` holds the total of
    /// `data[shard_range(len, n, i)]`; the rest of `data` is left as it was.
    pub fn reduce_scatter(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [f32],
    ) -> Result<(), FabricError> {
        self.run(Phases::ReduceScatter, me, group, edge, data)
    }

    /// All-gather in place: member `i` brings `data[shard_range(len, n, i)]`; afterwards every
    /// member holds every shard.
    pub fn all_gather(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [f32],
    ) -> Result<(), FabricError> {
        self.run(Phases::AllGather, me, group, edge, data)
    }

    /// Fails every waiting and later collective with [`FabricError::Aborted`].
    pub fn abort(&self, reason: &str) {
        self.aborted
            .lock()
            .expect("shared collectives")
            .get_or_insert(reason.to_string());
        for round in self.rounds.lock().expect("shared collectives").values() {
            round.abort(reason);
        }
    }

    fn round(&self, group: &[ActorId]) -> Result<Arc<Round>, FabricError> {
        if let Some(reason) = self.aborted.lock().expect("shared collectives").clone() {
            return Err(FabricError::Aborted(reason));
        }
        let mut rounds = self.rounds.lock().expect("shared collectives");
        Ok(rounds
            .entry(group.to_vec())
            .or_insert_with(|| Arc::new(Round::new(group)))
            .clone())
    }

    fn run(
        &self,
        phases: Phases,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [f32],
    ) -> Result<(), FabricError> {
        let i = group
            .iter()
            .position(|&a| a == me)
            .ok_or(FabricError::NoSuchActor(me))?;
        let n = group.len();
        if n < 2 {
            return Ok(());
        }
        let round = self.round(group)?;
        let len = data.len();
        // From here to the last barrier this member touches its buffer only through `mine`.
        let mine = Published {
            ptr: data.as_mut_ptr(),
            len,
            edge,
        };
        let buffers = round.barrier(i, edge, Some(mine), self.patience)?;
        // Every member sees the same published buffers, so every member returns here alike.
        if let Some(other) = buffers.iter().find(|b| b.edge != edge) {
            return Err(FabricError::Aborted(format!(
                "members of group {group:?} brought collectives {edge} and {} at once; every member must run the group's collectives in the same order",
                other.edge
            )));
        }
        if let Some(other) = buffers.iter().find(|b| b.len != len) {
            return Err(FabricError::Aborted(format!(
                "members of a collective on edge {edge} brought buffers of {len} and {} elements; every member must bring the same length",
                other.len
            )));
        }
        let shard = shard_range(len, n, i);
        match phases {
            Phases::AllReduce => sum_shard_into(&buffers, &buffers, shard),
            Phases::ReduceScatter => sum_shard_into(&buffers, &buffers[i..=i], shard),
            Phases::AllGather => {}
        }
        if phases == Phases::AllGather {
            for (j, from) in buffers.iter().enumerate().filter(|(j, _)| *j != i) {
                let shard = shard_range(len, n, j);
                // SAFETY: shard `j` of member `j`'s buffer is member `j`'s input, which nobody
                // writes during this phase; shard `j` of our own buffer is written by us alone
                // (the others read only their own shard of it). Both ranges lie within
                // buffers of `len` elements that stay alive: every member is blocked in this
                // collective until the final barrier. The two buffers are distinct (j ≠ i).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.ptr.add(shard.start),
                        mine.ptr.add(shard.start),
                        shard.len(),
                    );
                }
            }
        }
        // Nobody returns (and reuses its buffer) while another may still read it.
        round.barrier(i, edge, None, self.patience)?;
        Ok(())
    }
}

/// Writes the sum of `shard` over every buffer of `from` (in member order) into `shard` of
/// every buffer of `to`. The calling member is the only one that touches `shard` of any buffer
/// during this phase.
fn sum_shard_into(from: &[Published], to: &[Published], shard: std::ops::Range<usize>) {
    let mut total = [0.0f32; BLOCK];
    let mut at = shard.start;
    while at < shard.end {
        let block = BLOCK.min(shard.end - at);
        let total = &mut total[..block];
        for (j, buffer) in from.iter().enumerate() {
            // SAFETY: `[at, at + block)` lies within `shard` of a buffer of the common length,
            // alive until the final barrier (its owner is blocked in this collective). During
            // this phase `shard` of every buffer is read and written by this thread alone (each
            // member works on its own shard, and shards are disjoint), and the slice is dropped
            // before the writes below.
            let values = unsafe { std::slice::from_raw_parts(buffer.ptr.add(at), block) };
            if j == 0 {
                total.copy_from_slice(values);
            } else {
                total.iter_mut().zip(values).for_each(|(t, v)| *t += v);
            }
        }
        for buffer in to {
            // SAFETY: as above: this block of `shard` is this thread's alone in this phase, and
            // no other reference to it is alive here.
            let out = unsafe { std::slice::from_raw_parts_mut(buffer.ptr.add(at), block) };
            out.copy_from_slice(total);
        }
        at += block;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Op = fn(&SharedCollectives, ActorId, &[ActorId], u64, &mut [f32]) -> Result<(), FabricError>;

    /// Runs `op` on `n` threads, member `m` starting from `start(m, k)`.
    fn on_threads(n: usize, len: usize, op: Op, start: fn(usize, usize) -> f32) -> Vec<Vec<f32>> {
        let shared = Arc::new(SharedCollectives::new(Duration::from_secs(20)));
        let group: Vec<ActorId> = (0..n).map(|m| 10 + m).collect();
        let threads: Vec<_> = (0..n)
            .map(|m| {
                let (shared, group) = (shared.clone(), group.clone());
                std::thread::spawn(move || {
                    let mut data: Vec<f32> = (0..len).map(|k| start(m, k)).collect();
                    for edge in 0..3 {
                        if edge > 0 {
                            data = (0..len).map(|k| start(m, k)).collect();
                        }
                        op(&shared, group[m], &group, edge, &mut data).unwrap();
                    }
                    data
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn value(m: usize, k: usize) -> f32 {
        ((m * 7919 + k * 31) % 1000) as f32 * 0.001 - 0.5
    }

    #[test]
    fn all_reduce_sums_in_member_order_on_every_member() {
        for (n, len) in [(2, 10_007), (3, 5), (4, 3), (5, 3 * BLOCK + 17)] {
            let out = on_threads(n, len, SharedCollectives::all_reduce, value);
            let expected: Vec<f32> = (0..len)
                .map(|k| (1..n).fold(value(0, k), |s, m| s + value(m, k)))
                .collect();
            for member in &out {
                assert_eq!(member, &expected, "n = {n}, len = {len}");
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather_follow_the_zero_layout() {
        let (n, len) = (3, 1000);
        let out = on_threads(n, len, SharedCollectives::reduce_scatter, value);
        for (i, member) in out.iter().enumerate() {
            let own = shard_range(len, n, i);
            for (k, got) in member.iter().enumerate() {
                let expected = if own.contains(&k) {
                    (1..n).fold(value(0, k), |s, m| s + value(m, k))
                } else {
                    value(i, k)
                };
                assert_eq!(*got, expected, "member {i}, element {k}");
            }
        }
        fn owner_value(m: usize, k: usize) -> f32 {
            if shard_range(1000, 3, m).contains(&k) {
                k as f32
            } else {
                -1.0
            }
        }
        let gathered = on_threads(n, len, SharedCollectives::all_gather, owner_value);
        let expected: Vec<f32> = (0..len).map(|k| k as f32).collect();
        assert!(gathered.iter().all(|member| member == &expected));
    }

    #[test]
    fn a_member_that_never_arrives_is_named_and_abort_wakes_the_waiters() {
        let shared = Arc::new(SharedCollectives::new(Duration::from_millis(200)));
        let group = [4, 5, 6];
        let waiter = {
            let shared = shared.clone();
            std::thread::spawn(move || shared.all_reduce(4, &group, 9, &mut [1.0; 8]))
        };
        let error = waiter.join().unwrap().unwrap_err();
        assert!(
            matches!(&error, FabricError::GroupTimeout { me: 4, missing, edge: 9, .. } if missing == &vec![5, 6]),
            "{error}"
        );
        // The group stays broken: a late member fails at once instead of waiting.
        assert!(shared.all_reduce(5, &group, 9, &mut [1.0; 8]).is_err());

        let patient = Arc::new(SharedCollectives::new(Duration::from_secs(60)));
        let waiter = {
            let patient = patient.clone();
            std::thread::spawn(move || patient.all_gather(4, &group, 1, &mut [1.0; 8]))
        };
        std::thread::sleep(Duration::from_millis(50));
        patient.abort("actor 6 panicked");
        let error = waiter.join().unwrap().unwrap_err();
        assert!(
            matches!(error, FabricError::Aborted(ref why) if why == "actor 6 panicked"),
            "{error}"
        );
    }

    #[test]
    fn unequal_lengths_fail_every_member_naming_both() {
        let shared = Arc::new(SharedCollectives::new(Duration::from_secs(20)));
        let threads: Vec<_> = [(0, 8), (1, 9)]
            .into_iter()
            .map(|(me, len)| {
                let shared = shared.clone();
                std::thread::spawn(move || shared.all_reduce(me, &[0, 1], 0, &mut vec![0.0; len]))
            })
            .collect();
        for t in threads {
            let error = t.join().unwrap().unwrap_err().to_string();
            assert!(error.contains('8') && error.contains('9'), "{error}");
        }
    }
}
