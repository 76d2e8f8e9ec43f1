//! Stochastic rounding onto evenly spaced levels (issue 43's `--compress qsgd:BITS`, Alistarh
//! et al. 2017, and `--compress terngrad`, Wen et al. 2017): each chunk of f32 values crosses as
//! one f32 scale (its largest magnitude, the max-norm of QSGD's experiments) and one code of
//! `bits` bits a value, packed least significant bit first. A value `v` of scale `s` sits at
//! `x = v / s` in [−1, 1]; with `count` levels `(k − h) / h`, `h = (count − 1) / 2`, it rounds up
//! to the level above with the probability of its distance from the level below, so the
//! dequantized value is `v` in expectation (unbiased), and a zero crosses exact when `count` is
//! odd. The random numbers come from a counter-based generator (SplitMix64) keyed by the run's
//! seed, the collective's edge (step and bucket), the phase, the sending member and the element's
//! place in the bucket: a run repeats bit for bit, and every member dequantizes a message to the
//! same values.

use archipelago_dataflow::{ActorId, Codec};

use crate::fabric::FabricError;
use crate::typed_tensor::{DType, TypedTensor};

/// A stochastic codec's shape on the wire.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Levels {
    /// Levels from −1 to 1, 2 to 255.
    pub count: u32,
    /// Bits a code takes, 1 to 8.
    pub bits: u32,
    /// Values per scale (at least 1).
    pub chunk: usize,
    /// The run's seed.
    pub seed: u64,
    /// The negative control of the unit tests: rounding to the nearest level (biased).
    pub nearest: bool,
}

impl Levels {
    /// The levels of a stochastic codec (`None` for the others).
    pub fn of(codec: Codec) -> Option<Levels> {
        let count = codec.levels()?;
        let (bits, chunk, seed) = match codec {
            Codec::Qsgd { bits, chunk, seed } => (u32::from(bits), chunk.max(1) as usize, seed),
            Codec::TernGrad { chunk, seed } => (2, chunk.max(1) as usize, seed),
            Codec::None | Codec::Int8 { .. } | Codec::TopK { .. } | Codec::OneBit { .. } => return None,
        };
        Some(Levels {
            count,
            bits,
            chunk,
            seed,
            nearest: false,
        })
    }

    /// Scales a message of `len` values carries.
    fn scales(&self, len: usize) -> usize {
        len.div_ceil(self.chunk)
    }

    /// Bytes a message of `len` values takes (the dataflow's `Codec::wire_bytes`).
    pub fn packed_len(&self, len: usize) -> usize {
        4 * self.scales(len) + (len * self.bits as usize).div_ceil(8)
    }
}

/// Where a message's random numbers come from.
#[derive(Debug, Clone, Copy)]
pub struct Salt {
    /// The collective's edge: the step and the bucket.
    pub edge: u64,
    /// 0: the reduce-scatter's contributions; 1: the all-gather's totals.
    pub phase: u64,
    /// The sending member's place in its group.
    pub sender: usize,
    /// The place of the message's first value in the bucket.
    pub offset: usize,
}

/// SplitMix64's finaliser (Steele et al. 2014): a counter in, 64 well-mixed bits out.
fn mix(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1) for element `index` of a message keyed `key`.
fn uniform(key: u64, index: u64) -> f32 {
    (mix(key ^ mix(index)) >> 40) as f32 / (1u64 << 24) as f32
}

