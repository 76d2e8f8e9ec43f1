//! Training on burn: the compute half of an actor's training stream.
//!
//! Forward runs segment by segment; each segment's input is a fresh autodiff leaf, so the backward
//! of a segment is its own small graph: the last segment starts from the loss, every other one
//! from `sum(y ⊙ g)` with the upstream gradient `g` (exact: the vector–Jacobian product). A
//! segment's parameter gradients leave burn as one flat bucket as soon as its backward is done
//! (added up over micro-batches), so the bucket's all-reduce overlaps the backward of the segments
//! before it. The optimizer runs on flat slices and writes the parameters back into the modules.
//!
//! Pipeline stages: an actor builds only the blocks of its chunks. Activations and their
//! gradients that cross to another stage leave as [`HostTensor`]s ([`Computation::export`]) and
//! arrive through the tensor table. Under activation checkpointing a forward keeps only the
//! segment's input and drops its graph; the backward recomputes the forward first (Chen et al.,
//! 2016). ZB-H1's split backward: `BackwardInput` runs burn's backward (which always yields input
//! and weight gradients together) and keeps the weight gradients; `BackwardWeight` moves them into
//! the gradient bucket.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use archipelago_dataflow::data::{ClusterPool, DataSpec, TokenStream};
use archipelago_dataflow::{ActorId, ComputeOp, InputKind, ModelDesc, Program};

use crate::block::{Activation, Block, deterministic_init};
use crate::collectives::shard_range;
use crate::executor::{Computation, StepMetrics, TensorTable};
use crate::flat_optimizer::FlatOptimizer;
use crate::flow_functions::{from_burn, to_burn};
use crate::host_tensor::HostTensor;
use crate::zoo::{BuildContext, ModelBuilder};

/// The per-micro-batch copies of a segment's blocks (see [`Block::fresh_copy`]).
type BlockCopies<B> = Vec<Box<dyn Block<B>>>;

enum Samples {
    Clusters(ClusterPool),
    Tokens(TokenStream),
}

struct Batch<B: AutodiffBackend> {
    input: Activation<B>,
    targets: Tensor<B, 1, Int>,
}

/// A segment's forward for one micro-batch, kept for its backward.
struct Segment<B: AutodiffBackend> {
    input: Activation<B>,
    /// The output; without its graph when `checkpointed`.
    output: Activation<B>,
    checkpointed: bool,
    /// The per-micro-batch copies of the blocks the forward ran on (their gradients are read
    /// from these); empty when checkpointed (the recompute makes new ones).
    copies: BlockCopies<B>,
    /// The batch whose targets the loss uses (last segment only).
    batch: Option<String>,
}

/// What an actor holds: its chunks of blocks, its gradient buckets, its place in the dp group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Chunks of blocks (half-open ranges) this actor holds.
    pub chunks: Vec<(usize, usize)>,
    /// Its gradient buckets (segments), half-open block ranges.
    pub segments: Vec<(usize, usize)>,
    /// Its position in its data-parallel group.
    pub replica: usize,
    /// Members of its data-parallel group.
    pub replicas: usize,
}

