//! Top-k sparsification with error feedback (issue 43's `--compress topk:RATIO`; Aji & Heafield
//! 2017, "Sparse Communication for Distributed Gradient Descent"; Lin et al. 2018, Deep Gradient
//! Compression): each replica adds its error-feedback residual to its gradient bucket, sends the
//! `k` entries of largest magnitude of that sum as (index, value) pairs and keeps the rest as the
//! next step's residual — nothing is dropped, only delayed. The sparse contributions are reduced
//! by a collective of their own: every replica sends its pairs to every other (an all-gather of
//! the sparse parts, never a dense all-reduce of mostly zeros), and every replica adds every
//! replica's pairs, its own from the same message, into a zeroed bucket in replica order — all
//! end with the same bits. Member `i` reads `(n − 1)·8k` bytes (the dataflow's
//! `Codec::wire_bytes`).
//!
//! Under SGD with momentum the exchange takes the momentum (Deep Gradient Compression's momentum
//! correction, Lin et al. 2018, §3.2): each replica keeps a velocity `u ← m·u + g` of its own
//! gradient and accumulates `u` into its residual, so that what it sends, summed over the
//! replicas, is the momentum SGD would have applied; where it sent, both its residual and its
//! velocity are zeroed (momentum factor masking, §3.3: a stale velocity would push an entry
//! that has just moved). The optimizer runs plain SGD on the summed velocities. At a ratio of 1
//! every entry is sent and masked each step, so the velocity never outlives a step: plain SGD.

use std::collections::HashMap;

use archipelago_dataflow::{ActorId, Codec};

use crate::fabric::{Fabric, FabricError, Tag};
use crate::typed_tensor::{DType, TypedTensor};

/// Each bucket's error-feedback residual on one replica (its own gradient's leftover, sized like
/// its bucket), by the bucket's collective tag; under momentum correction its velocity too, by
/// [`VELOCITY`] above the tag.
pub type Residuals = HashMap<u64, Vec<f32>>;

/// The key of a bucket's velocity in [`Residuals`]: this bit above its tag (1-bit Adam's kinds
/// of state use the same high half, in runs of their own).
pub const VELOCITY: u64 = 1 << 32;

/// The shape of a top-k exchange.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopK {
    /// Entries kept per million of the bucket.
    pub per_million: u32,
    /// Whether the leftover is fed back (false: the negative control, dropped).
    pub feedback: bool,
    /// The momentum moved into the exchange (0: none).
    pub momentum: f32,
}

impl TopK {
    /// The top-k shape of `codec` (`None` for the others).
    pub fn of(codec: Codec) -> Option<TopK> {
        match codec {
            Codec::TopK {
                per_million,
                feedback,
                momentum_bits,
            } => Some(TopK {
                per_million,
                feedback,
                momentum: f32::from_bits(momentum_bits),
            }),
            _ => None,
        }
    }

    /// Entries sent of a bucket of `len` (the dataflow's `Codec::kept`).
    fn k(&self, len: usize) -> usize {
        Codec::TopK {
            per_million: self.per_million,
            feedback: self.feedback,
            momentum_bits: self.momentum.to_bits(),
        }
        .kept(len as u64) as usize
    }
}

/// The indices of the `k` entries of largest magnitude, ascending (ties to the lower index, so
/// the choice repeats).
fn top_indices(values: &[f32], k: usize) -> Vec<u32> {
    let mut indices: Vec<u32> = (0..values.len() as u32).collect();
    if k < indices.len() {
        let larger_first = |a: &u32, b: &u32| {
            let (x, y) = (values[*a as usize].abs(), values[*b as usize].abs());
            y.total_cmp(&x).then(a.cmp(b))
        };
        indices.select_nth_unstable_by(k, larger_first);
        indices.truncate(k);
    }
    indices.sort_unstable();
    indices
}

/// The pairs as a u8 message: `k` little-endian u32 indices, then their `k` f32 values.
fn pack(indices: &[u32], values: &[f32]) -> TypedTensor {
    let k = indices.len();
    let mut message = TypedTensor::zeros(DType::U8, vec![8 * k]).expect("a u8 shape");
    let (index_bytes, value_bytes) = message.bytes_mut().split_at_mut(4 * k);
    for ((out, &i), value_out) in index_bytes
        .chunks_exact_mut(4)
        .zip(indices)
        .zip(value_bytes.chunks_exact_mut(4))
    {
        out.copy_from_slice(&i.to_le_bytes());
        value_out.copy_from_slice(&values[i as usize].to_le_bytes());
    }
    message
}

