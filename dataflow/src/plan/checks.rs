//! The refusals `plan` gives before it builds anything: options that are zero, do not divide or
//! do not go together, each naming the flag to change, and the island of each device.

use crate::passes::schedule::Schedule;
use crate::program::Program;
use crate::tensor_parallel::{BlockTp, TpEdge, TpHeld};
use crate::{ModelSpec, PlanError, Split};

/// Refuses a program whose options are zero, do not divide, or do not go together, naming the fix.
pub(super) fn check_program(program: &Program) -> Result<(), PlanError> {
    let plan = &program.plan;
    for (value, what) in [
        (plan.dp, "--dp"),
        (plan.pp, "--pp"),
        (plan.batch, "--batch"),
        (plan.microbatches, "--microbatches"),
        (plan.virtual_stages, "--virtual-stages"),
        (plan.tp, "--tp"),
    ] {
        if value == 0 {
            return Err(PlanError::Zero { what });
        }
    }
    if program.model.blocks.is_empty() {
        return Err(PlanError::EmptyModel);
    }
    program.model.check()?;
    check_tp(program)?;
    crate::sequence_parallel::check(program)?;
    if !plan.batch.is_multiple_of(plan.dp) {
        let lower = plan.batch / plan.dp * plan.dp;
        return Err(PlanError::BatchNotDivisible {
            batch: plan.batch,
            dp: plan.dp,
            lower,
            upper: lower + plan.dp,
        });
    }
    let per_replica = plan.batch / plan.dp;
    let m = plan.microbatches;
    if !per_replica.is_multiple_of(m) {
        let suggest = (1..=m.min(per_replica))
            .rev()
            .find(|d| per_replica.is_multiple_of(*d))
            .unwrap_or(1);
        let unit = plan.dp * m;
        return Err(PlanError::MicrobatchesNotDivisible {
            per_replica,
            microbatches: m,
            suggest,
            batch_fix: plan.batch.div_ceil(unit) * unit,
        });
    }
    check_schedule(program)?;
    if plan.zero > 3 {
        return Err(PlanError::Conflict(format!(
            "--zero {}: the ZeRO stages are 0, 1, 2 and 3",
            plan.zero
        )));
    }
    if plan.offload_params && (plan.zero < 3 || plan.dp < 2 || !plan.offload.is_some()) {
        return Err(PlanError::Conflict(format!(
            "--offload-params offloads ZeRO-3's parameter shards: it needs --zero 3, --dp 2 or more and \
             --offload cpu or nvme:DIR (got --zero {} --dp {} --offload {})",
            plan.zero, plan.dp, plan.offload
        )));
    }
    check_activation_checkpoints(program)?;
    crate::passes::optimizer::check(program)?;
    crate::precision::check(program)?;
    check_state_placement(program)?;
    program.model.check_trainable()?;
    Ok(())
}

/// Refuses partitioned or offloaded activation checkpoints without checkpointing (ZeRO-3
/// implies it) or, partitioned, without a tensor-parallel group to partition over.
fn check_activation_checkpoints(program: &Program) -> Result<(), PlanError> {
    let plan = &program.plan;
    // Sequence parallelism's partitioned mixing-block inputs are checkpoints of their own.
    let selective = plan.sequence_parallel && plan.partition_activations;
    let checkpointed = plan.checkpoint_activations || plan.zero_stage().shards_parameters() || selective;
    let asked = [
        (plan.partition_activations, "--partition-activations"),
        (plan.offload_activations, "--offload-activations cpu"),
    ];
    if let Some((_, flag)) = asked.iter().find(|(on, _)| *on && !checkpointed) {
        return Err(PlanError::Conflict(format!(
            "{flag} keeps the checkpointed segment inputs elsewhere, and nothing is checkpointed: add \
             --checkpoint-activations, or drop {flag}"
        )));
    }
    if plan.partition_activations && plan.tp < 2 {
        return Err(PlanError::Conflict(format!(
            "--partition-activations splits each checkpointed input over the tensor-parallel group, \
             and --tp is {}: use --tp 2 or more, or drop --partition-activations (--offload-activations \
             cpu moves the checkpoints off the device without tp)",
            plan.tp
        )));
    }
    Ok(())
}

