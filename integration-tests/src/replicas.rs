//! The harness's side of the replica check ([`archipelago_controller::replica_check`]): a job's
//! final parameters put together from every actor that holds them, every copy of every element
//! required to agree bit for bit. Every run of this crate's helpers and every
//! [`crate::assert_equivalent`] goes through [`assert_replicas_agree`]; `sgd_matrix.rs`'s
//! `the_replica_check_catches_a_fault_in_another_replicas_last_update` is its control.

use archipelago_controller::TrainReport;
use archipelago_dataflow::ModelDesc;

pub use archipelago_controller::replica_check::replica_params;

/// Puts every block of `model` together from the parameters every actor of `report`'s run held
/// at the end, panicking (naming `what`) where an actor did not answer, an element is held by
/// nobody or two copies of an element differ. Returns the blocks' parameters, in block order.
pub fn assert_replicas_agree(report: &TrainReport, model: &ModelDesc, what: &str) -> Vec<Vec<f32>> {
    archipelago_controller::replica_check::assemble_params(report, model)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}
