//! The precision of a training job: the dtype forward and backward compute in, while the master
//! parameters and the optimizer state stay f32 (Micikevicius et al., "Mixed Precision Training",
//! 2018: an f32 master, a 16-bit compute copy refreshed after every update, the loss in f32).
//!
//! What is built (issue 38): `--precision f32|bf16` on every layout. Gradients are read into f32
//! buckets (accumulated over micro-batches in f32) and reduced in the compute dtype
//! (`--grad-reduce-dtype f32` keeps f32 on the wire); ZeRO's parameter gathers and the
//! activations crossing pipeline stages move in the compute dtype (`passes/precision.rs`).
//!
//! f16 has five exponent bits: small gradients underflow to zero, so an f16 job scales its loss
//! by `S` before the backward and its gradients by `1/S` in the update ([`LossScale`]; dynamic
//! by default: start at 2^16, halve on an overflow, double after 2000 clean steps, as PyTorch's
//! `GradScaler` and DeepSpeed). An overflow on any actor makes every actor skip the step: the
//! update waits for the sum of squares of every reduced gradient over every actor (the clipping
//! path's one-value all-reduce, `passes::optimizer`), which is finite exactly when no actor holds
//! an inf or a NaN. bf16 has f32's exponent range and needs no scaling.
//!
//! ```
//! use archipelago_dataflow::{DType, LossScale, Precision};
//! assert_eq!(Precision::parse("bf16").unwrap().compute, DType::BF16);
//! assert_eq!(Precision::default().compute, DType::F32);
//! assert!(Precision::parse("i8").is_err());
//! let f16 = Precision::parse("f16").unwrap();
//! assert_eq!(f16.loss_scaling(), Some(LossScale::DYNAMIC));
//! assert_eq!(LossScale::parse("static:1024"), Ok(LossScale::Static { scale: 1024.0 }));
//! assert_eq!(Precision::parse("bf16").unwrap().loss_scaling(), None);
//! ```

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::PlanError;
use crate::program::Program;

/// How an f16 job scales its loss (`--loss-scale`): `None` for bf16 and f32, which need none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossScale {
    /// No scaling (the default: f16 then takes [`LossScale::DYNAMIC`]).
    #[default]
    None,
    /// A fixed scale `S` (`--loss-scale static:S`); a step that overflows is still skipped.
    Static {
        /// The factor the loss is multiplied by.
        scale: f32,
    },
    /// Start at `init`, halve on an overflow (never below 1), double after `growth_interval`
    /// steps in a row without one (`--loss-scale dynamic[:INIT]`).
    Dynamic {
        /// The first step's scale.
        init: f32,
        /// Clean steps before the scale doubles.
        growth_interval: u32,
    },
}

impl LossScale {
    /// PyTorch's `GradScaler` defaults: start at 2^16, double after 2000 clean steps.
    pub const DYNAMIC: LossScale = LossScale::Dynamic {
        init: 65536.0,
        growth_interval: 2000,
    };

    /// The scaling of `--loss-scale dynamic`, `dynamic:INIT` or `static:S` (a scale is a finite
    /// number ≥ 1).
    pub fn parse(text: &str) -> Result<LossScale, String> {
        let scale = |s: &str| -> Result<f32, String> {
            match s.parse::<f32>() {
                Ok(v) if v.is_finite() && v >= 1.0 => Ok(v),
                _ => Err(format!(
                    "--loss-scale {text}: the scale `{s}` is not a finite number ≥ 1 (e.g. static:1024)"
                )),
            }
        };
        match text.split_once(':') {
            None if text == "dynamic" => Ok(LossScale::DYNAMIC),
            Some(("dynamic", init)) => Ok(LossScale::Dynamic {
                init: scale(init)?,
                growth_interval: 2000,
            }),
            Some(("static", s)) => Ok(LossScale::Static { scale: scale(s)? }),
            _ => Err(format!(
                "--loss-scale {text}: expected dynamic, dynamic:INIT or static:S"
            )),
        }
    }
}

/// How a job computes: the compute dtype of every parameter slice (storage stays f32).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Precision {
    /// The dtype of the modules' parameters, activations and gradients in forward and backward.
    pub compute: DType,
    /// The dtype gradients are reduced in between replicas (`--grad-reduce-dtype`): `None`, the
    /// compute dtype; `Some(F32)` keeps f32 on the wire.
    #[serde(default)]
    pub grad_reduce: Option<DType>,
    /// `--loss-scale`: `None` takes f16's default, [`LossScale::DYNAMIC`]; `plan` refuses any
    /// other with bf16 or f32.
    #[serde(default)]
    pub loss_scale: LossScale,
}

