//! Mixed precision on the fabric (issue 38; Micikevicius et al. 2018, and ZeRO's 2Ψ + 2Ψ
//! accounting of 16-bit gradients and parameters): every gradient bucket's all-reduce or
//! reduce-scatter carries the reduce dtype (the compute dtype unless `--grad-reduce-dtype f32`),
//! every ZeRO all-gather of parameters the compute dtype. The actors narrow their f32 buffers at
//! the collective's start and widen the result at its end (`executor.rs`): masters, buckets and
//! the optimizer stay f32. A hierarchical all-reduce across islands stays f32 (its worker reduces
//! f32 only). Activations and their gradients cross stages in the compute dtype as the trainer
//! makes them; their receives carry no dtype (`fabric_bytes::predict` sizes them), and a
//! tensor-parallel group's all-reduces of them (Megatron's g and f) are in the compute dtype too;
//! the vocabulary-parallel loss's statistics and the replicated gradients' sums stay f32.

use crate::graph::{Graph, NodeOp};
use crate::instruction::CollectiveKind;
use crate::precision::Precision;
use crate::tensor_id::TensorId;

/// Sets the dtype of every gradient and parameter collective of `graph` from `precision`.
pub fn apply(graph: &mut Graph, precision: &Precision) {
    for node in &mut graph.nodes {
        if let NodeOp::Collective {
            kind, tensor, dtype, ..
        } = node
        {
            *dtype = match tensor {
                TensorId::GradBucket { .. }
                    if !matches!(kind, CollectiveKind::HierarchicalAllReduceSum { .. }) =>
                {
                    precision.reduce_dtype()
                }
                TensorId::UpdatedParams { .. } | TensorId::GatheredParams { .. } => precision.compute,
                // Tensor parallelism's g and f reduce activations as the trainer holds them.
                TensorId::Activation { .. } | TensorId::ActivationGrad { .. } => precision.compute,
                // ZeRO-R gathers a checkpointed input as the trainer holds it.
                TensorId::Checkpoint { .. } => precision.compute,
                _ => *dtype,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{
        CollectiveKind, DType, Instruction, ModelSpec, ParallelPlan, Precision, Program, TensorId, compile,
    };

    /// Every collective of `program`'s streams: its kind, what it moves (gradients, parameters or
    /// other) and its dtype.
    fn dtypes(program: &Program) -> Vec<(CollectiveKind, String, DType)> {
        let plan = compile(program).unwrap();
        let mut out = Vec::new();
        for actor in plan.every_stream() {
            for i in &actor.instructions {
                if let Instruction::StartCollective {
                    kind, tensor, dtype, ..
                } = i
                {
                    let what = match tensor {
                        TensorId::GradBucket { .. } => "grad",
                        TensorId::UpdatedParams { .. } | TensorId::GatheredParams { .. } => "params",
                        _ => "other",
                    };
                    out.push((*kind, what.to_string(), *dtype));
                }
            }
        }
        out
    }

    fn program(zero: u8, precision: Precision) -> Program {
        Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_plan(ParallelPlan {
                dp: 2,
                zero,
                batch: 4,
                ..ParallelPlan::default()
            })
            .with_precision(precision)
            .with_clip_grad_norm(Some(1.0))
    }

    /// bf16: gradients and gathers in bf16, clipping's one value in f32; `--grad-reduce-dtype
    /// f32` keeps the gradients f32; f32 runs as before.
    #[test]
    fn gradients_and_gathers_move_in_the_compute_dtype() {
        let bf16 = Precision::parse("bf16").unwrap();
        for zero in [0, 1, 2, 3] {
            let all = dtypes(&program(zero, bf16));
            assert!(all.iter().any(|(_, what, _)| what == "grad"), "{all:?}");
            for (kind, what, dtype) in &all {
                let expected = if what == "grad" || what == "params" {
                    DType::BF16
                } else {
                    DType::F32
                };
                assert_eq!(*dtype, expected, "zero {zero}: {kind:?} of {what}");
            }
            let f32_wire = dtypes(&program(zero, bf16.with_grad_reduce(DType::F32)));
            for (kind, what, dtype) in &f32_wire {
                let expected = if what == "params" { DType::BF16 } else { DType::F32 };
                assert_eq!(*dtype, expected, "zero {zero}, f32 reduce: {kind:?} of {what}");
            }
            let plain = dtypes(&program(zero, Precision::default()));
            assert!(plain.iter().all(|(_, _, d)| *d == DType::F32), "{plain:?}");
        }
    }
}
