//! The compiled plan, and [`compile`]: program → graph → streams → verified plan.

use serde::{Deserialize, Serialize};

use crate::instruction::{ActorStream, ComputeOp, Instruction};
use crate::memory::{self, ActorShare, MemoryEstimate};
use crate::mesh::Mesh;
use crate::passes::optimizer::StepNorms;
use crate::passes::partition::{self, Chunk};
use crate::passes::pipeline::Layout;
use crate::passes::schedule::{self, PipelineShape, Schedule, Slot};
use crate::program::{Offload, Program};
use crate::simulate::{Prediction, simulate, simulate_with_comm};
use crate::simulate_comm::StageComm;
use crate::verify::verify;
use crate::{ActorId, ActorTraining, DeviceSpec, PlanError};

pub use crate::passes::data_parallel::Bucket;

/// What one actor holds and runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActorPlan {
    /// The actor (its rank in the mesh).
    pub actor: ActorId,
    /// Its device.
    pub device: DeviceSpec,
    /// Its coordinates in the mesh, one per axis.
    pub coords: Vec<usize>,
    /// Its data-parallel replica.
    pub replica: usize,
    /// Its pipeline device (stage) index.
    pub stage: usize,
    /// The chunks of blocks it holds, in model order.
    pub chunks: Vec<Chunk>,
    /// Its instruction stream for one step.
    pub stream: ActorStream,
    /// Its training state: segments and shards, ZeRO stage in force, offload, checkpointing.
    pub training: ActorTraining,
}

/// A compiled, verified program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The program it was compiled from.
    pub program: Program,
    /// The mesh.
    pub mesh: Mesh,
    /// Pipeline chunks in model order (chunk `c` on pipeline device `c % pp`).
    pub chunks: Vec<Chunk>,
    /// Gradient buckets (also the forward/backward segments), numbered over the whole model.
    pub buckets: Vec<Bucket>,
    /// The pass order of each pipeline device.
    pub schedule: Vec<Vec<Slot>>,
    /// The step simulator's prediction.
    pub prediction: Prediction,
    /// One entry per actor.
    pub actors: Vec<ActorPlan>,
    /// Memory estimate per actor.
    pub memory: Vec<MemoryEstimate>,
    /// Bytes each actor reads from its peers per step, by kind ([`crate::fabric_bytes::predict`]).
    #[serde(default)]
    pub fabric: Vec<crate::FabricBytes>,
    /// Bytes each actor moves to and from its offload tier per step
    /// ([`crate::offload_bytes::predict`]).
    #[serde(default)]
    pub offload_traffic: Vec<crate::OffloadTraffic>,
}

impl Plan {
    /// The plan as the host of `actors` needs it, what that host's part of the job carries: every actor's
    /// placement (device, coordinates, stage, chunks) stays, but only `actors` keep their
    /// instruction streams and segments — a host never reads another host's stream, and the
    /// streams are nearly all of a large plan's bytes.
    pub fn for_actors(&self, actors: &[ActorId]) -> Plan {
        let placement_only = |a: &ActorPlan| {
            let t = &a.training;
            ActorPlan {
                actor: a.actor,
                device: a.device,
                coords: a.coords.clone(),
                replica: a.replica,
                stage: a.stage,
                chunks: a.chunks.clone(),
                stream: ActorStream {
                    actor: a.stream.actor,
                    device: a.stream.device,
                    instructions: Vec::new(),
                },
                training: ActorTraining {
                    segments: Vec::new(),
                    replica: t.replica,
                    replicas: t.replicas,
                    zero: t.zero,
                    offload: t.offload.clone(),
                    offload_params: t.offload_params,
                    checkpoint_activations: t.checkpoint_activations,
                    state: t.state,
                    slices: Vec::new(),
                },
            }
        };
        Plan {
            program: self.program.clone(),
            mesh: self.mesh.clone(),
            chunks: self.chunks.clone(),
            buckets: self.buckets.clone(),
            schedule: self.schedule.clone(),
            prediction: self.prediction.clone(),
            actors: (self.actors.iter())
                .map(|a| {
                    if actors.contains(&a.actor) {
                        a.clone()
                    } else {
                        placement_only(a)
                    }
                })
                .collect(),
            memory: self.memory.clone(),
            fabric: self.fabric.clone(),
            offload_traffic: self.offload_traffic.clone(),
        }
    }

    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans are plain data")
    }
}

