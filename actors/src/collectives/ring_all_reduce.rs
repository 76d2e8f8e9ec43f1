//! Chunked, pipelined ring collectives on the fabric: all-reduce (sum), reduce-scatter (sum) and
//! all-gather.
//!
//! The bandwidth-optimal ring of Patarasuk & Yuan ("Bandwidth optimal all-reduce algorithms for
//! clusters of workstations", JPDC 2009), as popularised by Baidu's ring all-reduce and NCCL:
//! a reduce-scatter of n−1 steps leaves member i with the total of segment i+1, then an all-gather
//! of n−1 steps spreads the totals. Each segment moves in chunks, so a member adds chunk c while
//! chunk c+1 is on its way. Every member sends 2(n−1)/n of the buffer. Received all-gather chunks
//! are forwarded as the same shared buffers, never copied again.
//!
//! bf16 and f16 travel as themselves, and their sums accumulate in f32, rounded once: a ring
//! would round every partial sum it passes on, so their reduce-scatter is direct instead — each
//! member sends every other member that member's shard, and the owner sums all of them in one
//! f32 accumulator, in member order (the bytes of the ring's reduce-scatter, n−1 messages at
//! once instead of n−1 steps); the all-gather is the ring's. All-gathers carry any dtype.

use std::ops::Range;

use archipelago_dataflow::ActorId;

use super::element::{Accumulation, Reducible};
use crate::fabric::{Fabric, FabricError, Tag};
use crate::typed_tensor::{DType, Element, TypedTensor};

/// Chunk buffers kept between collectives, so that steady-state collectives allocate nothing
/// (fresh allocations of this size page-fault on every use). Buffers a member receives and owns
/// alone go back to its pool; the ring is symmetric, so pools stay balanced.
#[derive(Debug, Default)]
pub struct ChunkPool {
    free: Vec<Vec<f32>>,
}

impl ChunkPool {
    /// A message holding a copy of `values` (from the pool when they are f32).
    fn message<T: Element>(&mut self, values: &[T]) -> TypedTensor {
        match T::DTYPE {
            DType::F32 => self.filled(bytemuck::cast_slice(values)),
            _ => TypedTensor::from_values(vec![values.len()], values),
        }
    }

    /// A buffer holding a copy of `values`.
    fn filled(&mut self, values: &[f32]) -> TypedTensor {
        let mut buffer = self.free.pop().unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(values);
        TypedTensor::flat(buffer)
    }

    /// Takes a received buffer back if nobody else holds it.
    fn recycle(&mut self, tensor: TypedTensor) {
        if let Ok(buffer) = tensor.try_into_f32_vec()
            && self.free.len() < 1024
        {
            self.free.push(buffer);
        }
    }
}

/// The elements of shard `s` of a buffer of `len` elements split over `n` members (the ZeRO
/// layout: member `i` of a group owns shard `i`): the plan's function, so that the plan's shards
/// and the collectives' agree.
pub use archipelago_dataflow::shard_range;

/// The elements of a message `got` from `from` that must be `len` elements of `T`: a message
/// of another dtype or length is an error naming the sender, never a panic.
fn elements_of<T: Element>(got: &TypedTensor, len: usize, from: ActorId) -> Result<&[T], FabricError> {
    if got.dtype() != T::DTYPE || got.elements() != len {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} {} elements where this collective expects {len} {}",
            got.elements(),
            got.dtype(),
            T::DTYPE
        )));
    }
    Ok(got.values::<T>())
}

/// The ring around `group` as seen by `me`.
struct Ring<'a> {
    fabric: &'a dyn Fabric,
    me: ActorId,
    i: usize,
    n: usize,
    next: ActorId,
    prev: ActorId,
    edge: u64,
    chunk_elems: usize,
}

