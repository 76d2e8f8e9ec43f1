//! Tests of the plan compiler: streams per layout, refusals with their remedies, schedules and
//! islands.

use super::*;
use crate::passes::schedule::Schedule;
use crate::{CollectiveKind, ModelSpec, ParallelPlan};

fn program(dp: usize, batch: usize) -> Program {
    Program::new(ModelSpec::mlp_8x1024()).with_plan(ParallelPlan {
        dp,
        batch,
        ..ParallelPlan::default()
    })
}

fn collectives(plan: &Plan, actor: usize) -> Vec<(CollectiveKind, Vec<usize>)> {
    plan.stream(actor)
        .instructions
        .iter()
        .filter_map(|i| match i {
            Instruction::StartCollective { kind, group, .. } => Some((*kind, group.clone())),
            _ => None,
        })
        .collect()
}

/// A dp group spanning two islands of two all-reduces hierarchically, its group listed
/// island by island; one island, uneven islands and ZeRO-2's reduce-scatter stay flat rings.
#[test]
fn dp_groups_across_islands_all_reduce_hierarchically() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut p = program(4, 64);
    p.islands = names(&["a", "b", "a", "b"]);
    let plan = compile(&p).unwrap();
    let found = collectives(&plan, 1);
    assert!(!found.is_empty());
    for (kind, group) in &found {
        assert_eq!(*kind, CollectiveKind::HierarchicalAllReduceSum { island_size: 2 });
        assert_eq!(group, &vec![0, 2, 1, 3]);
    }
    p.islands = names(&["a", "a", "a", "b"]);
    let plan = compile(&p).unwrap();
    assert!(
        collectives(&plan, 0)
            .iter()
            .all(|(k, _)| *k == CollectiveKind::AllReduceSum)
    );
    p.islands = names(&["a", "b", "a", "b"]);
    p.plan.zero = 2;
    let plan = compile(&p).unwrap();
    assert!(
        collectives(&plan, 0)
            .iter()
            .all(|(k, _)| *k != CollectiveKind::HierarchicalAllReduceSum { island_size: 2 })
    );
    p.islands = names(&["a", "b"]);
    assert!(matches!(compile(&p), Err(PlanError::Conflict(_))));
}

#[test]
fn dp_plans_verify_and_overlap_all_reduce_with_backward() {
    let plan = compile(&program(4, 64)).unwrap();
    assert_eq!(plan.actors.len(), 4);
    let s = &plan.stream(2).instructions;
    assert!(matches!(
        s[0],
        Instruction::Compute {
            op: ComputeOp::LoadBatch { start: 32, end: 48 },
            ..
        }
    ));
    // The last bucket's all-reduce starts before the first bucket's backward runs.
    let first_start = s
        .iter()
        .position(|i| matches!(i, Instruction::StartCollective { .. }))
        .unwrap();
    let last_backward = s
        .iter()
        .rposition(|i| {
            matches!(
                i,
                Instruction::Compute {
                    op: ComputeOp::Backward { .. },
                    ..
                }
            )
        })
        .unwrap();
    assert!(first_start < last_backward, "{}", plan.summary());
    assert!(plan.to_json().contains("AllReduceSum"));
}

#[test]
fn indivisible_batch_is_refused_with_the_fix() {
    let err = compile(&program(3, 64)).unwrap_err().to_string();
    assert!(err.contains("--batch 63 or --batch 66"), "{err}");
}

#[test]
fn memory_budget_is_enforced() {
    let mut p = program(2, 64);
    p.plan.device_memory = Some(64 << 20);
    let err = compile(&p).unwrap_err().to_string();
    assert!(err.contains("budget"), "{err}");
    // dp=2 needs ≈ 159 MiB (16Ψ = 128 MiB + 28 MiB of all-reduce buffers). Under 140 MiB
    // ZeRO-1 and -2 fit; ZeRO-3 does not (it gathers a whole 28 MiB bucket, twice, at once).
    let mut p = program(2, 64);
    p.plan.device_memory = Some(140 << 20);
    let err = compile(&p).unwrap_err().to_string();
    let fixes: Vec<&str> = err
        .split("it fits with ")
        .nth(1)
        .unwrap()
        .split(", or ")
        .collect();
    for fix in ["--zero 1", "--zero 2", "--offload cpu", "--offload nvme:DIR"] {
        assert!(fixes.contains(&fix), "{fix} missing: {err}");
    }
    assert!(fixes.iter().any(|f| f.starts_with("--pp 2")), "{err}");
    assert!(!fixes.contains(&"--zero 3"), "{err}");
    let m = compile(&program(2, 64)).unwrap().memory[0].clone();
    assert_eq!(m.model_state(), 16 * 8_407_050);
}