/// One actor's model, optimizer state and in-flight step.
pub struct Trainer<B: AutodiffBackend> {
    device: B::Device,
    desc: ModelDesc,
    blocks: Vec<Option<Box<dyn Block<B>>>>,
    /// `offsets[i]..offsets[i + 1]`: block `i` in the local master vector (empty when not held).
    offsets: Vec<usize>,
    /// First block of each chunk held, for counting micro-batches in flight per chunk.
    chunk_starts: Vec<usize>,
    /// f32 master parameters of the held blocks, flat in block order.
    master: Vec<f32>,
    optimizer: FlatOptimizer,
    /// Gradient bucket buffers kept from the last step (no fresh allocation per step).
    spare_buffers: Vec<Vec<f32>>,
    samples: Samples,
    global_batch: usize,
    checkpoint: bool,
    batches: HashMap<String, Batch<B>>,
    segments: HashMap<(usize, usize), Segment<B>>,
    by_name: HashMap<String, (usize, usize)>,
    losses: HashMap<String, (usize, usize)>,
    loss_sum: Option<f32>,
    upstream: HashMap<String, Activation<B>>,
    /// ZB-H1: weight gradients computed by `BackwardInput` (with the block copies they belong
    /// to), waiting for `BackwardWeight`.
    pending_weights: HashMap<(usize, usize), (B::Gradients, BlockCopies<B>)>,
    grad_ranges: HashMap<String, Range<usize>>,
    /// ZeRO: gathered-parameter tensors and the blocks they belong to.
    param_ranges: HashMap<String, Range<usize>>,
    grads_started: HashSet<String>,
    peak_grad_bytes: u64,
    optimizer_grad_bytes: u64,
    live: HashMap<(usize, usize), usize>,
    peak_live: usize,
    /// ZeRO sharding over the dp group.
    sharding: Sharding,
    /// ZeRO-3: this replica's shards of the segments' parameters, concatenated (the master copy).
    shard_master: Vec<f32>,
    /// Which blocks this actor holds (under ZeRO-3 their modules come and go).
    held_blocks: Vec<bool>,
    builder: Arc<dyn ModelBuilder<B>>,
    seed: u64,
    actor: ActorId,
}

/// Where this actor sits in its data-parallel group, and what ZeRO shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// ZeRO stage in effect (0 when the group has one member).
    pub zero: u8,
    /// This actor's position in its dp group (its shard).
    pub rank: usize,
    /// Members of the dp group.
    pub members: usize,
    /// Optimizer-state offset of each segment's shard, by the segment's first block.
    state_offsets: HashMap<usize, usize>,
}

impl Sharding {
    /// Shard `rank` of `members` of every segment in `segments` (half-open block ranges), for a
    /// model whose block `i` lives at `offsets[i]..offsets[i + 1]` of the flat parameters.
    fn new(
        zero: u8,
        rank: usize,
        members: usize,
        segments: &[(usize, usize)],
        offsets: &[usize],
    ) -> Sharding {
        let zero = if members > 1 { zero } else { 0 };
        let mut state_offsets = HashMap::new();
        let mut next = 0;
        for &(start, end) in segments {
            state_offsets.insert(start, next);
            next += shard_range(offsets[end] - offsets[start], members, rank).len();
        }
        Sharding {
            zero,
            rank,
            members,
            state_offsets,
        }
    }

