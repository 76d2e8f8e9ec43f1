//! Quantized sums and gathers (issue 43's `--compress int8`, `qsgd:BITS`, `terngrad`,
//! `--quantize-grads`, `--quantize-weights`): every member's f32 values cross the fabric packed as
//! the edge's codec says, never as f32 — block-wise absmax int8 here (the quantizer of ZeRO++'s
//! qgZ, Wang et al. 2023, and of 8-bit optimizers: blocks of `block` int8 values with one f32
//! scale each, `absmax / 127`, rounded to nearest, deterministic), stochastic levels in
//! [`super::stochastic`].
//!
//! The all-reduce is a direct reduce-scatter then an all-gather, both of quantized shards: member
//! `i` sends every other member `j` its values of shard `j` quantized; `j` dequantizes every
//! member's contribution (its own through the same quantizer, so every contribution is treated
//! alike) and sums them in f32 in member order; then it quantizes that total once and sends it to
//! every other member, and every member — `j` too — takes the dequantized total, so all members
//! end with the same bits. Member `i` reads `(n − 1)·packed(|shardᵢ|) + Σ_{j≠i} packed(|shardⱼ|)`
//! bytes (`packed` the dataflow's `Codec::wire_bytes`; `m + 4·⌈m / block⌉` for int8): about a
//! quarter of the f32 ring's for int8. The reduce-scatter is the first half alone; the
//! all-gather (qwZ's parameter gathers) the second, each member keeping its own shard exact.

use archipelago_dataflow::{ActorId, Codec, CollectiveKind, shard_range};

use super::stochastic::{self, Levels, Salt};

use crate::fabric::{Fabric, FabricError, Tag};
use crate::typed_tensor::{DType, TypedTensor};

/// `values` quantized into a u8 message (sent as it is, to every peer alike): `⌈len / block⌉`
/// f32 scales (little-endian), then `len` int8 values. `block` 0 is the negative control: no
/// scales, each value rounded to an integer.
pub fn pack(values: &[f32], block: usize) -> TypedTensor {
    let blocks = if block == 0 {
        0
    } else {
        values.len().div_ceil(block)
    };
    let mut message = TypedTensor::zeros(DType::U8, vec![4 * blocks + values.len()]).expect("a u8 shape");
    let packed = message.bytes_mut();
    if block == 0 {
        for (q, v) in packed.iter_mut().zip(values) {
            *q = (v.round().clamp(-127.0, 127.0) as i8) as u8;
        }
        return message;
    }
    let (scales, quantized) = packed.split_at_mut(4 * blocks);
    for ((chunk, scale), out) in values
        .chunks(block)
        .zip(scales.chunks_exact_mut(4))
        .zip(quantized.chunks_mut(block))
    {
        let absmax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // A non-finite value makes its whole block NaN on every member (loss scaling sees it).
        let absmax = if chunk.iter().all(|v| v.is_finite()) {
            absmax
        } else {
            f32::NAN
        };
        let s = absmax / 127.0;
        scale.copy_from_slice(&s.to_le_bytes());
        for (q, &v) in out.iter_mut().zip(chunk) {
            let level = if s > 0.0 {
                (v / s).round().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            *q = (level as i8) as u8;
        }
    }
    message
}

/// Adds the values `packed` holds (of `out.len()` elements) into `out`, or writes them when
/// `add` is false. An ill-sized message is an error naming its sender.
fn unpack_into(
    packed: &[u8],
    out: &mut [f32],
    block: usize,
    add: bool,
    from: ActorId,
) -> Result<(), FabricError> {
    let blocks = if block == 0 { 0 } else { out.len().div_ceil(block) };
    if packed.len() != 4 * blocks + out.len() {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} bytes where an int8 shard of {} elements takes {}",
            packed.len(),
            out.len(),
            4 * blocks + out.len()
        )));
    }
    let (scales, quantized) = packed.split_at(4 * blocks);
    let unscaled = [1.0f32.to_le_bytes()];
    let (block, scales) = match block {
        0 => (out.len().max(1), &unscaled[..]),
        _ => (block, bytemuck::cast_slice::<u8, [u8; 4]>(scales)),
    };
    for ((chunk, scale), q) in out.chunks_mut(block).zip(scales).zip(quantized.chunks(block)) {
        let s = f32::from_le_bytes(*scale);
        for (o, &q) in chunk.iter_mut().zip(q) {
            let v = (q as i8) as f32 * s;
            if add {
                *o += v;
            } else {
                *o = v;
            }
        }
    }
    Ok(())
}