/// Under `--compress int8` the memory remedies that raise ZeRO to 2 swap it for
/// `--quantize-grads int8` (ZeRO-2/3 reduce-scatter the gradients), and still fit.
#[test]
fn remedies_past_zero_1_quantize_the_reduce_scatter_instead() {
    let mut p = program(2, 64).with_compression(crate::Compression::Int8);
    p.plan.device_memory = Some(140 << 20);
    let err = compile(&p).unwrap_err().to_string();
    assert!(
        err.contains("--zero 2 --compress none --quantize-grads int8"),
        "{err}"
    );
    assert!(err.contains("--zero 1, or"), "{err}");
}

/// When no single remedy fits, pairs on different knobs are tried: gpt-tiny at batch 64 under
/// 100 MiB fits neither with activation checkpointing alone nor with more stages alone, but with
/// both; under 40 MiB nothing of two remedies fits, and the refusal says so.
#[test]
fn remedies_combine_when_none_fits_alone() {
    let gpt = |budget: u64| {
        let mut p = Program::new(ModelSpec::parse("gpt-tiny").unwrap());
        p.plan.batch = 64;
        p.plan.device_memory = Some(budget << 20);
        p
    };
    let err = compile(&gpt(100)).unwrap_err().to_string();
    let fixes: Vec<&str> = err
        .split("it fits with ")
        .nth(1)
        .unwrap()
        .split(", or ")
        .collect();
    assert!(
        fixes.contains(&"--checkpoint-activations --pp 4 --microbatches 4 (4 devices)"),
        "{err}"
    );
    // Negative control: neither half of the pair is offered alone.
    assert!(!fixes.contains(&"--checkpoint-activations"), "{err}");
    assert!(!fixes.iter().any(|f| f.starts_with("--pp")), "{err}");
    let err = compile(&gpt(40)).unwrap_err().to_string();
    assert!(err.contains("alone or two together"), "{err}");
}

fn pipeline(pp: usize, m: usize, schedule: Schedule) -> Program {
    let mut p = program(1, 64);
    p.plan.pp = pp;
    p.plan.microbatches = m;
    p.plan.schedule = schedule;
    p
}

#[test]
fn pipeline_plans_verify_and_print_schedule_bubble_and_peak() {
    let plan = compile(&pipeline(2, 8, Schedule::OneFOneB)).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=1 × pp=2");
    assert_eq!(plan.chunks, vec![(0, 4), (4, 9)]);
    assert_eq!(plan.prediction.peak_in_flight, vec![2, 1]);
    let summary = plan.summary();
    assert!(summary.contains("stage 0: bubble 0.1"), "{summary}");
    assert!(
        summary.contains("peak micro-batches held 2: F0 F1 B0 F2 B1"),
        "{summary}"
    );
    let gpipe = compile(&pipeline(2, 8, Schedule::GPipe)).unwrap();
    assert_eq!(gpipe.prediction.peak_in_flight, vec![8, 8]);
    // GPipe keeps every micro-batch's activations; 1F1B at most pp; checkpointing only inputs.
    assert!(gpipe.memory[0].activations > 3 * plan.memory[0].activations);
    let mut ckpt = pipeline(2, 8, Schedule::GPipe);
    ckpt.plan.checkpoint_activations = true;
    let ckpt = compile(&ckpt).unwrap();
    assert!(ckpt.memory[0].activations < gpipe.memory[0].activations / 2);
    // Each stage holds only its blocks' state.
    assert!(plan.memory[0].params < 4 * 8_407_050 / 2 + 4 * 1_100_000);
    // Stage 0 sends activations to stage 1 and receives their gradients.
    let s0 = &plan.stream(0).instructions;
    assert!(s0.iter().any(|i| matches!(i, Instruction::Send { to: 1, .. })));
    assert!(s0.iter().any(|i| matches!(i, Instruction::Recv { from: 1, .. })));
}