    /// Optimizer state elements this actor keeps.
    fn state_len(&self, segments: &[(usize, usize)], offsets: &[usize]) -> usize {
        segments
            .iter()
            .map(|&(s, e)| shard_range(offsets[e] - offsets[s], self.members, self.rank).len())
            .sum()
    }
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Builds the blocks of `chunks` (half-open block ranges) of `program`'s model on `device`
    /// for `actor`, initialised from `(seed, block index)`, and the data source.
    pub fn new(
        program: &Program,
        builder: Arc<dyn ModelBuilder<B>>,
        actor: ActorId,
        device: B::Device,
        placement: &Placement,
    ) -> Result<Trainer<B>, String> {
        let chunks = &placement.chunks;
        let desc = program.model.clone();
        let held = |i: usize| chunks.iter().any(|&(s, e)| (s..e).contains(&i));
        let mut blocks = Vec::with_capacity(desc.blocks.len());
        let mut offsets = vec![0];
        let mut master = Vec::new();
        for (index, info) in desc.blocks.iter().enumerate() {
            if !held(index) {
                blocks.push(None);
                offsets.push(offsets[index]);
                continue;
            }
            let ctx = BuildContext {
                seed: program.seed,
                actor,
                block: index,
            };
            let block = builder.build_block(&ctx, &device);
            if block.num_params() as u64 != info.params {
                return Err(format!(
                    "block {index} `{}` has {} parameters but the model description says {}",
                    info.name,
                    block.num_params(),
                    info.params
                ));
            }
            let init = deterministic_init(&block.param_shapes(), program.seed, index);
            blocks.push(Some(block.load_params(&init)));
            master.extend_from_slice(&init);
            offsets.push(offsets[index] + info.params as usize);
        }
        let samples = samples(&program.data, desc.input)?;
        let sharding = Sharding::new(
            program.plan.zero,
            placement.replica,
            placement.replicas,
            &placement.segments,
            &offsets,
        );
        let state_len = if sharding.zero >= 1 {
            sharding.state_len(&placement.segments, &offsets)
        } else {
            master.len()
        };
        let held_blocks: Vec<bool> = blocks.iter().map(Option::is_some).collect();
        // ZeRO-3: keep only this replica's shard of each segment; modules exist only while a
        // segment's gathered parameters are loaded.
        let mut shard_master = Vec::new();
        if sharding.zero >= 3 {
            for &(start, end) in &placement.segments {
                let range = offsets[start]..offsets[end];
                let own = shard_range(range.len(), sharding.members, sharding.rank);
                shard_master.extend_from_slice(&master[range.start + own.start..range.start + own.end]);
            }
            master = Vec::new();
            blocks.iter_mut().for_each(|b| *b = None);
        }
        Ok(Trainer {
            device,
            desc,
            blocks,
            offsets,
            chunk_starts: chunks.iter().map(|c| c.0).collect(),
            optimizer: FlatOptimizer::new(program.optimizer, state_len),
            master,
            spare_buffers: Vec::new(),
            samples,
            global_batch: program.plan.batch,
            checkpoint: program.plan.checkpoint_activations,
            batches: HashMap::new(),
            segments: HashMap::new(),
            by_name: HashMap::new(),
            losses: HashMap::new(),
            loss_sum: None,
            upstream: HashMap::new(),
            pending_weights: HashMap::new(),
            grad_ranges: HashMap::new(),
            param_ranges: HashMap::new(),
            grads_started: HashSet::new(),
            peak_grad_bytes: 0,
            optimizer_grad_bytes: 0,
            live: HashMap::new(),
            peak_live: 0,
            sharding,
            shard_master,
            held_blocks,
            builder,
            seed: program.seed,
            actor,
        })
    }

    /// Flat parameters of block `index` (empty when this actor does not hold it).
    pub fn block_params(&self, index: usize) -> &[f32] {
        &self.master[self.offsets[index]..self.offsets[index + 1]]
    }

    fn block(&self, index: usize) -> Result<&dyn Block<B>, String> {
        self.blocks[index]
            .as_deref()
            .ok_or_else(|| format!("block {index} is not held by this actor"))
    }

    fn chunk_of(&self, block: usize) -> usize {
        self.chunk_starts
            .iter()
            .copied()
            .filter(|&s| s <= block)
            .max()
            .unwrap_or(0)
    }

    fn load_batch(&mut self, step: u64, rows: Range<usize>, name: &str) {
        let n = rows.len();
        let batch = match &self.samples {
            Samples::Clusters(pool) => {
                let b = pool.batch(step, self.global_batch, rows);
                let features = b.x.len() / n.max(1);
                let x = Tensor::<B, 2>::from_data(TensorData::new(b.x, [n, features]), &self.device);
                let labels: Vec<i32> = b.labels.iter().map(|&l| l as i32).collect();
                Batch {
                    input: Activation::Rows(x),
                    targets: Tensor::from_data(TensorData::new(labels, [n]), &self.device),
                }
            }
            Samples::Tokens(stream) => {
                let InputKind::Tokens { ctx, .. } = self.desc.input else {
                    unreachable!("checked at build")
                };
                let b = stream.batch(step, self.global_batch, ctx, rows);
                let ids: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
                let targets: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
                Batch {
                    input: Activation::Tokens(Tensor::from_data(
                        TensorData::new(ids, [n, ctx]),
                        &self.device,
                    )),
                    targets: Tensor::from_data(TensorData::new(targets, [n * ctx]), &self.device),
                }
            }
        };
        self.batches.insert(name.to_string(), batch);
    }

