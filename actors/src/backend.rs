//! The burn backends device actors run on, and the builders of an actor's trainer on each.
//!
//! `cpu:N` runs `Autodiff<Flex>`, one actor thread per device. With the cargo feature `cuda`,
//! `cuda:N` runs `Autodiff<Cuda>` on GPU `N` (burn's CUDA backend loads the driver at run time, so
//! the build needs neither a GPU nor a CUDA toolkit). [`check_devices`] refuses a device this
//! process cannot run — a build without `cuda`, no driver, too few GPUs — before any actor starts.

use std::sync::Arc;

use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{ActorId, DeviceSpec, ModelSpec, Program};

use crate::checkpoint::CheckpointReader;
use crate::executor::Computation;
use crate::trainer::{Placement, Trainer};
use crate::zoo::{ModelBuilder, ZooModel};

/// The CPU training backend: burn's pure-Rust `Flex` under autodiff.
pub type CpuBackend = Autodiff<Flex>;

/// The GPU training backend: burn's CUDA backend under autodiff.
#[cfg(feature = "cuda")]
pub type CudaBackend = Autodiff<burn::backend::Cuda>;

/// Whether this build has the CUDA backend (the cargo feature `cuda`).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Refuses a compute dtype (`--precision`) one of the `cuda:N` devices cannot run (bf16 below
/// compute capability 8.0: [`crate::gpus::runs_compute_dtype`]), naming the device and the fix.
/// Devices this host cannot see (no driver, another machine's plan) are not judged here;
/// [`check_devices`] refuses those when a job starts.
pub fn check_precision(devices: &[DeviceSpec], compute: archipelago_dataflow::DType) -> Result<(), String> {
    if !devices.iter().any(|d| d.cuda_ordinal().is_some()) {
        return Ok(());
    }
    let Ok(gpus) = crate::gpus::list() else {
        return Ok(());
    };
    for ordinal in devices.iter().filter_map(|d| d.cuda_ordinal()) {
        if let Some(gpu) = gpus.iter().find(|g| g.index == ordinal) {
            let named = format!("cuda:{ordinal} ({})", gpu.name);
            crate::gpus::runs_compute_dtype(&named, gpu.compute_capability, compute)?;
        }
    }
    Ok(())
}

/// Checks that this process can run every device of `devices`: CPU devices always; `cuda:N`
/// only in a build with the `cuda` feature, with an NVIDIA driver and at least `N + 1` GPUs.
pub fn check_devices(devices: &[DeviceSpec]) -> Result<(), String> {
    let Some(highest) = devices.iter().filter_map(|d| d.cuda_ordinal()).max() else {
        return Ok(());
    };
    if !CUDA_BUILT {
        return Err(format!(
            "device cuda:{highest} was asked for, but this build has no CUDA backend: rebuild with \
             `cargo build --release --features cuda`, or use cpu:N devices"
        ));
    }
    let gpus =
        crate::gpus::list().map_err(|why| format!("device cuda:{highest} was asked for, but {why}"))?;
    if highest as usize >= gpus.len() {
        return Err(format!(
            "device cuda:{highest} was asked for, but this host has {} GPU(s){}; `archipelago devices` \
             lists what it offers",
            gpus.len(),
            if gpus.is_empty() {
                String::new()
            } else {
                format!(" (cuda:0..cuda:{})", gpus.len() - 1)
            }
        ));
    }
    Ok(())
}

/// The makers of a model's blocks for each backend this build has: the zoo builds on all of them;
/// the user's own blocks on the backends they were given for.
#[derive(Clone)]
pub struct Builders {
    cpu: Arc<dyn ModelBuilder<CpuBackend>>,
    /// Batched host ⇄ device transfers (see [`Trainer::with_batched_transfers`]): by device kind
    /// (on for GPUs) unless set.
    batched_transfers: Option<bool>,
    /// With `--state device`, update with tensor ops even on CPU devices (see
    /// [`Builders::with_tensor_op_update`]).
    tensor_op_update: bool,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<dyn ModelBuilder<CudaBackend>>>,
}