#[test]
fn pipeline_times_data_parallel_all_reduces_within_each_stage() {
    let mut p = pipeline(2, 4, Schedule::OneFOneB);
    p.plan.dp = 2;
    let plan = compile(&p).unwrap();
    assert_eq!(plan.actors.len(), 4);
    for a in plan.every_stream() {
        let groups: Vec<&Vec<usize>> = a
            .instructions
            .iter()
            .filter_map(|i| match i {
                Instruction::StartCollective { group, .. } => Some(group),
                _ => None,
            })
            .collect();
        assert!(!groups.is_empty());
        let expected = plan.mesh.group(a.actor, "dp");
        assert!(
            groups.iter().all(|g| **g == expected),
            "actor {}: {groups:?}",
            a.actor
        );
    }
}

#[test]
fn bad_pipeline_input_is_refused_with_the_fix() {
    let err = |p: Program| compile(&p).unwrap_err().to_string();
    let e = err(pipeline(12, 8, Schedule::OneFOneB));
    assert!(e.contains("only 9 blocks") && e.contains("--pp 9"), "{e}");
    let e = err(pipeline(2, 5, Schedule::OneFOneB));
    assert!(e.contains("--microbatches 4") && e.contains("--batch 65"), "{e}");
    let mut p = pipeline(2, 4, Schedule::OneFOneB);
    p.plan.stages = Some(vec![(0, 5), (4, 9)]);
    assert!(err(p).contains("overlap"));
    let mut p = pipeline(2, 4, Schedule::OneFOneB);
    p.plan.stages = Some(vec![(0, 0), (0, 9)]);
    assert!(err(p).contains("empty"));
    let mut p = pipeline(2, 3, Schedule::Interleaved);
    p.plan.virtual_stages = 2;
    p.plan.batch = 66;
    assert!(err(p).contains("--microbatches 4"));
    let mut p = pipeline(2, 4, Schedule::OneFOneB);
    p.plan.virtual_stages = 2;
    assert!(err(p).contains("--schedule interleaved"));
}

#[test]
fn compiles_a_large_pipeline_mesh_quickly() {
    let model = ModelSpec::parse("gpt:layers=64").unwrap();
    let p = Program::new(model).with_plan(ParallelPlan {
        dp: 64,
        pp: 16,
        microbatches: 16,
        batch: 1024,
        ..ParallelPlan::default()
    });
    let plan = compile(&p).unwrap();
    assert_eq!(plan.actors.len(), 1024);
}

#[test]
fn compiles_a_large_mesh_quickly() {
    let p = Program::new(ModelSpec::gpt_tiny()).with_plan(ParallelPlan {
        dp: 512,
        batch: 1024,
        ..ParallelPlan::default()
    });
    let plan = compile(&p).unwrap();
    assert_eq!(plan.actors.len(), 512);
}

/// `--state device` compiles for every update rule (LAMB included, with clipping) and ZeRO 1-3,
/// and refuses offload (whose state is the offload actor's, in host memory), naming the flags.
#[test]
fn state_on_the_device_is_refused_with_offload_only() {
    use crate::{OptimizerSpec, StatePlacement};
    let on_device = |mut p: Program| {
        p.plan.state = StatePlacement::Device;
        p
    };
    assert!(compile(&on_device(program(2, 64))).is_ok());
    assert!(compile(&on_device(program(2, 64)).with_clip_grad_norm(Some(1.0))).is_ok());
    let lamb = on_device(program(2, 64)).with_optimizer(OptimizerSpec::lamb(1e-3));
    assert!(compile(&lamb).is_ok());
    for stage in [1, 2, 3] {
        let mut zero = on_device(program(2, 64));
        zero.plan.zero = stage;
        assert!(compile(&zero).is_ok(), "--zero {stage}");
    }
    let mut offload = on_device(program(1, 64));
    offload.plan.offload = crate::Offload::Cpu;
    match compile(&offload) {
        Err(PlanError::Conflict(why)) => {
            assert!(
                why.contains("--offload cpu") && why.contains("--state host"),
                "{why}"
            )
        }
        other => panic!("--offload with --state device: {other:?}"),
    }
}