impl Precision {
    /// The precision of `--precision NAME` (`f32`, `bf16` or `f16`).
    pub fn parse(name: &str) -> Result<Precision, String> {
        let compute = match name {
            "f32" | "fp32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            other => {
                return Err(format!("--precision {other}: expected f32, bf16 or f16"));
            }
        };
        Ok(Precision {
            compute,
            ..Precision::default()
        })
    }

    /// The same with gradients reduced in `dtype` (`--grad-reduce-dtype`; `plan` refuses any but
    /// f32 and the compute dtype).
    pub fn with_grad_reduce(self, dtype: DType) -> Precision {
        Precision {
            grad_reduce: Some(dtype),
            ..self
        }
    }

    /// The same with the loss scaled as `scale` says (`--loss-scale`; f16 only).
    pub fn with_loss_scale(self, scale: LossScale) -> Precision {
        Precision {
            loss_scale: scale,
            ..self
        }
    }

    /// How the loss is scaled: f16's (dynamic unless `--loss-scale` says), `None` for bf16 and
    /// f32. Every actor of a scaled job skips a step whose gradients overflowed on any actor.
    pub fn loss_scaling(&self) -> Option<LossScale> {
        match (self.compute, self.loss_scale) {
            (DType::F16, LossScale::None) => Some(LossScale::DYNAMIC),
            (DType::F16, scale) => Some(scale),
            _ => None,
        }
    }

    /// The dtype gradient buckets cross the fabric in.
    pub fn reduce_dtype(&self) -> DType {
        self.grad_reduce.unwrap_or(self.compute)
    }

    /// Whether forward and backward run in a 16-bit dtype.
    pub fn is_mixed(&self) -> bool {
        self.compute != DType::F32
    }
}

/// Refuses a precision the trainer cannot run, naming what to change.
pub fn check(program: &Program) -> Result<(), PlanError> {
    let precision = program.precision;
    if let Some(reduce) = precision.grad_reduce
        && reduce != DType::F32
        && reduce != precision.compute
    {
        return Err(PlanError::Conflict(format!(
            "--grad-reduce-dtype {reduce} with --precision {}: gradients are reduced in the compute \
             dtype or in f32; use --grad-reduce-dtype {} or f32",
            precision.compute, precision.compute
        )));
    }
    if precision.loss_scale != LossScale::None && precision.compute != DType::F16 {
        return Err(PlanError::Conflict(format!(
            "--loss-scale with --precision {}: only f16 scales its loss ({} has f32's exponent range, \
             where gradients neither underflow nor overflow); drop --loss-scale, or use --precision f16",
            precision.compute, precision.compute
        )));
    }
    match precision.compute {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(PlanError::Conflict(format!(
            "--precision {other}: a compute dtype is a float type; use f32, bf16 or f16"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, ParallelPlan, compile};

    fn program(precision: &str) -> Program {
        Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_plan(ParallelPlan {
                dp: 2,
                zero: 3,
                batch: 4,
                ..ParallelPlan::default()
            })
            .with_precision(Precision::parse(precision).unwrap())
    }

    /// Every slice of every actor computes in the program's dtype over f32 storage.
    #[test]
    fn the_slices_compute_in_the_programs_dtype_over_f32_storage() {
        for (name, dtype) in [("f32", DType::F32), ("bf16", DType::BF16), ("f16", DType::F16)] {
            let plan = compile(&program(name)).unwrap();
            let slices = plan.actors.iter().flat_map(|a| &a.training.slices);
            assert!(slices.clone().count() > 0);
            for slice in slices {
                assert_eq!(
                    (slice.storage, slice.compute),
                    (DType::F32, dtype),
                    "{}",
                    slice.param
                );
            }
        }
    }

    /// f16 compiles with dynamic scaling by default; `--loss-scale` with bf16 or f32 is refused
    /// before any actor starts, naming the fix; so are a name that is no precision and a scale
    /// that is no scale.
    #[test]
    fn loss_scaling_is_f16s_and_bad_scales_are_refused() {
        let plan = compile(&program("f16")).unwrap();
        assert_eq!(plan.program.precision.loss_scaling(), Some(LossScale::DYNAMIC));
        let fixed = program("f16").with_precision(
            Precision::parse("f16")
                .unwrap()
                .with_loss_scale(LossScale::Static { scale: 128.0 }),
        );
        assert_eq!(
            compile(&fixed).unwrap().program.precision.loss_scaling(),
            Some(LossScale::Static { scale: 128.0 })
        );
        for name in ["bf16", "f32"] {
            let scaled = program(name).with_precision(
                Precision::parse(name)
                    .unwrap()
                    .with_loss_scale(LossScale::DYNAMIC),
            );
            let refused = compile(&scaled).unwrap_err().to_string();
            assert!(
                refused.contains("--loss-scale with --precision") && refused.contains("drop --loss-scale"),
                "{refused}"
            );
        }
        let refused = Precision::parse("int8").unwrap_err();
        assert!(refused.contains("f32, bf16 or f16"), "{refused}");
        for bad in [
            "static:0",
            "static:inf",
            "static:-4",
            "dynamic:x",
            "auto",
            "static",
        ] {
            assert!(LossScale::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            LossScale::parse("dynamic:1024"),
            Ok(LossScale::Dynamic {
                init: 1024.0,
                growth_interval: 2000
            })
        );
    }
}
