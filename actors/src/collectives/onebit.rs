//! 1-bit Adam's exchange (issue 43's `--optimizer onebit-adam --freeze-step W`; Tang et al. 2021,
//! "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", after
//! Seide et al. 2014's 1-bit SGD). Up to step `W` a bucket is an f32 gradient all-reduce — plain
//! Adam, whose variance is still learning — while each member keeps Adam's two moments of the
//! sums (the expressions the optimizer evaluates, so they agree bit for bit). After it the
//! variance is frozen and the momentum is what crosses:
//!
//! 1. each member forms its momentum estimate `β1·m + (1 − β1)·n·g` (its own gradient share
//!    `g`, times the `n` members, in place of the average) plus its *worker error*, and sends
//!    shard `j` of it to member `j` as a sign bit a value and a scale per chunk — the chunk's
//!    root mean square, so the signs carry its L2 norm — keeping what the rounding lost as its
//!    next worker error;
//! 2. member `j` averages the members' shard `j` (in member order), adds its *server error*,
//!    rounds the same way, keeps the loss as its next server error, and sends the rounded shard
//!    to every member;
//! 3. every member decodes every shard: the new momentum, the same bits everywhere.
//!
//! A parameter whose gradient was 0 through the whole warm-up (a dead ReLU unit) froze with a
//! variance of 0; a sign carries no zero, so its momentum would be `±scale` and its update
//! `lr·scale/ε`: its momentum is held at 0 while frozen (DeepSpeed asks the user for such a
//! mask, `exp_avg_mask`; here it is found).
//!
//! The optimizer then steps with that momentum and the frozen variance (`optim::adam`). Member
//! `i` reads `(n − 1)` shards in each phase: `⌈len/8⌉ + 4⌈len/chunk⌉` bytes a shard (the
//! dataflow's `Codec::wire_bytes`), 32× fewer than f32's reduce-scatter and all-gather, less the
//! scales. The momentum and both errors are each member's state, kept with top-k's residuals
//! (keys beside the bucket's tag) and saved in checkpoints with them.

use archipelago_dataflow::{ActorId, Codec};

use super::ring_all_reduce::shard_range;
use super::sparse::Residuals;
use crate::fabric::{Fabric, FabricError, Tag};
use crate::typed_tensor::{DType, TypedTensor};

/// The shape of 1-bit Adam's exchange.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneBit {
    /// The last step of plain Adam.
    pub freeze_step: u64,
    /// Adam's first-moment decay.
    pub beta1: f32,
    /// Adam's second-moment decay.
    pub beta2: f32,
    /// Adam's ε.
    pub eps: f32,
    /// Values per scale.
    pub chunk: usize,
    /// Whether both errors are fed back (false: the negative control drops them).
    pub feedback: bool,
}

impl OneBit {
    /// The 1-bit shape of `codec` (`None` for the others).
    pub fn of(codec: Codec) -> Option<OneBit> {
        match codec {
            Codec::OneBit {
                freeze_step,
                adam_bits: [beta1, beta2, eps],
                chunk,
                feedback,
            } => Some(OneBit {
                freeze_step: u64::from(freeze_step),
                beta1: f32::from_bits(beta1),
                beta2: f32::from_bits(beta2),
                eps: f32::from_bits(eps),
                chunk: chunk.max(1) as usize,
                feedback,
            }),
            _ => None,
        }
    }
}

/// Which state of a bucket a key of [`Residuals`] holds (beside the tag in the low 32 bits).
#[derive(Clone, Copy)]
enum Kept {
    Momentum = 1,
    WorkerError = 2,
    ServerError = 3,
    Variance = 4,
}

fn key(tag: u64, kept: Kept) -> u64 {
    ((kept as u64) << 32) | tag
}

/// `values` as signs and a scale per chunk (the message), with `values` left holding what the
/// rounding lost (`values − decoded`).
fn encode(values: &mut [f32], chunk: usize) -> TypedTensor {
    let chunks = values.len().div_ceil(chunk);
    let mut message =
        TypedTensor::zeros(DType::U8, vec![4 * chunks + values.len().div_ceil(8)]).expect("a u8 shape");
    let (scale_bytes, sign_bytes) = message.bytes_mut().split_at_mut(4 * chunks);
    for (c, (part, out)) in values
        .chunks_mut(chunk)
        .zip(scale_bytes.chunks_exact_mut(4))
        .enumerate()
    {
        let squares: f64 = part.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let scale = (squares / part.len() as f64).sqrt() as f32;
        out.copy_from_slice(&scale.to_le_bytes());
        for (e, x) in part.iter_mut().enumerate() {
            let at = c * chunk + e;
            // sign(0) = +1, as DeepSpeed's compressed all-reduce.
            let positive = *x >= 0.0;
            if positive {
                sign_bytes[at / 8] |= 1 << (at % 8);
            }
            *x -= if positive { scale } else { -scale };
        }
    }
    message
}