/// A host part's plan keeps its own actors whole and every other actor's placement, without
/// their streams and segments: the host builds exactly what it would from the whole plan, and
/// the plan it is sent shrinks with the share of actors it runs.
#[test]
fn a_hosts_plan_keeps_its_actors_whole_and_only_the_others_placement() {
    let mut p = program(4, 64);
    p.plan.pp = 2;
    p.plan.microbatches = 2;
    p.devices = DeviceSpec::cpus(8);
    let plan = compile(&p).unwrap();
    let mine = [2, 5];
    let sent = plan.for_actors(&mine);
    assert_eq!(sent.actors.len(), plan.actors.len());
    for (whole, part) in plan.actors.iter().zip(&sent.actors) {
        assert_eq!(
            (whole.device, &whole.coords, whole.stage, whole.replica),
            (part.device, &part.coords, part.stage, part.replica)
        );
        assert_eq!(whole.training.zero, part.training.zero);
        let a = whole.actor;
        let class = |x| plan.streams.representative(x);
        if mine.contains(&a) {
            assert_eq!(whole, part, "actor {a} is this host's: whole");
            assert_eq!(plan.stream(a), sent.stream(a), "actor {a}'s stream");
        } else {
            assert!(part.training.segments.is_empty());
            let shares_a_class = mine.iter().any(|&m| class(m) == class(a));
            assert_eq!(sent.class_stream(a).is_empty(), !shares_a_class, "actor {a}");
            assert!(
                !plan.class_stream(a).is_empty(),
                "the control: others had streams to drop"
            );
        }
    }
    let size = |plan: &Plan| serde_json::to_vec(plan).unwrap().len();
    assert!(
        size(&sent) * 4 < size(&plan) * 3,
        "{} vs {} bytes",
        size(&sent),
        size(&plan)
    );
}

/// The API's default placement is `Auto`, decided at compile time for the actors' devices: the
/// state on GPUs, in host memory on CPU devices or with offload; an explicit placement stays.
#[test]
fn the_default_state_placement_is_decided_for_the_devices() {
    use crate::{DeviceSpec, Offload, StatePlacement};
    let placed = |devices: Vec<DeviceSpec>, offload: Offload, state: StatePlacement| {
        let mut p = program(devices.len(), 64);
        p.devices = devices;
        p.plan.offload = offload;
        p.plan.state = state;
        let plan = compile(&p).unwrap();
        let states: Vec<StatePlacement> = plan.actors.iter().map(|a| a.training.state).collect();
        assert!(states.iter().all(|s| *s == plan.program.plan.state), "{states:?}");
        plan.program.plan.state
    };
    let gpus = || vec![DeviceSpec::Cuda(0), DeviceSpec::Cuda(1)];
    let auto = StatePlacement::Auto;
    assert_eq!(program(1, 64).plan.state, auto, "the default");
    assert_eq!(placed(gpus(), Offload::None, auto), StatePlacement::Device);
    assert_eq!(
        placed(DeviceSpec::cpus(2), Offload::None, auto),
        StatePlacement::Host
    );
    assert_eq!(placed(gpus(), Offload::Cpu, auto), StatePlacement::Host);
    // The control: explicit placements are kept on either kind of device.
    assert_eq!(
        placed(gpus(), Offload::None, StatePlacement::Host),
        StatePlacement::Host
    );
    assert_eq!(
        placed(DeviceSpec::cpus(2), Offload::None, StatePlacement::Device),
        StatePlacement::Device
    );
}

/// On GPUs, where `Auto` puts the state on the device, a plan that does not fit is still offered
/// offload (whose state placement is then decided afresh: host), and every remedy is checked
/// with the GPU's own estimate. The control: the same refusal on CPU devices names the same
/// offload remedy.
#[test]
fn a_gpu_plan_that_does_not_fit_is_offered_offload() {
    use crate::DeviceSpec;
    for devices in [vec![DeviceSpec::Cuda(0)], vec![DeviceSpec::Cpu(0)]] {
        let mut p = program(1, 64);
        p.devices = devices.clone();
        p.plan.device_memory = Some(100 << 20);
        match compile(&p) {
            Err(PlanError::DoesNotFit { fixes, .. }) => {
                assert!(fixes.contains("--offload cpu"), "{devices:?}: {fixes}")
            }
            other => panic!("{devices:?}: expected DoesNotFit, got {other:?}"),
        }
    }
}

