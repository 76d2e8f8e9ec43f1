//! Shared pieces of the examples, so that tests can check exactly what the examples run.
//!
//! [`sharded_sum_of_squares`] is a map-reduce over tensors on 4 actors; [`producer_consumer`]
//! is a loop in which one actor produces tensors and another accumulates them. Neither is a
//! training loop: they use the general dataflow API on the same controller and actors.

pub mod programs;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::Tensor;

use archipelago_actors::HostTensor;
use archipelago_actors::flow_functions::{FlowContext, FunctionTable, from_burn, to_burn};
use archipelago_controller::{Controller, JobError};
use archipelago_dataflow::DeviceSpec;
use archipelago_dataflow::flow::FlowGraph;

/// Σ x² over `0..n` computed as 4 shards on 4 actors: each actor squares and sums its shard with
/// burn, an all-reduce edge adds the partial sums, and actor 0 outputs the total.
pub fn sharded_sum_of_squares(n: usize) -> Result<f32, JobError> {
    let actors = 4;
    let mut flow = FlowGraph::new(actors);
    let partials: Vec<_> = (0..actors)
        .map(|a| flow.compute(a, "square_sum_shard", &[], "partial"))
        .collect();
    let totals = flow.all_reduce(&partials);
    flow.output(&totals[0], "total");

    let mut functions = FunctionTable::new();
    functions.register("square_sum_shard", move |ctx: &mut FlowContext, _| {
        let (start, end) = (ctx.actor * n / actors, (ctx.actor + 1) * n / actors);
        let shard: Vec<f32> = (start..end).map(|i| i as f32).collect();
        let x: Tensor<Flex, 1> = to_burn(&HostTensor::flat(shard), &FlexDevice);
        from_burn((x.clone() * x).sum())
    });
    let run = Controller::local(DeviceSpec::cpus(actors)).run_flow(&flow, &functions, 1)?;
    Ok(run.values("total")[0].tensor.data[0])
}

/// Actor 0 produces the vector `[k, 2k, 3k]` at run k and sends it to actor 1, which adds it to
/// an accumulator kept across runs and outputs the running total. Returns the total after each run.
pub fn producer_consumer(runs: u64) -> Result<Vec<Vec<f32>>, JobError> {
    let mut flow = FlowGraph::new(2);
    let produced = flow.compute(0, "produce", &[], "v");
    let total = flow.compute(1, "accumulate", &[&produced], "total");
    flow.output(&total, "total");

    let mut functions = FunctionTable::new();
    functions.register("produce", |ctx: &mut FlowContext, _| {
        let k = ctx.step as f32;
        HostTensor::flat(vec![k, 2.0 * k, 3.0 * k])
    });
    functions.register("accumulate", |ctx: &mut FlowContext, inputs: &[HostTensor]| {
        let incoming: Tensor<Flex, 1> = to_burn(&inputs[0], &FlexDevice);
        let sum = match ctx.state.get("acc") {
            Some(acc) => to_burn::<Flex, 1>(acc, &FlexDevice) + incoming,
            None => incoming,
        };
        let sum = from_burn(sum);
        ctx.state.insert("acc".into(), sum.clone());
        sum
    });
    let run = Controller::local(DeviceSpec::cpus(2)).run_flow(&flow, &functions, runs)?;
    Ok(run
        .values("total")
        .iter()
        .map(|o| o.tensor.data.to_vec())
        .collect())
}
