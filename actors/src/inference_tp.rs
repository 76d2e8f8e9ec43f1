//! Tensor-parallel generation (Megatron-LM's layers, Shoeybi et al. 2019; issue 42's first
//! step): a model cut over `tp` ranks exactly as training cuts it — each rank builds the zoo's
//! sliced blocks (its heads of every attention, its columns of `fc1` and rows of `fc2`, its rows
//! of the vocabulary-parallel embedding and its columns of the head) and loads its slice of the
//! whole weights ([`take_local`](archipelago_dataflow::tensor_parallel::take_local)). A step runs
//! every rank's block on the same input and sums their outputs (the all-reduce after each
//! row-parallel projection, Megatron's g; the first rank adds biases and the residual), and
//! gathers the head's vocabulary columns into the logits. Each rank keeps its own heads' keys
//! and values. The ranks run one after another in this process: the reductions are the
//! arithmetic of the collectives, so the sharded forward is checked against one device before
//! the ranks move onto actors with the runtime's collectives.

use burn::tensor::Tensor;

use archipelago_dataflow::ModelSpec;

use crate::CpuBackend;
use crate::block::Activation;
use crate::generate::{Greedy, PagedCache, Sequence, greedy, split_logits, tokens_of};
use crate::inference::WholeModel;
use crate::step_model::StepModel;
use crate::zoo::tp::TpPlace;
use crate::zoo::{BuildContext, ModelBuilder, ZooModel};

/// How a step combines the ranks' outputs between blocks (a test's deliberately broken
/// variant skips a sum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Every sum done (the model's arithmetic).
    Sum,
    /// Block `b`'s sum skipped: rank 0's summand alone goes on (the negative control).
    SkipAfter(usize),
}

/// A model cut over tensor-parallel ranks.
pub struct TpModel {
    spec: ModelSpec,
    ranks: Vec<WholeModel>,
    reduction: Reduction,
}

