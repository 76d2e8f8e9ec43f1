//! User dataflow graphs: computations placed on actors, joined by edges that carry values.
//!
//! A [`Value`] is a future of a value on one actor. Using it on another actor inserts a transfer
//! edge (send ↔ recv); [`FlowGraph::all_reduce`] joins same-named values with a collective edge.
//! The graph compiles to per-actor instruction streams through the same lowering and verifier as
//! training. Computations are referenced by name and the executor gives the names their meaning:
//! the runtime's compiled programs (`archipelago_actors::runtime::compiled`) record calls over
//! actors as `node:{i}` computations and run the streams this module compiles.
//!
//! ```
//! use archipelago_dataflow::flow::FlowGraph;
//! let mut flow = FlowGraph::new(2);
//! let x = flow.compute(0, "make", &[], "x");
//! let y = flow.compute(1, "double", &[&x], "y"); // x moves 0 → 1
//! flow.output(&y, "result");
//! let streams = flow.compile().unwrap();
//! assert_eq!(streams.len(), 2);
//! ```

use std::collections::BTreeMap;

use crate::graph::Graph;
use crate::instruction::{CollectiveKind, ComputeOp, Instruction};
use crate::passes::lower::lower;
use crate::tensor_id::TensorId;
use crate::verify::verify;
use crate::{ActorId, PlanError};

/// A tensor-to-be on one actor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value {
    /// The actor that holds it.
    pub actor: ActorId,
    /// Its name on that actor.
    pub name: String,
}

/// A user dataflow graph under construction.
#[derive(Debug, Clone)]
pub struct FlowGraph {
    graph: Graph,
    moved: BTreeMap<(Value, ActorId), String>,
    errors: Vec<String>,
}

impl FlowGraph {
    /// An empty graph over `actors` actors.
    pub fn new(actors: usize) -> FlowGraph {
        FlowGraph {
            graph: Graph::new(actors),
            moved: BTreeMap::new(),
            errors: Vec::new(),
        }
    }

    /// Runs the registered function `func` on `actor` with `inputs` (moved there if they live
    /// elsewhere), producing the tensor `output` on `actor`.
    pub fn compute(&mut self, actor: ActorId, func: &str, inputs: &[&Value], output: &str) -> Value {
        self.check_actor(actor);
        let local: Vec<TensorId> = inputs
            .iter()
            .map(|v| TensorId::named(self.bring(v, actor)))
            .collect();
        self.graph.compute(
            actor,
            ComputeOp::User {
                name: func.to_string(),
            },
            &local,
            &[TensorId::named(output)],
        );
        Value {
            actor,
            name: output.to_string(),
        }
    }

    /// Sums same-named values held by different actors; each member gets the total.
    pub fn all_reduce(&mut self, values: &[Value]) -> Vec<Value> {
        let Some(first) = values.first() else {
            self.errors.push("all_reduce needs at least one value".into());
            return Vec::new();
        };
        if values.iter().any(|v| v.name != first.name) {
            self.errors.push(format!(
                "all_reduce joins values of one name on several actors; got {:?}",
                values.iter().map(|v| &v.name).collect::<Vec<_>>()
            ));
        }
        let group: Vec<ActorId> = values.iter().map(|v| v.actor).collect();
        self.graph
            .collective(CollectiveKind::AllReduceSum, group, &TensorId::named(&first.name));
        values.to_vec()
    }

    /// Hands `value` to the caller under `key` after each run.
    pub fn output(&mut self, value: &Value, key: &str) {
        let op = ComputeOp::Output { key: key.to_string() };
        self.graph
            .compute(value.actor, op, &[TensorId::named(&value.name)], &[]);
    }

    /// Lowers and verifies the graph: one stream per actor.
    pub fn compile(&self) -> Result<Vec<Vec<Instruction>>, PlanError> {
        if let Some(e) = self.errors.first() {
            return Err(PlanError::Flow(e.clone()));
        }
        let streams = lower(&self.graph);
        verify(&streams)?;
        Ok(streams)
    }

    /// The graph built so far.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    fn bring(&mut self, value: &Value, to: ActorId) -> String {
        if value.actor == to {
            return value.name.clone();
        }
        if let Some(name) = self.moved.get(&(value.clone(), to)) {
            return name.clone();
        }
        let name = format!("{}@{}", value.name, value.actor);
        self.graph.transfer(
            value.actor,
            &TensorId::named(&value.name),
            to,
            &TensorId::named(&name),
        );
        self.moved.insert((value.clone(), to), name.clone());
        name
    }

    fn check_actor(&mut self, actor: ActorId) {
        if actor >= self.graph.actors {
            self.errors.push(format!(
                "actor {actor} does not exist (the graph has {})",
                self.graph.actors
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_reduce_compiles_and_moves_values_once() {
        let mut flow = FlowGraph::new(4);
        let parts: Vec<Value> = (0..4)
            .map(|a| flow.compute(a, "square_sum", &[], "partial"))
            .collect();
        let totals = flow.all_reduce(&parts);
        flow.output(&totals[0], "total");
        let shard = flow.compute(3, "make", &[], "s");
        flow.compute(0, "use", &[&shard], "u1");
        flow.compute(0, "use", &[&shard], "u2");
        let streams = flow.compile().unwrap();
        let sends = streams[3]
            .iter()
            .filter(|i| matches!(i, Instruction::Send { .. }))
            .count();
        assert_eq!(sends, 1);
    }

    #[test]
    fn mismatched_all_reduce_is_refused() {
        let mut flow = FlowGraph::new(2);
        let a = flow.compute(0, "f", &[], "a");
        let b = flow.compute(1, "f", &[], "b");
        flow.all_reduce(&[a, b]);
        assert!(flow.compile().unwrap_err().to_string().contains("one name"));
        let mut flow = FlowGraph::new(1);
        flow.compute(5, "f", &[], "a");
        assert!(flow.compile().is_err());
    }
}