/// `values` rounded onto `levels` into a u8 message: the scales (f32, little-endian), then the
/// codes.
pub fn pack(values: &[f32], levels: &Levels, salt: Salt) -> TypedTensor {
    let scales = levels.scales(values.len());
    let mut message =
        TypedTensor::zeros(DType::U8, vec![levels.packed_len(values.len())]).expect("a u8 shape");
    let (scale_bytes, codes) = message.bytes_mut().split_at_mut(4 * scales);
    let key = mix(mix(mix(levels.seed) ^ salt.edge) ^ ((salt.phase << 32) | salt.sender as u64));
    let half = (levels.count - 1) as f32 / 2.0;
    let top = levels.count - 1;
    let chunk = levels.chunk;
    for (c, (values, scale)) in values
        .chunks(chunk)
        .zip(scale_bytes.chunks_exact_mut(4))
        .enumerate()
    {
        let absmax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // A non-finite value makes its whole chunk NaN on every member (loss scaling sees it).
        let s = match values.iter().all(|v| v.is_finite()) {
            true => absmax,
            false => f32::NAN,
        };
        scale.copy_from_slice(&s.to_le_bytes());
        for (k, &v) in values.iter().enumerate() {
            let x = if s > 0.0 { (v / s).clamp(-1.0, 1.0) } else { 0.0 };
            let position = x * half + half;
            let below = position.floor();
            let up = match levels.nearest {
                true => position - below >= 0.5,
                false => uniform(key, (salt.offset + c * chunk + k) as u64) < position - below,
            };
            let code = (below as u32 + u32::from(up)).min(top);
            put(codes, (c * chunk + k) * levels.bits as usize, code);
        }
    }
    message
}

/// Writes `code` at bit `bit` of `codes` (least significant first; a code spans two bytes at
/// most).
fn put(codes: &mut [u8], bit: usize, code: u32) {
    let shifted = (code as u16) << (bit % 8);
    codes[bit / 8] |= shifted as u8;
    if let Some(next) = codes.get_mut(bit / 8 + 1) {
        *next |= (shifted >> 8) as u8;
    }
}

/// The `bits`-bit code at bit `bit` of `codes`.
fn get(codes: &[u8], bit: usize, bits: u32) -> u32 {
    let low = u16::from(codes[bit / 8]);
    let high = u16::from(codes.get(bit / 8 + 1).copied().unwrap_or(0));
    (((high << 8) | low) >> (bit % 8)) as u32 & ((1 << bits) - 1)
}