/// Refuses schedule options that do not go together, naming the fix.
fn check_schedule(program: &Program) -> Result<(), PlanError> {
    let plan = &program.plan;
    let (pp, v, m) = (plan.pp, plan.virtual_stages, plan.microbatches);
    if v > 1 && plan.schedule != Schedule::Interleaved {
        return Err(PlanError::Conflict(format!(
            "--virtual-stages {v} needs --schedule interleaved (the {} schedule runs one chunk per device)",
            plan.schedule
        )));
    }
    if plan.schedule == Schedule::Interleaved {
        if pp < 2 {
            return Err(PlanError::Conflict(
                "--schedule interleaved needs --pp 2 or more".into(),
            ));
        }
        if !m.is_multiple_of(pp) {
            return Err(PlanError::Conflict(format!(
                "--schedule interleaved runs micro-batches in groups of pp={pp}: use --microbatches {} \
                 (a multiple of {pp})",
                m.div_ceil(pp) * pp
            )));
        }
    }
    Ok(())
}

/// `--state device` covers every update rule and ZeRO 0-3; not offload (the state is then the
/// offload actor's, in host memory by design).
fn check_state_placement(program: &Program) -> Result<(), PlanError> {
    let plan = &program.plan;
    if plan.state != crate::StatePlacement::Device {
        return Ok(());
    }
    if plan.offload.is_some() {
        return Err(PlanError::Conflict(format!(
            "--state device keeps the state on the device; --offload {} keeps it in host memory (the \
             offload actor's): use --state host (what --state auto picks with --offload), or drop --offload",
            plan.offload
        )));
    }
    Ok(())
}

/// The island index of each actor from the programme's island names (empty: one island).
pub(super) fn island_indices(names: &[String], actors: usize) -> Result<Vec<usize>, PlanError> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if names.len() < actors {
        return Err(PlanError::Conflict(format!(
            "{} island names for {actors} devices: name the island of every device, or none",
            names.len()
        )));
    }
    let mut seen: Vec<&str> = Vec::new();
    Ok(names[..actors]
        .iter()
        .map(|n| match seen.iter().position(|s| *s == n) {
            Some(i) => i,
            None => {
                seen.push(n);
                seen.len() - 1
            }
        })
        .collect())
}

/// Refuses a tensor-parallel degree the model cannot be split by, naming the fix: gpt's attention
/// heads (and so its width and MLP width) and mlp's hidden width must divide by `--tp` (the
/// vocabulary and mlp's classes need not: they are padded); a model given only by parameter
/// counts has no splits to follow.
pub(super) fn check_tp(program: &Program) -> Result<(), PlanError> {
    let tp = program.plan.tp;
    if tp == 1 {
        return Ok(());
    }
    let model = &program.model;
    if let Some(b) = model
        .blocks
        .iter()
        .find(|b| b.param_descs.is_empty() && b.params > 0)
    {
        return Err(PlanError::Conflict(format!(
            "--tp {tp} cuts each parameter as its description says (`ParamDesc.split`), and block `{}` \
             of {} gives only a parameter count: describe its parameters (`BlockInfo::described`) or \
             use --tp 1",
            b.name, model.name
        )));
    }
    check_tp_forms(program)?;
    if matches!(program.optimizer, crate::OptimizerSpec::Lamb { .. }) {
        return Err(PlanError::Conflict(format!(
            "--optimizer lamb with --tp {tp}: LAMB's trust ratios need each parameter's norm over the \
             tensor-parallel group, which is not built yet: use --optimizer adamw or sgd, or --tp 1"
        )));
    }
    let divisors = |n: usize| -> String {
        let ok: Vec<String> = (2..=n)
            .filter(|k| n.is_multiple_of(*k))
            .map(|k| k.to_string())
            .collect();
        if ok.is_empty() {
            "none above 1".into()
        } else {
            ok.join(", ")
        }
    };
    let (what, n) = match ModelSpec::parse(&model.name) {
        Ok(spec) => spec.family().tp_unit(spec.dims()),
        Err(_) => return check_described_splits(program),
    };
    if !n.is_multiple_of(tp) {
        return Err(PlanError::Conflict(format!(
            "--tp {tp} splits the {n} {what} of {} across the tensor-parallel group: use a --tp that \
             divides {n} ({}) or a model whose {what} divide by {tp}",
            model.name,
            divisors(n)
        )));
    }
    Ok(())
}

