//! Training on burn: the compute half of an actor's training stream.
//!
//! Forward runs segment by segment; each segment's input is a fresh autodiff leaf, so the backward
//! of a segment is its own small graph: the last segment starts from the loss, every other one
//! from `sum(y ⊙ g)` with the upstream gradient `g` (exact: the vector–Jacobian product). A
//! segment's parameter gradients leave burn as one flat bucket as soon as its backward is done,
//! so the bucket's all-reduce overlaps the backward of the segments before it. The optimizer runs
//! on flat slices and writes the parameters back into the modules.

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use archipelago_dataflow::data::{ClusterPool, DataSpec, TokenStream};
use archipelago_dataflow::{ActorId, ComputeOp, InputKind, ModelDesc, Program};

use crate::block::{Activation, Block, deterministic_init};
use crate::executor::{Computation, StepMetrics, TensorTable};
use crate::flat_optimizer::FlatOptimizer;
use crate::host_tensor::HostTensor;
use crate::zoo::{BuildContext, ModelBuilder};

enum Samples {
    Clusters(ClusterPool),
    Tokens(TokenStream),
}

struct Batch<B: AutodiffBackend> {
    input: Activation<B>,
    targets: Tensor<B, 1, Int>,
}

struct Segment<B: AutodiffBackend> {
    input: Activation<B>,
    output: Activation<B>,
}