/// Adds the pairs of `message` (from `from`) into `out`; a message of another size, or an index
/// outside the bucket, is an error naming the sender.
fn scatter_add(message: &TypedTensor, out: &mut [f32], k: usize, from: ActorId) -> Result<(), FabricError> {
    if message.dtype() != DType::U8 || message.byte_len() != 8 * k {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} bytes of {} where the top-{k} of a {}-element bucket takes {} u8",
            message.byte_len(),
            message.dtype(),
            out.len(),
            8 * k
        )));
    }
    let (index_bytes, value_bytes) = message.bytes().split_at(4 * k);
    for (i, v) in index_bytes.chunks_exact(4).zip(value_bytes.chunks_exact(4)) {
        let i = u32::from_le_bytes(i.try_into().expect("4 bytes")) as usize;
        let v = f32::from_le_bytes(v.try_into().expect("4 bytes"));
        let Some(slot) = out.get_mut(i) else {
            return Err(FabricError::Aborted(format!(
                "actor {from} sent index {i} for a bucket of {} elements",
                out.len()
            )));
        };
        *slot += v;
    }
    Ok(())
}

/// Adds `data` into its velocity (`u ← m·u + g`, when `topk` takes a momentum) and `data` plus
/// the residual into `data`: what is offered to the top-k.
fn accumulate(data: &mut [f32], topk: TopK, tag: u64, residuals: &mut Residuals) {
    if topk.momentum != 0.0 {
        let velocity = residuals.entry(VELOCITY | tag).or_default();
        velocity.resize(data.len(), 0.0);
        for (d, u) in data.iter_mut().zip(velocity.iter_mut()) {
            *u = topk.momentum * *u + *d;
            *d = *u;
        }
    }
    let residual = residuals.entry(tag).or_default();
    residual.resize(data.len(), 0.0);
    data.iter_mut().zip(residual.iter()).for_each(|(d, r)| *d += r);
}

/// Keeps what of `offered` is not sent as the next residual (nothing, in the control), and
/// zeroes the velocity where it was sent (momentum factor masking).
fn hold_back(offered: &[f32], sent: &[u32], topk: TopK, tag: u64, residuals: &mut Residuals) {
    let residual = residuals.get_mut(&tag).expect("accumulated this step");
    residual.copy_from_slice(offered);
    sent.iter().for_each(|&j| residual[j as usize] = 0.0);
    if !topk.feedback {
        residual.iter_mut().for_each(|r| *r = 0.0);
    }
    if let Some(velocity) = residuals.get_mut(&(VELOCITY | tag)) {
        sent.iter().for_each(|&j| velocity[j as usize] = 0.0);
    }
}