    /// A received tensor from the table as an activation.
    fn import(&self, name: &str, table: &mut TensorTable) -> Result<Activation<B>, String> {
        let t = table
            .remove(name)
            .ok_or_else(|| format!("`{name}` was neither produced here nor received"))?;
        match t.shape.len() {
            2 => Ok(Activation::Rows(to_burn::<B, 2>(&t, &self.device))),
            3 => Ok(Activation::Seq(to_burn::<B, 3>(&t, &self.device))),
            r => Err(format!("`{name}` has rank {r}; activations have rank 2 or 3")),
        }
    }

    /// Runs `blocks` on `x`, each on a fresh copy (see [`Block::fresh_copy`]); returns the
    /// output and the copies.
    fn run_blocks(
        &self,
        blocks: Range<usize>,
        x: Activation<B>,
    ) -> Result<(Activation<B>, BlockCopies<B>), String> {
        let mut y = x;
        let mut copies = Vec::with_capacity(blocks.len());
        for index in blocks {
            let copy = self.block(index)?.fresh_copy();
            y = copy.forward(y);
            copies.push(copy);
        }
        Ok((y, copies))
    }

    fn forward(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        input: &str,
        output: &str,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let x = if let Some(batch) = self.batches.get(input) {
            batch.input.clone()
        } else if let Some(key) = self.by_name.get(input) {
            self.segments[key].output.leaf()
        } else {
            self.import(input, table)?.leaf()
        };
        let (y, copies) = self.run_blocks(blocks.clone(), x.clone())?;
        let (kept, copies) = if self.checkpoint {
            (y.detach(), Vec::new())
        } else {
            (y, copies)
        };
        let key = (blocks.start, mb);
        self.segments.insert(
            key,
            Segment {
                input: x,
                output: kept,
                checkpointed: self.checkpoint,
                copies,
                batch: None,
            },
        );
        self.by_name.insert(output.to_string(), key);
        let chunk = (self.chunk_of(blocks.start), mb);
        *self.live.entry(chunk).or_default() += 1;
        self.peak_live = self.peak_live.max(self.live.len());
        Ok(())
    }

    fn loss_of(&self, output: &Activation<B>, batch: &str) -> Result<Tensor<B, 1>, String> {
        let logits = match output {
            Activation::Rows(l) => l.clone(),
            Activation::Seq(l) => {
                let [b, t, v] = l.dims();
                l.clone().reshape([b * t, v])
            }
            Activation::Tokens(_) => return Err("the model's last block must output logits".into()),
        };
        let targets = self
            .batches
            .get(batch)
            .ok_or_else(|| format!("batch `{batch}` is not loaded"))?
            .targets
            .clone();
        let [n, _] = logits.dims();
        let per_global_sample = 1.0 / (self.global_batch * self.desc.input.tokens_per_sample()) as f32;
        let picked = log_softmax(logits, 1).gather(1, targets.reshape([n, 1]));
        Ok(picked.sum().neg().mul_scalar(per_global_sample))
    }

    fn compute_loss(&mut self, logits: &str, batch: &str, loss: &str) -> Result<(), String> {
        let key = *self
            .by_name
            .get(logits)
            .ok_or_else(|| format!("no segment produced `{logits}`"))?;
        let value = self.loss_of(&self.segments[&key].output, batch)?;
        let scalar = value.into_scalar().elem::<f32>();
        *self.loss_sum.get_or_insert(0.0) += scalar;
        self.segments.get_mut(&key).expect("segment").batch = Some(batch.to_string());
        self.losses.insert(loss.to_string(), key);
        Ok(())
    }

    /// Runs the backward of segment `(start, mb)` from `upstream`; returns burn's gradients and
    /// the segment (for its input's gradient).
    fn backward_pass(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        upstream: &str,
        table: &mut TensorTable,
    ) -> Result<(B::Gradients, Segment<B>), String> {
        let mut segment = self
            .segments
            .remove(&(blocks.start, mb))
            .ok_or("backward of a segment that did not run forward")?;
        if segment.checkpointed {
            (segment.output, segment.copies) = self.run_blocks(blocks.clone(), segment.input.clone())?;
        }
        let grads = if let Some(key) = self.losses.remove(upstream) {
            if key != (blocks.start, mb) {
                return Err(format!("`{upstream}` is not the loss of this segment"));
            }
            let batch = segment.batch.clone().ok_or("no loss computed for this segment")?;
            self.loss_of(&segment.output, &batch)?.backward()
        } else {
            let g = match self.upstream.remove(upstream) {
                Some(g) => g,
                None => self.import(upstream, table)?,
            };
            segment.output.dot(&g).backward()
        };
        Ok((grads, segment))
    }

