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
//! The members meet at the fabric's [`SharedBuffers`] (the rendezvous of one process's groups:
//! publish, barrier, give up after the fabric's patience naming who is missing, abort); this
//! module is the work between the barriers. It is the one module of the collectives with
//! `unsafe` code: each block says why it is sound.
#![allow(unsafe_code)]

use archipelago_dataflow::ActorId;

use super::element::{Accumulation, Reducible};
use super::ring_all_reduce::shard_range;
use crate::fabric::shared_buffers::PublishedBuffer;
use crate::fabric::{FabricError, SharedBuffers};
use crate::typed_tensor::Element;

/// Elements summed per block of the first phase (16 KiB of accumulator: stays in L1).
const BLOCK: usize = 4096;

/// What a collective does between its barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phases {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// A [`PublishedBuffer::work`]'s collective.
fn work_name(work: u8) -> &'static str {
    match work {
        w if w == Phases::AllReduce as u8 => "all-reduce",
        w if w == Phases::ReduceScatter as u8 => "reduce-scatter",
        _ => "all-gather",
    }
}

/// The collectives of the members of one process through the fabric's [`SharedBuffers`]: every
/// member of `group` calls the same one from its own thread with the same `edge`, element type
/// and length. Sums accumulate in f32 and are rounded once to the element type ([`Reducible`]).
pub trait SharedCollectives {
    /// Sums `data` over `group` in place, as [`super::ring_all_reduce()`] does.
    fn all_reduce<T: Reducible>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError>;

    /// Reduce-scatter (sum) in place: afterwards member `i` holds the total of
    /// `data[shard_range(len, n, i)]`; the rest of `data` is left as it was.
    fn reduce_scatter<T: Reducible>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError>;

    /// All-gather in place: member `i` brings `data[shard_range(len, n, i)]`; afterwards every
    /// member holds every shard (any element type: nothing is summed).
    fn all_gather<T: Element>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError>;
}