impl<'a> Ring<'a> {
    fn new(
        fabric: &'a dyn Fabric,
        me: ActorId,
        group: &[ActorId],
        edge: u64,
        chunk_elems: usize,
    ) -> Result<Ring<'a>, FabricError> {
        let n = group.len();
        let i = group
            .iter()
            .position(|&a| a == me)
            .ok_or(FabricError::NoSuchActor(me))?;
        Ok(Ring {
            fabric,
            me,
            i,
            n,
            next: group[(i + 1) % n],
            prev: group[(i + n - 1) % n],
            edge,
            chunk_elems: chunk_elems.max(1),
        })
    }

    fn chunks(&self, r: Range<usize>) -> Vec<Range<usize>> {
        (r.start..r.end)
            .step_by(self.chunk_elems)
            .map(|c| c..(c + self.chunk_elems).min(r.end))
            .collect()
    }

    fn tag(&self, phase: u64, step: usize, chunk: usize) -> Tag {
        Tag {
            edge: self.edge,
            seq: ((phase * self.n as u64 + step as u64) << 32) | chunk as u64,
        }
    }

    /// Shard `k` (mod n) of `data`.
    fn shard(&self, len: usize, k: usize) -> Range<usize> {
        shard_range(len, self.n, k % self.n)
    }

    /// Reduce-scatter: afterwards this member holds the total of shard `i + offset`.
    /// At step s it sends shard `i + offset − 1 − s` and adds the received shard `i + offset − 2 − s`.
    fn reduce_scatter(
        &self,
        data: &mut [f32],
        offset: usize,
        pool: &mut ChunkPool,
    ) -> Result<(), FabricError> {
        let (n, i, len) = (self.n, self.i, data.len());
        for s in 0..n - 1 {
            let out = self.chunks(self.shard(len, i + offset + 2 * n - 1 - s));
            let inn = self.chunks(self.shard(len, i + offset + 2 * n - 2 - s));
            for c in 0..out.len().max(inn.len()) {
                if let Some(r) = out.get(c) {
                    let payload = pool.filled(&data[r.clone()]);
                    self.fabric.send(self.me, self.next, self.tag(0, s, c), payload)?;
                }
                if let Some(r) = inn.get(c) {
                    let got = self.fabric.recv(self.me, self.prev, self.tag(0, s, c))?;
                    let values = elements_of::<f32>(&got, r.len(), self.prev)?;
                    for (d, g) in data[r.clone()].iter_mut().zip(values) {
                        *d += g;
                    }
                    pool.recycle(got);
                }
            }
        }
        Ok(())
    }

    /// Direct reduce-scatter of a 16-bit buffer (see the module docs): afterwards this member
    /// holds the total of shard `i`, summed over the members in order as `accumulation` says.
    fn direct_reduce_scatter<T: Reducible>(
        &self,
        data: &mut [T],
        accumulation: Accumulation,
        group: &[ActorId],
    ) -> Result<(), FabricError> {
        let (n, i, len) = (self.n, self.i, data.len());
        for (j, &peer) in group.iter().enumerate().filter(|&(j, _)| j != i) {
            for (c, r) in self.chunks(shard_range(len, n, j)).into_iter().enumerate() {
                let message = TypedTensor::from_values(vec![r.len()], &data[r]);
                self.fabric.send(self.me, peer, self.tag(2, i, c), message)?;
            }
        }
        let mut total: Vec<f32> = Vec::new();
        for (c, r) in self.chunks(shard_range(len, n, i)).into_iter().enumerate() {
            total.clear();
            total.resize(r.len(), 0.0);
            for (j, &member) in group.iter().enumerate() {
                let got;
                let values: &[T] = if j == i {
                    &data[r.clone()]
                } else {
                    got = self.fabric.recv(self.me, member, self.tag(2, j, c))?;
                    elements_of::<T>(&got, r.len(), member)?
                };
                accumulation.add(j, &mut total, values);
            }
            data[r]
                .iter_mut()
                .zip(&total)
                .for_each(|(d, &t)| *d = T::from_f32(t));
        }
        Ok(())
    }

    /// All-gather: this member starts with shard `i + offset`; afterwards it holds every shard.
    /// Received chunks are forwarded as the same shared buffers.
    fn all_gather<T: Element>(
        &self,
        data: &mut [T],
        offset: usize,
        pool: &mut ChunkPool,
    ) -> Result<(), FabricError> {
        let (n, i, len) = (self.n, self.i, data.len());
        let mut forward: Vec<TypedTensor> = Vec::new();
        for s in 0..n - 1 {
            let out = self.chunks(self.shard(len, i + offset + n - s));
            let inn = self.chunks(self.shard(len, i + offset + 2 * n - s - 1));
            let mut received = Vec::with_capacity(inn.len());
            for c in 0..out.len().max(inn.len()) {
                if let Some(r) = out.get(c) {
                    let payload = if s == 0 {
                        pool.message(&data[r.clone()])
                    } else {
                        forward
                            .get(c)
                            .cloned()
                            .expect("chunk received at the previous step")
                    };
                    self.fabric.send(self.me, self.next, self.tag(1, s, c), payload)?;
                }
                if let Some(r) = inn.get(c) {
                    let got = self.fabric.recv(self.me, self.prev, self.tag(1, s, c))?;
                    data[r.clone()].copy_from_slice(elements_of::<T>(&got, r.len(), self.prev)?);
                    received.push(got);
                }
            }
            for done in std::mem::replace(&mut forward, received) {
                pool.recycle(done);
            }
        }
        for done in forward {
            pool.recycle(done);
        }
        Ok(())
    }
}

/// Sums `data` over `group` in place; every member calls it with the same `edge`, `group`,
/// element type and length. `chunk_elems` bounds the size of one message; `pool` lends the
/// message buffers. 16-bit sums accumulate in f32 (see the module docs).
pub fn ring_all_reduce<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    let Some(ring) = ring(fabric, me, group, edge, data.len(), chunk_elems)? else {
        return Ok(());
    };
    if T::DTYPE == DType::F32 {
        let data: &mut [f32] = bytemuck::cast_slice_mut(data);
        ring.reduce_scatter(data, 1, pool)?;
        return ring.all_gather(data, 1, pool);
    }
    ring.direct_reduce_scatter(data, Accumulation::F32, group)?;
    ring.all_gather(data, 0, pool)
}

