//! Chunked, pipelined ring all-reduce (sum) on the fabric.
//!
//! The bandwidth-optimal ring of Patarasuk & Yuan ("Bandwidth optimal all-reduce algorithms for
//! clusters of workstations", JPDC 2009), as popularised by Baidu's ring all-reduce and NCCL:
//! a reduce-scatter of n−1 steps leaves member i with the total of segment i+1, then an all-gather
//! of n−1 steps spreads the totals. Each segment moves in chunks, so a member adds chunk c while
//! chunk c+1 is on its way. Every member sends 2(n−1)/n of the buffer. Received all-gather chunks
//! are forwarded as the same shared buffers, never copied again.

use std::ops::Range;

use archipelago_dataflow::ActorId;

use crate::fabric::{Fabric, FabricError, Tag};
use crate::host_tensor::HostTensor;

/// Chunk buffers kept between collectives, so that steady-state collectives allocate nothing
/// (fresh allocations of this size page-fault on every use). Buffers a member receives and owns
/// alone go back to its pool; the ring is symmetric, so pools stay balanced.
#[derive(Debug, Default)]
pub struct ChunkPool {
    free: Vec<Vec<f32>>,
}

impl ChunkPool {
    /// A buffer holding a copy of `values`.
    fn filled(&mut self, values: &[f32]) -> HostTensor {
        let mut buffer = self.free.pop().unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(values);
        HostTensor::flat(buffer)
    }

    /// Takes a received buffer back if nobody else holds it.
    fn recycle(&mut self, tensor: HostTensor) {
        if let Ok(buffer) = std::sync::Arc::try_unwrap(tensor.data)
            && self.free.len() < 1024
        {
            self.free.push(buffer);
        }
    }
}

/// Sums `data` over `group` in place; every member calls it with the same `edge`, `group` and
/// length. `chunk_elems` bounds the size of one message; `pool` lends the message buffers.
pub fn ring_all_reduce(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    let n = group.len();
    if n <= 1 || data.is_empty() {
        return Ok(());
    }
    let i = group
        .iter()
        .position(|&a| a == me)
        .ok_or(FabricError::NoSuchActor(me))?;
    let next = group[(i + 1) % n];
    let prev = group[(i + n - 1) % n];
    let len = data.len();
    let segment = |s: usize| s * len / n..(s + 1) * len / n;
    let chunks = |r: Range<usize>| -> Vec<Range<usize>> {
        let step = chunk_elems.max(1);
        (r.start..r.end)
            .step_by(step)
            .map(|c| c..(c + step).min(r.end))
            .collect()
    };
    let tag = |phase: u64, step: usize, chunk: usize| Tag {
        edge,
        seq: ((phase * n as u64 + step as u64) << 32) | chunk as u64,
    };

    // Reduce-scatter: at step s, send segment i−s, receive segment i−s−1 and add it in.
    for s in 0..n - 1 {
        let out = chunks(segment((i + n - s) % n));
        let inn = chunks(segment((i + 2 * n - s - 1) % n));
        for c in 0..out.len().max(inn.len()) {
            if let Some(r) = out.get(c) {
                fabric.send(me, next, tag(0, s, c), pool.filled(&data[r.clone()]))?;
            }
            if let Some(r) = inn.get(c) {
                let got = fabric.recv(me, prev, tag(0, s, c))?;
                for (d, g) in data[r.clone()].iter_mut().zip(got.data.iter()) {
                    *d += g;
                }
                pool.recycle(got);
            }
        }
    }

    // All-gather: member i owns the total of segment i+1; pass totals around the ring.
    let mut forward: Vec<HostTensor> = Vec::new();
    for s in 0..n - 1 {
        let out = chunks(segment((i + 1 + n - s) % n));
        let inn = chunks(segment((i + n - s) % n));
        let mut received = Vec::with_capacity(inn.len());
        for c in 0..out.len().max(inn.len()) {
            if let Some(r) = out.get(c) {
                let payload = if s == 0 {
                    pool.filled(&data[r.clone()])
                } else {
                    forward
                        .get(c)
                        .cloned()
                        .expect("chunk received at the previous step")
                };
                fabric.send(me, next, tag(1, s, c), payload)?;
            }
            if let Some(r) = inn.get(c) {
                let got = fabric.recv(me, prev, tag(1, s, c))?;
                data[r.clone()].copy_from_slice(&got.data);
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
