//! The memory estimate per actor: parameters, gradients, optimizer state, activations and
//! communication buffers, in bytes (f32), computed from the plan alone.
//!
//! Model-state accounting follows ZeRO (Rajbhandari et al., SC 2020): with f32 and Adam, a
//! replica holding Ψ parameters keeps 4Ψ of parameters, 4Ψ of gradients and 8Ψ of optimizer state.

use serde::{Deserialize, Serialize};

use crate::model_spec::ModelDesc;
use crate::passes::data_parallel::Bucket;
use crate::program::Program;

/// Bytes one actor is expected to hold at its peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEstimate {
    /// The actor.
    pub actor: usize,
    /// f32 parameters.
    pub params: u64,
    /// f32 gradients (flat buckets).
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Activations kept for backward at the peak.
    pub activations: u64,
    /// Communication buffers in flight.
    pub buffers: u64,
}

impl MemoryEstimate {
    /// Parameters + gradients + optimizer state.
    pub fn model_state(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// Everything.
    pub fn total(&self) -> u64 {
        self.model_state() + self.activations + self.buffers
    }

    /// `params 32.1 MiB + grads … `, for messages.
    pub fn breakdown(&self) -> String {
        format!(
            "params {} + grads {} + optimizer {} + activations {} + buffers {}",
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.activations),
            mib(self.buffers)
        )
    }
}

/// Formats bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Estimates one data-parallel replica's memory (every dp actor holds the same).
pub fn estimate(actor: usize, program: &Program, model: &ModelDesc, buckets: &[Bucket]) -> MemoryEstimate {
    let dp = program.plan.dp.max(1);
    let local_batch = (program.plan.batch / dp) as u64;
    let params = 4 * model.params();
    let activations = 4
        * local_batch
        * model
            .blocks
            .iter()
            .map(|b| b.activation_floats_per_sample)
            .sum::<u64>();
    let largest_bucket = buckets.iter().map(|b| b.bytes).max().unwrap_or(0);
    MemoryEstimate {
        actor,
        params,
        grads: params,
        optimizer: params * program.optimizer.state_floats_per_param(),
        activations,
        buffers: if dp > 1 { largest_bucket / dp as u64 * 2 } else { 0 },
    }
}