/// Adds the values `message` (from actor `from`) encodes into `out`, after checking its length.
fn decode_add(
    message: &TypedTensor,
    out: &mut [f32],
    chunk: usize,
    from: ActorId,
) -> Result<(), FabricError> {
    let chunks = out.len().div_ceil(chunk);
    let expected = 4 * chunks + out.len().div_ceil(8);
    if message.dtype() != DType::U8 || message.byte_len() != expected {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} bytes of {} for a 1-bit shard of {} values ({expected} bytes)",
            message.byte_len(),
            message.dtype(),
            out.len()
        )));
    }
    let (scale_bytes, sign_bytes) = message.bytes().split_at(4 * chunks);
    for (c, (part, scale)) in out.chunks_mut(chunk).zip(scale_bytes.chunks_exact(4)).enumerate() {
        let scale = f32::from_le_bytes(scale.try_into().expect("4 bytes"));
        for (e, x) in part.iter_mut().enumerate() {
            let at = c * chunk + e;
            let positive = sign_bytes[at / 8] & (1 << (at % 8)) != 0;
            *x += if positive { scale } else { -scale };
        }
    }
    Ok(())
}

/// The state of `key`, sized `len` (zeros when new).
fn state(kept: &mut Residuals, key: u64, len: usize) -> Vec<f32> {
    let mut values = kept.remove(&key).unwrap_or_default();
    values.resize(len, 0.0);
    values
}

/// 1-bit Adam's all-reduce of bucket `edge` (step in the high 32 bits, tag in the low): up to
/// the freeze `dense` sums `data` (the f32 all-reduce) and Adam's moments of the sums are kept;
/// after it `data` (this member's gradient share) is replaced by the exchanged momentum. Every
/// member calls it with the same `edge`, `group`, `onebit` and length.
pub fn onebit_all_reduce(
    fabric: &dyn Fabric,
    me: ActorId,
    (group, edge): (&[ActorId], u64),
    data: &mut [f32],
    onebit: OneBit,
    kept: &mut Residuals,
    dense: impl FnOnce(&mut [f32]) -> Result<(), FabricError>,
) -> Result<(), FabricError> {
    let (step, tag) = (edge >> 32, edge & 0xffff_ffff);
    let mut momentum = state(kept, key(tag, Kept::Momentum), data.len());
    let mut variance = state(kept, key(tag, Kept::Variance), data.len());
    if step <= onebit.freeze_step {
        dense(data)?;
        let (beta1, beta2) = (onebit.beta1, onebit.beta2);
        // Adam's own expressions (`optim::adam`), so the optimizer's moments and these agree.
        for ((m, v), g) in momentum.iter_mut().zip(variance.iter_mut()).zip(data.iter()) {
            *m = beta1 * *m + (1.0 - beta1) * g;
            *v = beta2 * *v + (1.0 - beta2) * g * g;
        }
    } else {
        let mut errors = Errors {
            worker: state(kept, key(tag, Kept::WorkerError), data.len()),
            server: Vec::new(),
        };
        let exchange = Exchange {
            fabric,
            me,
            group,
            edge,
            onebit,
        };
        let mine = exchange.shard(data.len(), exchange.index()?);
        errors.server = state(kept, key(tag, Kept::ServerError), mine.len());
        exchange.run(data, &momentum, &variance, &mut errors)?;
        momentum.copy_from_slice(data);
        kept.insert(key(tag, Kept::WorkerError), errors.worker);
        kept.insert(key(tag, Kept::ServerError), errors.server);
    }
    kept.insert(key(tag, Kept::Momentum), momentum);
    kept.insert(key(tag, Kept::Variance), variance);
    Ok(())
}

/// A member's two error-feedback buffers: its whole bucket's (worker) and its shard's (server).
struct Errors {
    worker: Vec<f32>,
    server: Vec<f32>,
}

/// One compressed momentum exchange of a bucket among `group`.
struct Exchange<'a> {
    fabric: &'a dyn Fabric,
    me: ActorId,
    group: &'a [ActorId],
    edge: u64,
    onebit: OneBit,
}