/// One actor's model, optimizer state and in-flight step.
pub struct Trainer<B: AutodiffBackend> {
    device: B::Device,
    desc: ModelDesc,
    blocks: Vec<Option<Box<dyn Block<B>>>>,
    offsets: Vec<usize>,
    /// f32 master parameters, flat in block order; the modules hold the compute copy.
    master: Vec<f32>,
    optimizer: FlatOptimizer,
    /// Gradient bucket buffers kept from the last step (no fresh allocation per step).
    spare_buffers: Vec<Vec<f32>>,
    samples: Samples,
    global_batch: usize,
    batch: Option<Batch<B>>,
    segments: HashMap<usize, Segment<B>>,
    by_name: HashMap<String, usize>,
    loss: Option<Tensor<B, 1>>,
    loss_value: Option<f32>,
    upstream: HashMap<String, Activation<B>>,
    grad_ranges: HashMap<String, Range<usize>>,
    peak_grad_bytes: u64,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Builds every block of `program`'s model on `device` for `actor`, initialised from
    /// `(seed, block index)`, and the data source.
    pub fn new(
        program: &Program,
        builder: &dyn ModelBuilder<B>,
        actor: ActorId,
        device: B::Device,
    ) -> Result<Trainer<B>, String> {
        let desc = program.model.clone();
        let mut blocks = Vec::with_capacity(desc.blocks.len());
        let mut offsets = vec![0];
        let mut master = Vec::with_capacity(desc.params() as usize);
        for (index, info) in desc.blocks.iter().enumerate() {
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
        let samples = match (&program.data, desc.input) {
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
        };
        let total = *offsets.last().expect("offsets");
        Ok(Trainer {
            device,
            desc,
            blocks,
            offsets,
            master,
            optimizer: FlatOptimizer::new(program.optimizer, total),
            spare_buffers: Vec::new(),
            samples,
            global_batch: program.plan.batch,
            batch: None,
            segments: HashMap::new(),
            by_name: HashMap::new(),
            loss: None,
            loss_value: None,
            upstream: HashMap::new(),
            grad_ranges: HashMap::new(),
            peak_grad_bytes: 0,
        })
    }

    /// Flat parameters of block `index`.
    pub fn block_params(&self, index: usize) -> &[f32] {
        &self.master[self.offsets[index]..self.offsets[index + 1]]
    }

    fn block(&self, index: usize) -> &dyn Block<B> {
        self.blocks[index].as_deref().expect("block present")
    }

    fn load_batch(&mut self, step: u64, rows: Range<usize>) {
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
        self.batch = Some(batch);
    }

    fn forward(&mut self, blocks: Range<usize>, input: &str, output: &str) -> Result<(), String> {
        let x = if input == "batch" {
            self.batch.as_ref().ok_or("no batch loaded")?.input.clone()
        } else {
            let producer = self
                .by_name
                .get(input)
                .ok_or_else(|| format!("no segment produced `{input}`"))?;
            self.segments[producer].output.leaf()
        };
        let mut y = x.clone();
        for index in blocks.clone() {
            y = self.block(index).forward(y);
        }
        self.segments
            .insert(blocks.start, Segment { input: x, output: y });
        self.by_name.insert(output.to_string(), blocks.start);
        Ok(())
    }

    fn compute_loss(&mut self, logits_name: &str) -> Result<(), String> {
        let producer = self
            .by_name
            .get(logits_name)
            .ok_or_else(|| format!("no segment produced `{logits_name}`"))?;
        let logits = match &self.segments[producer].output {
            Activation::Rows(l) => l.clone(),
            Activation::Seq(l) => {
                let [b, t, v] = l.dims();
                l.clone().reshape([b * t, v])
            }
            Activation::Tokens(_) => return Err("the model's last block must output logits".into()),
        };
        let targets = self.batch.as_ref().ok_or("no batch loaded")?.targets.clone();
        let [n, _] = logits.dims();
        let per_global_sample = 1.0 / (self.global_batch * self.desc.input.tokens_per_sample()) as f32;
        let picked = log_softmax(logits, 1).gather(1, targets.reshape([n, 1]));
        let loss = picked.sum().neg().mul_scalar(per_global_sample);
        self.loss_value = Some(loss.clone().into_scalar().elem::<f32>());
        self.loss = Some(loss);
        Ok(())
    }

    fn backward(
        &mut self,
        blocks: Range<usize>,
        upstream: &str,
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let segment = self
            .segments
            .remove(&blocks.start)
            .ok_or("backward of a segment that did not run forward")?;
        let mut grads = if upstream == "loss" {
            self.loss.take().ok_or("no loss to backpropagate")?.backward()
        } else {
            let g = self
                .upstream
                .remove(upstream)
                .ok_or_else(|| format!("no upstream gradient `{upstream}`"))?;
            segment.output.dot(&g).backward()
        };
        let range = self.offsets[blocks.start]..self.offsets[blocks.end];
        let mut flat = match self.spare_buffers.iter().position(|b| b.len() == range.len()) {
            Some(i) => self.spare_buffers.swap_remove(i),
            None => vec![0.0f32; range.len()],
        };
        for index in blocks.clone() {
            let at = self.offsets[index] - range.start..self.offsets[index + 1] - range.start;
            self.block(index).take_grads(&mut grads, &mut flat[at]);
        }
        let grad_name = outputs.first().ok_or("backward names no gradient output")?;
        table.insert(grad_name.clone(), HostTensor::flat(flat));
        let spare: u64 = self.spare_buffers.iter().map(|b| 4 * b.len() as u64).sum();
        self.peak_grad_bytes = self.peak_grad_bytes.max(table.bytes() + spare);
        self.grad_ranges.insert(grad_name.clone(), blocks);
        if let Some(input_grad) = outputs.get(1) {
            let g = segment
                .input
                .take_grad(&mut grads)
                .ok_or("the segment input has no gradient")?;
            self.upstream.insert(input_grad.clone(), g);
        }
        Ok(())
    }

    fn optimizer_step(&mut self, inputs: &[String], table: &mut TensorTable) -> Result<(), String> {
        self.optimizer.begin_step();
        for name in inputs {
            let grad = table
                .remove(name)
                .ok_or_else(|| format!("gradient `{name}` missing"))?;
            let blocks = self
                .grad_ranges
                .remove(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
            let range = self.offsets[blocks.start]..self.offsets[blocks.end];
            self.optimizer
                .update(range.start, &mut self.master[range.clone()], &grad.data);
            for index in blocks {
                let block = self.blocks[index].take().expect("block present");
                let params = &self.master[self.offsets[index]..self.offsets[index + 1]];
                self.blocks[index] = Some(block.load_params(params));
            }
            self.spare_buffers.push(grad.into_vec());
        }
        Ok(())
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
        let first = |names: &[String]| {
            names
                .first()
                .cloned()
                .ok_or_else(|| format!("{op} names no tensor"))
        };
        match op {
            ComputeOp::LoadBatch { start, end } => {
                self.load_batch(step, *start..*end);
                Ok(())
            }
            ComputeOp::Forward { start, end, .. } => {
                self.forward(*start..*end, &first(inputs)?, &first(outputs)?)
            }
            ComputeOp::Loss { .. } => self.compute_loss(&first(inputs)?),
            ComputeOp::Backward { start, end, .. } => {
                self.backward(*start..*end, &first(inputs)?, outputs, table)
            }
            ComputeOp::OptimizerStep { .. } => self.optimizer_step(inputs, table),
            ComputeOp::User { name } => Err(format!("a training actor has no user function `{name}`")),
            ComputeOp::Output { key } => Err(format!("a training actor does not output `{key}`")),
        }
    }

    fn finish_step(&mut self) -> StepMetrics {
        self.batch = None;
        self.segments.clear();
        self.by_name.clear();
        let params = 4 * self.master.len() as u64;
        let state = params + self.optimizer.state_bytes();
        let held_grads: u64 = self.spare_buffers.iter().map(|b| 4 * b.len() as u64).sum();
        let metrics = StepMetrics {
            loss: self.loss_value.take(),
            model_state_bytes: state + held_grads,
            peak_model_state_bytes: state + self.peak_grad_bytes.max(held_grads),
            compute_weight_bytes: params,
        };
        self.peak_grad_bytes = 0;
        metrics
    }

    fn block_params(&self) -> Vec<Vec<f32>> {
        (0..self.blocks.len())
            .map(|i| Trainer::block_params(self, i).to_vec())
            .collect()
    }
}
