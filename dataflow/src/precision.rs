//! The precision of a training job: the dtype forward and backward compute in, while the master
//! parameters and the optimizer state stay f32 (Micikevicius et al., "Mixed Precision Training",
//! 2018: an f32 master, a 16-bit compute copy refreshed after every update, the loss in f32).
//!
//! What is built (issue 38): `--precision f32|bf16` on every layout. Gradients are read into f32
//! buckets (accumulated over micro-batches in f32) and reduced in the compute dtype
//! (`--grad-reduce-dtype f32` keeps f32 on the wire); ZeRO's parameter gathers and the
//! activations crossing pipeline stages move in the compute dtype (`passes/precision.rs`). f16
//! needs loss scaling, which is not built yet: the plan refuses it, naming bf16.
//!
//! ```
//! use archipelago_dataflow::{DType, Precision};
//! assert_eq!(Precision::parse("bf16").unwrap().compute, DType::BF16);
//! assert_eq!(Precision::default().compute, DType::F32);
//! assert!(Precision::parse("i8").is_err());
//! ```

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::PlanError;
use crate::program::Program;

/// How a job computes: the compute dtype of every parameter slice (storage stays f32).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Precision {
    /// The dtype of the modules' parameters, activations and gradients in forward and backward.
    pub compute: DType,
    /// The dtype gradients are reduced in between replicas (`--grad-reduce-dtype`): `None`, the
    /// compute dtype; `Some(F32)` keeps f32 on the wire.
    #[serde(default)]
    pub grad_reduce: Option<DType>,
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
            grad_reduce: None,
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
    match precision.compute {
        DType::F32 | DType::BF16 => Ok(()),
        DType::F16 => Err(PlanError::Conflict(
            "--precision f16 needs loss scaling (f16 gradients underflow without it), which is not built \
             yet; use --precision bf16 (the same 16 bits on the wire, f32's exponent range, no scaling)"
                .to_string(),
        )),
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
        for (name, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
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

    /// f16 is refused before any actor starts, naming bf16; so is a name that is no precision.
    #[test]
    fn f16_is_refused_naming_bf16() {
        let refused = compile(&program("f16")).unwrap_err().to_string();
        assert!(
            refused.contains("loss scaling") && refused.contains("--precision bf16"),
            "{refused}"
        );
        let refused = Precision::parse("int8").unwrap_err();
        assert!(refused.contains("f32, bf16 or f16"), "{refused}");
    }
}
