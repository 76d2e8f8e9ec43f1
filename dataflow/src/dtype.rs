//! The one element type of the workspace: what a parameter is held in (the plan's
//! [`ParamDesc`](crate::ParamDesc)), what a typed tensor holds in the runtime API and on the
//! training fabric, and what a collective carries. f32, bf16 and f16 are the floating types
//! (mixed precision, Micikevicius et al. 2018); i8 and u8 carry quantised payloads, i32 and i64
//! indices and counts.
//!
//! ```
//! use archipelago_dataflow::DType;
//! assert_eq!(DType::default(), DType::F32);
//! assert_eq!((DType::BF16.bytes(), DType::BF16.to_string()), (2, "bf16".to_string()));
//! assert_eq!(DType::from_code(DType::I64.code()), Some(DType::I64));
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

/// The element types a tensor or a parameter may have. The order is the wire code ([`DType::code`])
/// and serde's variant index (bincode): new types go at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE single precision: every parameter today, and the master copy under mixed precision.
    #[default]
    F32,
    /// bfloat16 (stored as its 16 bits).
    BF16,
    /// IEEE half precision (stored as its 16 bits).
    F16,
    /// Signed byte.
    I8,
    /// Unsigned byte.
    U8,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// Bytes per element, as the plan counts bytes.
    pub fn bytes(self) -> u64 {
        self.size() as u64
    }

    /// Whether it is a floating type (what a parameter that trains may be held in).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// Its wire code (one byte in tensor headers).
    pub fn code(self) -> u8 {
        DType::ALL.iter().position(|d| *d == self).expect("listed") as u8
    }

    /// The dtype of a wire code, if valid.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_variant_order_and_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(d.code() as usize, i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
        }
        assert_eq!(DType::from_code(7), None);
        // serde names are the variant names (a program's JSON says "F32", "BF16").
        assert_eq!(serde_json::to_string(&DType::BF16).unwrap(), "\"BF16\"");
    }
}