/// The trainer holds every parameter in f32 for now: `compile` refuses a model that describes a
/// 16-bit parameter (frozen or not), naming the block and the parameter, so that no actor refuses
/// an accepted plan at start. Controls: the model as described, and with a frozen f32 parameter,
/// is accepted.
#[test]
fn parameters_the_trainer_cannot_hold_are_refused_by_the_plan() {
    let model = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap();
    let p = Program::new(model);
    assert!(compile(&p).is_ok(), "as described: trainable f32");
    let mut frozen = p.clone();
    frozen.model.blocks[1].param_descs[0].trainable = false;
    assert!(compile(&frozen).is_ok(), "a frozen f32 parameter");
    for trainable in [true, false] {
        let mut q = p.clone();
        let w = &mut q.model.blocks[1].param_descs[0];
        w.trainable = trainable;
        w.dtype = crate::DType::BF16;
        let err = compile(&q).unwrap_err();
        assert!(matches!(err, PlanError::NotTrainable { block: 1, .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("`layers.1.weight`"), "{text}");
        let said = if trainable {
            "described as bf16"
        } else {
            "frozen bf16"
        };
        assert!(text.contains(said), "{text}");
    }
}

/// hpZ (ZeRO++) at dp=4 ZeRO-3 over islands a, b, a, b: every backward gather runs over the two
/// members of one island from the secondary copy, every forward gather over all four keeps
/// its island slice first, and the plan counts the slice (half of each segment) as memory.
/// Control: the same plan without hpZ gathers the backward across islands.
#[test]
fn hpz_gathers_the_backward_inside_each_island() {
    use crate::{GatherFor, TensorId};
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut p = program(4, 64);
    p.islands = names(&["a", "b", "a", "b"]);
    p.plan.zero = 3;
    p.plan.bucket_bytes = 1 << 20;
    let backward_groups = |plan: &Plan| -> Vec<Vec<usize>> {
        (plan.stream(1).instructions.iter())
            .filter_map(|i| match i {
                Instruction::StartCollective {
                    tensor: TensorId::GatheredParams { pass, .. },
                    group,
                    ..
                } if *pass != GatherFor::Forward => Some(group.clone()),
                _ => None,
            })
            .collect()
    };
    let without = compile(&p).unwrap();
    assert!(backward_groups(&without).iter().all(|g| g == &[0, 1, 2, 3]));
    assert_eq!(without.memory[1].secondary_params, 0);
    p.plan.zero_hpz = true;
    let with = compile(&p).unwrap();
    let groups = backward_groups(&with);
    assert!(
        !groups.is_empty() && groups.iter().all(|g| g == &[1, 3]),
        "{groups:?}"
    );
    let ops = |op: &str| {
        (with.stream(1).instructions.iter())
            .filter(|i| i.to_string().contains(op))
            .count()
    };
    let segments = with.actors[1].training.segments.len();
    assert_eq!(ops("KeepSecondary"), segments);
    assert_eq!(ops("SecondaryShard"), segments);
    assert_eq!(with.actors[1].training.secondary, Some((0, 2)));
    assert_eq!(with.actors[3].training.secondary, Some((1, 2)));
    let params: usize = with.actors[1].training.segments.iter().map(|s| s.params).sum();
    assert_eq!(with.memory[1].secondary_params, 4 * params as u64 / 2);
    assert!(with.memory[1].total() > without.memory[1].total());
    // Refusals, each naming the fix.
    let refused = |p: &Program, says: &str| match compile(p) {
        Err(PlanError::Conflict(why)) => assert!(why.contains(says), "{why}"),
        other => panic!("expected a refusal naming {says}, got {:?}", other.map(|_| ())),
    };
    let mut two = p.clone();
    two.plan.zero = 2;
    refused(&two, "--zero 3");
    let mut one_island = p.clone();
    one_island.islands = names(&["a", "a", "a", "a"]);
    refused(&one_island, "two islands or more");
}
