//! Communication compression as a property of a collective edge (issue 43): the user's choice
//! ([`Compression`], `--compress`) and the codec a pass writes on each gradient collective it
//! compresses ([`Codec`], on `StartCollective`), which the verifier, the byte prediction and the
//! simulator read like any other field of the edge.
//!
//! Built: `int8`, block-wise absmax quantization of the data-parallel gradient all-reduce (the
//! quantizer of ZeRO++'s qgZ, Wang et al. 2023: one f32 scale per block, deterministic);
//! `qsgd:BITS` (Alistarh et al. 2017: stochastic rounding onto a uniform grid of levels per chunk,
//! unbiased, with the chunk's max-norm as its scale, as in the paper's experiments); `terngrad`
//! (Wen et al. 2017: three levels −s, 0, s, stochastic, with one scale s — the largest magnitude
//! — per chunk of [`TERNGRAD_CHUNK`] values rather than per layer). Their randomness is keyed by
//! (seed, step, bucket, sending member, element), so a run repeats. `topk:RATIO` (Aji & Heafield
//! 2017; Lin et al. 2018): the largest `RATIO` of each replica's bucket plus its error-feedback
//! residual, sent as (index, value) pairs. `onebit` (1-bit Adam, Tang et al. 2021, from
//! `--optimizer onebit-adam --freeze-step W`): Adam's momentum exchanged as one sign bit a value
//! and a scale per chunk after the variance freezes, with error feedback on both sides.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::OptimizerSpec;

/// How a collective's payload crosses the fabric.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Codec {
    /// As its dtype.
    #[default]
    None,
    /// Block-wise absmax int8: each block of `block` f32 values crosses as one f32 scale
    /// (`absmax / 127`) and `block` int8 values rounded to nearest; sums run in f32 on
    /// dequantized values. `block` 0 is the negative control (`TestFault::UnscaledInt8`): no
    /// scales, every value rounded to an integer.
    Int8 {
        /// Values per scale (0: none).
        block: u32,
    },
    /// QSGD: each chunk of `chunk` f32 values crosses as one f32 scale (its largest magnitude)
    /// and `bits` bits a value, the value over the scale rounded stochastically (unbiased) onto
    /// [`Codec::levels`] evenly spaced levels from −1 to 1.
    Qsgd {
        /// Bits per value, 1–8.
        bits: u8,
        /// Values per scale.
        chunk: u32,
        /// The run's seed, first key of the rounding's randomness.
        seed: u64,
    },
    /// Top-k sparsification with error feedback: each replica sends the [`Codec::kept`]
    /// entries of largest magnitude of its bucket plus its residual as (u32 index, f32 value)
    /// pairs and keeps the rest as its next residual; the pairs are gathered and summed.
    TopK {
        /// Entries kept per million of a bucket's.
        per_million: u32,
        /// Whether the leftover is fed back (false: the negative control,
        /// `TestFault::TopKWithoutFeedback`, drops it; under momentum correction the velocity is
        /// still kept, masked where sent, so the control drops the residual only).
        feedback: bool,
        /// Deep Gradient Compression's momentum correction (Lin et al. 2018, §3.2), as f32 bits
        /// (0: none): SGD's momentum `m` moves from the optimizer into the exchange — each
        /// replica keeps a velocity `u ← m·u + g` of its own gradient, accumulates `u` (not `g`)
        /// into its residual, and zeroes both where it sent (momentum factor masking, §3.3); the
        /// optimizer then runs plain SGD on the summed sparse velocities.
        momentum_bits: u32,
    },
    /// TernGrad: each chunk of `chunk` f32 values crosses as one f32 scale (its largest
    /// magnitude) and 2 bits a value, each rounded stochastically (unbiased) to −1, 0 or 1 times
    /// the scale.
    TernGrad {
        /// Values per scale.
        chunk: u32,
        /// The run's seed, first key of the rounding's randomness.
        seed: u64,
    },
    /// 1-bit Adam's exchange (Tang et al. 2021): up to step `freeze_step` the bucket is an
    /// f32 gradient all-reduce (plain Adam, the variance still learning) while each member keeps
    /// Adam's momentum of the sums; after it, each member sends its momentum estimate (its own
    /// gradient in place of the average) plus its error, as signs and a scale per `chunk`
    /// values, to the owner of each shard, which averages, adds its own error, and sends the
    /// shard back the same way; the result is the momentum, the optimizer's with the variance
    /// frozen. Reads as a reduce-scatter plus an all-gather of `⌈len/8⌉ + 4⌈len/chunk⌉`-byte
    /// shards after the freeze.
    OneBit {
        /// The last step of plain Adam (the variance is frozen after it).
        freeze_step: u32,
        /// Adam's β1, β2 and ε, as f32 bits.
        adam_bits: [u32; 3],
        /// Values per scale.
        chunk: u32,
        /// Whether both errors are fed back (false: the negative control,
        /// `TestFault::OneBitWithoutFeedback`, drops them).
        feedback: bool,
    },
}

