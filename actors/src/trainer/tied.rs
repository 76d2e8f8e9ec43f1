//! The trainer's side of a tie ([`archipelago_dataflow::ties`]; GPT-2's head reusing the token
//! embedding, Press & Wolf 2017): the mirror's gradient summed over the step's micro-batches and
//! handed out as `TiedGrads` by its last backward, added into the mirrored parameter's place in
//! its bucket (`AddTiedGrads`), and the mirrored parameter's values read as the step starts
//! (`TiedValues`) and written into the mirror (`LoadTied`).

use archipelago_dataflow::TensorId;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::block::{Block, read_flat};
use crate::executor::TensorTable;
use crate::typed_tensor::TypedTensor;

impl<B: AutodiffBackend> Trainer<B> {
    /// The mirror of block `block` and the parameter it mirrors: (mirror's index among the
    /// block's parameters, target's block, target's index).
    fn tie_of(&self, block: usize) -> Result<(usize, usize, usize), String> {
        let params = &self.stage.desc.blocks[block].param_descs;
        let (mirror, target) = (params.iter().enumerate())
            .find_map(|(i, p)| p.tied_to.as_ref().map(|t| (i, t)))
            .ok_or_else(|| format!("block {block} holds no tied parameter"))?;
        let (tb, ti) = (self.stage.desc.blocks.iter().enumerate())
            .find_map(|(b, x)| (x.param_descs.iter().position(|p| &p.name == target)).map(|i| (b, i)))
            .ok_or_else(|| format!("`{target}`, which block {block} mirrors, is not in the model"))?;
        Ok((mirror, tb, ti))
    }

    /// Where parameter `index` of block `block` lies in the block's trained vector (`trained`)
    /// or among its frozen values.
    fn param_range(&self, block: usize, index: usize, trained: bool) -> Range<usize> {
        let params = &self.stage.desc.blocks[block].param_descs;
        let start = (params[..index].iter())
            .filter(|p| p.trainable == trained)
            .map(|p| p.len())
            .sum::<usize>();
        start..start + params[index].len()
    }

    /// After a backward of `copies` (blocks from `first`): the tied mirrors' gradients added to
    /// the step's sums.
    pub(super) fn accumulate_tied(
        &mut self,
        first: usize,
        copies: &[Box<dyn Block<B>>],
        grads: &mut B::Gradients,
    ) {
        for (i, copy) in copies.iter().enumerate() {
            let parts = copy.take_tied_grads(grads);
            if parts.is_empty() {
                continue;
            }
            let len = parts.iter().map(|t| t.shape().num_elements()).sum();
            let sum = self.step.tied_grads.entry(first + i);
            let started = matches!(sum, std::collections::hash_map::Entry::Occupied(_));
            let sum = sum.or_insert_with(|| vec![0.0; len]);
            read_flat(parts, sum, started, self.batched_transfers);
        }
    }

    /// A backward naming `TiedGrads`: the mirror's gradient sum handed out under that name.
    pub(super) fn hand_out_tied(
        &mut self,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        for name in outputs {
            if let TensorId::TiedGrads { block } = name {
                let sum = (self.step.tied_grads.remove(block)).ok_or_else(|| {
                    format!("`{name}`: the backward computed no gradient for block {block}'s mirror")
                })?;
                table.insert(name.clone(), TypedTensor::flat(sum));
            }
        }
        Ok(())
    }

    /// `AddTiedGrads`: the mirror's gradient (`inputs[0]`) added into its target's place in the
    /// bucket `outputs[0]`.
    pub(super) fn add_tied_grads(
        &mut self,
        block: usize,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (Some(tied), Some(bucket)) = (inputs.first(), outputs.first()) else {
            return Err("AddTiedGrads names no gradient or no bucket".into());
        };
        let grads = (table.remove(tied))
            .ok_or_else(|| format!("`{tied}` did not arrive before AddTiedGrads"))?
            .into_f32_vec();
        if self.fault.as_ref().is_some_and(|f| f.skips_tied_grads()) {
            return Ok(());
        }
        let (_, tb, ti) = self.tie_of(block)?;
        let blocks = (self.step.grad_ranges.get(bucket))
            .ok_or_else(|| format!("`{bucket}` is not a gradient bucket of this step"))?;
        if !blocks.contains(&tb) {
            return Err(format!(
                "`{bucket}` does not hold block {tb}, whose parameter block {block} mirrors"
            ));
        }
        let within = self.param_range(tb, ti, true);
        let at = self.stage.offsets[tb] - self.stage.offsets[blocks.start] + within.start;
        let range = at..at + within.len();
        if grads.len() != range.len() {
            return Err(format!(
                "`{tied}` holds {} values; the parameter it adds to holds {}",
                grads.len(),
                range.len()
            ));
        }
        if let Some(mut bucket_values) = table.remove(bucket) {
            let values = &mut bucket_values.values_mut::<f32>()[range];
            values.iter_mut().zip(&grads).for_each(|(v, g)| *v += g);
            table.insert(bucket.clone(), bucket_values);
            return Ok(());
        }
        let device = self.stage.device.clone();
        let state =
            (self.state.store.device_mut()).ok_or_else(|| format!("gradient bucket `{bucket}` missing"))?;
        let mut values = (state.read_ranges(bucket, std::slice::from_ref(&range)))
            .ok_or_else(|| format!("gradient bucket `{bucket}` missing"))?;
        values.iter_mut().zip(&grads).for_each(|(v, g)| *v += g);
        match state.write_ranges(bucket, &[range], values, &device) {
            true => Ok(()),
            false => Err(format!("gradient bucket `{bucket}` missing")),
        }
    }

    /// `TiedValues`: the values of the parameter block `block`'s mirror mirrors, read from its
    /// module (loaded for the step's first forward) into `outputs[0]`.
    pub(super) fn tied_values(
        &mut self,
        block: usize,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let name = outputs.first().ok_or("TiedValues names no output")?;
        let (_, tb, ti) = self.tie_of(block)?;
        let module = self.block(tb)?;
        let mut values = vec![0.0f32; module.num_params()];
        module.write_params(&mut values);
        let range = self.param_range(tb, ti, true);
        values.truncate(range.end);
        values.drain(..range.start);
        table.insert(name.clone(), TypedTensor::flat(values));
        Ok(())
    }

    /// `LoadTied`: `inputs[0]` written into block `block`'s mirror (its frozen values, which a
    /// rebuilt module starts from, and the module when it is held).
    pub(super) fn load_tied(
        &mut self,
        block: usize,
        inputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let name = inputs.first().ok_or("LoadTied names no values")?;
        let values = (table.remove(name))
            .ok_or_else(|| format!("`{name}` did not arrive before LoadTied"))?
            .into_f32_vec();
        if self.fault.as_ref().is_some_and(|f| f.keeps_stale_mirror()) {
            return Ok(());
        }
        let (mirror, _, _) = self.tie_of(block)?;
        let range = self.param_range(block, mirror, false);
        let frozen = Arc::make_mut(&mut self.stage.frozen[block]);
        if values.len() != range.len() || frozen.len() < range.end {
            return Err(format!(
                "`{name}` holds {} values; block {block}'s mirror holds {}",
                values.len(),
                range.len()
            ));
        }
        frozen[range].copy_from_slice(&values);
        if let Some(module) = self.stage.blocks[block].take() {
            self.stage.blocks[block] = Some(module.load_frozen(&self.stage.frozen[block]));
        }
        Ok(())
    }
}