impl Exchange<'_> {
    fn index(&self) -> Result<usize, FabricError> {
        (self.group.iter().position(|&a| a == self.me)).ok_or(FabricError::NoSuchActor(self.me))
    }

    fn shard(&self, len: usize, j: usize) -> std::ops::Range<usize> {
        shard_range(len, self.group.len(), j)
    }

    /// Phase `phase`'s message from member `sender`.
    fn tag(&self, phase: usize, sender: usize) -> Tag {
        Tag {
            edge: self.edge,
            seq: (phase * self.group.len() + sender) as u64,
        }
    }

    /// Sends `message` to every other member as this member's message of `phase`.
    fn to_all(&self, phase: usize, i: usize, message: &TypedTensor) -> Result<(), FabricError> {
        for (_, &peer) in self.group.iter().enumerate().filter(|&(j, _)| j != i) {
            self.fabric
                .send(self.me, peer, self.tag(phase, i), message.clone())?;
        }
        Ok(())
    }

    /// Adds member `j`'s message of `phase` (`own` when `j` is this member) into `out`.
    fn add_from(
        &self,
        phase: usize,
        j: usize,
        own: &TypedTensor,
        out: &mut [f32],
    ) -> Result<(), FabricError> {
        let (member, chunk) = (self.group[j], self.onebit.chunk);
        if member == self.me {
            return decode_add(own, out, chunk, member);
        }
        let got = self.fabric.recv(self.me, member, self.tag(phase, j))?;
        decode_add(&got, out, chunk, member)
    }

    /// The three phases: `data` (this member's gradient share) becomes the exchanged momentum,
    /// from the last momentum `momentum`; a parameter whose variance froze at 0 (no gradient
    /// through the warm-up) keeps a momentum of 0 — DeepSpeed's `exp_avg_mask`, found rather
    /// than asked for — since a sign carries no zero and its update would be `±scale/ε`.
    fn run(
        &self,
        data: &mut [f32],
        momentum: &[f32],
        variance: &[f32],
        errors: &mut Errors,
    ) -> Result<(), FabricError> {
        let (i, n, beta1) = (self.index()?, self.group.len(), self.onebit.beta1);
        let live = |v: f32| if v == 0.0 { 0.0 } else { 1.0 };
        // 1. This member's momentum estimate plus its worker error, one message per shard.
        let replicas = n as f32;
        for (((e, g), m), v) in errors
            .worker
            .iter_mut()
            .zip(data.iter())
            .zip(momentum)
            .zip(variance)
        {
            *e += (beta1 * m + (1.0 - beta1) * (replicas * g)) * live(*v);
        }
        let messages: Vec<TypedTensor> = (0..n)
            .map(|j| encode(&mut errors.worker[self.shard(data.len(), j)], self.onebit.chunk))
            .collect();
        for (j, &peer) in self.group.iter().enumerate().filter(|&(j, _)| j != i) {
            self.fabric
                .send(self.me, peer, self.tag(0, i), messages[j].clone())?;
        }
        // 2. Shard i: the members' average plus the server error, rounded and sent to all.
        let mut average = vec![0.0f32; errors.server.len()];
        for j in 0..n {
            self.add_from(0, j, &messages[i], &mut average)?;
        }
        for (e, a) in errors.server.iter_mut().zip(&average) {
            *e += a / replicas;
        }
        let rounded = encode(&mut errors.server, self.onebit.chunk);
        self.to_all(1, i, &rounded)?;
        // 3. Every shard, decoded: the new momentum.
        data.iter_mut().for_each(|d| *d = 0.0);
        for j in 0..n {
            let shard = self.shard(data.len(), j);
            self.add_from(1, j, &rounded, &mut data[shard])?;
        }
        data.iter_mut().zip(variance).for_each(|(x, v)| *x *= live(*v));
        if !self.onebit.feedback {
            errors.worker.iter_mut().for_each(|e| *e = 0.0);
            errors.server.iter_mut().for_each(|e| *e = 0.0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::members_tests::on_members;
    use crate::collectives::{ChunkPool, all_reduce};

    /// `steps` exchanges of each member's constant gradient share `inputs[me]` (freeze after
    /// step `freeze`): every member's outputs, step by step.
    fn exchange_steps(inputs: &[Vec<f32>], onebit: OneBit, steps: u64) -> Vec<Vec<Vec<f32>>> {
        on_members(inputs.len(), |me, fabric, group| {
            let (mut kept, mut pool) = (Residuals::new(), ChunkPool::default());
            (1..=steps)
                .map(|step| {
                    let mut data = inputs[me].clone();
                    let edge = (step << 32) | 4;
                    let dense = |d: &mut [f32]| all_reduce(fabric, me, group, edge, d, 64, &mut pool);
                    onebit_all_reduce(fabric, me, (group, edge), &mut data, onebit, &mut kept, dense)
                        .unwrap();
                    data
                })
                .collect()
        })
    }

    /// Before the freeze the output is the exact sum; after it, the momentum of the exact sums
    /// (Adam's, constant gradients) is what the exchanged momentum averages to, every member with
    /// the same bits; a region whose gradient was 0 through the warm-up (a dead unit) keeps a
    /// momentum of exactly 0.
    #[test]
    fn the_exchanged_momentum_tracks_adams_and_every_member_agrees() {
        let (n, len, freeze, steps) = (2, 300, 3, 600);
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|m| {
                (0..len)
                    .map(|k| {
                        if k < 20 {
                            0.0
                        } else {
                            (((k * 31 + m * 17) % 97) as f32 - 48.0) / 1000.0
                        }
                    })
                    .collect()
            })
            .collect();
        let exact: Vec<f32> = (0..len).map(|k| inputs.iter().map(|v| v[k]).sum()).collect();
        let onebit = |feedback| OneBit {
            freeze_step: freeze,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            chunk: 128,
            feedback,
        };
        // Adam's momentum of the exact sums, step by step; the exchanged one averages to it.
        let mut adam = vec![0.0f32; len];
        let exact_momenta: Vec<Vec<f32>> = (0..steps)
            .map(|_| {
                adam.iter_mut()
                    .zip(&exact)
                    .for_each(|(m, g)| *m = 0.9 * *m + 0.1 * g);
                adam.clone()
            })
            .collect();
        let mean = |rows: &[Vec<f32>], k: usize| rows.iter().map(|o| o[k]).sum::<f32>() / rows.len() as f32;
        let largest = exact.iter().fold(0.0f32, |a, g| a.max(g.abs()));
        let gap = |outputs: &[Vec<f32>]| {
            (20..len)
                .map(|k| {
                    (mean(&outputs[freeze as usize..], k) - mean(&exact_momenta[freeze as usize..], k)).abs()
                })
                .fold(0.0f32, f32::max)
        };
        let results = exchange_steps(&inputs, onebit(true), steps);
        for member in &results[1..] {
            assert_eq!(member, &results[0]);
        }
        let outputs = &results[0];
        for (step, output) in outputs.iter().take(freeze as usize).enumerate() {
            assert_eq!(output, &exact, "step {}", step + 1);
        }
        let worst = gap(outputs);
        let dropped = gap(&exchange_steps(&inputs, onebit(false), steps)[0]);
        eprintln!("mean momentum {worst} from Adam's, without feedback {dropped} (largest sum {largest})");
        assert!(
            worst < 0.1 * largest,
            "mean momentum {worst} from Adam's (largest sum {largest})"
        );
        assert!(
            dropped > 3.0 * worst,
            "without feedback only {dropped} (with it {worst})"
        );
        let after = &outputs[freeze as usize..];
        for o in after {
            assert!(o[..20].iter().all(|&x| x == 0.0), "{:?}", &o[..20]);
        }
    }

    #[test]
    fn signs_and_a_root_mean_square_per_chunk_and_the_error_is_what_they_lose() {
        let mut values = vec![3.0, -4.0, 0.0, 1.0, -1.0];
        let original = values.clone();
        let message = encode(&mut values, 2);
        assert_eq!(message.byte_len(), 4 * 3 + 1);
        let mut decoded = vec![0.0; 5];
        decode_add(&message, &mut decoded, 2, 0).unwrap();
        let rms = (12.5f32).sqrt();
        assert_eq!(decoded[..2], [rms, -rms]);
        assert_eq!(decoded[2..4], [(0.5f32).sqrt(), (0.5f32).sqrt()]);
        assert_eq!(decoded[4], -1.0);
        for ((v, o), d) in values.iter().zip(&original).zip(&decoded) {
            assert!((v - (o - d)).abs() < 1e-6);
        }
        let refused = decode_add(&message, &mut [0.0; 4], 2, 7).unwrap_err().to_string();
        assert!(refused.contains("actor 7 sent 13 bytes"), "{refused}");
    }
}