    /// Moves the segment's weight gradients into its bucket `grad_name`, adding to what earlier
    /// micro-batches left there this step.
    fn accumulate(
        &mut self,
        blocks: Range<usize>,
        copies: &[Box<dyn Block<B>>],
        grads: &mut B::Gradients,
        grad_name: &str,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let range = self.offsets[blocks.start]..self.offsets[blocks.end];
        let first = self.grads_started.insert(grad_name.to_string());
        let mut flat = if first {
            match self.spare_buffers.iter().position(|b| b.len() == range.len()) {
                Some(i) => self.spare_buffers.swap_remove(i),
                None => vec![0.0f32; range.len()],
            }
        } else {
            table
                .remove(grad_name)
                .ok_or_else(|| format!("gradient bucket `{grad_name}` left the actor mid-step"))?
                .into_vec()
        };
        for (index, copy) in blocks.clone().zip(copies) {
            let at = self.offsets[index] - range.start..self.offsets[index + 1] - range.start;
            copy.take_grads(grads, &mut flat[at], !first);
        }
        table.insert(grad_name.to_string(), HostTensor::flat(flat));
        let held: u64 = self
            .grad_ranges
            .keys()
            .chain(std::iter::once(&grad_name.to_string()))
            .collect::<HashSet<_>>()
            .into_iter()
            .filter_map(|n| table.get(n).map(HostTensor::bytes))
            .sum();
        let spare: u64 = self.spare_buffers.iter().map(|b| 4 * b.len() as u64).sum();
        self.peak_grad_bytes = self.peak_grad_bytes.max(held + spare);
        self.grad_ranges.insert(grad_name.to_string(), blocks);
        Ok(())
    }

