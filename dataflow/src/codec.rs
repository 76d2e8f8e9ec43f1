//! Communication compression as a property of a collective edge (issue 43): the user's choice
//! ([`Compression`], `--compress`) and the codec a pass writes on each gradient collective it
//! compresses ([`Codec`], on `StartCollective`), which the verifier, the byte prediction and the
//! simulator read like any other field of the edge.
//!
//! Built: `int8`, block-wise absmax quantization of the data-parallel gradient all-reduce (the
//! quantizer of ZeRO++'s qgZ, Wang et al. 2023: one f32 scale per block, deterministic). Parsed
//! and refused with the reason until they are built: `topk:RATIO` (Aji & Heafield 2017; Lin et
//! al. 2018), `qsgd:BITS` (Alistarh et al. 2017), `terngrad` (Wen et al. 2017).

use std::fmt;

use serde::{Deserialize, Serialize};

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
}

/// Values per scale of `--compress int8` (ZeRO++ quantizes in groups of this order).
pub const INT8_BLOCK: u32 = 256;

impl Codec {
    /// Bytes a contiguous shard of `elems` values takes on the wire (`dtype_size` bytes each
    /// when uncompressed).
    pub fn wire_bytes(self, elems: u64, dtype_size: u64) -> u64 {
        match self {
            Codec::None => elems * dtype_size,
            Codec::Int8 { block: 0 } => elems,
            Codec::Int8 { block } => elems + 4 * elems.div_ceil(u64::from(block)),
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::None => f.write_str("none"),
            Codec::Int8 { block } => write!(f, "int8/{block}"),
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
    /// Top-k sparsification with error feedback, keeping `ratio` of each bucket (not built yet).
    TopK {
        /// Share of the elements sent, in (0, 1].
        ratio: f32,
    },
    /// QSGD's stochastic rounding to `2^bits` levels (not built yet).
    Qsgd {
        /// Bits per element, 1–8.
        bits: u8,
    },
    /// TernGrad's three levels (not built yet).
    TernGrad,
}

impl Compression {
    /// The codec of a compressed gradient edge; an error naming what to change for a
    /// compression not built yet.
    pub fn codec(self) -> Result<Codec, String> {
        match self {
            Compression::None => Ok(Codec::None),
            Compression::Int8 => Ok(Codec::Int8 { block: INT8_BLOCK }),
            other => Err(format!(
                "--compress {other} is not built yet (issue 43); use --compress int8, or drop --compress"
            )),
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
        assert!(
            Compression::TopK { ratio: 0.01 }
                .codec()
                .unwrap_err()
                .contains("not built yet")
        );
    }

    #[test]
    fn int8_takes_a_byte_a_value_and_a_scale_a_block() {
        let int8 = Compression::Int8.codec().unwrap();
        assert_eq!(int8.wire_bytes(1000, 4), 1000 + 4 * 4);
        assert_eq!(int8.wire_bytes(0, 4), 0);
        assert_eq!(Codec::None.wire_bytes(1000, 2), 2000);
    }
}
