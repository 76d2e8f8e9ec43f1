//! Compression of the gradient reductions (issue 43): writes the codec of `--compress` on every
//! data-parallel all-reduce of a gradient bucket, and int8 on ZeRO-2/3's reduce-scatter of one
//! under `--quantize-grads int8` (ZeRO++'s qgZ), whose payload then crosses as the codec says
//! (and in f32 before encoding: the codec replaces the reduce dtype's narrowing). Refuses, with
//! what to change, a compression not built yet and a plan in which nothing would be compressed
//! (no data parallelism; ZeRO-2/3's reduce-scatter; the hierarchical all-reduce across islands).

use crate::codec::{Codec, Compression, INT8_BLOCK};
use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{Graph, NodeOp};
use crate::instruction::CollectiveKind;
use crate::program::Program;
use crate::program::TestFault;
use crate::tensor_id::TensorId;

/// Sets the codecs of `--compress` and `--quantize-grads` on `graph`'s gradient reductions.
pub fn apply(graph: &mut Graph, program: &Program) -> Result<(), PlanError> {
    let (asked, zero) = (program.compression, program.plan.zero);
    let quantize_grads = program.quantize_grads;
    if asked == Compression::None && !quantize_grads {
        return Ok(());
    }
    let flag = if asked == Compression::None {
        "--quantize-grads int8".to_string()
    } else {
        format!("--compress {asked}")
    };
    let control = |codec| match (codec, program.test_fault) {
        (Codec::Int8 { .. }, Some(TestFault::UnscaledInt8)) => Codec::Int8 { block: 0 },
        (codec, _) => codec,
    };
    let all_reduce = control(asked.codec().map_err(PlanError::Conflict)?);
    let reduce_scatter = control(Codec::Int8 { block: INT8_BLOCK });
    if program.plan.dp < 2 {
        return Err(PlanError::Conflict(format!(
            "{flag} compresses the gradients' data-parallel reduction, and dp={} has none: use --dp 2 or more, or drop {flag}",
            program.plan.dp
        )));
    }
    if quantize_grads && zero < 2 {
        return Err(PlanError::Conflict(format!(
            "--quantize-grads int8 quantizes ZeRO-2/3's gradient reduce-scatter (ZeRO++'s qgZ); at --zero {zero} the gradients are all-reduced: use --compress int8 there"
        )));
    }
    for node in &mut graph.nodes {
        let NodeOp::Collective {
            kind,
            tensor: TensorId::GradBucket { .. },
            dtype,
            codec: edge,
            ..
        } = node
        else {
            continue;
        };
        let codec = match kind {
            CollectiveKind::AllReduceSum => all_reduce,
            CollectiveKind::ReduceScatterSum if quantize_grads => reduce_scatter,
            CollectiveKind::ReduceScatterSum => {
                return Err(PlanError::Conflict(format!(
                    "{flag} compresses the data-parallel all-reduce; under --zero {zero} the gradients are reduce-scattered: use --quantize-grads int8 (ZeRO++'s qgZ) instead"
                )));
            }
            CollectiveKind::HierarchicalAllReduceSum { .. } => {
                return Err(PlanError::Conflict(format!(
                    "{flag} compresses the flat gradient reduction; its dp group spans islands (the hosts' --island), where the gradients are reduced hierarchically, which is not compressed yet: keep the replicas in one island, or drop {flag}"
                )));
            }
            _ => continue,
        };
        if codec != Codec::None {
            *edge = codec;
            *dtype = DType::F32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{
        Codec, CollectiveKind, Compression, DType, Instruction, ModelSpec, ParallelPlan, Precision, Program,
        compile,
    };

    fn program(dp: usize, zero: u8, compression: Compression) -> Program {
        Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_plan(ParallelPlan {
                dp,
                zero,
                batch: 4,
                ..ParallelPlan::default()
            })
            .with_precision(Precision::parse("bf16").unwrap())
            .with_clip_grad_norm(Some(1.0))
            .with_compression(compression)
    }

    fn quantized(dp: usize, zero: u8) -> Program {
        let mut program = program(dp, zero, Compression::None);
        program.quantize_grads = true;
        program
    }

    /// `--quantize-grads int8` puts int8 on ZeRO-2/3's gradient reduce-scatters and nothing else.
    #[test]
    fn quantized_gradients_are_the_zero_reduce_scatters() {
        for zero in [2, 3] {
            let plan = compile(&quantized(2, zero)).unwrap();
            let mut quantized = 0;
            let streams: Vec<_> = plan.every_stream().collect();
            for i in streams.iter().flat_map(|a| a.instructions.iter()) {
                if let Instruction::StartCollective {
                    kind, tensor, codec, ..
                } = i
                {
                    let gradient = matches!(tensor, crate::TensorId::GradBucket { .. });
                    let expected = if gradient && *kind == CollectiveKind::ReduceScatterSum {
                        quantized += 1;
                        Codec::Int8 { block: 256 }
                    } else {
                        Codec::None
                    };
                    assert_eq!(*codec, expected, "zero {zero}: {i}");
                }
            }
            assert!(quantized > 0, "zero {zero}: nothing quantized");
        }
    }

    /// `--compress int8` puts the codec on every gradient all-reduce (in f32, whatever the
    /// reduce dtype) and on nothing else; the plan's predicted gradient bytes are the codec's.
    #[test]
    fn int8_compresses_every_gradient_all_reduce_and_nothing_else() {
        for zero in [0, 1] {
            let plan = compile(&program(2, zero, Compression::Int8)).unwrap();
            let mut compressed = 0;
            for actor in plan.every_stream() {
                for i in &actor.instructions {
                    let Instruction::StartCollective {
                        kind,
                        tensor,
                        dtype,
                        codec,
                        ..
                    } = i
                    else {
                        continue;
                    };
                    let gradient = matches!(tensor, crate::TensorId::GradBucket { .. });
                    if gradient && *kind == CollectiveKind::AllReduceSum {
                        assert_eq!(
                            (*codec, *dtype),
                            (Codec::Int8 { block: 256 }, DType::F32),
                            "zero {zero}"
                        );
                        assert!(i.to_string().contains("int8/256"), "{i}");
                        compressed += 1;
                    } else {
                        assert_eq!(*codec, Codec::None, "zero {zero}: {i}");
                    }
                }
            }
            assert!(compressed > 0, "zero {zero}: nothing compressed");
            let plain = compile(&program(2, zero, Compression::None)).unwrap();
            let (int8, bf16) = (plan.fabric[0].gradients, plain.fabric[0].gradients);
            // bf16 moves 2 bytes a value, int8 one and a 4-byte scale per 256 (or per shard's
            // partial block: this model's shards are small).
            let ratio = bf16 as f64 / int8 as f64;
            assert!(
                ratio > 1.8 && ratio < 2.0,
                "zero {zero}: {bf16} bf16 bytes against {int8} int8: {ratio}"
            );
        }
    }

    /// What nothing would compress, and what is not built yet, is refused naming the fix.
    #[test]
    fn what_it_cannot_compress_is_refused_with_the_fix() {
        for (program, says) in [
            (program(1, 0, Compression::Int8), "use --dp 2"),
            (program(2, 2, Compression::Int8), "use --quantize-grads int8"),
            (program(2, 3, Compression::Int8), "use --quantize-grads int8"),
            (quantized(2, 1), "use --compress int8 there"),
            (quantized(1, 3), "use --dp 2"),
            (program(2, 0, Compression::TopK { ratio: 0.01 }), "not built yet"),
            (program(2, 0, Compression::Qsgd { bits: 4 }), "not built yet"),
        ] {
            let refused = compile(&program).unwrap_err().to_string();
            assert!(refused.contains(says), "{refused}");
        }
    }
}