    fn release(&mut self, start: usize, mb: usize) {
        let key = (self.chunk_of(start), mb);
        if let Some(n) = self.live.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&key);
            }
        }
    }

    fn backward(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        upstream: &str,
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, segment) = self.backward_pass(blocks.clone(), mb, upstream, table)?;
        let grad_name = outputs.first().ok_or("backward names no gradient output")?;
        self.accumulate(blocks.clone(), &segment.copies, &mut grads, grad_name, table)?;
        self.keep_input_grad(&segment, &mut grads, outputs.get(1))?;
        self.release(blocks.start, mb);
        Ok(())
    }

    /// Keeps the gradient of the segment's input under `name` (for the segment before, or to be
    /// sent to the stage before); the first segment of the model has none.
    fn keep_input_grad(
        &mut self,
        segment: &Segment<B>,
        grads: &mut B::Gradients,
        name: Option<&String>,
    ) -> Result<(), String> {
        if let Some(name) = name {
            let g = segment
                .input
                .take_grad(grads)
                .ok_or("the segment input has no gradient")?;
            self.upstream.insert(name.clone(), g);
        }
        Ok(())
    }

    fn backward_input(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        upstream: &str,
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, segment) = self.backward_pass(blocks.clone(), mb, upstream, table)?;
        self.keep_input_grad(&segment, &mut grads, outputs.first())?;
        self.pending_weights
            .insert((blocks.start, mb), (grads, segment.copies));
        Ok(())
    }

    fn backward_weight(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, copies) = self
            .pending_weights
            .remove(&(blocks.start, mb))
            .ok_or("BackwardWeight before its BackwardInput")?;
        let grad_name = outputs.first().ok_or("BackwardWeight names no gradient output")?;
        self.accumulate(blocks.clone(), &copies, &mut grads, grad_name, table)?;
        self.release(blocks.start, mb);
        Ok(())
    }

    fn optimizer_step(
        &mut self,
        inputs: &[String],
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        self.optimizer.begin_step();
        for (k, name) in inputs.iter().enumerate() {
            let grad = table
                .remove(name)
                .ok_or_else(|| format!("gradient `{name}` missing"))?;
            let blocks = self
                .grad_ranges
                .remove(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
            let range = self.offsets[blocks.start]..self.offsets[blocks.end];
            if self.sharding.zero == 0 {
                self.optimizer
                    .update(range.start, &mut self.master[range.clone()], &grad.data);
                self.reload(blocks.clone())?;
            } else {
                // ZeRO: update only this replica's shard; the all-gather brings the others.
                let Sharding { rank, members, .. } = self.sharding;
                let shard = shard_range(range.len(), members, rank);
                let own = range.start + shard.start..range.start + shard.end;
                let grads = if grad.len() == range.len() {
                    &grad.data[shard.clone()]
                } else if grad.len() == shard.len() {
                    &grad.data[..]
                } else {
                    return Err(format!(
                        "gradient `{name}` has {} values; expected the bucket ({}) or this replica's shard ({})",
                        grad.len(),
                        range.len(),
                        shard.len()
                    ));
                };
                let state = self.sharding.state_offsets[&blocks.start];
                if self.sharding.zero >= 3 {
                    // The master copy is the shard itself; it stays sharded until the next gather.
                    let at = state..state + shard.len();
                    self.optimizer.update(state, &mut self.shard_master[at], grads);
                    self.optimizer_grad_bytes += grad.bytes();
                    continue;
                }
                self.optimizer.update(state, &mut self.master[own.clone()], grads);
                let mut gathered = vec![0.0f32; range.len()];
                gathered[shard].copy_from_slice(&self.master[own]);
                let out = outputs
                    .get(k)
                    .ok_or_else(|| format!("the sharded optimizer step names no output for `{name}`"))?;
                table.insert(out.clone(), HostTensor::flat(gathered));
                self.param_ranges.insert(out.clone(), blocks);
            }
            self.optimizer_grad_bytes += grad.bytes();
            if grad.len() == range.len() {
                // Whole buckets are reused by the next backward; ZeRO-2 shards are not.
                self.spare_buffers.push(grad.into_vec());
            }
        }
        Ok(())
    }

    /// ZeRO-3: this replica's shard of segment `blocks` in a buffer of the segment's length.
    fn shard_params(
        &mut self,
        blocks: Range<usize>,
        output: &str,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let len = self.offsets[blocks.end] - self.offsets[blocks.start];
        let Sharding { rank, members, .. } = self.sharding;
        let own = shard_range(len, members, rank);
        let state = *self.sharding.state_offsets.get(&blocks.start).ok_or_else(|| {
            format!(
                "blocks {}..{} are not a segment of this actor",
                blocks.start, blocks.end
            )
        })?;
        let mut full = vec![0.0f32; len];
        full[own.clone()].copy_from_slice(&self.shard_master[state..state + own.len()]);
        table.insert(output.to_string(), HostTensor::flat(full));
        Ok(())
    }

    /// ZeRO-3: builds the modules of `blocks` from their gathered parameters.
    fn materialize(&mut self, blocks: Range<usize>, params: &[f32]) -> Result<(), String> {
        let base = self.offsets[blocks.start];
        for index in blocks {
            if !self.held_blocks[index] {
                return Err(format!("block {index} is not held by this actor"));
            }
            let ctx = BuildContext {
                seed: self.seed,
                actor: self.actor,
                block: index,
            };
            let block = self.builder.build_block(&ctx, &self.device);
            let at = self.offsets[index] - base..self.offsets[index + 1] - base;
            self.blocks[index] = Some(block.load_params(&params[at]));
        }
        Ok(())
    }

    /// Copies gathered parameters into the master copy and the modules.
    fn load_params(&mut self, name: &str, table: &mut TensorTable) -> Result<(), String> {
        let params = table
            .remove(name)
            .ok_or_else(|| format!("gathered parameters `{name}` missing"))?;
        let blocks = self
            .param_ranges
            .remove(name)
            .ok_or_else(|| format!("`{name}` is not a parameter bucket"))?;
        let range = self.offsets[blocks.start]..self.offsets[blocks.end];
        if params.len() != range.len() {
            return Err(format!(
                "`{name}` has {} values, the blocks {}",
                params.len(),
                range.len()
            ));
        }
        self.master[range].copy_from_slice(&params.data);
        self.reload(blocks)
    }

    /// Loads the master parameters of `blocks` into their modules.
    fn reload(&mut self, blocks: Range<usize>) -> Result<(), String> {
        for index in blocks {
            let block = self.blocks[index]
                .take()
                .ok_or_else(|| format!("block {index} is not held by this actor"))?;
            let params = &self.master[self.offsets[index]..self.offsets[index + 1]];
            self.blocks[index] = Some(block.load_params(params));
        }
        Ok(())
    }
}

