//! The compiled plan, and [`compile`]: program → graph → streams → verified plan.

use serde::{Deserialize, Serialize};

use crate::instruction::{ActorStream, ComputeOp, Instruction};
use crate::memory::{self, ActorShare, MemoryEstimate};
use crate::mesh::Mesh;
use crate::passes::optimizer::StepNorms;
use crate::passes::partition::{self, Chunk};
use crate::passes::pipeline::Layout;
use crate::passes::schedule::{self, PipelineShape, Slot};
use crate::program::Program;
use crate::simulate::{Prediction, simulate, simulate_with_comm};
use crate::simulate_comm::StageComm;
use crate::stream_class::{StreamClasses, Symmetry};
use crate::tensor_parallel::TpPlace;
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
    /// The chunks of blocks it holds, in model order (its instruction stream is
    /// [`Plan::stream`]).
    pub chunks: Vec<Chunk>,
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
    /// The instruction streams for one step: one per stream class ([`crate::stream_class`]),
    /// read per actor through [`Plan::stream`].
    pub streams: StreamClasses,
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
    /// segments and only their classes' streams stay — a host never reads another host's stream.
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
                    tp: t.tp,
                    checkpoints: t.checkpoints,
                    secondary: t.secondary,
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
            streams: self.streams.for_actors(actors),
            memory: self.memory.clone(),
            fabric: self.fabric.clone(),
            offload_traffic: self.offload_traffic.clone(),
        }
    }

    /// `actor`'s instruction stream for one step (its class's, translated to it).
    pub fn stream(&self, actor: ActorId) -> ActorStream {
        ActorStream {
            actor,
            device: self.actors[actor].device,
            instructions: self.streams.stream(actor),
        }
    }

    /// Every actor's stream, in actor order (materialized: for tests and small plans).
    pub fn every_stream(&self) -> impl Iterator<Item = ActorStream> + '_ {
        (0..self.actors.len()).map(|a| self.stream(a))
    }

    /// The stream of `actor`'s class as its representative runs it (see
    /// [`StreamClasses::template`]): what an analysis that reads computes, tensors and collective
    /// kinds reads, without translating peers.
    pub fn class_stream(&self, actor: ActorId) -> &[Instruction] {
        self.streams.template(actor)
    }

    /// The island of each actor, numbered in order of first appearance (empty: one island).
    pub fn island_indices(&self) -> Vec<usize> {
        checks::island_indices(&self.program.islands, self.actors.len()).unwrap_or_default()
    }

    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans are plain data")
    }
}

/// Compiles and verifies `program`. Nothing runs; a refused plan says what to change.
pub fn compile(program: &Program) -> Result<Plan, PlanError> {
    compile_with(program, true, Build::Classes)
}

/// Compiles `program` building and verifying every actor's stream on its own: the reference the
/// stream classes ([`crate::stream_class`], what [`compile`] builds) are tested against.
pub fn compile_every_actor(program: &Program) -> Result<Plan, PlanError> {
    compile_with(program, true, Build::EveryActor)
}

/// How the streams are built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    /// One representative per stream class, translated to the other actors.
    Classes,
    /// Every actor's graph, lowered and verified whole.
    EveryActor,
}

mod checks;
mod remedies;
use remedies::fitting_remedies;