/// Compiles and verifies `program`. Nothing runs; a refused plan says what to change.
pub fn compile(program: &Program) -> Result<Plan, PlanError> {
    compile_with(program, true)
}

/// A change that may make a plan fit: its flags, the knobs it turns (two remedies combine only
/// when they turn different knobs) and the change itself.
struct Remedy {
    flags: String,
    knobs: &'static [&'static str],
    apply: Box<dyn Fn(&mut Program)>,
}

impl Remedy {
    fn new(flags: String, knobs: &'static [&'static str], apply: impl Fn(&mut Program) + 'static) -> Remedy {
        Remedy {
            flags,
            knobs,
            apply: Box::new(apply),
        }
    }
}

/// The remedies tried when a plan does not fit its memory budget.
fn remedies(program: &Program) -> Vec<Remedy> {
    let plan = &program.plan;
    let mut out = Vec::new();
    if plan.dp > 1 {
        for z in plan.zero + 1..=3 {
            out.push(Remedy::new(format!("--zero {z}"), &["zero"], move |p| {
                p.plan.zero = z
            }));
        }
    }
    if !plan.offload.is_some() {
        for offload in [Offload::Cpu, Offload::Nvme { dir: "DIR".into() }] {
            out.push(Remedy::new(
                format!("--offload {offload}"),
                &["offload"],
                move |p| p.plan.offload = offload.clone(),
            ));
        }
    }
    if plan.dp > 1 && !plan.offload_params {
        // ZeRO-3 with the parameter shards offloaded too (ZeRO-Infinity).
        let tiers = if plan.offload.is_some() {
            vec![plan.offload.clone()]
        } else {
            vec![Offload::Cpu, Offload::Nvme { dir: "DIR".into() }]
        };
        for tier in tiers {
            let flags = format!("--zero 3 --offload {tier} --offload-params");
            out.push(Remedy::new(flags, &["zero", "offload"], move |p| {
                p.plan.zero = 3;
                p.plan.offload = tier.clone();
                p.plan.offload_params = true;
            }));
        }
    }
    if !plan.checkpoint_activations {
        out.push(Remedy::new(
            "--checkpoint-activations".into(),
            &["checkpoint"],
            |p| p.plan.checkpoint_activations = true,
        ));
    }
    for pp in [plan.pp * 2, plan.pp * 4] {
        if pp * plan.virtual_stages <= program.model.blocks.len() {
            let m = plan.microbatches.max(pp);
            let flags = format!("--pp {pp} --microbatches {m} ({} devices)", plan.dp * pp);
            out.push(Remedy::new(flags, &["pp"], move |p| {
                p.plan.pp = pp;
                p.plan.microbatches = m;
                p.plan.stages = None;
            }));
        }
    }
    out
}

/// `program` changed by `remedies`, compiled on as many devices of the same kind as it needs (a
/// GPU plan's estimate counts GPU-only terms), deciding its state placement afresh (`Auto` with
/// offload is `Host`; a placement the user named stays).
fn remedied(program: &Program, remedies: &[&Remedy]) -> Program {
    let mut p = program.clone();
    for r in remedies {
        (r.apply)(&mut p);
    }
    let actors = (p.plan.dp * p.plan.pp).max(1);
    p.devices = match program.devices.first() {
        Some(DeviceSpec::Cuda(_)) => (0..actors as u32).map(DeviceSpec::Cuda).collect(),
        _ => Vec::new(),
    };
    p
}

