//! Compression of the data-parallel collectives (issue 43): writes the codec of `--compress` on
//! every data-parallel all-reduce of a gradient bucket, int8 on ZeRO-2/3's reduce-scatter of one
//! under `--quantize-grads int8` (ZeRO++'s qgZ) and on ZeRO-3's parameter gathers under
//! `--quantize-weights int8` (qwZ), whose payload then crosses as the codec says
//! (and in f32 before encoding: the codec replaces the reduce dtype's narrowing); 1-bit Adam's
//! exchange (`Compression::OneBitAdam`) is the all-reduce's codec too. Refuses, with
//! what to change, a compression not built yet and a plan in which nothing would be compressed
//! (no data parallelism; the wrong ZeRO stage; the hierarchical all-reduce across islands).

use crate::codec::{Codec, Compression, INT8_BLOCK};
use crate::dtype::DType;
use crate::error::PlanError;
use crate::graph::{Graph, NodeOp};
use crate::instruction::CollectiveKind;
use crate::program::Program;
use crate::program::TestFault;
use crate::tensor_id::TensorId;

/// The codec of each kind of edge the flags compress.
struct Codecs {
    /// The gradient all-reduce's (`--compress`).
    all_reduce: Codec,
    /// ZeRO-2/3's gradient reduce-scatter's (`--quantize-grads`).
    reduce_scatter: Codec,
    /// ZeRO-3's parameter gathers' (`--quantize-weights`).
    gather: Codec,
    /// The flag asked, for refusals.
    flag: String,
}

/// The codecs `program`'s flags ask for (`None` when none), or the refusal naming the fix.
fn codecs(program: &Program) -> Result<Option<Codecs>, PlanError> {
    let (asked, zero, dp) = (program.compression, program.plan.zero, program.plan.dp);
    let (grads, weights) = (program.quantize_grads, program.quantize_weights);
    let flag = match (asked, grads, weights) {
        (Compression::None, false, false) => return Ok(None),
        (Compression::None, true, _) => "--quantize-grads int8".to_string(),
        (Compression::None, false, true) => "--quantize-weights int8".to_string(),
        (asked, ..) => format!("--compress {asked}"),
    };
    let conflict = |why: String| Err(PlanError::Conflict(why));
    if dp < 2 {
        return conflict(format!(
            "{flag} compresses the data-parallel collectives, and dp={dp} has none: use --dp 2 or more, or drop {flag}"
        ));
    }
    if grads && zero < 2 {
        return conflict(format!(
            "--quantize-grads int8 quantizes ZeRO-2/3's gradient reduce-scatter (ZeRO++'s qgZ); at --zero {zero} the gradients are all-reduced: use --compress int8 there"
        ));
    }
    if weights && zero != 3 {
        return conflict(format!(
            "--quantize-weights int8 quantizes ZeRO-3's parameter gathers (ZeRO++'s qwZ); --zero {zero} gathers none before the passes: use --zero 3, or drop --quantize-weights"
        ));
    }
    let precision = program.precision;
    let scaled = precision.compute == DType::F16 || precision.loss_scale != crate::precision::LossScale::None;
    if matches!(asked, Compression::TopK { .. }) && scaled {
        return conflict(format!(
            "{flag} keeps each replica's unsent gradient as a residual from step to step, and loss scaling (f16's) changes the gradients' scale and skips an overflowing step whose non-finite values would stay in the residual: use --precision bf16 or f32 with top-k, or another --compress"
        ));
    }
    if let Compression::OneBitAdam { .. } = asked {
        onebit_supported(program)?;
    }
    if asked.moved_momentum(program.optimizer).is_some() {
        momentum_correction_supported(program)?;
    }
    let control = |codec| match (codec, program.test_fault) {
        (
            Codec::OneBit {
                freeze_step,
                adam_bits,
                chunk,
                ..
            },
            Some(TestFault::OneBitWithoutFeedback),
        ) => Codec::OneBit {
            freeze_step,
            adam_bits,
            chunk,
            feedback: false,
        },
        (Codec::Int8 { .. }, Some(TestFault::UnscaledInt8)) => Codec::Int8 { block: 0 },
        (
            Codec::TopK {
                per_million,
                momentum_bits,
                ..
            },
            Some(TestFault::TopKWithoutFeedback),
        ) => Codec::TopK {
            per_million,
            feedback: false,
            momentum_bits,
        },
        (codec, _) => codec,
    };
    let int8 = |on: bool| {
        if on {
            control(Codec::Int8 { block: INT8_BLOCK })
        } else {
            Codec::None
        }
    };
    Ok(Some(Codecs {
        all_reduce: control(
            asked
                .codec(program.seed, program.optimizer)
                .map_err(PlanError::Conflict)?,
        ),
        reduce_scatter: int8(grads),
        gather: int8(weights),
        flag,
    }))
}