/// Values per scale of `--compress int8` (ZeRO++ quantizes in groups of this order).
pub const INT8_BLOCK: u32 = 256;

/// Values per scale of `--compress qsgd:BITS` (QSGD's experiments use buckets of 512).
pub const QSGD_CHUNK: u32 = 512;

/// Values per scale of `--compress terngrad`. The paper scales per layer; ternary levels under one
/// scale per layer (or per message) are too noisy for a small transformer — a 2-layer gpt, Adam
/// 1e-3, dp=2, 300 steps ended 81% above the uncompressed loss with one scale per message, 11%
/// with one per 64 values (2.5 bits a value) — so the scale is per chunk, QSGD's bucketing.
pub const TERNGRAD_CHUNK: u32 = 64;

/// Values per scale of 1-bit Adam's exchange (the paper scales per tensor; a scale per 2048
/// values costs 1/64 bit a value and keeps a bucket's large and small parameters apart).
pub const ONEBIT_CHUNK: u32 = 2048;

impl Codec {
    /// Bytes a contiguous shard of `elems` values takes on the wire (`dtype_size` bytes each
    /// when uncompressed).
    pub fn wire_bytes(self, elems: u64, dtype_size: u64) -> u64 {
        match self {
            Codec::None => elems * dtype_size,
            Codec::Int8 { block: 0 } => elems,
            Codec::Int8 { block } => elems + 4 * elems.div_ceil(u64::from(block)),
            Codec::Qsgd { bits, chunk, .. } => {
                (elems * u64::from(bits)).div_ceil(8) + 4 * elems.div_ceil(u64::from(chunk))
            }
            Codec::TernGrad { chunk, .. } => (elems * 2).div_ceil(8) + 4 * elems.div_ceil(u64::from(chunk)),
            Codec::TopK { .. } => 8 * self.kept(elems),
            Codec::OneBit { chunk, .. } => elems.div_ceil(8) + 4 * elems.div_ceil(u64::from(chunk)),
        }
    }

    /// Entries a top-k codec sends of a bucket of `len`: `⌈len · ratio⌉`, at least one, at most
    /// all (`len` for the other codecs).
    pub fn kept(self, len: u64) -> u64 {
        match self {
            Codec::TopK { per_million, .. } => (len * u64::from(per_million))
                .div_ceil(1_000_000)
                .clamp(len.min(1), len),
            _ => len,
        }
    }

    /// Whether an all-reduce of this codec gathers every member's whole quantized contribution
    /// and sums them on every member (the stochastic codecs, as QSGD and TernGrad exchange
    /// gradients: one rounding per contribution, the total never re-quantized) rather than
    /// reduce-scattering quantized shards and gathering the quantized totals.
    pub fn gathers_contributions(self) -> bool {
        self.levels().is_some() || matches!(self, Codec::TopK { .. })
    }

    /// The stochastic codecs' number of levels, evenly spaced from −1 to 1 (times the scale):
    /// `2^bits − 1` (odd, so 0 is one of them and a zero crosses exact) for 2 bits and more, 2
    /// (the sign) for 1 bit, 3 for TernGrad; `None` for the deterministic ones.
    pub fn levels(self) -> Option<u32> {
        match self {
            Codec::Qsgd { bits: 1, .. } => Some(2),
            Codec::Qsgd { bits, .. } => Some((1u32 << bits) - 1),
            Codec::TernGrad { .. } => Some(3),
            Codec::None | Codec::Int8 { .. } | Codec::TopK { .. } | Codec::OneBit { .. } => None,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::None => f.write_str("none"),
            Codec::Int8 { block } => write!(f, "int8/{block}"),
            Codec::Qsgd { bits, chunk, .. } => write!(f, "qsgd{bits}/{chunk}"),
            Codec::TernGrad { chunk, .. } => write!(f, "terngrad/{chunk}"),
            Codec::TopK {
                per_million,
                feedback,
                momentum_bits,
            } => {
                let without = if *feedback { "" } else { " without feedback" };
                write!(f, "topk/{}{without}", f64::from(*per_million) / 1e6)?;
                match f32::from_bits(*momentum_bits) {
                    0.0 => Ok(()),
                    m => write!(f, " with momentum {m} corrected"),
                }
            }
            Codec::OneBit {
                freeze_step,
                chunk,
                feedback,
                ..
            } => {
                let without = if *feedback { "" } else { " without feedback" };
                write!(f, "onebit/{chunk} after step {freeze_step}{without}")
            }
        }
    }
}