/// The bytes of a message: a u8 tensor from `from`.
fn bytes_of(got: &TypedTensor, from: ActorId) -> Result<&[u8], FabricError> {
    if got.dtype() != DType::U8 {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} elements where an int8 collective expects packed u8",
            got.dtype()
        )));
    }
    Ok(got.values::<u8>())
}

/// How an encoded collective's values cross: its codec, ready to pack and unpack.
#[derive(Debug, Clone, Copy)]
pub enum Wire {
    /// Block-wise absmax int8 (`block` 0: the unscaled control).
    Int8 {
        /// Values per scale.
        block: usize,
    },
    /// Stochastic rounding onto evenly spaced levels (QSGD, TernGrad).
    Levels(Levels),
}

impl Wire {
    /// The wire of `codec` (`None` for values crossing as their dtype, and for top-k's pairs:
    /// [`super::sparse`]).
    pub fn of(codec: Codec) -> Option<Wire> {
        match codec {
            Codec::None | Codec::TopK { .. } | Codec::OneBit { .. } => None,
            Codec::Int8 { block } => Some(Wire::Int8 {
                block: block as usize,
            }),
            Codec::Qsgd { .. } | Codec::TernGrad { .. } => Levels::of(codec).map(Wire::Levels),
        }
    }

    fn pack(&self, values: &[f32], salt: Salt) -> TypedTensor {
        match self {
            Wire::Int8 { block } => pack(values, *block),
            Wire::Levels(levels) => stochastic::pack(values, levels, salt),
        }
    }

    fn unpack_into(
        &self,
        packed: &[u8],
        out: &mut [f32],
        add: bool,
        from: ActorId,
    ) -> Result<(), FabricError> {
        match self {
            Wire::Int8 { block } => unpack_into(packed, out, *block, add, from),
            Wire::Levels(levels) => stochastic::unpack_into(packed, out, levels, add, from),
        }
    }
}

/// A member's place in its group and the tags of its messages.
struct Exchange<'a> {
    fabric: &'a dyn Fabric,
    me: ActorId,
    i: usize,
    group: &'a [ActorId],
    edge: u64,
    wire: Wire,
}

impl<'a> Exchange<'a> {
    fn new(
        fabric: &'a dyn Fabric,
        me: ActorId,
        group: &'a [ActorId],
        edge: u64,
        wire: Wire,
    ) -> Result<Self, FabricError> {
        let i = group
            .iter()
            .position(|&a| a == me)
            .ok_or(FabricError::NoSuchActor(me))?;
        Ok(Exchange {
            fabric,
            me,
            i,
            group,
            edge,
            wire,
        })
    }

    /// The randomness of this member's phase-`phase` message of the values from `offset`.
    fn salt(&self, phase: u64, offset: usize) -> Salt {
        Salt {
            edge: self.edge,
            phase,
            sender: self.i,
            offset,
        }
    }

    /// Phase `phase`'s message from member `sender`.
    fn tag(&self, phase: u64, sender: usize) -> Tag {
        Tag {
            edge: self.edge,
            seq: (phase << 32) | sender as u64,
        }
    }

    fn send(&self, to: ActorId, phase: u64, message: TypedTensor) -> Result<(), FabricError> {
        self.fabric.send(self.me, to, self.tag(phase, self.i), message)
    }