/// Refuses, naming the fix, what top-k under SGD with momentum does not combine with: its
/// momentum moves into the exchange (Deep Gradient Compression's momentum correction, each
/// replica's velocity of its own gradient), so what the optimizer would add to the gradient
/// before the momentum (weight decay), a momentum of another form (Nesterov's, dampening), or a
/// norm of the averaged gradient (clipping: no replica holds it) has no place to run.
fn momentum_correction_supported(program: &Program) -> Result<(), PlanError> {
    let crate::OptimizerSpec::Sgd {
        dampening,
        nesterov,
        weight_decay,
        ..
    } = program.optimizer
    else {
        return Ok(());
    };
    let refuse = |what: &str, fix: &str| {
        Err(PlanError::Conflict(format!(
            "--compress {} under SGD with momentum moves the momentum into the exchange (each replica's velocity of its own gradient, Deep Gradient Compression's momentum correction), which {what}: {fix}",
            program.compression
        )))
    };
    if nesterov {
        return refuse("is the heavy-ball form, not Nesterov's", "drop --nesterov");
    }
    if dampening != 0.0 {
        return refuse("accumulates undampened gradients", "drop the dampening");
    }
    if weight_decay != 0.0 {
        return refuse(
            "would need the parameters' decay term added to each replica's gradient before its velocity",
            "drop --weight-decay",
        );
    }
    if program.clip_grad_norm.is_some() {
        return refuse(
            "no replica holds the averaged gradient whose norm --clip-grad-norm needs",
            "drop --clip-grad-norm",
        );
    }
    Ok(())
}

/// Refuses, naming the fix, what 1-bit Adam does not combine with: it replaces Adam's update
/// after the freeze (the exchanged momentum, the variance frozen), so the optimizer must be Adam
/// without weight decay (an L2 term would need the parameters in the exchange); no clipping
/// (after the freeze no replica ever holds the averaged gradient whose norm clipping needs);
/// no ZeRO (each replica's momentum is whole, as in DeepSpeed, whose 1-bit Adam does not combine
/// with ZeRO either); no offload (the update runs on the actor); no loss scaling (an overflowing
/// step's momentum would stay in the errors).
fn onebit_supported(program: &Program) -> Result<(), PlanError> {
    let refuse = |why: &str| Err(PlanError::Conflict(format!("--optimizer onebit-adam {why}")));
    match program.optimizer {
        crate::OptimizerSpec::Adam {
            weight_decay: 0.0, ..
        } => {}
        crate::OptimizerSpec::Adam { .. } => {
            return refuse(
                "exchanges Adam's momentum, and an L2 --weight-decay would need the parameters in the exchange: drop --weight-decay",
            );
        }
        other => {
            return refuse(&format!(
                "is Adam with its momentum exchanged in 1 bit; the program's optimizer is {}: use --optimizer onebit-adam alone",
                other.name()
            ));
        }
    }
    if program.clip_grad_norm.is_some() {
        return refuse(
            "exchanges momentum, not gradients: after the freeze no replica holds the averaged gradient whose norm --clip-grad-norm needs (each has only its own): drop --clip-grad-norm",
        );
    }
    if program.plan.zero > 0 {
        return refuse(&format!(
            "keeps each replica's momentum whole (as DeepSpeed, whose 1-bit Adam does not combine with ZeRO): use --zero 0, not --zero {}",
            program.plan.zero
        ));
    }
    if program.plan.offload != crate::program::Offload::None || program.plan.offload_params {
        return refuse("updates on the actor with the exchanged momentum: drop --offload");
    }
    let precision = program.precision;
    if precision.compute == DType::F16 || precision.loss_scale != crate::precision::LossScale::None {
        return refuse(
            "keeps rounding errors from step to step, and loss scaling would leave an overflowing step's values in them: use --precision bf16 or f32",
        );
    }
    Ok(())
}