/// What `--compress` asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub enum Compression {
    /// Gradients cross in the reduce dtype.
    #[default]
    None,
    /// Block-wise absmax int8 gradients (deterministic).
    Int8,
    /// Top-k sparsification with error feedback, keeping `ratio` of each bucket.
    TopK {
        /// Share of the elements sent, in (0, 1].
        ratio: f32,
    },
    /// QSGD's stochastic rounding (unbiased) to `2^bits − 1` levels (2 at one bit) per chunk.
    Qsgd {
        /// Bits per element, 1–8.
        bits: u8,
    },
    /// TernGrad's three levels, stochastic (unbiased).
    TernGrad,
    /// 1-bit Adam's momentum exchange after step `freeze_step` (`--optimizer onebit-adam
    /// --freeze-step W`, not a `--compress` form: it replaces Adam's exchange, not a gradient's).
    OneBitAdam {
        /// The last step of plain Adam.
        freeze_step: u32,
        /// Adam's first-moment decay.
        beta1: f32,
        /// Adam's second-moment decay.
        beta2: f32,
        /// Adam's ε.
        eps: f32,
    },
}

impl Compression {
    /// The momentum this compression moves from `optimizer` into the exchange: SGD's, under
    /// top-k (Deep Gradient Compression's momentum correction); `None` otherwise.
    pub fn moved_momentum(self, optimizer: OptimizerSpec) -> Option<f32> {
        match (self, optimizer) {
            (Compression::TopK { .. }, OptimizerSpec::Sgd { momentum, .. }) if momentum != 0.0 => {
                Some(momentum)
            }
            _ => None,
        }
    }

    /// The rule each actor's optimizer applies under this compression: `optimizer`, less the
    /// momentum [`Compression::moved_momentum`] moves into the exchange (plain SGD on the summed
    /// velocities).
    pub fn update_rule(self, optimizer: OptimizerSpec) -> OptimizerSpec {
        match (self.moved_momentum(optimizer), optimizer) {
            (Some(_), OptimizerSpec::Sgd { lr, weight_decay, .. }) => OptimizerSpec::Sgd {
                lr,
                momentum: 0.0,
                dampening: 0.0,
                nesterov: false,
                weight_decay,
            },
            _ => optimizer,
        }
    }