    /// The direct reduce-scatter: afterwards `data[shard i]` holds the sum of every member's
    /// dequantized values of it, in member order.
    fn reduce_scatter(&self, data: &mut [f32]) -> Result<(), FabricError> {
        let (n, len) = (self.group.len(), data.len());
        for (j, &peer) in self.group.iter().enumerate().filter(|&(j, _)| j != self.i) {
            let shard = shard_range(len, n, j);
            let message = self.wire.pack(&data[shard.clone()], self.salt(0, shard.start));
            self.send(peer, 0, message)?;
        }
        let own = shard_range(len, n, self.i);
        let mine = self.wire.pack(&data[own.clone()], self.salt(0, own.start));
        let total = &mut data[own];
        total.iter_mut().for_each(|t| *t = 0.0);
        for (j, &member) in self.group.iter().enumerate() {
            if j == self.i {
                self.wire.unpack_into(mine.bytes(), total, true, member)?;
            } else {
                let got = self.fabric.recv(self.me, member, self.tag(0, j))?;
                self.wire
                    .unpack_into(bytes_of(&got, member)?, total, true, member)?;
            }
        }
        Ok(())
    }

    /// The stochastic codecs' all-reduce (QSGD's and TernGrad's exchange): this member's whole
    /// contribution quantized once and sent to every other member; every member sums every
    /// member's dequantized contribution (its own through the same message) in member order, so
    /// all end with the same bits and no total is rounded again.
    fn gather_sum(&self, data: &mut [f32]) -> Result<(), FabricError> {
        let mine = self.wire.pack(data, self.salt(0, 0));
        for (_, &peer) in self.group.iter().enumerate().filter(|&(j, _)| j != self.i) {
            self.send(peer, 0, mine.clone())?;
        }
        data.iter_mut().for_each(|t| *t = 0.0);
        for (j, &member) in self.group.iter().enumerate() {
            if j == self.i {
                self.wire.unpack_into(mine.bytes(), data, true, member)?;
            } else {
                let got = self.fabric.recv(self.me, member, self.tag(0, j))?;
                self.wire
                    .unpack_into(bytes_of(&got, member)?, data, true, member)?;
            }
        }
        Ok(())
    }

    /// The all-gather of quantized shards: every other shard becomes the dequantized values its
    /// owner sent, and this member's own too when `own_alike` (the all-reduce's totals, so that
    /// every member ends with the same bits); without it the own shard stays exact (qwZ's
    /// parameters: the owner's master is never rounded).
    fn all_gather(&self, data: &mut [f32], own_alike: bool) -> Result<(), FabricError> {
        let (n, len) = (self.group.len(), data.len());
        let own = shard_range(len, n, self.i);
        let mine = self.wire.pack(&data[own.clone()], self.salt(1, own.start));
        for (_, &peer) in self.group.iter().enumerate().filter(|&(j, _)| j != self.i) {
            self.send(peer, 1, mine.clone())?;
        }
        if own_alike {
            self.wire
                .unpack_into(mine.bytes(), &mut data[own], false, self.me)?;
        }
        for (j, &member) in self.group.iter().enumerate().filter(|&(j, _)| j != self.i) {
            let got = self.fabric.recv(self.me, member, self.tag(1, j))?;
            let shard = &mut data[shard_range(len, n, j)];
            self.wire
                .unpack_into(bytes_of(&got, member)?, shard, false, member)?;
        }
        Ok(())
    }
}