/// The sum over `group` of every member's top-k of `data` plus its residual (its velocity plus
/// its residual, under momentum correction), in `data`, with the residual of bucket `edge` (the
/// low 32 bits: the collective's tag) kept in `residuals`. Every member calls it with the same
/// `edge`, `group`, `topk` and length.
pub fn topk_all_reduce(
    fabric: &dyn Fabric,
    me: ActorId,
    (group, edge): (&[ActorId], u64),
    data: &mut [f32],
    topk: TopK,
    residuals: &mut Residuals,
) -> Result<(), FabricError> {
    if group.len() < 2 {
        return Ok(());
    }
    let i = group
        .iter()
        .position(|&a| a == me)
        .ok_or(FabricError::NoSuchActor(me))?;
    if u32::try_from(data.len()).is_err() {
        return Err(FabricError::Aborted(format!(
            "a top-k bucket of {} elements is past the u32 indices its pairs carry: use a smaller --bucket-mb",
            data.len()
        )));
    }
    let bucket = edge & 0xffff_ffff;
    accumulate(data, topk, bucket, residuals);
    let k = topk.k(data.len());
    let kept = top_indices(data, k);
    let mine = pack(&kept, data);
    hold_back(data, &kept, topk, bucket, residuals);
    let tag = |sender: usize| Tag {
        edge,
        seq: sender as u64,
    };
    for (_, &peer) in group.iter().enumerate().filter(|&(j, _)| j != i) {
        fabric.send(me, peer, tag(i), mine.clone())?;
    }
    data.iter_mut().for_each(|d| *d = 0.0);
    for (j, &member) in group.iter().enumerate() {
        if j == i {
            scatter_add(&mine, data, k, member)?;
        } else {
            let got = fabric.recv(me, member, tag(j))?;
            scatter_add(&got, data, k, member)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::members_tests::on_members;

    #[test]
    fn the_largest_magnitudes_are_kept_ties_to_the_lower_index() {
        let values = [0.5, -3.0, 1.0, 3.0, 0.0, -0.5, 2.0];
        assert_eq!(top_indices(&values, 3), [1, 3, 6]);
        assert_eq!(top_indices(&values, 1), [1]);
        assert_eq!(top_indices(&values, 7), [0, 1, 2, 3, 4, 5, 6]);
        let message = pack(&[1, 3], &values);
        let mut out = [1.0; 7];
        scatter_add(&message, &mut out, 2, 0).unwrap();
        assert_eq!(out, [1.0, -2.0, 1.0, 4.0, 1.0, 1.0, 1.0]);
        let refused = scatter_add(&message, &mut out, 3, 5).unwrap_err().to_string();
        assert!(refused.contains("actor 5 sent 16 bytes"), "{refused}");
        let refused = scatter_add(&message, &mut [0.0; 2], 2, 5)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("index 3 for a bucket of 2"), "{refused}");
    }

    /// Runs `steps` top-k all-reduces of `inputs` over an in-process fabric, every member
    /// keeping its residuals; every member's results and the bytes it read in the last.
    fn reduce_steps(inputs: &[Vec<f32>], topk: TopK, steps: usize) -> Vec<(Vec<Vec<f32>>, u64)> {
        on_members(inputs.len(), |me, fabric, group| {
            let mut residuals = Residuals::new();
            let mut results = Vec::new();
            let mut read = 0;
            for step in 0..steps as u64 {
                crate::fabric::read_count::take();
                let mut data = inputs[me].clone();
                let call = (group, (step << 32) | 4);
                topk_all_reduce(fabric, me, call, &mut data, topk, &mut residuals).unwrap();
                read = crate::fabric::read_count::take();
                results.push(data);
            }
            (results, read)
        })
    }

    /// With feedback, what a step leaves is sent later: summed over enough steps every member
    /// has sent its whole gradient each step (the sum of the sent totals approaches steps × the
    /// exact sum); every member ends with the same bits, reading `(n − 1)·8k` bytes. Without
    /// feedback (the control) the small entries are never sent.
    #[test]
    fn with_feedback_nothing_is_lost_only_delayed_and_without_it_the_control_loses_it() {
        let (n, len, steps) = (3, 100, 200);
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|m| {
                (0..len)
                    .map(|k| (((k * 31 + m * 17) % 97) as f32 - 48.0) / 10.0)
                    .collect()
            })
            .collect();
        let exact: Vec<f32> = (0..len).map(|k| inputs.iter().map(|v| v[k]).sum()).collect();
        for feedback in [true, false] {
            let topk = TopK {
                per_million: 100_000,
                feedback,
                momentum: 0.0,
            };
            let results = reduce_steps(&inputs, topk, steps);
            for (me, (sums, read)) in results.iter().enumerate() {
                assert_eq!(sums, &results[0].0, "member {me} differs from member 0");
                assert_eq!(*read, (n as u64 - 1) * 8 * 10, "member {me}");
            }
            let sent: Vec<f32> = (0..len)
                .map(|k| results[0].0.iter().map(|s| s[k]).sum())
                .collect();
            // What is still held back is a residual per member, whatever the steps: an entry
            // waits until it is among the k largest, which k entries leave each step, so the
            // threshold settles near Σ|g| / k; twice that plus a step's largest, per member.
            let bound: f32 = (inputs.iter())
                .map(|g| {
                    let (sum, max) = g
                        .iter()
                        .fold((0.0f32, 0.0f32), |(s, m), v| (s + v.abs(), m.max(v.abs())));
                    2.0 * (sum / 10.0 + max)
                })
                .sum();
            let worst = (sent.iter().zip(&exact))
                .map(|(s, e)| (s - e * steps as f32).abs())
                .fold(0.0f32, f32::max);
            eprintln!("feedback {feedback}: {worst} held back (bound {bound})");
            match feedback {
                true => assert!(worst <= bound, "feedback: {worst} held back, over {bound}"),
                false => assert!(worst > 2.0 * bound, "the control lost only {worst}"),
            }
        }
    }

    /// Momentum correction by hand (momentum 0.5, top-1 of two entries, member 1 sending
    /// zeros): the velocity accumulates into the residual, and where an entry is sent both are
    /// zeroed; the control drops the residual but keeps the masked velocity. At a ratio of 1
    /// everything is sent and masked each step: the sum is every step's plain gradient sum.
    #[test]
    fn the_velocity_accumulates_into_the_residual_and_is_masked_where_sent() {
        let inputs = [vec![1.0, 0.6], vec![0.0, 0.0]];
        let topk = |feedback, per_million| TopK {
            per_million,
            feedback,
            momentum: 0.5,
        };
        for (feedback, expected) in [
            (true, [[1.0, 0.0], [0.0, 1.5], [2.5, 0.0]]),
            (false, [[1.0, 0.0], [1.0, 0.0], [0.0, 1.05]]),
        ] {
            let results = reduce_steps(&inputs, topk(feedback, 500_000), 3);
            for (step, (got, want)) in results[0].0.iter().zip(expected).enumerate() {
                let close = got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6);
                assert!(close, "feedback {feedback}, step {step}: {got:?}, not {want:?}");
            }
            assert_eq!(results[1].0, results[0].0, "the members agree");
        }
        let results = reduce_steps(&inputs, topk(true, 1_000_000), 3);
        assert!(
            results[0].0.iter().all(|sum| sum == &inputs[0]),
            "{:?}",
            results[0].0
        );
    }
}