    /// The codec of a compressed gradient edge of a run seeded `seed` whose optimizer is
    /// `optimizer` (an error naming what to change for a compression not built, none today).
    pub fn codec(self, seed: u64, optimizer: OptimizerSpec) -> Result<Codec, String> {
        match self {
            Compression::None => Ok(Codec::None),
            Compression::Int8 => Ok(Codec::Int8 { block: INT8_BLOCK }),
            Compression::Qsgd { bits } => Ok(Codec::Qsgd {
                bits,
                chunk: QSGD_CHUNK,
                seed,
            }),
            Compression::TernGrad => Ok(Codec::TernGrad {
                chunk: TERNGRAD_CHUNK,
                seed,
            }),
            Compression::TopK { ratio } => Ok(Codec::TopK {
                per_million: (f64::from(ratio) * 1e6).round().max(1.0) as u32,
                feedback: true,
                momentum_bits: self.moved_momentum(optimizer).unwrap_or(0.0).to_bits(),
            }),
            Compression::OneBitAdam {
                freeze_step,
                beta1,
                beta2,
                eps,
            } => Ok(Codec::OneBit {
                freeze_step,
                adam_bits: [beta1, beta2, eps].map(f32::to_bits),
                chunk: ONEBIT_CHUNK,
                feedback: true,
            }),
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Int8 => f.write_str("int8"),
            Compression::TopK { ratio } => write!(f, "topk:{ratio}"),
            Compression::Qsgd { bits } => write!(f, "qsgd:{bits}"),
            Compression::TernGrad => f.write_str("terngrad"),
            Compression::OneBitAdam { freeze_step, .. } => {
                write!(f, "onebit-adam (freeze step {freeze_step})")
            }
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Compression, String> {
        let forms = "none, int8, topk:RATIO (0 < RATIO <= 1), qsgd:BITS (1-8) or terngrad";
        match s.split_once(':') {
            None => match s {
                "none" => Ok(Compression::None),
                "int8" => Ok(Compression::Int8),
                "terngrad" => Ok(Compression::TernGrad),
                _ => Err(format!("--compress takes {forms}, not `{s}`")),
            },
            Some(("topk", ratio)) => match ratio.parse::<f32>() {
                Ok(ratio) if ratio > 0.0 && ratio <= 1.0 => Ok(Compression::TopK { ratio }),
                _ => Err(format!(
                    "--compress topk:RATIO keeps a share of each bucket in (0, 1] (0.01 keeps 1%), not `{ratio}`"
                )),
            },
            Some(("qsgd", bits)) => match bits.parse::<u8>() {
                Ok(bits @ 1..=8) => Ok(Compression::Qsgd { bits }),
                _ => Err(format!("--compress qsgd:BITS takes 1 to 8 bits, not `{bits}`")),
            },
            Some(_) => Err(format!("--compress takes {forms}, not `{s}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_and_bad_ones_name_the_fix() {
        assert_eq!("int8".parse(), Ok(Compression::Int8));
        assert_eq!("topk:0.01".parse(), Ok(Compression::TopK { ratio: 0.01 }));
        assert_eq!("qsgd:4".parse(), Ok(Compression::Qsgd { bits: 4 }));
        assert_eq!("terngrad".parse(), Ok(Compression::TernGrad));
        for (bad, says) in [
            ("topk:0", "(0, 1]"),
            ("topk:1.5", "(0, 1]"),
            ("topk:x", "(0, 1]"),
            ("qsgd:0", "1 to 8"),
            ("qsgd:9", "1 to 8"),
            ("fp4", "--compress takes"),
        ] {
            let refused = bad.parse::<Compression>().unwrap_err();
            assert!(refused.contains(says), "{bad}: {refused}");
        }
        let topk = Compression::TopK { ratio: 0.01 }
            .codec(0, OptimizerSpec::adam(1e-3))
            .unwrap();
        assert_eq!(topk.to_string(), "topk/0.01");
        assert_eq!(
            (topk.kept(1000), topk.kept(1001), topk.kept(50), topk.kept(0)),
            (10, 11, 1, 0)
        );
        assert_eq!(topk.wire_bytes(1000, 4), 80);
        assert_eq!(
            Compression::TopK { ratio: 1.0 }
                .codec(0, OptimizerSpec::adam(1e-3))
                .unwrap()
                .kept(7),
            7
        );
    }

    #[test]
    fn int8_takes_a_byte_a_value_and_a_scale_a_block() {
        let int8 = Compression::Int8.codec(0, OptimizerSpec::adam(1e-3)).unwrap();
        assert_eq!(int8.wire_bytes(1000, 4), 1000 + 4 * 4);
        assert_eq!(int8.wire_bytes(0, 4), 0);
        assert_eq!(Codec::None.wire_bytes(1000, 2), 2000);
    }

    #[test]
    fn qsgd_and_terngrad_take_their_bits_a_value_and_their_scales() {
        let qsgd = |bits| {
            Compression::Qsgd { bits }
                .codec(7, OptimizerSpec::adam(1e-3))
                .unwrap()
        };
        assert_eq!(qsgd(4).wire_bytes(1000, 4), 500 + 4 * 2);
        assert_eq!(qsgd(3).wire_bytes(1001, 4), 376 + 4 * 2);
        assert_eq!(qsgd(8).wire_bytes(512, 4), 512 + 4);
        assert_eq!(qsgd(4).wire_bytes(0, 4), 0);
        let terngrad = Compression::TernGrad.codec(7, OptimizerSpec::adam(1e-3)).unwrap();
        assert_eq!(terngrad.wire_bytes(1001, 4), 251 + 4 * 16);
        assert_eq!(terngrad.wire_bytes(0, 4), 0);
        let levels: Vec<_> = [1, 2, 4, 8].map(|b| qsgd(b).levels().unwrap()).into();
        assert_eq!(levels, [2, 3, 15, 255]);
        assert_eq!(terngrad.levels(), Some(3));
        assert_eq!(Codec::Int8 { block: 256 }.levels(), None);
        assert_eq!(qsgd(4).to_string(), "qsgd4/512");
    }

    #[test]
    fn onebit_takes_a_bit_a_value_and_a_scale_a_chunk() {
        let onebit = Compression::OneBitAdam {
            freeze_step: 10,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
        .codec(0, OptimizerSpec::adam(1e-3))
        .unwrap();
        assert_eq!(onebit.wire_bytes(4096, 4), 512 + 4 * 2);
        assert_eq!(onebit.wire_bytes(4097, 4), 513 + 4 * 3);
        assert_eq!(onebit.wire_bytes(0, 4), 0);
        assert!(!onebit.gathers_contributions());
        assert_eq!(onebit.to_string(), "onebit/2048 after step 10");
    }
}