fn compile_with(program: &Program, suggest: bool, build: Build) -> Result<Plan, PlanError> {
    // hpZ's gathers inside islands run over part of the dp axis, which the stream classes
    // (translated along whole axes) cannot carry: every actor's stream is built and verified.
    let build = if program.plan.zero_hpz {
        Build::EveryActor
    } else {
        build
    };
    let given = program;
    let resolved;
    let program = if program.plan.state == crate::StatePlacement::Auto {
        resolved = program.with_state_resolved();
        &resolved
    } else {
        program
    };
    checks::check_program(program)?;
    let plan = &program.plan;
    let per_replica = plan.batch / plan.dp;
    let m = plan.microbatches;
    // ZeRO-3 pairs with activation checkpointing (DESIGN.md): implied.
    let mut program = program.clone();
    if plan.zero_stage().shards_parameters() {
        program.plan.checkpoint_activations = true;
    }
    let program = &program;
    let plan = &program.plan;
    // What one tensor-parallel rank holds: buckets, costs, state and memory are its slice's.
    let sliced = &Program {
        model: crate::tensor_parallel::local_model(&program.model, plan.tp),
        ..program.clone()
    };
    let (pp, v) = (plan.pp, plan.virtual_stages);
    let chunks = chunks_of(program)?;
    let mesh = mesh_of(plan)?;
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
    let costs = cost_model.pass_costs(&sliced.model, &chunks, microbatch_rows);
    let orders = schedule::orders(plan.schedule, shape, &costs);
    let mut layout = Layout::new(
        &sliced.model,
        mesh.clone(),
        shape,
        chunks.clone(),
        plan.bucket_bytes.max(1),
    );
    layout.islands = checks::island_indices(&program.islands, mesh.size())?;
    layout.checkpoints = crate::ActivationCheckpoints::of(plan);
    checks::check_tp_islands(plan.tp, &layout.islands)?;
    checks::check_hpz(program, &layout.islands)?;
    layout.hpz = plan.zero_hpz;
    let symmetry = (build == Build::Classes).then(|| Symmetry::of(&layout.mesh, per_replica));
    layout.built = symmetry.as_ref().map(Symmetry::built);
    let norms = StepNorms::of(program);
    let mut graph = crate::passes::step::build_step(
        &layout,
        plan.batch,
        &orders,
        (plan.zero_stage(), plan.offload.is_some()),
        norms,
        &sliced.model.ties(),
    );
    crate::passes::precision::apply(&mut graph, &program.precision);
    crate::passes::compress::apply(&mut graph, program)?;
    let streams = crate::passes::lower::lower(&graph);
    let streams = StreamClasses::verified(symmetry, streams, graph.nodes.len() as u64)?;
    let optimizer_s = optimizer_seconds(sliced, &layout, &cost_model);
    let prediction = simulate(plan.schedule, shape, &orders, &costs, &optimizer_s);
    let (memory, actors) = actor_plans(sliced, &layout, &devices, &prediction);
    refuse_unfit(given, &memory, &devices, suggest)?;
    let mut plan = Plan {
        program: program.clone(),
        mesh,
        chunks,
        buckets: layout.segments.clone(),
        schedule: orders,
        prediction,
        actors,
        streams,
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
    plan.prediction.share_cores(
        plan.program.plan.dp * plan.program.plan.tp,
        cost_model.compute_units,
    );
    Ok(plan)
}

/// The optimizer step's modelled seconds on each stage (its trained parameters).
fn optimizer_seconds(program: &Program, layout: &Layout, cost_model: &crate::CostModel) -> Vec<f64> {
    (0..layout.shape.pp)
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
        .collect()
}

/// Each actor's plan (its place, chunks, training share and stream) and memory estimate.
fn actor_plans(
    program: &Program,
    layout: &Layout,
    devices: &[DeviceSpec],
    prediction: &Prediction,
) -> (Vec<MemoryEstimate>, Vec<ActorPlan>) {
    let mesh = &layout.mesh;
    let microbatch_rows = program.plan.batch / program.plan.dp / program.plan.microbatches;
    let mut memory = Vec::with_capacity(mesh.size());
    let mut actors = Vec::with_capacity(mesh.size());
    for (actor, &device) in devices.iter().enumerate().take(mesh.size()) {
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
        let secondary = (layout.hpz).then(|| layout.island_place(actor, stage)).flatten();
        let training = ActorTraining {
            tp: TpPlace::new(mesh.coord(actor, "tp"), program.plan.tp),
            secondary,
            ..ActorTraining::of(program, &buckets, mesh.coord(actor, "dp"))
        };
        if let (Some((position, members)), Some(estimate)) = (secondary, memory.last_mut()) {
            estimate.secondary_params = (training.segments.iter())
                .map(|s| 4 * crate::shard_range(s.params, members, position).len() as u64)
                .sum();
        }
        actors.push(ActorPlan {
            actor,
            device,
            coords: mesh.coords(actor),
            replica: mesh.coord(actor, "dp"),
            stage,
            chunks: held,
            training,
        });
    }
    (memory, actors)
}

/// The mesh `dp × pp × tp`: `dp` always, `pp` and `tp` when above 1, tp innermost (a tp group is
/// consecutive actors, on one host and island).
fn mesh_of(plan: &crate::ParallelPlan) -> Result<Mesh, PlanError> {
    let mut axes = vec![("dp", plan.dp)];
    if plan.pp > 1 {
        axes.push(("pp", plan.pp));
    }
    if plan.tp > 1 {
        axes.push(("tp", plan.tp));
    }
    Mesh::new(&axes)
}

/// The block range of each model chunk: the user's `--stages`, checked, or a balanced cut.
fn chunks_of(program: &Program) -> Result<Vec<Chunk>, PlanError> {
    let plan = &program.plan;
    let blocks = program.model.blocks.len();
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
    let cuts: Vec<usize> = (0..blocks)
        .filter(|&k| k > 0 && crate::sequence_parallel::can_cut_before(&program.model, k))
        .collect();
    let bad = chunks
        .iter()
        .map(|c| c.0)
        .find(|&start| !crate::sequence_parallel::can_cut_before(&program.model, start));
    if chunks.len() != n_chunks || bad.is_some() {
        return Err(PlanError::Conflict(format!(
            "--sequence-parallel cuts pipeline stages only before a LayerNorm block (where the tokens are \
             cut: blocks {cuts:?}){}: {} chunks need {} of those cuts; use a --pp × --virtual-stages of at \
             most {} (or --stages starting at those blocks)",
            bad.map(|b| format!(", not at block {b}")).unwrap_or_default(),
            n_chunks,
            n_chunks - 1,
            cuts.len() + 1
        )));
    }
    Ok(chunks)
}

/// Refuses a plan whose estimate exceeds `--device-memory` on some actor, naming the remedies that
/// make it fit (when `suggest`: the remedies themselves compile without suggesting).
fn refuse_unfit(
    given: &Program,
    memory: &[MemoryEstimate],
    devices: &[DeviceSpec],
    suggest: bool,
) -> Result<(), PlanError> {
    if let Some(budget) = given.plan.device_memory
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
    Ok(())
}

/// Counts the instructions of each kind in a stream (for summaries and tests).
pub fn count_compute(stream: &[Instruction], pred: impl Fn(&ComputeOp) -> bool) -> usize {
    stream
        .iter()
        .filter(|i| matches!(i, Instruction::Compute { op, .. } if pred(op)))
        .count()
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

#[cfg(test)]
mod tp_tests;
#[cfg(test)]
mod zero_r_tests;