/// Sets the codecs of `--compress`, `--quantize-grads` and `--quantize-weights` on `graph`'s
/// gradient reductions and ZeRO-3 parameter gathers.
pub fn apply(graph: &mut Graph, program: &Program) -> Result<(), PlanError> {
    let Some(codecs) = codecs(program)? else {
        return Ok(());
    };
    let (flag, zero) = (&codecs.flag, program.plan.zero);
    for node in &mut graph.nodes {
        let NodeOp::Collective {
            kind,
            tensor,
            dtype,
            codec: edge,
            ..
        } = node
        else {
            continue;
        };
        let codec = match (tensor, kind) {
            (TensorId::GradBucket { .. }, CollectiveKind::AllReduceSum) => codecs.all_reduce,
            (TensorId::GradBucket { .. }, CollectiveKind::ReduceScatterSum) => {
                if codecs.all_reduce != Codec::None {
                    return Err(PlanError::Conflict(format!(
                        "{flag} compresses the data-parallel all-reduce; under --zero {zero} the gradients are reduce-scattered: use --quantize-grads int8 (ZeRO++'s qgZ) instead"
                    )));
                }
                codecs.reduce_scatter
            }
            (TensorId::GradBucket { .. }, CollectiveKind::HierarchicalAllReduceSum { .. }) => {
                return Err(PlanError::Conflict(format!(
                    "{flag} compresses the flat data-parallel collectives; this dp group spans islands (the hosts' --island), where the gradients are reduced hierarchically, which is not compressed yet: keep the replicas in one island, or drop {flag}"
                )));
            }
            (TensorId::GatheredParams { .. }, CollectiveKind::AllGather) => codecs.gather,
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
    use super::codecs;
    use crate::program::TestFault;
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

    fn gathered(dp: usize, zero: u8) -> Program {
        let mut program = program(dp, zero, Compression::None);
        program.quantize_weights = true;
        program
    }

    /// `--quantize-weights int8` puts int8 on ZeRO-3's parameter gathers and nothing else.
    #[test]
    fn quantized_weights_are_the_zero3_gathers() {
        let plan = compile(&gathered(2, 3)).unwrap();
        let streams: Vec<_> = plan.every_stream().collect();
        let mut quantized = 0;
        for i in streams.iter().flat_map(|a| a.instructions.iter()) {
            if let Instruction::StartCollective {
                tensor, codec, dtype, ..
            } = i
            {
                let gather = matches!(tensor, crate::TensorId::GatheredParams { .. });
                quantized += usize::from(gather);
                let expected = if gather {
                    (Codec::Int8 { block: 256 }, DType::F32)
                } else {
                    (Codec::None, *dtype)
                };
                assert_eq!((*codec, *dtype), expected, "{i}");
            }
        }
        assert!(quantized > 0, "nothing quantized");
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
            (gathered(2, 2), "use --zero 3"),
            (
                program(2, 2, Compression::Qsgd { bits: 4 }),
                "use --quantize-grads int8",
            ),
            (
                program(2, 3, Compression::TopK { ratio: 0.01 }),
                "use --quantize-grads int8",
            ),
            (
                program(2, 0, Compression::TopK { ratio: 0.01 })
                    .with_precision(Precision::parse("f16").unwrap()),
                "use --precision bf16 or f32 with top-k",
            ),
        ] {
            let refused = compile(&program).unwrap_err().to_string();
            assert!(refused.contains(says), "{refused}");
        }
    }

    #[test]
    fn onebit_adam_is_refused_where_it_does_not_combine_naming_why() {
        let onebit = Compression::OneBitAdam {
            freeze_step: 5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let base = program(2, 0, onebit)
            .with_clip_grad_norm(None)
            .with_precision(Precision::default());
        let codec = codecs(&base).unwrap().unwrap().all_reduce;
        assert!(
            matches!(
                codec,
                Codec::OneBit {
                    freeze_step: 5,
                    feedback: true,
                    ..
                }
            ),
            "{codec}"
        );
        let mut control = base.clone();
        control.test_fault = Some(TestFault::OneBitWithoutFeedback);
        let codec = codecs(&control).unwrap().unwrap().all_reduce;
        assert!(matches!(codec, Codec::OneBit { feedback: false, .. }), "{codec}");
        let refused = |p: Program| match codecs(&p) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted"),
        };
        let with = |f: &dyn Fn(&mut Program)| {
            let mut p = base.clone();
            f(&mut p);
            p
        };
        for (program, says) in [
            (
                with(&|p| p.optimizer = crate::OptimizerSpec::sgd(0.1)),
                "optimizer is sgd",
            ),
            (
                with(&|p| p.optimizer = crate::OptimizerSpec::adam(0.1).with_weight_decay(0.1)),
                "drop --weight-decay",
            ),
            (with(&|p| p.clip_grad_norm = Some(1.0)), "drop --clip-grad-norm"),
            (with(&|p| p.plan.zero = 1), "use --zero 0"),
            (with(&|p| p.plan.dp = 1), "dp=1 has none"),
            (
                with(&|p| p.precision = Precision::parse("f16").unwrap()),
                "--precision bf16 or f32",
            ),
        ] {
            let why = refused(program);
            assert!(why.contains(says), "{says}: {why}");
        }
    }

    /// Top-k under SGD with momentum moves the momentum into the exchange (Deep Gradient
    /// Compression's momentum correction): the codec carries it, the control keeps it, the
    /// optimizer's rule loses it, and what has no place to run then is refused naming the fix.
    #[test]
    fn topk_under_momentum_carries_it_and_refuses_what_cannot_follow() {
        let momentum = |nesterov| {
            crate::OptimizerSpec::sgd(0.1)
                .with_momentum(0.9, nesterov)
                .unwrap()
        };
        let topk = Compression::TopK { ratio: 0.01 };
        let mut base = program(2, 0, topk).with_clip_grad_norm(None);
        base.optimizer = momentum(false);
        let moved = 0.9f32.to_bits();
        let codec = codecs(&base).unwrap().unwrap().all_reduce;
        let corrected = Codec::TopK {
            per_million: 10_000,
            feedback: true,
            momentum_bits: moved,
        };
        assert_eq!(codec, corrected);
        assert_eq!(codec.to_string(), "topk/0.01 with momentum 0.9 corrected");
        assert_eq!(topk.update_rule(base.optimizer), crate::OptimizerSpec::sgd(0.1));
        assert_eq!(
            topk.update_rule(crate::OptimizerSpec::adam(0.1)),
            crate::OptimizerSpec::adam(0.1)
        );
        let mut control = base.clone();
        control.test_fault = Some(TestFault::TopKWithoutFeedback);
        let codec = codecs(&control).unwrap().unwrap().all_reduce;
        let dropped = Codec::TopK {
            per_million: 10_000,
            feedback: false,
            momentum_bits: moved,
        };
        assert_eq!(codec, dropped);
        let plain = program(2, 0, topk).with_clip_grad_norm(None);
        let codec = codecs(&plain).unwrap().unwrap().all_reduce;
        assert!(matches!(codec, Codec::TopK { momentum_bits: 0, .. }), "{codec}");
        let with = |f: &dyn Fn(&mut Program)| {
            let mut p = base.clone();
            f(&mut p);
            codecs(&p).err().map(|e| e.to_string()).unwrap_or_default()
        };
        for (why, says) in [
            (with(&|p| p.optimizer = momentum(true)), "drop --nesterov"),
            (
                with(&|p| p.optimizer = momentum(false).with_weight_decay(1e-4)),
                "drop --weight-decay",
            ),
            (with(&|p| p.clip_grad_norm = Some(1.0)), "drop --clip-grad-norm"),
        ] {
            assert!(why.contains(says), "{says}: {why}");
        }
    }
}