impl TpModel {
    /// `spec` cut over `tp` ranks, each with its slice of block `i`'s whole flat parameters
    /// `values[i]`; refused where the model does not divide (heads by `tp`).
    pub fn load(spec: &ModelSpec, values: &[Vec<f32>], tp: usize) -> Result<TpModel, String> {
        if tp == 0 {
            return Err("tp must be 1 or more".into());
        }
        let desc = spec.desc();
        if let Some(heads) = spec.get("heads").filter(|h| h % tp != 0) {
            return Err(format!("{spec}: {heads} heads do not divide over tp={tp}"));
        }
        if values.len() != desc.blocks.len() {
            return Err(format!(
                "{spec} has {} blocks, {} were given",
                desc.blocks.len(),
                values.len()
            ));
        }
        if let Some((index, (info, flat))) = (desc.blocks.iter().zip(values).enumerate())
            .find(|(_, (info, flat))| flat.len() as u64 != info.params)
        {
            return Err(format!(
                "block {index} (`{}`) of {spec} has {} parameters, {} were given",
                info.name,
                info.params,
                flat.len()
            ));
        }
        let zoo = ZooModel(spec.clone());
        let ranks = (0..tp)
            .map(|rank| {
                let place = TpPlace::new(rank, tp);
                let local: Vec<Vec<f32>> = (desc.blocks.iter().zip(values))
                    .map(|(info, flat)| crate::trainer::local_block(info, flat.clone(), place))
                    .collect();
                let blocks = (local.iter().enumerate())
                    .map(|(index, flat)| {
                        let ctx = BuildContext {
                            tp: place,
                            ..BuildContext::whole(index)
                        };
                        let block = ModelBuilder::<CpuBackend>::build_block(&zoo, &ctx, &burn::backend::flex::FlexDevice);
                        if block.num_params() != flat.len() {
                            return Err(format!(
                                "block {index} of {spec} at tp rank {rank}/{tp}: {} parameters built, {} sliced",
                                block.num_params(),
                                flat.len()
                            ));
                        }
                        Ok(block.load_params(flat, false).untracked_copy())
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                Ok(WholeModel {
                    spec: spec.clone(),
                    blocks,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(TpModel {
            spec: spec.clone(),
            ranks,
            reduction: Reduction::Sum,
        })
    }

    /// The same model combining its ranks' outputs by `reduction`.
    pub fn with_reduction(self, reduction: Reduction) -> TpModel {
        TpModel { reduction, ..self }
    }

    /// The ranks.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// Parameter elements held by all ranks together.
    pub fn params(&self) -> usize {
        (self.ranks.iter().flat_map(|r| &r.blocks))
            .map(|b| b.num_params())
            .sum()
    }

    /// Every rank's weights in bf16 ([`WholeModel::to_bf16`]); the weights' bytes after.
    pub fn to_bf16(&mut self) -> u64 {
        self.ranks.iter_mut().map(WholeModel::to_bf16).sum()
    }

    /// Block `b`'s outputs combined: summed, or the head's (the last of `blocks`) gathered.
    fn combine(
        &self,
        b: usize,
        blocks: usize,
        outs: Vec<Activation<CpuBackend>>,
    ) -> Result<Activation<CpuBackend>, String> {
        if b + 1 == blocks {
            gather(outs)
        } else {
            self.reduce(b, outs)
        }
    }

    /// The gathered logits without the vocabulary's padding columns.
    fn logits(&self, x: Activation<CpuBackend>) -> Result<Tensor<CpuBackend, 3>, String> {
        let vocab = self.spec.get("vocab").unwrap_or(0);
        let Activation::Seq(logits) = x else {
            return Err(format!("{}'s last block gave no sequence of logits", self.spec));
        };
        let [rows, t, width] = logits.dims();
        Ok(logits.slice([0..rows, 0..t, 0..vocab.min(width)]))
    }

    /// The greedy continuation of `prompt` by `new_tokens` tokens ([`WholeModel::greedy`]).
    pub fn greedy(&self, prompt: &[u32], new_tokens: usize) -> Result<Greedy, String> {
        greedy(self, prompt, new_tokens)
    }

    /// The ranks' outputs of block `b` summed (each rank's summand of the group's output).
    fn reduce(&self, b: usize, outs: Vec<Activation<CpuBackend>>) -> Result<Activation<CpuBackend>, String> {
        let mut outs = outs.into_iter();
        let Some(Activation::Seq(mut sum)) = outs.next() else {
            return Err(format!("block {b} of {} gave no sequence", self.spec));
        };
        if self.reduction == Reduction::SkipAfter(b) {
            return Ok(Activation::Seq(sum));
        }
        for out in outs {
            let Activation::Seq(part) = out else {
                return Err(format!("block {b} of {} gave no sequence", self.spec));
            };
            sum = sum + part;
        }
        Ok(Activation::Seq(sum))
    }
}

/// [`WholeModel::extend_paged`] over the ranks: one sequence for every rank (the ranks share its
/// block table, each keeps its heads' layers of the cache).
impl StepModel for TpModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn start(&self) -> Sequence {
        self.ranks[0].start()
    }

    /// [`WholeModel::extend_paged`] over the ranks: each rank's block runs from the sequences'
    /// positions before the block (a paged past holds no keys, only its offset) into its own
    /// layers of `cache`, the outputs summed between blocks and the head's columns gathered.
    fn extend_paged(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        cache: &mut PagedCache,
    ) -> Result<Vec<Vec<f32>>, String> {
        let vocab = self.ranks[0].check_step(sequences, ids, Some(cache.pool))?;
        let blocks = self.ranks[0].blocks.len();
        let mut x = tokens_of(ids);
        for b in 0..blocks {
            let before: Vec<usize> = sequences.iter().map(|s| s.pasts[b].offset).collect();
            let mut outs = Vec::with_capacity(self.ranks.len());
            for (r, rank) in self.ranks.iter().enumerate() {
                for (sequence, &offset) in sequences.iter_mut().zip(&before) {
                    sequence.pasts[b].offset = offset;
                }
                outs.push(rank.step_block(b, x.clone(), sequences, ids, Some(cache.rank(r))));
            }
            x = self.combine(b, blocks, outs)?;
        }
        let logits = self.logits(x)?;
        for (sequence, ids) in sequences.iter_mut().zip(ids) {
            sequence.tokens.extend_from_slice(ids);
        }
        split_logits(logits, ids, vocab)
    }
}

/// The head's vocabulary columns of every rank side by side.
fn gather(outs: Vec<Activation<CpuBackend>>) -> Result<Activation<CpuBackend>, String> {
    let parts = (outs.into_iter())
        .map(|out| match out {
            Activation::Seq(part) => Ok(part),
            _ => Err("the head gave no sequence of logits".to_string()),
        })
        .collect::<Result<Vec<Tensor<CpuBackend, 3>>, String>>()?;
    Ok(Activation::Seq(Tensor::cat(parts, 2)))
}

#[cfg(test)]
#[path = "inference_tp_tests.rs"]
mod tests;
