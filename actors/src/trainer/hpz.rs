//! ZeRO++'s hierarchical partitioning (Wang et al., "ZeRO++: Extremely Efficient Collective
//! Communication for Giant Model Training", 2023, §3.2 hpZ) on the trainer: after each forward
//! gather of a segment's parameters (over the whole dp group, across islands) the replica keeps
//! its slice of them among the dp group's members on its island — a secondary copy of the
//! parameters, sharded inside the island — and the backward's gather of that segment brings this
//! slice to an all-gather over the island's members only, so it never crosses islands. The copy
//! is refreshed by every forward gather (the parameters change only at the update, after every
//! backward of the step); the plan places the ops and counts the copy's memory
//! (`archipelago_dataflow::passes::zero`).

use std::collections::BTreeMap;
use std::ops::Range;

use archipelago_dataflow::{TensorId, shard_range};
use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::executor::TensorTable;
use crate::typed_tensor::TypedTensor;

/// This replica's secondary copy: its place on its island, and its slice of each segment the
/// forward gathered, by first block.
#[derive(Debug, Default)]
pub(super) struct Secondary {
    /// (position, members) among its dp group's members on its island; `None` without hpZ.
    place: Option<(usize, usize)>,
    kept: BTreeMap<usize, Vec<f32>>,
}

impl Secondary {
    /// The secondary copy of a replica at `place` (from its plan), empty until a forward gathers.
    pub(super) fn new(place: Option<(usize, usize)>) -> Secondary {
        Secondary {
            place,
            kept: BTreeMap::new(),
        }
    }

    /// Its slice of a segment of `params` elements.
    fn slice(&self, params: usize) -> Result<Range<usize>, String> {
        let (position, members) = self.place.ok_or(
            "the stream keeps an hpZ secondary copy, and this actor's plan places it on no island: the \
             stream was not compiled from this actor's plan",
        )?;
        Ok(shard_range(params, members, position))
    }

    /// Bytes it holds now.
    pub(super) fn bytes(&self) -> usize {
        self.kept.values().map(|v| 4 * v.len()).sum()
    }
}

impl<B: AutodiffBackend> Trainer<B> {
    /// `KeepSecondary`: this replica's island slice of the gathered parameters `name` of segment
    /// `blocks`, kept (and the gathered tensor left for the load that follows).
    pub(super) fn keep_secondary(
        &mut self,
        blocks: Range<usize>,
        name: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        let gathered = table
            .get(name)
            .ok_or_else(|| format!("gathered parameters `{name}` missing before the secondary copy"))?;
        if gathered.elements() != segment.params {
            return Err(format!(
                "`{name}` has {} values, blocks {}..{} have {}",
                gathered.elements(),
                blocks.start,
                blocks.end,
                segment.params
            ));
        }
        let stale = self.fault.as_ref().is_some_and(|f| f.keeps_stale_secondary());
        if stale && self.state.secondary.kept.contains_key(&blocks.start) {
            return Ok(());
        }
        let slice = self.state.secondary.slice(segment.params)?;
        // The step before's copy of the segment, refilled in place (no allocation per forward).
        let kept = self.state.secondary.kept.entry(blocks.start).or_default();
        kept.clear();
        kept.extend_from_slice(&gathered.f32s()[slice]);
        Ok(())
    }

    /// `SecondaryShard`: this replica's slice of the secondary copy of segment `blocks`, in a
    /// buffer of the segment's length, for the all-gather inside its island.
    pub(super) fn secondary_shard(
        &mut self,
        blocks: Range<usize>,
        output: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        let slice = self.state.secondary.slice(segment.params)?;
        let mut full = self.gather_buffer(segment.params);
        let kept = self.state.secondary.kept.get(&blocks.start).ok_or_else(|| {
            format!(
                "the backward gathers blocks {}..{} from the hpZ secondary copy, and no forward kept one \
                 this step",
                blocks.start, blocks.end
            )
        })?;
        full[slice].copy_from_slice(kept);
        table.insert(output.clone(), TypedTensor::flat(full));
        Ok(())
    }
}
