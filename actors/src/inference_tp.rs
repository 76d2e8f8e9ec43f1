//! One pipeline stage of a served model cut over tensor-parallel ranks (Megatron-LM's layers,
//! Shoeybi et al. 2019), exactly as training cuts it: each rank builds the zoo's sliced blocks
//! (its heads of every attention, its columns of `fc1` and rows of `fc2`, its rows of the
//! vocabulary-parallel embedding and its columns of the head) and loads its slice of the whole
//! weights ([`take_local`](archipelago_dataflow::tensor_parallel::take_local)). Between blocks
//! the ranks' outputs are summed with training's all-reduce (Megatron's g after each
//! row-parallel projection; the first rank adds biases and the residual) and the head's
//! vocabulary columns all-gathered ([`crate::collectives`]), each rank on its own thread
//! ([`crate::inference_sharded`] runs them).

use std::ops::Range;
use std::sync::Mutex;

use burn::tensor::{Tensor, TensorData};

use archipelago_dataflow::{ActorId, ModelSpec};

use crate::CpuBackend;
use crate::block::{Activation, Block};
use crate::collectives::{ChunkPool, DEFAULT_CHUNK_ELEMS, all_gather, all_reduce};
use crate::fabric::Fabric;
use crate::zoo::tp::TpPlace;
use crate::zoo::{BuildContext, ModelBuilder, ZooModel};

/// A rank's blocks of its stage (the stage's first block at index 0).
pub(crate) type RankBlocks = Vec<Box<dyn Block<CpuBackend>>>;

/// The model's blocks `blocks` cut over `tp` ranks.
pub(crate) struct TpStage {
    /// The model's blocks this stage runs.
    pub(crate) blocks: Range<usize>,
    /// Each rank's slices of those blocks (a rank's thread takes its lock for a step).
    pub(crate) ranks: Vec<Mutex<RankBlocks>>,
}

impl TpStage {
    /// Blocks `blocks` of `spec` cut over `tp` ranks, each loading its slice of block `i`'s
    /// whole flat parameters `values[i]` (checked against the model by the caller).
    pub(crate) fn load(
        spec: &ModelSpec,
        values: &[Vec<f32>],
        tp: usize,
        blocks: Range<usize>,
    ) -> Result<TpStage, String> {
        let desc = spec.desc();
        let zoo = ZooModel(spec.clone());
        let ranks = (0..tp)
            .map(|rank| {
                let place = TpPlace::new(rank, tp);
                (blocks.clone())
                    .map(|index| {
                        let info = &desc.blocks[index];
                        let flat = crate::trainer::local_block(info, values[index].clone(), place);
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
                        Ok(block.load_params(&flat, false).untracked_copy())
                    })
                    .collect::<Result<RankBlocks, String>>()
                    .map(Mutex::new)
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(TpStage { blocks, ranks })
    }

    /// Parameter elements of each rank.
    pub(crate) fn rank_params(&self) -> Vec<usize> {
        (self.ranks.iter())
            .map(|rank| lock(rank).iter().map(|b| b.num_params()).sum())
            .collect()
    }

    /// Every rank's weights in bf16 (activations follow); the weights' bytes after.
    pub(crate) fn cast_to_bf16(&mut self) -> u64 {
        let mut bytes = 0;
        for rank in &mut self.ranks {
            let blocks = rank.get_mut().unwrap_or_else(|e| e.into_inner());
            *blocks = (std::mem::take(blocks).into_iter())
                .map(|b| b.cast_params(burn::tensor::FloatDType::BF16))
                .collect();
            bytes += blocks.iter().map(|b| 2 * b.num_params() as u64).sum::<u64>();
        }
        bytes
    }
}

/// A rank's blocks, taken for a step (a rank that panicked left them whole: a step changes
/// no weights).
pub(crate) fn lock(rank: &Mutex<RankBlocks>) -> std::sync::MutexGuard<'_, RankBlocks> {
    rank.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a rank meets its stage's other ranks: the fabric, its own id and the group's, and a
/// pool of chunks for collectives that go as rings.
pub(crate) struct RankGroup<'a> {
    /// The fabric the ranks' collectives run on.
    pub(crate) fabric: &'a dyn Fabric,
    /// This rank.
    pub(crate) me: ActorId,
    /// Its stage's ranks, in rank order.
    pub(crate) group: Vec<ActorId>,
    /// Chunks of ring collectives.
    pub(crate) pool: ChunkPool,
}

impl RankGroup<'_> {
    /// This rank's output of a block summed with every other rank's (the all-reduce after a
    /// row-parallel projection), in the output's element type; `edge` names the collective.
    pub(crate) fn all_reduce(
        &mut self,
        x: Activation<CpuBackend>,
        edge: u64,
    ) -> Result<Activation<CpuBackend>, String> {
        let Activation::Seq(part) = x else {
            return Err("a block before the head gave no sequence".into());
        };
        if self.group.len() == 1 {
            return Ok(Activation::Seq(part));
        }
        let (dims, dtype) = (part.dims(), part.dtype());
        let mut flat = f32s(part)?;
        (all_reduce(
            self.fabric,
            self.me,
            &self.group,
            edge,
            &mut flat,
            DEFAULT_CHUNK_ELEMS,
            &mut self.pool,
        ))
        .map_err(|e| format!("the all-reduce after a block: {e}"))?;
        let sum =
            Tensor::<CpuBackend, 3>::from_data(TensorData::new(flat, dims), &burn::backend::flex::FlexDevice);
        Ok(Activation::Seq(sum.cast(dtype)))
    }

    /// The head's logits `[1, t, vocab columns]`: every rank's columns all-gathered side by side
    /// (rank order).
    pub(crate) fn gather_columns(
        &mut self,
        x: Activation<CpuBackend>,
        edge: u64,
    ) -> Result<Tensor<CpuBackend, 3>, String> {
        let Activation::Seq(part) = x else {
            return Err("the head gave no sequence of logits".into());
        };
        let n = self.group.len();
        if n == 1 {
            return Ok(part);
        }
        let [rows, t, columns] = part.dims();
        let i = (self.group.iter().position(|&a| a == self.me)).ok_or("a rank outside its group")?;
        let mut gathered = vec![0.0f32; n * rows * t * columns];
        let shard = rows * t * columns;
        gathered[i * shard..(i + 1) * shard].copy_from_slice(&f32s(part)?);
        (all_gather(
            self.fabric,
            self.me,
            &self.group,
            edge,
            &mut gathered,
            DEFAULT_CHUNK_ELEMS,
            &mut self.pool,
        ))
        .map_err(|e| format!("the all-gather of the head's columns: {e}"))?;
        let ranks = Tensor::<CpuBackend, 4>::from_data(
            TensorData::new(gathered, [n, rows, t, columns]),
            &burn::backend::flex::FlexDevice,
        );
        Ok(ranks.permute([1, 2, 0, 3]).reshape([rows, t, n * columns]))
    }
}

/// A tensor's values as f32.
fn f32s(x: Tensor<CpuBackend, 3>) -> Result<Vec<f32>, String> {
    (x.into_data().convert::<f32>().to_vec::<f32>()).map_err(|e| format!("cannot read an activation: {e:?}"))
}
