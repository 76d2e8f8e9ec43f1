//! One training step, built by passes in order: pipeline ([`super::pipeline`]: forward and
//! backward runs, send/recv between stages), data-parallel gradient reductions
//! ([`super::data_parallel`]), the optimizer update with the norms it needs
//! ([`super::optimizer`]), offload ([`super::offload`]), the ZeRO rewrite ([`super::zero`]) and
//! islands ([`super::islands`]). Each pass reads the [`Layout`] and the graph so far and never
//! re-derives what an earlier one decided.

use crate::ZeroStage;
use crate::graph::Graph;
use crate::passes::layout::Layout;
use crate::passes::optimizer::StepNorms;
use crate::passes::schedule::Slot;
use crate::passes::{data_parallel, islands, offload, optimizer, pipeline, tied, zero};
use crate::ties::Tie;

/// Builds the graph of one training step with the given per-device pass orders.
///
/// Offload runs before the ZeRO rewrite so that, under ZeRO-3, a segment's drop lands right after
/// its run, ahead of the reduction and hand-off that follow it. A tie's gradient sum goes in
/// before the reductions are rewritten, its values after the loads are placed ([`tied`]).
pub fn build_step(
    layout: &Layout,
    batch: usize,
    orders: &[Vec<Slot>],
    (zero, offload): (ZeroStage, bool),
    norms: StepNorms,
    ties: &[Tie],
) -> Graph {
    let mut graph = pipeline::build(layout, batch, orders);
    data_parallel::reduce_gradients(&mut graph, layout);
    tied::sum_gradients(&mut graph, layout, ties);
    optimizer::append_updates(&mut graph, layout, norms);
    if offload {
        offload::apply(&mut graph, layout);
    }
    zero::apply(&mut graph, layout, zero);
    tied::share_values(&mut graph, layout, ties);
    islands::apply(&mut graph, layout);
    graph
}
