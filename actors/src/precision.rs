//! Mixed precision on an actor (Micikevicius et al., 2018): the compute dtype its plan's slices
//! give, as burn's float dtype. The modules an actor holds are the compute copy (cast once when
//! built, kept in that dtype by every load, which rounds the f32 master into it); the master, the
//! gradient buckets and the optimizer state stay f32. Also f16's loss scale ([`LossScaler`]).

use archipelago_dataflow::{DType, LossScale, SliceState};
use burn::tensor::FloatDType;

/// burn's float dtype for a plan's floating `dtype`.
///
/// # Panics
/// When `dtype` is not a float type (the plan refuses such a precision first).
pub fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F32 => FloatDType::F32,
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        other => panic!("{other} is not a compute dtype"),
    }
}

/// The plan's dtype for burn's float `dtype` (f32, bf16 or f16; any other reads as f32).
pub fn plan_dtype(dtype: FloatDType) -> DType {
    match dtype {
        FloatDType::BF16 => DType::BF16,
        FloatDType::F16 => DType::F16,
        _ => DType::F32,
    }
}

/// The one compute dtype of an actor's slices (f32 when it holds none); an error naming the two
/// when they differ (a per-parameter precision is not built).
pub fn compute_dtype(slices: &[SliceState]) -> Result<FloatDType, String> {
    let first = slices.first().map_or(DType::F32, |s| s.compute);
    match slices.iter().find(|s| s.compute != first) {
        Some(other) => Err(format!(
            "parameter `{}` computes in {} but `{}` in {}: an actor computes in one dtype",
            slices[0].param, first, other.param, other.compute
        )),
        None if first.is_float() => Ok(float_dtype(first)),
        None => Err(format!(
            "parameter `{}` computes in {first}, not a float type",
            slices[0].param
        )),
    }
}

/// An f16 job's loss scale on one actor (Micikevicius et al. 2018, §3.2; PyTorch's `GradScaler`):
/// every actor keeps the same one, moved by the same vote, so all scale alike. The loss of a step
/// is multiplied by [`LossScaler::scale`] before its backward, the gradients by its inverse in
/// the update; [`LossScaler::after_step`] then skips an overflowed step and moves the scale.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    /// The scale of the next backward.
    pub scale: f32,
    /// Steps in a row without an overflow since the scale last changed.
    pub clean_steps: u32,
    /// Clean steps before the scale doubles; 0 for a static scale, which never moves.
    pub growth_interval: u32,
}

impl LossScaler {
    /// The scaler of `scaling` (`None` when the job does not scale: bf16, f32).
    pub fn of(scaling: Option<LossScale>) -> Option<LossScaler> {
        let (scale, growth_interval) = match scaling? {
            LossScale::None => return None,
            LossScale::Static { scale } => (scale, 0),
            LossScale::Dynamic {
                init,
                growth_interval,
            } => (init, growth_interval.max(1)),
        };
        Some(LossScaler {
            scale,
            clean_steps: 0,
            growth_interval,
        })
    }

    /// After a step whose gradients did (`overflow`) or did not overflow anywhere: whether the
    /// step is skipped (it is when they did). A dynamic scale halves on an overflow (never below
    /// 1) and doubles after `growth_interval` clean steps in a row.
    pub fn after_step(&mut self, overflow: bool) -> bool {
        if self.growth_interval == 0 {
            return overflow;
        }
        if overflow {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps == self.growth_interval {
                self.scale *= 2.0;
                self.clean_steps = 0;
            }
        }
        overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An overflow halves the scale and restarts the count; `growth_interval` clean steps in a
    /// row double it; the scale never falls below 1; a static scale skips but never moves.
    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_clean_steps() {
        let mut s = LossScaler::of(Some(LossScale::Dynamic {
            init: 8.0,
            growth_interval: 2,
        }))
        .unwrap();
        assert!(!s.after_step(false));
        assert_eq!((s.scale, s.clean_steps), (8.0, 1));
        assert!(s.after_step(true));
        assert_eq!((s.scale, s.clean_steps), (4.0, 0));
        assert!(!s.after_step(false));
        assert!(!s.after_step(false));
        assert_eq!((s.scale, s.clean_steps), (8.0, 0));
        for _ in 0..5 {
            assert!(s.after_step(true));
        }
        assert_eq!(s.scale, 1.0);
        let mut fixed = LossScaler::of(Some(LossScale::Static { scale: 128.0 })).unwrap();
        assert!(fixed.after_step(true));
        assert!(!fixed.after_step(false));
        assert_eq!(fixed.scale, 128.0);
        assert_eq!(LossScaler::of(None), None);
        assert_eq!(LossScaler::of(Some(LossScale::DYNAMIC)).unwrap().scale, 65536.0);
    }
}
