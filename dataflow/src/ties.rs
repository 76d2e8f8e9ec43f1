//! Tied parameters: one parameter used by two blocks, as GPT-2's output head reuses the token
//! embedding (Press & Wolf, "Using the Output Embedding to Improve Language Models", 2017).
//!
//! The second use is a *mirror* ([`crate::ParamDesc::tied_to`]): described beside its block, held whole
//! by the actor that runs that block, with no place in any trained vector, optimizer state,
//! ZeRO shard or checkpoint — the parameter is one, its target. When the target trains, the step
//! carries the tie ([`crate::passes::tied`]): the mirror's gradient is added into the target's
//! before the target's bucket is reduced (so the update sees the sum of both uses, as Megatron-LM's
//! embedding group all-reduces it between the first and the last stage), and each step starts by
//! copying the target's values into the mirror. A frozen target (LoRA's base, evaluation) needs
//! neither: both were read from the same values.

use crate::PlanError;
use crate::model_spec::ModelDesc;

/// A mirror and the parameter it mirrors, each as (block, index among the block's parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tie {
    /// The mirror.
    pub mirror: (usize, usize),
    /// The parameter it mirrors.
    pub target: (usize, usize),
}

impl ModelDesc {
    /// Every mirror whose target trains: the ties a training step carries.
    pub fn ties(&self) -> Vec<Tie> {
        let mut ties = Vec::new();
        for (b, block) in self.blocks.iter().enumerate() {
            for (i, p) in block.param_descs.iter().enumerate() {
                let Some(target) = &p.tied_to else { continue };
                if let Some(target) = self.find_param(target)
                    && self.blocks[target.0].param_descs[target.1].trainable
                {
                    ties.push(Tie {
                        mirror: (b, i),
                        target,
                    });
                }
            }
        }
        ties
    }

    /// The parameters counted once each, a mirror as the parameter it mirrors (what
    /// `transformers` gives as a tied model's size; [`ModelDesc::params`] counts every block's
    /// elements, a mirror's too).
    pub fn distinct_params(&self) -> u64 {
        let mirrors: u64 = (self.blocks.iter().flat_map(|b| &b.param_descs))
            .filter(|p| p.tied_to.is_some())
            .map(|p| p.len() as u64)
            .sum();
        self.params() - mirrors
    }

    /// Whether block `block`'s parameters are mirrors of a trained target, in order (what the
    /// actor running it keeps in autodiff though they are not in its trained vector).
    pub fn tracked_mirrors(&self, block: usize) -> Vec<bool> {
        let mut tracked = vec![false; self.blocks[block].param_descs.len()];
        for tie in self.ties().into_iter().filter(|t| t.mirror.0 == block) {
            tracked[tie.mirror.1] = true;
        }
        tracked
    }

    fn find_param(&self, name: &str) -> Option<(usize, usize)> {
        self.blocks
            .iter()
            .enumerate()
            .find_map(|(b, block)| (block.param_descs.iter().position(|p| p.name == name)).map(|i| (b, i)))
    }

    /// Each mirror names a parameter of the model that is not a mirror, with its shape and
    /// split, and holds no state of its own (it is frozen; it trains when its target does).
    pub(crate) fn check_ties(&self) -> Result<(), PlanError> {
        for (index, block) in self.blocks.iter().enumerate() {
            for p in block.param_descs.iter().filter(|p| p.tied_to.is_some()) {
                let bad = |why: String| PlanError::BadParams {
                    block: index,
                    name: block.name.clone(),
                    why,
                };
                let target = p.value_name();
                let Some((b, i)) = self.find_param(target) else {
                    return Err(bad(format!(
                        "`{}` is tied to `{target}`, which the model lacks",
                        p.name
                    )));
                };
                let tied = &self.blocks[b].param_descs[i];
                if tied.shape != p.shape || tied.split != p.split || tied.tied_to.is_some() {
                    return Err(bad(format!(
                        "`{}` {:?} ({:?}) is tied to `{target}` {:?} ({:?}): a tie needs the same shape \
                         and split, and a parameter that is not itself a mirror",
                        p.name, p.shape, p.split, tied.shape, tied.split
                    )));
                }
                if p.trainable {
                    return Err(bad(format!(
                        "`{}` mirrors `{target}` and has no state of its own: describe it frozen \
                         (it trains when `{target}` does)",
                        p.name
                    )));
                }
            }
        }
        Ok(())
    }
}
