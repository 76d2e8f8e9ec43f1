//! The element types the collectives reduce and move: f32, bf16 and f16, each summed in f32
//! and rounded once to its own type (Micikevicius et al., "Mixed Precision Training", 2018:
//! 16-bit values, 32-bit accumulation).
//!
//! A 16-bit sum accumulated in 16 bits rounds after every addition: over three members that is
//! two roundings, and the error grows with the group. The shared-buffer collectives sum every
//! member's values of an element into one f32 accumulator and round the total once.

use half::{bf16, f16};

use crate::typed_tensor::Element;

/// An element type a collective reduces ([`Element::DTYPE`] names it; members must agree on
/// it): its way to and from the f32 accumulator.
pub trait Reducible: Element + Send + Sync {
    /// Widened to the accumulator (exact for every type here).
    fn to_f32(self) -> f32;
    /// The accumulator rounded to this type (to nearest, ties to even).
    fn from_f32(value: f32) -> Self;
}

impl Reducible for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> f32 {
        value
    }
}

impl Reducible for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> bf16 {
        bf16::from_f32(value)
    }
}

impl Reducible for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> f16 {
        f16::from_f32(value)
    }
}

/// Where a reduction accumulates: in f32 (what every collective does), or in the element type
/// itself, rounding after every addition (the negative control of the 16-bit tests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulation {
    /// One f32 accumulator per element, rounded once at the end.
    F32,
    /// Rounded to the element type after every addition (what f32 accumulation avoids).
    InElementType,
}

impl Accumulation {
    /// Adds `values` into the accumulator `total` (member `j`'s values, in member order; the
    /// first member's start it): in f32, or rounded to `T` after the addition for the control.
    #[inline]
    pub fn add<T: Reducible>(self, j: usize, total: &mut [f32], values: &[T]) {
        let pairs = total.iter_mut().zip(values);
        match (j, self) {
            (0, _) => pairs.for_each(|(t, v)| *t = v.to_f32()),
            (_, Accumulation::F32) => pairs.for_each(|(t, v)| *t += v.to_f32()),
            (_, Accumulation::InElementType) => {
                pairs.for_each(|(t, v)| *t = T::from_f32(*t + v.to_f32()).to_f32())
            }
        }
    }
}