impl SharedCollectives for SharedBuffers {
    fn all_reduce<T: Reducible>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError> {
        reduce(self, Phases::AllReduce, me, group, edge, data, Accumulation::F32)
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError> {
        reduce(
            self,
            Phases::ReduceScatter,
            me,
            group,
            edge,
            data,
            Accumulation::F32,
        )
    }

    fn all_gather<T: Element>(
        &self,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        data: &mut [T],
    ) -> Result<(), FabricError> {
        // An all-gather sums nothing.
        run(self, Phases::AllGather, me, group, edge, data, |_, _, _| {})
    }
}

/// A summing collective (`phases` all-reduce or reduce-scatter) accumulating as `accumulation`
/// says ([`run`]).
fn reduce<T: Reducible>(
    buffers: &SharedBuffers,
    phases: Phases,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    accumulation: Accumulation,
) -> Result<(), FabricError> {
    let sum = |from: &[PublishedBuffer], to: &[PublishedBuffer], shard: std::ops::Range<usize>| {
        sum_shard_into::<T>(from, to, shard, accumulation)
    };
    run(buffers, phases, me, group, edge, data, sum)
}

/// One collective: publish `data` at the group's round, do this member's part of `phases`
/// straight in the published buffers (`sum` writes a shard's total over `from` into `to`), and
/// wait at the closing barrier until nobody reads `data` any more.
fn run<T: Element>(
    buffers: &SharedBuffers,
    phases: Phases,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    sum: impl Fn(&[PublishedBuffer], &[PublishedBuffer], std::ops::Range<usize>),
) -> Result<(), FabricError> {
    let i = group
        .iter()
        .position(|&a| a == me)
        .ok_or(FabricError::NoSuchActor(me))?;
    let n = group.len();
    if n < 2 {
        return Ok(());
    }
    let round = buffers.round(group)?;
    let len = data.len();
    // From here to the last barrier this member touches its buffer only through `mine`.
    let mine = PublishedBuffer {
        ptr: data.as_mut_ptr().cast::<u8>(),
        len,
        dtype: T::DTYPE,
        edge,
        work: phases as u8,
    };
    let published = round.barrier(i, edge, Some(mine))?;
    // Every member sees the same published buffers, so every member returns here alike.
    check_in_step(group, mine, &published)?;
    let shard = shard_range(len, n, i);
    let own = shard.len();
    // What this member reads from its peers: their values of its shard (summed), and in an
    // all-reduce or all-gather every other shard (written into its buffer by the shard's owner).
    match phases {
        Phases::AllReduce => sum(&published, &published, shard),
        Phases::ReduceScatter => sum(&published, &published[i..=i], shard),
        Phases::AllGather => gather_shards_into::<T>(&published, i, mine),
    }
    // By peer: `j`'s values of this member's shard, and `j`'s own shard written into it.
    let size = std::mem::size_of::<T>();
    for (j, &peer) in group.iter().enumerate().filter(|&(j, _)| j != i) {
        let theirs = shard_range(len, n, j).len();
        let from_peer = match phases {
            Phases::AllReduce => own + theirs,
            Phases::ReduceScatter => own,
            Phases::AllGather => theirs,
        };
        crate::fabric::read_count::count_from(peer, (from_peer * size) as u64);
    }
    // Nobody returns (and reuses its buffer) while another may still read it.
    round.barrier(i, edge, None)?;
    Ok(())
}

/// Refuses a round whose members brought different collectives or lengths.
fn check_in_step(
    group: &[ActorId],
    mine: PublishedBuffer,
    published: &[PublishedBuffer],
) -> Result<(), FabricError> {
    let PublishedBuffer { edge, len, dtype, .. } = mine;
    if let Some(other) = published.iter().find(|b| b.edge != edge) {
        return Err(FabricError::Aborted(format!(
            "members of group {group:?} brought collectives {edge} and {} at once; every member must run the group's collectives in the same order",
            other.edge
        )));
    }
    if let Some(other) = published.iter().find(|b| b.dtype != dtype) {
        return Err(FabricError::Aborted(format!(
            "members of a collective on edge {edge} brought {dtype} and {} buffers; every member must bring the collective's dtype",
            other.dtype
        )));
    }
    if let Some(other) = published.iter().find(|b| b.work != mine.work) {
        return Err(FabricError::Aborted(format!(
            "members of a collective on edge {edge} brought it to {} and {}; every member must run the same collective",
            work_name(mine.work),
            work_name(other.work)
        )));
    }
    if let Some(other) = published.iter().find(|b| b.len != len) {
        return Err(FabricError::Aborted(format!(
            "members of a collective on edge {edge} brought buffers of {len} and {} elements; every member must bring the same length",
            other.len
        )));
    }
    Ok(())
}

/// Copies every other member's own shard of its buffer into the same shard of `mine` (member
/// `i`'s buffer).
fn gather_shards_into<T: Element>(published: &[PublishedBuffer], i: usize, mine: PublishedBuffer) {
    let (len, n) = (mine.len, published.len());
    let mine_ptr = mine.ptr.cast::<T>();
    for (j, from) in published.iter().enumerate().filter(|(j, _)| *j != i) {
        let shard = shard_range(len, n, j);
        let from_ptr = from.ptr.cast::<T>();
        // SAFETY: shard `j` of member `j`'s buffer is member `j`'s input, which nobody
        // writes during this phase; shard `j` of our own buffer is written by us alone
        // (the others read only their own shard of it). Both ranges lie within
        // buffers of `len` elements that stay alive: every member is blocked in this
        // collective until the final barrier (every member checked in with this element type,
        // so both hold `len` elements of `T`). The two buffers are distinct (j ≠ i).
        unsafe {
            std::ptr::copy_nonoverlapping(from_ptr.add(shard.start), mine_ptr.add(shard.start), shard.len());
        }
    }
}

/// Writes the sum of `shard` over every buffer of `from` (in member order, accumulated as
/// `accumulation` says, rounded to `T` once at the end when in f32) into `shard` of every buffer
/// of `to`. The calling member is the only one that touches `shard` of any buffer during this
/// phase.
fn sum_shard_into<T: Reducible>(
    from: &[PublishedBuffer],
    to: &[PublishedBuffer],
    shard: std::ops::Range<usize>,
    accumulation: Accumulation,
) {
    let mut total = [0.0f32; BLOCK];
    let mut at = shard.start;
    while at < shard.end {
        let block = BLOCK.min(shard.end - at);
        let total = &mut total[..block];
        for (j, buffer) in from.iter().enumerate() {
            // SAFETY: `[at, at + block)` lies within `shard` of a buffer of the common length and
            // element type `T` (checked in), alive until the final barrier (its owner is blocked
            // in this collective). During this phase `shard` of every buffer is read and written
            // by this thread alone (each member works on its own shard, and shards are
            // disjoint), and the slice is dropped before the writes below.
            let values = unsafe { std::slice::from_raw_parts(buffer.ptr.cast::<T>().add(at), block) };
            accumulation.add(j, total, values);
        }
        for buffer in to {
            // SAFETY: as above: this block of `shard` is this thread's alone in this phase, and
            // no other reference to it is alive here.
            let out = unsafe { std::slice::from_raw_parts_mut(buffer.ptr.cast::<T>().add(at), block) };
            out.iter_mut()
                .zip(total.iter())
                .for_each(|(o, &t)| *o = T::from_f32(t));
        }
        at += block;
    }
}

#[cfg(test)]
#[path = "shared_16bit_tests.rs"]
pub(crate) mod shared_16bit_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    type Op = fn(&SharedBuffers, ActorId, &[ActorId], u64, &mut [f32]) -> Result<(), FabricError>;

    /// Runs `op` on `n` threads, member `m` starting from `start(m, k)`.
    fn on_threads(n: usize, len: usize, op: Op, start: fn(usize, usize) -> f32) -> Vec<Vec<f32>> {
        let shared = Arc::new(SharedBuffers::new(Duration::from_secs(20)));
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
            let out = on_threads(n, len, SharedBuffers::all_reduce::<f32>, value);
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
        let out = on_threads(n, len, SharedBuffers::reduce_scatter::<f32>, value);
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
        let gathered = on_threads(n, len, SharedBuffers::all_gather::<f32>, owner_value);
        let expected: Vec<f32> = (0..len).map(|k| k as f32).collect();
        assert!(gathered.iter().all(|member| member == &expected));
    }

    #[test]
    fn a_member_that_never_arrives_is_named_and_abort_wakes_the_waiters() {
        let shared = Arc::new(SharedBuffers::new(Duration::from_millis(200)));
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

        let patient = Arc::new(SharedBuffers::new(Duration::from_secs(60)));
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
        let shared = Arc::new(SharedBuffers::new(Duration::from_secs(20)));
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