/// Adds the values `packed` holds (of `out.len()` elements) into `out`, or writes them when
/// `add` is false. An ill-sized message is an error naming its sender.
pub fn unpack_into(
    packed: &[u8],
    out: &mut [f32],
    levels: &Levels,
    add: bool,
    from: ActorId,
) -> Result<(), FabricError> {
    let expected = levels.packed_len(out.len());
    if packed.len() != expected {
        return Err(FabricError::Aborted(format!(
            "actor {from} sent {} bytes where a {}-level shard of {} elements takes {expected}",
            packed.len(),
            levels.count,
            out.len(),
        )));
    }
    let (scales, codes) = packed.split_at(4 * levels.scales(out.len()));
    let half = (levels.count - 1) as f32 / 2.0;
    let chunk = levels.chunk;
    for (c, (values, scale)) in out.chunks_mut(chunk).zip(scales.chunks_exact(4)).enumerate() {
        let s = f32::from_le_bytes(scale.try_into().expect("4 bytes"));
        for (k, o) in values.iter_mut().enumerate() {
            let code = get(codes, (c * chunk + k) * levels.bits as usize, levels.bits);
            let v = (code as f32 - half) / half * s;
            if add {
                *o += v;
            } else {
                *o = v;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qsgd(bits: u8, chunk: u32) -> Levels {
        Levels::of(Codec::Qsgd { bits, chunk, seed: 3 }).unwrap()
    }

    fn salt(edge: u64) -> Salt {
        Salt {
            edge,
            phase: 0,
            sender: 1,
            offset: 0,
        }
    }

    fn round_trip(values: &[f32], levels: &Levels, salt: Salt) -> Vec<f32> {
        let packed = pack(values, levels, salt);
        assert_eq!(packed.byte_len(), levels.packed_len(values.len()));
        let mut back = vec![0.0; values.len()];
        unpack_into(packed.bytes(), &mut back, levels, false, 0).unwrap();
        back
    }

    /// Every value comes back on one of the two levels around it; zeros stay zero where 0 is a
    /// level; the same salt gives the same bits, another salt other bits.
    #[test]
    fn values_land_on_the_levels_around_them_and_repeat_by_salt() {
        let values: Vec<f32> = (0..1000).map(|k| ((k * 37 % 101) as f32 - 50.0) / 7.0).collect();
        for levels in [qsgd(1, 64), qsgd(2, 64), qsgd(3, 100), qsgd(4, 512), qsgd(8, 64)] {
            let back = round_trip(&values, &levels, salt(5));
            let half = (levels.count - 1) as f32 / 2.0;
            for (chunk, got) in values.chunks(levels.chunk).zip(back.chunks(levels.chunk)) {
                let s = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let spacing = s / half;
                for (v, g) in chunk.iter().zip(got) {
                    assert!(
                        (v - g).abs() <= spacing * 1.0001,
                        "{levels:?}: {v} came back as {g}"
                    );
                }
            }
            assert_eq!(back, round_trip(&values, &levels, salt(5)), "{levels:?}");
            assert_ne!(back, round_trip(&values, &levels, salt(6)), "{levels:?}");
        }
        let zeros = round_trip(&[0.0, 1.0, 0.0, -2.0], &qsgd(4, 2), salt(1));
        assert_eq!((zeros[0], zeros[2]), (0.0, 0.0));
        let terngrad = Levels::of(Codec::TernGrad { chunk: 64, seed: 3 }).unwrap();
        let back = round_trip(&values, &terngrad, salt(5));
        for (chunk, got) in values.chunks(64).zip(back.chunks(64)) {
            let s = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(got.iter().all(|&g| [0.0, s, -s].contains(&g)), "{got:?}");
        }
        assert_eq!(round_trip(&[], &terngrad, salt(5)), Vec::<f32>::new());
    }

    /// The mean of many roundings (other salts) is the value — unbiased — while the control,
    /// rounding to the nearest level, stays a whole level off.
    #[test]
    fn the_rounding_is_unbiased_and_rounding_to_nearest_is_caught() {
        let values = [0.1f32, -0.23, 0.52, 1.0, -0.07, 0.0, 0.9, -1.0];
        let trials = 4000u64;
        for levels in [qsgd(1, 8), qsgd(2, 8), qsgd(4, 8)] {
            let mut nearest = levels;
            nearest.nearest = true;
            for (levels, unbiased) in [(levels, true), (nearest, false)] {
                let mut sum = [0.0f64; 8];
                for trial in 0..trials {
                    let back = round_trip(&values, &levels, salt(trial));
                    sum.iter_mut().zip(&back).for_each(|(s, b)| *s += f64::from(*b));
                }
                let worst = (values.iter().zip(&sum))
                    .map(|(v, s)| (s / trials as f64 - f64::from(*v)).abs())
                    .fold(0.0, f64::max);
                // One rounding is off by a level spacing at most (the scale is 1), so its
                // standard deviation is at most half a spacing; four standard errors of the mean.
                let spacing = 1.0 / ((levels.count - 1) as f64 / 2.0);
                let bound = 4.0 * spacing / 2.0 / (trials as f64).sqrt();
                match unbiased {
                    true => assert!(worst < bound, "{levels:?}: mean {worst} from the values"),
                    false => assert!(worst > 3.0 * bound, "{levels:?}: nearest is {worst} off"),
                }
            }
        }
    }

    #[test]
    fn an_ill_sized_message_names_its_sender() {
        let levels = qsgd(4, 8);
        let packed = pack(&[1.0; 10], &levels, salt(0));
        let refused = unpack_into(packed.bytes(), &mut [0.0; 11], &levels, false, 4).unwrap_err();
        assert!(refused.to_string().contains("actor 4 sent 13 bytes"), "{refused}");
    }
}
