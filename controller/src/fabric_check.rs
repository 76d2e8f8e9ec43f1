//! The fabric-bytes check: every actor's bytes read from its peers in a step, measured where they
//! arrive (`archipelago_actors::fabric::read_count`), against the plan's prediction
//! (`archipelago_dataflow::fabric_bytes::predict`), kind by kind — gradient reductions,
//! parameter gathers, pipeline activations and their gradients, norms — within [`TOLERANCE`];
//! and beside them, on its own line, the bytes each actor moved to and from its offload tier
//! (`archipelago_dataflow::offload_bytes::predict`), both ways within the same tolerance.
//!
//! A prediction that holds on every layout and data path is what lets `archipelago plan` say
//! what a job will move before it starts, and what the simulator's communication term stands
//! on. The equivalence harnesses, in one process (shared buffers and rings) and across host
//! processes, call [`check`] on every run; its unit test is the control (a prediction made for
//! another ZeRO stage, and a count 2 % off, are both caught).

use archipelago_dataflow::{FabricBytes, FabricKind, OffloadTraffic};

use crate::report::TrainReport;

/// How far a measured figure may be from the prediction, relative: shards of uneven length
/// make the ring and the shared-buffer collectives differ from the prediction by at most
/// `n − 1` elements per collective.
pub const TOLERANCE: f64 = 0.01;

/// The norms' collectives carry one value (clipping) or two per parameter tensor (LAMB), so an
/// uneven shard is most of them: their bytes may differ by the bound itself, `n − 1` f32
/// elements for each of the (at most two) norm collectives a step runs over `n ≤ actors`.
fn norms_slack_bytes(actors: usize) -> u64 {
    2 * 4 * actors.saturating_sub(1) as u64
}

/// Checks every actor of `report` (the last step's figures) against its prediction; the first
/// kind that differs by more than [`TOLERANCE`], naming the actor, its stage and replica.
pub fn check(report: &TrainReport) -> Result<(), String> {
    let norms_slack = norms_slack_bytes(report.actors.len());
    for a in &report.actors {
        let (measured, predicted) = (&a.fabric_bytes_per_step, &a.predicted_fabric_bytes_per_step);
        if let Some(kind) = first_off(measured, predicted, norms_slack) {
            return Err(format!(
                "actor {} (stage {}, replica {}) read {} B of {kind:?} from its peers in the last step, \
                 the plan predicted {} B (more than {}% apart): measured {measured}, predicted {predicted}",
                a.actor,
                a.stage,
                a.replica,
                measured.of_kind(kind),
                predicted.of_kind(kind),
                100.0 * TOLERANCE,
            ));
        }
        let (moved, planned) = (&a.offload_bytes_per_step, &a.predicted_offload_bytes_per_step);
        if offload_off(moved, planned) {
            return Err(format!(
                "actor {} (stage {}, replica {}) moved {moved} to and from its offload tier in the last \
                 step, the plan predicted {planned} (more than {}% apart)",
                a.actor,
                a.stage,
                a.replica,
                100.0 * TOLERANCE,
            ));
        }
    }
    Ok(())
}

/// Whether offload traffic `moved` is more than [`TOLERANCE`] from `planned`, either way.
fn offload_off(moved: &OffloadTraffic, planned: &OffloadTraffic) -> bool {
    let off = |m: u64, p: u64| m.abs_diff(p) as f64 > TOLERANCE * p as f64;
    off(moved.to_tier, planned.to_tier) || off(moved.from_tier, planned.from_tier)
}

/// The first kind whose measured bytes are more than [`TOLERANCE`] from the predicted ones
/// (norms: more than `norms_slack` bytes).
fn first_off(measured: &FabricBytes, predicted: &FabricBytes, norms_slack: u64) -> Option<FabricKind> {
    FabricBytes::KINDS.into_iter().find(|&kind| {
        let (m, p) = (measured.of_kind(kind), predicted.of_kind(kind));
        let off = m.abs_diff(p);
        match kind {
            FabricKind::Norms => off > norms_slack,
            _ => off as f64 > TOLERANCE * p as f64,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(gradients: u64, parameters: u64) -> FabricBytes {
        FabricBytes {
            gradients,
            parameters,
            ..FabricBytes::default()
        }
    }

    /// Equal figures pass, and so do figures within 1 %; a count 2 % off, a kind that moved
    /// where none was predicted, and ZeRO-2's prediction (reduce-scatter, then a gather) set
    /// against dp's measured all-reduce are caught.
    /// Offload traffic: equal and 0.5 % off pass; 2 % off either way, and traffic where none
    /// was planned, are caught.
    #[test]
    fn offload_traffic_more_than_one_percent_off_is_caught() {
        let planned = OffloadTraffic {
            to_tier: 1_000_000,
            from_tier: 1_000_000,
        };
        let moved = |to_tier, from_tier| OffloadTraffic { to_tier, from_tier };
        assert!(!offload_off(&planned, &planned));
        assert!(!offload_off(&moved(1_005_000, 995_000), &planned));
        assert!(offload_off(&moved(1_020_000, 1_000_000), &planned));
        assert!(offload_off(&moved(1_000_000, 980_000), &planned));
        assert!(offload_off(&moved(4, 0), &OffloadTraffic::default()));
    }

    #[test]
    fn a_kind_more_than_one_percent_off_is_caught() {
        let n = 1_000_000;
        let all_reduce = bytes(n, 0);
        assert_eq!(first_off(&all_reduce, &all_reduce, 0), None);
        assert_eq!(first_off(&bytes(n + n / 200, 0), &all_reduce, 0), None);
        assert_eq!(
            first_off(&bytes(n + n / 50, 0), &all_reduce, 0),
            Some(FabricKind::Gradients)
        );
        assert_eq!(
            first_off(&bytes(n, 4), &all_reduce, 0),
            Some(FabricKind::Parameters)
        );
        let zero2 = bytes(n / 2, n / 2);
        assert_eq!(first_off(&all_reduce, &zero2, 0), Some(FabricKind::Gradients));
        // Norms: the ring's 8 bytes against the shared buffers' 4 over four actors pass; a
        // norm collective counted twice over does not.
        let norms = |norms| FabricBytes {
            norms,
            ..FabricBytes::default()
        };
        let slack = norms_slack_bytes(4);
        assert_eq!(first_off(&norms(8), &norms(4), slack), None);
        assert_eq!(
            first_off(&norms(4 + 4 + slack), &norms(4), slack),
            Some(FabricKind::Norms)
        );
    }
}
