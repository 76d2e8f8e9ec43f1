//! The compiled plan, and [`compile`]: program → graph → streams → verified plan.

use serde::{Deserialize, Serialize};

use crate::instruction::{ActorStream, ComputeOp, Instruction};
use crate::memory::{self, MemoryEstimate};
use crate::mesh::Mesh;
use crate::passes::{data_parallel, lower};
use crate::program::Program;
use crate::verify::verify;
use crate::{ActorId, DeviceSpec, PlanError};

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
    /// First block it holds.
    pub block_start: usize,
    /// One past the last block it holds.
    pub block_end: usize,
    /// Its instruction stream for one step.
    pub stream: ActorStream,
}

/// A compiled, verified program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The program it was compiled from.
    pub program: Program,
    /// The mesh.
    pub mesh: Mesh,
    /// Gradient buckets (also the forward/backward segments).
    pub buckets: Vec<Bucket>,
    /// One entry per actor.
    pub actors: Vec<ActorPlan>,
    /// Memory estimate per actor.
    pub memory: Vec<MemoryEstimate>,
}

impl Plan {
    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans are plain data")
    }

    /// A human-readable summary: mesh, placement, streams (summarised) and memory.
    pub fn summary(&self) -> String {
        let p = &self.program;
        let mut out = format!(
            "model {} ({} parameters, {} blocks)\nmesh {} ({} actors)   global batch {}   buckets {}\n",
            p.model.name,
            p.model.params(),
            p.model.blocks.len(),
            self.mesh,
            self.actors.len(),
            p.plan.batch,
            self.buckets
                .iter()
                .map(|b| format!("[blocks {}..{}: {}]", b.start, b.end, memory::mib(b.bytes)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        for (a, m) in self.actors.iter().zip(&self.memory) {
            out.push_str(&format!(
                "\nactor {} on {} {:?}: blocks {}..{}, {} instructions, memory ≈ {} ({})\n",
                a.actor,
                a.device,
                a.coords,
                a.block_start,
                a.block_end,
                a.stream.instructions.len(),
                memory::mib(m.total()),
                m.breakdown()
            ));
            for (i, instruction) in a.stream.instructions.iter().enumerate() {
                out.push_str(&format!("  {i:>3}  {instruction}\n"));
            }
        }
        out
    }
}

/// Compiles and verifies `program`. Nothing runs; a refused plan says what to change.
pub fn compile(program: &Program) -> Result<Plan, PlanError> {
    let plan = &program.plan;
    if plan.dp == 0 {
        return Err(PlanError::Zero { what: "--dp" });
    }
    if plan.batch == 0 {
        return Err(PlanError::Zero { what: "--batch" });
    }
    if program.model.blocks.is_empty() {
        return Err(PlanError::EmptyModel);
    }
    if !plan.batch.is_multiple_of(plan.dp) {
        let lower = plan.batch / plan.dp * plan.dp;
        return Err(PlanError::BatchNotDivisible {
            batch: plan.batch,
            dp: plan.dp,
            lower,
            upper: lower + plan.dp,
        });
    }
    let mesh = Mesh::new(&[("dp", plan.dp)])?;
    let devices = program.devices_for(mesh.size());
    if devices.len() < mesh.size() {
        return Err(PlanError::NotEnoughDevices {
            mesh: mesh.to_string(),
            needed: mesh.size(),
            given: devices.len(),
        });
    }
    let buckets = data_parallel::buckets(&program.model, plan.bucket_bytes.max(1));
    let graph = data_parallel::build_step(&program.model, &mesh, plan.batch, &buckets);
    let streams = lower::lower(&graph);
    verify(&streams)?;
    let memory: Vec<MemoryEstimate> = (0..mesh.size())
        .map(|a| memory::estimate(a, program, &program.model, &buckets))
        .collect();
    if let Some(budget) = plan.device_memory
        && let Some(m) = memory.iter().find(|m| m.total() > budget)
    {
        return Err(PlanError::DoesNotFit {
            actor: m.actor,
            device: devices[m.actor].to_string(),
            needed: m.total(),
            budget,
            breakdown: m.breakdown(),
        });
    }
    let actors = streams
        .into_iter()
        .enumerate()
        .map(|(actor, instructions)| ActorPlan {
            actor,
            device: devices[actor],
            coords: mesh.coords(actor),
            block_start: 0,
            block_end: program.model.blocks.len(),
            stream: ActorStream {
                actor,
                device: devices[actor],
                instructions,
            },
        })
        .collect();
    Ok(Plan {
        program: program.clone(),
        mesh,
        buckets,
        actors,
        memory,
    })
}

/// Counts the instructions of each kind in a stream (for summaries and tests).
pub fn count_compute(stream: &[Instruction], pred: impl Fn(&ComputeOp) -> bool) -> usize {
    stream
        .iter()
        .filter(|i| matches!(i, Instruction::Compute { op, .. } if pred(op)))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, ParallelPlan};

    fn program(dp: usize, batch: usize) -> Program {
        Program::new(ModelSpec::mlp_8x1024()).with_plan(ParallelPlan {
            dp,
            batch,
            ..ParallelPlan::default()
        })
    }

    #[test]
    fn dp_plans_verify_and_overlap_all_reduce_with_backward() {
        let plan = compile(&program(4, 64)).unwrap();
        assert_eq!(plan.actors.len(), 4);
        let s = &plan.actors[2].stream.instructions;
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
        let m = compile(&program(2, 64)).unwrap().memory[0].clone();
        assert_eq!(m.model_state(), 16 * 8_407_050);
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
}
