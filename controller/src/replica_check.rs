//! The replica check: a job's final parameters put together from every actor that holds them —
//! every replica of every stage, every ZeRO-3 shard (and, later, every tensor-parallel rank) —
//! with every copy of every element required to agree bit for bit.
//!
//! Data-parallel replicas apply the same all-reduced gradient to the same parameters, so they
//! hold the same bits after every step (a collective hands every member the same sums). The
//! checkpoint and the block norms are written by one replica only, so without this check a fault
//! that touches another replica's parameters alone (its last update, say) passes every
//! comparison against the single-device reference (`integration-tests/tests/sgd_matrix.rs`'s
//! `the_replica_check_catches_a_fault_in_another_replicas_last_update` is the control). The
//! equivalence tests, in one process and across hosts, call [`assemble_params`] on every run.

use archipelago_dataflow::ModelDesc;

use crate::report::{ActorParams, TrainReport};

/// One element's first copy: its value and the actor that holds it.
#[derive(Clone, Copy)]
struct Seen {
    value: f32,
    actor: usize,
}

/// The first disagreement found in a block, and how many elements disagree.
struct Disagreement {
    block: usize,
    element: usize,
    first: Seen,
    other: Seen,
    elements: usize,
    largest: f64,
}

/// Puts every block of `model` together from the parameters every actor of `report`'s run held
/// at the end (the run must have set [`TrainOptions::keep_params`](crate::TrainOptions)), and
/// checks that every actor answered, every element is held by some actor, and every copy of an
/// element agrees with its other copies bit for bit. Returns the blocks' parameters, in block
/// order, or what is wrong (a disagreement names the block, the element, the actors, their
/// stages and replicas).
pub fn assemble_params(report: &TrainReport, model: &ModelDesc) -> Result<Vec<Vec<f32>>, String> {
    if report.held_params.is_empty() {
        return Err(
            "the report holds no parameters: train with `TrainOptions { keep_params: true, .. }`".into(),
        );
    }
    if report.held_params.len() != report.actors.len() {
        return Err(format!(
            "{} of {} actors answered with their parameters",
            report.held_params.len(),
            report.actors.len()
        ));
    }
    let mut seen: Vec<Vec<Option<Seen>>> = (model.blocks.iter())
        .map(|b| vec![None; b.params as usize])
        .collect();
    let mut disagreements: Vec<Disagreement> = Vec::new();
    for held in &report.held_params {
        collect(held, &mut seen, &mut disagreements)?;
    }
    if let Some(d) = disagreements.first() {
        let actor = |a: usize| match report.held_params.iter().find(|h| h.actor == a) {
            Some(held) => format!("actor {a} (stage {}, replica {})", held.stage, held.replica),
            None => format!("actor {a}"),
        };
        return Err(format!(
            "replicas disagree in {} block(s); block {}: {} element(s) differ, the first \
             (element {}) is {} on {} and {} on {}; largest difference {:e}",
            disagreements.len(),
            d.block,
            d.elements,
            d.element,
            d.first.value,
            actor(d.first.actor),
            d.other.value,
            actor(d.other.actor),
            d.largest
        ));
    }
    (seen.into_iter().enumerate())
        .map(|(b, block)| {
            (block.into_iter().enumerate())
                .map(|(e, s)| {
                    s.map(|s| s.value)
                        .ok_or_else(|| format!("no actor holds element {e} of block {b}"))
                })
                .collect()
        })
        .collect()
}

/// Records every element one actor holds: its first copy, or a disagreement with the first.
fn collect(
    held: &ActorParams,
    seen: &mut [Vec<Option<Seen>>],
    disagreements: &mut Vec<Disagreement>,
) -> Result<(), String> {
    if held.parts.is_empty() {
        return Err(format!("actor {} holds no parameters", held.actor));
    }
    for part in &held.parts {
        let Some(block) = seen.get_mut(part.block) else {
            return Err(format!(
                "actor {} holds block {}, beyond the model",
                held.actor, part.block
            ));
        };
        if part.range.end > block.len() || part.range.len() != part.values.len() {
            return Err(format!(
                "actor {}'s part {:?} of block {} does not fit its {} parameters",
                held.actor,
                part.range,
                part.block,
                block.len()
            ));
        }
        for (element, &value) in part.range.clone().zip(&part.values) {
            let copy = Seen {
                value,
                actor: held.actor,
            };
            match block[element] {
                None => block[element] = Some(copy),
                Some(first) if same(first.value, value) => {}
                Some(first) => record(disagreements, part.block, element, first, copy),
            }
        }
    }
    Ok(())
}

/// Bit for bit, but `0.0 == -0.0`.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || a == b
}

fn record(disagreements: &mut Vec<Disagreement>, block: usize, element: usize, first: Seen, other: Seen) {
    let difference = (first.value as f64 - other.value as f64).abs();
    match disagreements.iter_mut().find(|d| d.block == block) {
        Some(d) => {
            d.elements += 1;
            d.largest = d.largest.max(difference);
        }
        None => disagreements.push(Disagreement {
            block,
            element,
            first,
            other,
            elements: 1,
            largest: difference,
        }),
    }
}

/// The parameters of `model` as the actors of data-parallel position `replica` alone hold them
/// (whole blocks: a layout that replicates its parameters), unchecked against the other replicas:
/// how far one replica strayed.
pub fn replica_params(report: &TrainReport, model: &ModelDesc, replica: usize) -> Vec<Vec<f32>> {
    let mut blocks: Vec<Vec<f32>> = (model.blocks.iter())
        .map(|b| vec![f32::NAN; b.params as usize])
        .collect();
    for held in report.held_params.iter().filter(|h| h.replica == replica) {
        for part in &held.parts {
            blocks[part.block][part.range.clone()].copy_from_slice(&part.values);
        }
    }
    blocks
}