/// Every block says how its input and output are held across the group, and each block's input
/// is held as the one before it leaves its output (after g).
fn check_tp_forms(program: &Program) -> Result<(), PlanError> {
    let (tp, model) = (program.plan.tp, &program.model);
    let mut before: Option<(&str, BlockTp)> = None;
    for b in &model.blocks {
        if let Some(BlockTp {
            input: TpHeld::Replicated,
            output: TpHeld::Replicated,
            ..
        }) = b.tp
        {
            return Err(PlanError::Conflict(format!(
                "--tp {tp}: block `{}` of {} is computed whole on every rank (replicated input and \
                 output), which the tensor-parallel step does not run yet (its input gradient and its \
                 parameters' gradients would be summed over the group): split it (column- or \
                 row-parallel, `BlockInfo::with_tp`), or use --tp 1",
                b.name, model.name
            )));
        }
        let Some(form) = b.tp else {
            return Err(PlanError::Conflict(format!(
                "--tp {tp}: block `{}` of {} does not say how its input and output are held across a \
                 tensor-parallel group (`BlockInfo::with_tp`): give every block its form, or use --tp 1",
                b.name, model.name
            )));
        };
        if let Some((name, prev)) = before
            && TpEdge::between(prev.output, form.input).is_err()
        {
            return Err(PlanError::Conflict(format!(
                "--tp {tp}: block `{name}` of {} leaves its output {:?} and block `{}` takes its input \
                 {:?}: make the forms agree (`BlockInfo::with_tp`), or use --tp 1",
                model.name, prev.output, b.name, form.input
            )));
        }
        before = Some((&b.name, form));
    }
    Ok(())
}

/// Every split parameter of a user model divides by `--tp` along its split dimension.
fn check_described_splits(program: &Program) -> Result<(), PlanError> {
    let tp = program.plan.tp;
    for p in program.model.blocks.iter().flat_map(|b| &b.param_descs) {
        let Some(dim) = p.split.dim(p.shape.len()) else {
            continue;
        };
        let cut = match p.split {
            Split::HeadColumns { parts } if parts == 0 || !p.shape[dim].is_multiple_of(parts) => {
                return Err(PlanError::Conflict(format!(
                    "`{}` (shape {:?}) is described as {parts} column groups cut per head, which its \
                     {} columns are not: fix its `Split::HeadColumns`, or use --tp 1",
                    p.name, p.shape, p.shape[dim]
                )));
            }
            Split::HeadColumns { parts } => p.shape[dim] / parts,
            _ => p.shape[dim],
        };
        if !cut.is_multiple_of(tp) {
            return Err(PlanError::Conflict(format!(
                "--tp {tp} cuts `{}` (shape {:?}) along dimension {dim} in pieces of {cut}: use a --tp \
                 that divides {cut}, or mark the parameter `Split::Replicated`",
                p.name, p.shape
            )));
        }
    }
    Ok(())
}

/// A tensor-parallel group (consecutive actors) stays inside one island: its all-reduces run on
/// every layer's critical path and cannot cross the slow links between islands.
pub(super) fn check_tp_islands(tp: usize, islands: &[usize]) -> Result<(), PlanError> {
    if tp == 1 || islands.is_empty() {
        return Ok(());
    }
    for (g, group) in islands.chunks(tp).enumerate() {
        if group.iter().any(|i| *i != group[0]) {
            let largest = largest_run(islands);
            return Err(PlanError::Conflict(format!(
                "--tp {tp}: tensor-parallel group {g} (actors {}..{}) spans islands {group:?}; a tp group \
                 must stay in one island: use a --tp of at most {largest} that the islands' sizes divide, \
                 or name the devices so that each group of {tp} consecutive ones shares an island",
                g * tp,
                (g + 1) * tp
            )));
        }
    }
    Ok(())
}

/// Refuses `--zero-hpz` where it has nothing to do or is not built yet, naming the fix: it
/// keeps ZeRO-3's gathered parameters inside islands, so it needs `--zero 3` with `--dp` 2 or
/// more and replicas on two islands or more; tensor parallelism with it is not built yet.
pub(super) fn check_hpz(program: &Program, islands: &[usize]) -> Result<(), PlanError> {
    let plan = &program.plan;
    if !plan.zero_hpz {
        return Ok(());
    }
    let refuse = |why: String| Err(PlanError::Conflict(format!("--zero-hpz {why}")));
    if plan.zero != 3 || plan.dp < 2 {
        return refuse(format!(
            "keeps a secondary copy of ZeRO-3's gathered parameters inside each island: it needs --zero 3 \
             and --dp 2 or more (got --zero {} --dp {})",
            plan.zero, plan.dp
        ));
    }
    if plan.tp > 1 {
        return refuse(format!(
            "with --tp {} is not built yet (each tp rank's slice would need its own secondary copy): \
             drop --zero-hpz or --tp",
            plan.tp
        ));
    }
    let mut distinct: Vec<usize> = islands.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return refuse(
            "gathers the backward's parameters inside each island, and every device is on one island: \
             run on hosts of two islands or more (a cluster's hosts name their islands), or drop \
             --zero-hpz"
                .into(),
        );
    }
    Ok(())
}

/// The most consecutive actors on one island.
fn largest_run(islands: &[usize]) -> usize {
    let (mut best, mut run) = (0, 0);
    for (i, island) in islands.iter().enumerate() {
        run = if i > 0 && islands[i - 1] == *island {
            run + 1
        } else {
            1
        };
        best = best.max(run);
    }
    best
}