/// Runs collective `kind` over `data` in place with every value crossing as `wire` says (see
/// the module docs): the all-reduce (sum), the reduce-scatter (member `i` ends with the total of
/// `data[shard_range(len, n, i)]`, the other shards left as they were) and the all-gather
/// (member `i` brings its shard and keeps it exact); any other kind is refused. Every member
/// calls it with the same `kind`, `edge`, `group`, `wire` and length.
pub fn quantized_collective(
    fabric: &dyn Fabric,
    me: ActorId,
    kind: CollectiveKind,
    (group, edge): (&[ActorId], u64),
    data: &mut [f32],
    wire: Wire,
) -> Result<(), FabricError> {
    let supported = [
        CollectiveKind::AllReduceSum,
        CollectiveKind::ReduceScatterSum,
        CollectiveKind::AllGather,
    ];
    if !supported.contains(&kind) {
        return Err(FabricError::Aborted(format!(
            "{kind:?} has no quantized form (sums and gathers only)"
        )));
    }
    if group.len() < 2 {
        return Ok(());
    }
    let exchange = Exchange::new(fabric, me, group, edge, wire)?;
    if kind == CollectiveKind::AllReduceSum && matches!(wire, Wire::Levels(_)) {
        return exchange.gather_sum(data);
    }
    if kind != CollectiveKind::AllGather {
        exchange.reduce_scatter(data)?;
    }
    match kind {
        CollectiveKind::ReduceScatterSum => Ok(()),
        // The all-reduce's totals are taken alike by every member, owner too (the same bits).
        _ => exchange.all_gather(data, kind == CollectiveKind::AllReduceSum),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::members_tests::on_members;

    #[test]
    fn a_block_round_trips_within_half_a_level_and_zeros_stay_zero() {
        let values: Vec<f32> = (0..1000).map(|k| ((k * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let packed = pack(&values, 64);
        assert_eq!(packed.byte_len(), 1000 + 4 * 16);
        let mut back = vec![0.0; 1000];
        unpack_into(packed.bytes(), &mut back, 64, false, 0).unwrap();
        for (block, got) in values.chunks(64).zip(back.chunks(64)) {
            let level = block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (v, g) in block.iter().zip(got) {
                assert!((v - g).abs() <= level * 0.5 + 1e-6, "{v} came back as {g}");
            }
        }
        let zeros = pack(&[0.0; 10], 4);
        let mut back = vec![1.0; 10];
        unpack_into(zeros.bytes(), &mut back, 4, false, 0).unwrap();
        assert_eq!(back, [0.0; 10]);
        let mut short = vec![0.0; 11];
        let refused = unpack_into(zeros.bytes(), &mut short, 4, false, 3)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("actor 3 sent 22 bytes"), "{refused}");
    }

    /// Runs the int8 all-reduce over `n` members of an in-process fabric; every member's result
    /// and the bytes it read.
    fn all_reduce(n: usize, inputs: &[Vec<f32>], wire: Wire) -> Vec<(Vec<f32>, u64)> {
        on_members(n, |me, fabric, group| {
            let mut data = inputs[me].clone();
            crate::fabric::read_count::take();
            let sum = CollectiveKind::AllReduceSum;
            quantized_collective(fabric, me, sum, (group, 7), &mut data, wire).unwrap();
            (data, crate::fabric::read_count::take())
        })
    }

    /// qwZ's gather: every member ends with its own shard exact and the others' within half a
    /// level, reading the others' packed shards.
    #[test]
    fn a_gather_keeps_the_own_shard_exact_and_the_others_near() {
        let (n, len, block) = (3, 1001, 64);
        let values: Vec<f32> = (0..len).map(|k| ((k * 13 % 89) as f32 - 44.0) / 9.0).collect();
        let results: Vec<(Vec<f32>, u64)> = on_members(n, |me, fabric, group| {
            let mut data = vec![0.0f32; len];
            let own = shard_range(len, n, me);
            data[own.clone()].copy_from_slice(&values[own]);
            crate::fabric::read_count::take();
            let gather = CollectiveKind::AllGather;
            let wire = Wire::Int8 { block };
            quantized_collective(fabric, me, gather, (group, 9), &mut data, wire).unwrap();
            (data, crate::fabric::read_count::take())
        });
        let packed = |m: usize| (m + 4 * m.div_ceil(block)) as u64;
        for (me, (got, read)) in results.iter().enumerate() {
            let own = shard_range(len, n, me);
            assert_eq!(&got[own.clone()], &values[own], "member {me}'s own shard");
            for (k, (g, v)) in got.iter().zip(&values).enumerate() {
                assert!(
                    (g - v).abs() <= 44.0 / 9.0 / 127.0 / 2.0 + 1e-6,
                    "member {me} element {k}: {g} for {v}"
                );
            }
            let others: u64 = (0..n)
                .filter(|&j| j != me)
                .map(|j| packed(shard_range(len, n, j).len()))
                .sum();
            assert_eq!(*read, others, "member {me}");
        }
    }

    #[test]
    fn every_member_ends_with_the_same_bits_near_the_exact_sum_reading_a_quarter() {
        for (n, len, block) in [(2, 1000, 64), (3, 1001, 256), (4, 37, 8)] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|m| {
                    (0..len)
                        .map(|k| (((k * 31 + m * 17) % 97) as f32 - 48.0) / 10.0)
                        .collect()
                })
                .collect();
            let results = all_reduce(n, &inputs, Wire::Int8 { block });
            let exact: Vec<f32> = (0..len).map(|k| inputs.iter().map(|v| v[k]).sum()).collect();
            for (me, (got, read)) in results.iter().enumerate() {
                assert_eq!(got, &results[0].0, "member {me} differs from member 0");
                let packed = |m: usize| (m + 4 * m.div_ceil(block)) as u64;
                let own = shard_range(len, n, me).len();
                let others: u64 = (0..n)
                    .filter(|&j| j != me)
                    .map(|j| packed(shard_range(len, n, j).len()))
                    .sum();
                assert_eq!(*read, (n as u64 - 1) * packed(own) + others, "n={n} member {me}");
            }
            // n contributions of at most half a level (4.8/127/2) each, then the total's own.
            let bound = (n as f32 + n as f32) * 4.8 / 127.0 / 2.0 + 1e-5;
            for (k, (g, e)) in results[0].0.iter().zip(&exact).enumerate() {
                assert!((g - e).abs() <= bound, "n={n} element {k}: {g} against {e}");
            }
        }
    }

    /// QSGD and TernGrad: every member ends with the same bits, within a level spacing of each
    /// contribution's scale of the exact sum, reading every other member's packed contribution
    /// (what the dataflow predicts).
    #[test]
    fn stochastic_sums_agree_on_every_member_near_the_exact_sum() {
        for codec in [
            Codec::Qsgd {
                bits: 4,
                chunk: 64,
                seed: 1,
            },
            Codec::Qsgd {
                bits: 8,
                chunk: 512,
                seed: 1,
            },
            Codec::TernGrad { chunk: 64, seed: 1 },
        ] {
            let (n, len) = (3, 1001);
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|m| {
                    (0..len)
                        .map(|k| (((k * 31 + m * 17) % 97) as f32 - 48.0) / 10.0)
                        .collect()
                })
                .collect();
            let results = all_reduce(n, &inputs, Wire::of(codec).unwrap());
            let spacing = 2.0 / (codec.levels().unwrap() - 1) as f32;
            let bound = n as f32 * 4.8 * spacing + 1e-4;
            for (me, (got, read)) in results.iter().enumerate() {
                assert_eq!(got, &results[0].0, "{codec}: member {me} differs from member 0");
                // Every other member's whole contribution, packed.
                let packed = codec.wire_bytes(len as u64, 4);
                assert_eq!(*read, (n as u64 - 1) * packed, "{codec}: member {me}");
            }
            for k in 0..len {
                let exact: f32 = inputs.iter().map(|v| v[k]).sum();
                let got = results[0].0[k];
                assert!(
                    (got - exact).abs() <= bound,
                    "{codec}: element {k}: {got} against {exact}"
                );
            }
        }
    }
}