/// The flags that make `program` fit: every single remedy that does; when none does, every pair
/// of remedies on different knobs that does (e.g. `--checkpoint-activations` with `--pp 4`).
fn fitting_remedies(program: &Program) -> Vec<String> {
    let all = remedies(program);
    let fits = |rs: &[&Remedy]| compile_with(&remedied(program, rs), false).is_ok();
    let singles: Vec<String> = (all.iter())
        .filter(|r| fits(&[r]))
        .map(|r| r.flags.clone())
        .collect();
    if !singles.is_empty() {
        return singles;
    }
    let mut pairs = Vec::new();
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if a.knobs.iter().all(|k| !b.knobs.contains(k)) && fits(&[a, b]) {
                pairs.push(format!("{} {}", a.flags, b.flags));
            }
        }
    }
    if pairs.len() > MAX_PAIRS_SHOWN {
        let more = pairs.len() - MAX_PAIRS_SHOWN;
        pairs.truncate(MAX_PAIRS_SHOWN);
        pairs.push(format!("{more} other pairs of these"));
    }
    pairs
}

/// Fitting pairs of remedies named in a refusal; the rest are counted.
const MAX_PAIRS_SHOWN: usize = 4;

fn compile_with(program: &Program, suggest: bool) -> Result<Plan, PlanError> {
    let given = program;
    let resolved;
    let program = if program.plan.state == crate::StatePlacement::Auto {
        resolved = program.with_state_resolved();
        &resolved
    } else {
        program
    };
    let plan = &program.plan;
    for (value, what) in [
        (plan.dp, "--dp"),
        (plan.pp, "--pp"),
        (plan.batch, "--batch"),
        (plan.microbatches, "--microbatches"),
        (plan.virtual_stages, "--virtual-stages"),
    ] {
        if value == 0 {
            return Err(PlanError::Zero { what });
        }
    }
    let blocks = program.model.blocks.len();
    if blocks == 0 {
        return Err(PlanError::EmptyModel);
    }
    program.model.check()?;
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
    crate::passes::optimizer::check(program)?;
    crate::precision::check(program)?;
    check_state_placement(program)?;
    program.model.check_trainable()?;
    // ZeRO-3 pairs with activation checkpointing (DESIGN.md): implied.
    let mut program = program.clone();
    if plan.zero_stage().shards_parameters() {
        program.plan.checkpoint_activations = true;
    }
    let program = &program;
    let plan = &program.plan;
    let (pp, v) = (plan.pp, plan.virtual_stages);
    let n_chunks = pp * v;
    let chunks = match &plan.stages {
        Some(given) => {
            let text = partition::format_stages(given);
            partition::check(given, blocks, n_chunks, &text)?;
            given.clone()
        }
        None => {
            if n_chunks > blocks {
                return Err(PlanError::TooManyStages {
                    pp,
                    virtual_stages: v,
                    chunks: n_chunks,
                    blocks,
                    max_pp: (blocks / v).max(1),
                });
            }
            partition::balanced(&program.model, n_chunks)
        }
    };
    let mesh = if pp > 1 {
        Mesh::new(&[("dp", plan.dp), ("pp", pp)])?
    } else {
        Mesh::new(&[("dp", plan.dp)])?
    };
    let devices = program.devices_for(mesh.size());
    if devices.len() < mesh.size() {
        return Err(PlanError::NotEnoughDevices {
            mesh: mesh.to_string(),
            needed: mesh.size(),
            given: devices.len(),
        });
    }
    let shape = PipelineShape { pp, v, m };
    let microbatch_rows = per_replica / m;
    let cost_model = program.cost_model.unwrap_or_default();
    let costs = cost_model.pass_costs(&program.model, &chunks, microbatch_rows);
    let orders = schedule::orders(plan.schedule, shape, &costs);
    let mut layout = Layout::new(
        &program.model,
        mesh.clone(),
        shape,
        chunks.clone(),
        plan.bucket_bytes.max(1),
    );
    layout.islands = island_indices(&program.islands, mesh.size())?;
    let norms = StepNorms::of(program);
    let mut graph = crate::passes::step::build_step(
        &layout,
        plan.batch,
        &orders,
        plan.zero_stage(),
        plan.offload.is_some(),
        norms,
    );
    crate::passes::precision::apply(&mut graph, &program.precision);
    let streams = crate::passes::lower::lower(&graph);
    verify(&streams)?;
    let optimizer_s: Vec<f64> = (0..pp)
        .map(|s| {
            let params = layout
                .chunks_on(s)
                .iter()
                .map(|&(a, b)| {
                    program.model.blocks[a..b]
                        .iter()
                        .map(|x| x.trained_params())
                        .sum::<u64>()
                })
                .sum();
            cost_model.optimizer(params)
        })
        .collect();
    let prediction = simulate(plan.schedule, shape, &orders, &costs, &optimizer_s);
    let mut memory = Vec::with_capacity(mesh.size());
    let mut actors = Vec::with_capacity(mesh.size());
    for (actor, instructions) in streams.into_iter().enumerate() {
        let stage = mesh.coord(actor, "pp");
        let held = layout.chunks_on(stage);
        let buckets: Vec<&Bucket> = layout
            .segments
            .iter()
            .filter(|b| layout.device_of_segment(b.id) == stage)
            .collect();
        memory.push(memory::estimate(
            program,
            &program.model,
            ActorShare {
                actor,
                chunks: &held,
                buckets: &buckets,
                microbatch_rows,
                peak_in_flight: prediction.peak_in_flight[stage],
            },
        ));
        actors.push(ActorPlan {
            actor,
            device: devices[actor],
            coords: mesh.coords(actor),
            replica: mesh.coord(actor, "dp"),
            stage,
            chunks: held,
            training: ActorTraining::of(program, &buckets, mesh.coord(actor, "dp")),
            stream: ActorStream {
                actor,
                device: devices[actor],
                instructions,
            },
        });
    }
    if let Some(budget) = plan.device_memory
        && let Some(m) = memory.iter().find(|m| m.total() > budget)
    {
        let fits = if suggest {
            fitting_remedies(given)
        } else {
            Vec::new()
        };
        let fixes = if fits.is_empty() {
            "neither a higher --zero, offload, --checkpoint-activations nor more pipeline stages make it \
             fit, alone or two together: lower --batch, raise --device-memory or use more devices"
                .to_string()
        } else {
            format!("it fits with {}", fits.join(", or "))
        };
        return Err(PlanError::DoesNotFit {
            actor: m.actor,
            device: devices[m.actor].to_string(),
            needed: m.total(),
            budget,
            breakdown: m.breakdown(),
            fixes,
        });
    }
    let mut plan = Plan {
        program: program.clone(),
        mesh,
        chunks,
        buckets: layout.segments.clone(),
        schedule: orders,
        prediction,
        actors,
        memory,
        fabric: Vec::new(),
        offload_traffic: Vec::new(),
    };
    plan.fabric = crate::fabric_bytes::predict(&plan);
    plan.offload_traffic = crate::offload_bytes::predict(&plan);
    let comm = StageComm::of_plan(&plan, &cost_model);
    plan.prediction = simulate_with_comm(
        program.plan.schedule,
        shape,
        &plan.schedule,
        &costs,
        &optimizer_s,
        &comm,
    );
    plan.prediction
        .share_cores(plan.program.plan.dp, cost_model.compute_units);
    Ok(plan)
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

/// Counts the instructions of each kind in a stream (for summaries and tests).
pub fn count_compute(stream: &[Instruction], pred: impl Fn(&ComputeOp) -> bool) -> usize {
    stream
        .iter()
        .filter(|i| matches!(i, Instruction::Compute { op, .. } if pred(op)))
        .count()
}

/// The island index of each actor from the programme's island names (empty: one island).
fn island_indices(names: &[String], actors: usize) -> Result<Vec<usize>, PlanError> {
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

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

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