/// Reduce-scatter (sum) in place: afterwards member `i` of `group` holds, in
/// `data[shard_range(len, n, i)]`, the sum of that shard over all members (the rest of `data` is
/// left partial). Each member sends (n−1)/n of the buffer.
pub fn ring_reduce_scatter<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    reduce_scatter_with(
        fabric,
        me,
        group,
        edge,
        data,
        chunk_elems,
        pool,
        Accumulation::F32,
    )
}

/// [`ring_reduce_scatter`] accumulating 16-bit sums as `accumulation` says (in their own type
/// only for the negative control of the tests).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter_with<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
    accumulation: Accumulation,
) -> Result<(), FabricError> {
    let Some(ring) = ring(fabric, me, group, edge, data.len(), chunk_elems)? else {
        return Ok(());
    };
    match T::DTYPE {
        DType::F32 => ring.reduce_scatter(bytemuck::cast_slice_mut(data), 0, pool),
        _ => ring.direct_reduce_scatter(data, accumulation, group),
    }
}

/// All-gather in place (any element type): member `i` brings `data[shard_range(len, n, i)]`;
/// afterwards every member holds every shard. Each member sends (n−1)/n of the buffer.
pub fn ring_all_gather<T: Element>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match ring(fabric, me, group, edge, data.len(), chunk_elems)? {
        Some(ring) => ring.all_gather(data, 0, pool),
        None => Ok(()),
    }
}

/// The ring for a collective over `len` elements, or `None` when there is nothing to move.
fn ring<'a>(
    fabric: &'a dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    len: usize,
    chunk_elems: usize,
) -> Result<Option<Ring<'a>>, FabricError> {
    if group.len() <= 1 || len == 0 {
        return Ok(None);
    }
    Ring::new(fabric, me, group, edge, chunk_elems).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::InProcessFabric;
    use std::sync::Arc;
    use std::time::Duration;

    fn run(n: usize, len: usize, chunk: usize) {
        let fabric = Arc::new(InProcessFabric::new(n, Duration::from_secs(10)));
        let group: Vec<usize> = (0..n).collect();
        let handles: Vec<_> = (0..n)
            .map(|me| {
                let fabric = fabric.clone();
                let group = group.clone();
                std::thread::spawn(move || {
                    let mut data: Vec<f32> = (0..len).map(|k| (me * 1000 + k) as f32).collect();
                    let mut pool = ChunkPool::default();
                    ring_all_reduce(fabric.as_ref(), me, &group, 3, &mut data, chunk, &mut pool).unwrap();
                    data
                })
            })
            .collect();
        let expected: Vec<f32> = (0..len)
            .map(|k| (0..n).map(|me| (me * 1000 + k) as f32).sum())
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), expected, "n={n} len={len} chunk={chunk}");
        }
    }

    type Collective = fn(
        &dyn Fabric,
        ActorId,
        &[ActorId],
        u64,
        &mut [f32],
        usize,
        &mut ChunkPool,
    ) -> Result<(), FabricError>;

    fn run_each(n: usize, len: usize, chunk: usize, collective: Collective) -> Vec<Vec<f32>> {
        let fabric = Arc::new(InProcessFabric::new(n, Duration::from_secs(10)));
        let group: Vec<usize> = (0..n).rev().collect(); // ring order is not rank order
        let handles: Vec<_> = (0..n)
            .map(|me| {
                let (fabric, group) = (fabric.clone(), group.clone());
                std::thread::spawn(move || {
                    let mut data: Vec<f32> = (0..len).map(|k| (me * 1000 + k) as f32).collect();
                    let mut pool = ChunkPool::default();
                    collective(fabric.as_ref(), me, &group, 9, &mut data, chunk, &mut pool).unwrap();
                    data
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn reduce_scatter_leaves_each_member_the_total_of_its_shard_and_all_gather_restores_all() {
        for n in 1..=5 {
            for len in [0, 1, 3, 7, 64, 1001] {
                for chunk in [1, 4, 1 << 18] {
                    let group: Vec<usize> = (0..n).rev().collect();
                    let total = |k: usize| (0..n).map(|me| (me * 1000 + k) as f32).sum::<f32>();
                    let out = run_each(n, len, chunk, ring_reduce_scatter);
                    for (me, data) in out.iter().enumerate() {
                        let i = group.iter().position(|&a| a == me).unwrap();
                        for k in shard_range(len, n, i) {
                            assert_eq!(
                                data[k],
                                total(k),
                                "reduce-scatter n={n} len={len} chunk={chunk} member {me}"
                            );
                        }
                    }
                    let out = run_each(n, len, chunk, ring_all_gather);
                    for data in &out {
                        for (s, &owner) in group.iter().enumerate() {
                            for k in shard_range(len, n, s) {
                                assert_eq!(data[k], (owner * 1000 + k) as f32, "all-gather n={n} len={len}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sums_for_every_group_size_length_and_chunking() {
        for n in 1..=5 {
            for len in [0, 1, 3, 7, 64, 1001] {
                for chunk in [1, 4, 1 << 18] {
                    run(n, len, chunk);
                }
            }
        }
    }
}
