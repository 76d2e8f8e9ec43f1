//! The trainer's parameters as the model has them: each held piece of a trained vector put back
//! at its place among all of its block's parameters, with the frozen parameters beside it
//! (what [`crate::executor::Computation::block_params`] answers: reports and replica checks see
//! every parameter of the model, frozen ones included).

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::executor::HeldParams;

impl<B: AutodiffBackend> Trainer<B> {
    /// `trained` (ranges of blocks' trained vectors) in the blocks' full vectors, and the frozen
    /// parameters of every held block, read from its module (so that a write that reached a
    /// frozen parameter shows): the one held, or under ZeRO-3 one built as a gather builds it.
    pub(super) fn in_full_vectors(&self, trained: Vec<HeldParams>) -> Vec<HeldParams> {
        let mut out = Vec::with_capacity(trained.len());
        for held in trained {
            let layout = &self.stage.layouts[held.block];
            if !layout.has_frozen() {
                out.push(held);
                continue;
            }
            let base = held.range.start;
            for (in_trained, in_full) in layout.trained_in_full(held.range.clone()) {
                out.push(HeldParams {
                    block: held.block,
                    range: in_full,
                    values: held.values[in_trained.start - base..in_trained.end - base].to_vec(),
                });
            }
        }
        for (index, layout) in self.stage.layouts.iter().enumerate() {
            if !self.stage.held_blocks[index] || !layout.has_frozen() {
                continue;
            }
            // A block not built now (ZeRO-3 between gathers) is built as a gather would build it.
            let built;
            let block = match self.stage.blocks[index].as_deref() {
                Some(block) => block,
                None => {
                    built = self.stage.build_held(index);
                    &*built
                }
            };
            let mut full = vec![0.0; layout.full_len()];
            block.write_full_params(&mut full);
            for (_, in_full) in layout.frozen_in_full() {
                out.push(HeldParams {
                    block: index,
                    values: full[in_full.clone()].to_vec(),
                    range: in_full,
                });
            }
        }
        out
    }
}
