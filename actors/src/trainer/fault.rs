//! Test hook: the faults the equivalence suite injects to show that its element-wise comparison
//! catches them (`Program::test_fault`; see `integration-tests/tests/sgd_matrix.rs`). Built only
//! when a program names a fault: the normal path holds `None` and never calls in here.

use archipelago_dataflow::TensorId;
use std::collections::HashMap;

use archipelago_dataflow::TestFault;

use crate::typed_tensor::TypedTensor;

/// The fault in force on one actor, and what it needs to inject it.
pub(super) struct FaultHook {
    fault: TestFault,
    /// This actor.
    actor: archipelago_dataflow::ActorId,
    /// This actor's position in its dp group.
    replica: usize,
    /// Micro-batches per step.
    microbatches: usize,
    /// `SkipAllReduce`: each bucket as this actor computed it, before the all-reduce.
    local: HashMap<TensorId, Vec<f32>>,
    /// `SkipAllReduce`: the one all-reduce has been skipped.
    skipped: bool,
}

impl FaultHook {
    pub(super) fn new(
        fault: Option<TestFault>,
        (actor, replica): (archipelago_dataflow::ActorId, usize),
        microbatches: usize,
    ) -> Option<FaultHook> {
        fault.map(|fault| FaultHook {
            fault,
            actor,
            replica,
            microbatches,
            local: HashMap::new(),
            skipped: false,
        })
    }

    /// `LocalLossMax`: the vocabulary-parallel loss's sums are taken against this rank's own
    /// maxima (kept here by `LossMax` under the statistic's name).
    pub(super) fn keep_local_max(&mut self, name: &TensorId, max: &[f32]) {
        if self.fault == TestFault::LocalLossMax {
            self.local.insert(name.clone(), max.to_vec());
        }
    }

    /// `SkipCheckpointGather`: whether a recompute reads the rank's own part of a partitioned
    /// checkpoint in place of the gathered whole.
    pub(super) fn skips_checkpoint_gather(&self) -> bool {
        self.fault == TestFault::SkipCheckpointGather
    }

    /// `HpzStaleSecondary`: whether a secondary copy once kept is never refreshed.
    pub(super) fn keeps_stale_secondary(&self) -> bool {
        self.fault == TestFault::HpzStaleSecondary
    }

    /// `SkipTiedGrads`: whether a tie's gradient is dropped instead of added.
    pub(super) fn skips_tied_grads(&self) -> bool {
        self.fault == TestFault::SkipTiedGrads
    }

    /// `StaleTiedValues`: whether a mirror keeps its old values.
    pub(super) fn keeps_stale_mirror(&self) -> bool {
        self.fault == TestFault::StaleTiedValues
    }

    /// `DropResidualGrad`: whether the residual stream's gradient is back-propagated as zeros.
    pub(super) fn drops_residual_grad(&self) -> bool {
        self.fault == TestFault::DropResidualGrad
    }

    /// `LocalLossMax`: this rank's own maxima kept under `name`, in place of the group's.
    pub(super) fn local_max(&self, name: &TensorId) -> Option<&[f32]> {
        self.local.get(name).map(Vec::as_slice)
    }

    /// Whether the modules of a segment are reloaded from the master after its update (not under
    /// `StaleComputeCopy`); under `RoundedMaster` the master is first rounded to `compute`.
    pub(super) fn on_reload(&self, master: &mut [f32], compute: burn::tensor::FloatDType) -> bool {
        match self.fault {
            TestFault::StaleComputeCopy => false,
            TestFault::RoundedMaster => {
                let round: fn(f32) -> f32 = match compute {
                    burn::tensor::FloatDType::BF16 => |x| half::bf16::from_f32(x).to_f32(),
                    burn::tensor::FloatDType::F16 => |x| half::f16::from_f32(x).to_f32(),
                    _ => |x| x,
                };
                master.iter_mut().for_each(|x| *x = round(*x));
                true
            }
            _ => true,
        }
    }

    /// Whether loss scaling decides an overflow from this actor's own share of the gradients
    /// instead of the vote (`LocalOverflowDecision`, the overflow test's control).
    pub(super) fn decides_overflow_locally(&self) -> bool {
        matches!(self.fault, TestFault::LocalOverflowDecision { .. })
    }

    /// A bucket as the backward left it in job step `step`, before any collective reads it.
    pub(super) fn on_bucket(&mut self, name: &TensorId, step: u64, flat: &mut [f32]) {
        match self.fault {
            TestFault::DropReplicaGrad if self.replica == 1 => flat.fill(0.0),
            TestFault::InfGradient { actor, step: at }
            | TestFault::LocalOverflowDecision { actor, step: at }
                if actor == self.actor && at == step =>
            {
                if let Some(first) = flat.first_mut() {
                    *first = f32::INFINITY;
                }
            }
            TestFault::SkipAllReduce if !self.skipped => {
                self.local.insert(name.clone(), flat.to_vec());
            }
            _ => {}
        }
    }

    /// The gradient optimizer step `step` (1-based) is about to apply for bucket `name`.
    pub(super) fn on_update(&mut self, name: &TensorId, step: u64, grad: TypedTensor) -> TypedTensor {
        match self.fault {
            TestFault::SkipReplicaUpdate { replica, step: at } if replica == self.replica && at == step => {
                TypedTensor::flat(vec![0.0; grad.f32s().len()])
            }
            // The first bucket updated in the first step, only: one all-reduce skipped.
            TestFault::SkipAllReduce if !self.skipped => match self.local.remove(name) {
                Some(local) => {
                    self.skipped = true;
                    self.local.clear();
                    TypedTensor::flat(local)
                }
                None => grad,
            },
            TestFault::AverageMicrobatches => {
                let scale = 1.0 / self.microbatches as f32;
                TypedTensor::flat(grad.f32s().iter().map(|g| g * scale).collect())
            }
            _ => grad,
        }
    }

    /// A ZeRO shard's gradient, read one element off (when that is the fault).
    pub(super) fn shard_gradient(&self, grads: &[f32]) -> Option<Vec<f32>> {
        (self.fault == TestFault::ShiftZeroShard).then(|| {
            let mut shifted = grads.to_vec();
            shifted.rotate_left(1);
            shifted
        })
    }
}

/// The model whole as the trainer slices it: `model`, or under `ContiguousQkv` with every per-head
/// split (the fused qkv) cut contiguously instead.
pub(super) fn sliced_as(
    model: &archipelago_dataflow::ModelDesc,
    fault: Option<TestFault>,
) -> archipelago_dataflow::ModelDesc {
    let mut model = model.clone();
    if fault == Some(TestFault::ContiguousQkv) {
        for p in model.blocks.iter_mut().flat_map(|b| b.param_descs.iter_mut()) {
            if matches!(p.split, archipelago_dataflow::Split::HeadColumns { .. }) {
                p.split = archipelago_dataflow::Split::Columns;
            }
        }
    }
    model
}