impl Builders {
    /// A zoo model on every backend.
    pub fn zoo(spec: ModelSpec) -> Builders {
        Builders {
            cpu: Arc::new(ZooModel(spec.clone())),
            batched_transfers: None,
            tensor_op_update: false,
            #[cfg(feature = "cuda")]
            cuda: Some(Arc::new(ZooModel(spec))),
        }
    }

    /// The user's blocks for CPU devices only.
    pub fn cpu(builder: Arc<dyn ModelBuilder<CpuBackend>>) -> Builders {
        Builders {
            cpu: builder,
            batched_transfers: None,
            tensor_op_update: false,
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }

    /// Adds the user's blocks for `cuda:N` devices.
    #[cfg(feature = "cuda")]
    pub fn with_cuda(mut self, builder: Arc<dyn ModelBuilder<CudaBackend>>) -> Builders {
        self.cuda = Some(builder);
        self
    }

    /// Forces batched host ⇄ device transfers on or off for every device (by default on for
    /// GPUs, off for CPUs, where they cost a copy and save nothing; on for CPUs tests the GPU
    /// path's transfers).
    pub fn with_batched_transfers(mut self, on: bool) -> Builders {
        self.batched_transfers = Some(on);
        self
    }

    /// With the state on the device (`--state device`), runs the update as tensor ops on CPU
    /// devices too (by default they run the optimizer's flat loops in place on the tensors'
    /// buffers, host memory there): tests the GPU path's update on CPU.
    pub fn with_tensor_op_update(mut self, on: bool) -> Builders {
        self.tensor_op_update = on;
        self
    }

    /// Checks that `devices` can run here and that there are blocks for each one's backend.
    pub fn check(&self, devices: &[DeviceSpec]) -> Result<(), String> {
        check_devices(devices)?;
        #[cfg(feature = "cuda")]
        if self.cuda.is_none()
            && let Some(gpu) = devices.iter().find(|d| d.cuda_ordinal().is_some())
        {
            return Err(format!(
                "device {gpu} was asked for, but the model's blocks were given for CPU devices only: \
                 add a builder for the CUDA backend (`Builders::with_cuda`)"
            ));
        }
        Ok(())
    }

    /// The trainer of `actor` on `device`, holding `placement`'s blocks of `program`'s model,
    /// loaded from `restore` when given.
    pub fn trainer(
        &self,
        program: &Program,
        actor: ActorId,
        device: DeviceSpec,
        placement: &Placement,
        restore: Option<&CheckpointReader>,
    ) -> Result<Box<dyn Computation>, String> {
        let paths = |gpu: bool| GpuPaths {
            batched_transfers: self.batched_transfers.unwrap_or(gpu),
            tensor_op_update: self.tensor_op_update || gpu,
        };
        match device {
            DeviceSpec::Cpu(_) => trainer_on(
                program,
                self.cpu.clone(),
                actor,
                FlexDevice,
                placement,
                restore,
                paths(false),
            ),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(n) => {
                let builder = self.cuda.clone().ok_or_else(|| {
                    format!("no blocks were given for the CUDA backend, which cuda:{n} needs")
                })?;
                let gpu = burn::backend::cuda::CudaDevice { index: n as usize };
                trainer_on(program, builder, actor, gpu, placement, restore, paths(true))
            }
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => Err(check_devices(&[device]).err().unwrap_or_default()),
        }
    }
}

/// The GPU's ways of moving and updating the state, on for GPUs and, in tests, for CPUs.
struct GpuPaths {
    batched_transfers: bool,
    tensor_op_update: bool,
}

fn trainer_on<B: AutodiffBackend>(
    program: &Program,
    builder: Arc<dyn ModelBuilder<B>>,
    actor: ActorId,
    device: B::Device,
    placement: &Placement,
    restore: Option<&CheckpointReader>,
    paths: GpuPaths,
) -> Result<Box<dyn Computation>, String> {
    let mut trainer = Trainer::<B>::new(program, builder, actor, device, placement)?
        .with_batched_transfers(paths.batched_transfers)
        .with_tensor_op_update(paths.tensor_op_update);
    if let Some(checkpoint) = restore {
        trainer.restore(checkpoint)?;
    }
    Ok(Box::new(trainer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_devices_always_run_and_a_gpu_is_refused_naming_what_is_missing() {
        assert_eq!(check_devices(&DeviceSpec::cpus(4)), Ok(()));
        let gpus = crate::gpus::list();
        match check_devices(&[DeviceSpec::Cpu(0), DeviceSpec::Cuda(0)]) {
            Ok(()) => assert!(gpus.is_ok_and(|g| !g.is_empty()), "cuda:0 accepted without a GPU"),
            Err(why) => {
                assert!(why.starts_with("device cuda:0 was asked for, but "), "{why}");
                if CUDA_BUILT {
                    assert!(why.contains("NVIDIA driver") || why.contains("GPU(s)"), "{why}");
                } else {
                    assert!(why.contains("--features cuda"), "{why}");
                }
            }
        }
        // Past the GPUs a host has.
        let err = check_devices(&[DeviceSpec::Cuda(4096)]).unwrap_err();
        assert!(err.contains("cuda:4096"), "{err}");
    }

    #[test]
    fn builders_refuse_a_gpu_they_cannot_build_or_run() {
        let builders = Builders::zoo(ModelSpec::parse("mlp:in=2,hidden=2,layers=1,out=1").unwrap());
        assert_eq!(builders.check(&DeviceSpec::cpus(2)), Ok(()));
        let cpu_only = Builders::cpu(Arc::new(ZooModel(ModelSpec::parse("mlp-8x1024").unwrap())));
        assert!(cpu_only.check(&[DeviceSpec::Cuda(0)]).is_err());
    }

    /// The trainer follows the instruction's update scope and checks it against the actor's
    /// plan: a ZeRO-1 actor told to update whole buckets refuses, naming both (a stream not
    /// compiled from its plan never updates the wrong range silently).
    #[test]
    fn an_update_the_plan_does_not_call_for_is_refused() {
        use archipelago_dataflow::{ComputeOp, ParallelPlan, Program, UpdateScope, compile};
        let spec = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=2").unwrap();
        let program = Program::new(spec.clone()).with_plan(ParallelPlan {
            dp: 2,
            zero: 1,
            batch: 4,
            ..ParallelPlan::default()
        });
        let plan = compile(&program).unwrap();
        let actor = &plan.actors[0];
        let compiled = plan
            .class_stream(actor.actor)
            .iter()
            .find_map(|i| match i {
                archipelago_dataflow::Instruction::Compute {
                    op: op @ ComputeOp::OptimizerStep { .. },
                    ..
                } => Some(op.clone()),
                _ => None,
            })
            .expect("an update");
        assert!(matches!(
            compiled,
            ComputeOp::OptimizerStep {
                scope: UpdateScope::ShardThenGather,
                ..
            }
        ));
        let ComputeOp::OptimizerStep { start, end, .. } = compiled else {
            unreachable!()
        };
        let mut trainer = Builders::zoo(spec)
            .trainer(&program, 0, DeviceSpec::Cpu(0), &Placement::of(actor), None)
            .unwrap();
        let wrong = ComputeOp::OptimizerStep {
            start,
            end,
            scope: UpdateScope::Whole,
        };
        let err = trainer
            .compute(0, &wrong, &[], &[], &mut crate::executor::TensorTable::default())
            .unwrap_err();
        assert!(
            err.contains("updates `whole`") && err.contains("plan says `shard, then gather`"),
            "{err}"
        );
    }
}