fn samples(data: &DataSpec, input: InputKind) -> Result<Samples, String> {
    Ok(match (data, input) {
        (DataSpec::Clusters { seed }, InputKind::Dense { features, classes }) => {
            Samples::Clusters(ClusterPool::new(*seed, features, classes))
        }
        (DataSpec::SyntheticBytes { seed }, InputKind::Tokens { .. }) => {
            Samples::Tokens(TokenStream::synthetic(*seed))
        }
        (DataSpec::TextFile { path }, InputKind::Tokens { ctx, vocab }) => {
            let bytes = std::fs::read(path).map_err(|e| format!("cannot read --data {path}: {e}"))?;
            if vocab < 256 {
                return Err(format!(
                    "--data trains on bytes: the model needs vocab=256, not {vocab}"
                ));
            }
            if bytes.len() <= ctx + 1 {
                return Err(format!(
                    "--data {path} has {} bytes; it needs more than ctx+1 = {}",
                    bytes.len(),
                    ctx + 1
                ));
            }
            Samples::Tokens(TokenStream::from_bytes(bytes))
        }
        (data, input) => return Err(format!("data {data:?} does not fit a model that takes {input:?}")),
    })
}

fn to_host<B: AutodiffBackend>(a: &Activation<B>) -> Result<HostTensor, String> {
    match a {
        Activation::Rows(t) => Ok(from_burn(t.clone().detach())),
        Activation::Seq(t) => Ok(from_burn(t.clone().detach())),
        Activation::Tokens(_) => Err("token ids do not cross stages; the first chunk loads them".into()),
    }
}

impl<B: AutodiffBackend> Computation for Trainer<B> {
    fn compute(
        &mut self,
        step: u64,
        op: &ComputeOp,
        inputs: &[String],
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let nth = |names: &[String], i: usize| {
            names
                .get(i)
                .cloned()
                .ok_or_else(|| format!("{op} names too few tensors"))
        };
        match op {
            ComputeOp::LoadBatch { start, end } => {
                self.load_batch(step, *start..*end, &nth(outputs, 0)?);
                Ok(())
            }
            ComputeOp::Forward { start, end, mb } => {
                self.forward(*start..*end, *mb, &nth(inputs, 0)?, &nth(outputs, 0)?, table)
            }
            ComputeOp::Loss { .. } => {
                self.compute_loss(&nth(inputs, 0)?, &nth(inputs, 1)?, &nth(outputs, 0)?)
            }
            ComputeOp::Backward { start, end, mb } => {
                self.backward(*start..*end, *mb, &nth(inputs, 0)?, outputs, table)
            }
            ComputeOp::BackwardInput { start, end, mb } => {
                self.backward_input(*start..*end, *mb, &nth(inputs, 0)?, outputs, table)
            }
            ComputeOp::BackwardWeight { start, end, mb } => {
                self.backward_weight(*start..*end, *mb, outputs, table)
            }
            ComputeOp::OptimizerStep { .. } => self.optimizer_step(inputs, outputs, table),
            ComputeOp::LoadParams { start, end } if self.sharding.zero >= 3 => {
                let name = nth(inputs, 0)?;
                let params = table
                    .remove(&name)
                    .ok_or_else(|| format!("gathered parameters `{name}` missing"))?;
                self.materialize(*start..*end, &params.data)
            }
            ComputeOp::LoadParams { .. } => self.load_params(&nth(inputs, 0)?, table),
            ComputeOp::ShardParams { start, end } => {
                self.shard_params(*start..*end, &nth(outputs, 0)?, table)
            }
            ComputeOp::DropParams { start, end } => {
                (*start..*end).for_each(|i| self.blocks[i] = None);
                Ok(())
            }
            ComputeOp::User { name } => Err(format!("a training actor has no user function `{name}`")),
            ComputeOp::Output { key } => Err(format!("a training actor does not output `{key}`")),
        }
    }

    fn export(&mut self, name: &str) -> Option<Result<HostTensor, String>> {
        if let Some(key) = self.by_name.get(name) {
            return Some(to_host(&self.segments.get(key)?.output));
        }
        self.upstream.remove(name).map(|g| to_host(&g))
    }

    fn finish_step(&mut self) -> StepMetrics {
        self.batches.clear();
        self.segments.clear();
        self.by_name.clear();
        self.losses.clear();
        self.upstream.clear();
        self.pending_weights.clear();
        self.grads_started.clear();
        self.live.clear();
        let params = 4 * (self.master.len() + self.shard_master.len()) as u64;
        let state = params + self.optimizer.state_bytes();
        let materialized: usize = (0..self.blocks.len())
            .filter(|&i| self.blocks[i].is_some())
            .map(|i| self.offsets[i + 1] - self.offsets[i])
            .sum();
        // The gradients the optimizer step consumed: whole buckets, or shards under ZeRO-2.
        let held_grads = std::mem::take(&mut self.optimizer_grad_bytes);
        let metrics = StepMetrics {
            loss: self.loss_sum.take(),
            model_state_bytes: state + held_grads,
            peak_model_state_bytes: state + self.peak_grad_bytes.max(held_grads),
            compute_weight_bytes: 4 * materialized as u64,
            peak_microbatches_held: self.peak_live,
        };
        self.peak_grad_bytes = 0;
        self.peak_live = 0;
        metrics
    }

    fn block_params(&self) -> Vec<(usize, Vec<f32>)> {
        if self.sharding.zero >= 3 {
            return Vec::new(); // only shards here; see block_squares
        }
        (0..self.blocks.len())
            .filter(|&i| self.held_blocks[i])
            .map(|i| (i, Trainer::block_params(self, i).to_vec()))
            .collect()
    }

    fn block_squares(&self) -> Vec<(usize, f64)> {
        let sq = |v: &[f32]| v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        if self.sharding.zero < 3 {
            // Every replica holds every parameter: the first one answers for the group.
            if self.sharding.rank != 0 {
                return Vec::new();
            }
            return (0..self.blocks.len())
                .filter(|&i| self.held_blocks[i])
                .map(|i| (i, sq(Trainer::block_params(self, i))))
                .collect();
        }
        // ZeRO-3: the squares of this replica's shard, split by block.
        let mut out: HashMap<usize, f64> = HashMap::new();
        let Sharding { rank, members, .. } = self.sharding;
        for (&start, &state) in &self.sharding.state_offsets {
            let end = (start..self.held_blocks.len())
                .find(|&e| {
                    e + 1 == self.held_blocks.len()
                        || !self.held_blocks[e + 1]
                        || self.sharding.state_offsets.contains_key(&(e + 1))
                })
                .map_or(start + 1, |e| e + 1);
            let base = self.offsets[start];
            let own = shard_range(self.offsets[end] - base, members, rank);
            for (k, &x) in self.shard_master[state..state + own.len()].iter().enumerate() {
                let flat = base + own.start + k;
                let block = (start..end)
                    .find(|&b| flat < self.offsets[b + 1])
                    .unwrap_or(start);
                *out.entry(block).or_default() += (x as f64) * (x as f64);
            }
        }
        out.into_iter().collect()
    }
}
