//! A worker of a dense model on the parameter server (Li et al., OSDI 2014): any model of the
//! zoo (an mlp on the cluster pool, a gpt on synthetic bytes or a text file), built on the
//! worker's own device thread and initialised as the library's trainer initialises it. Its flat
//! parameters are cut into keys of `width` values ([`DenseLayout`]: key `k` holds elements
//! `k·width ..`, the last key padded with zeros that no gradient touches), spread over the
//! servers by the ring. Each clock it pulls every key, loads the values, runs forward and
//! backward on its rows of the clock's global batch and pushes every key's gradient.
//!
//! Worker `r`'s loss is the sum over its rows of `−log p(target)` divided by the global batch
//! (times the tokens per sample for a gpt), as the trainer scales a data-parallel replica's
//! loss; clock `c` trains on the trainer's step `c + 1`, worker `r` on rows `r·B .. (r+1)·B`, as
//! data-parallel rank `r` does. So at `K = 0` with plain SGD a job is synchronous data
//! parallelism, step for step.

use burn::backend::flex::FlexDevice;
use burn::tensor::activation::log_softmax;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use archipelago_dataflow::data::{ClusterPool, DataSpec, TokenStream};
use archipelago_dataflow::{InputKind, ModelSpec};

use super::client::{ClientFigures, PsClient};
use super::update::ServerUpdate;
use super::worker::{LoopSettings, SeedModel, Train, WorkerRun, WorkerStep};
use crate::CpuBackend;
use crate::block::{Activation, Block, check_described, describe_shapes, initial_params, read_flat};
use crate::runtime::{Actor, Context, Handler};
use crate::zoo::{BuildContext, ModelBuilder, ZooModel};

/// A dense model's flat parameters as keys of `width` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseLayout {
    /// Parameters of the model.
    pub params: usize,
    /// Values per key.
    pub width: usize,
}

impl DenseLayout {
    /// Keys of the model (`⌈params / width⌉`).
    pub fn keys(&self) -> usize {
        self.params.div_ceil(self.width)
    }

    /// Every key, in order.
    pub fn key_list(&self) -> Vec<u64> {
        (0..self.keys() as u64).collect()
    }

    /// The flat parameters padded to whole keys.
    pub fn pad(&self, flat: &[f32]) -> Vec<f32> {
        let mut padded = flat.to_vec();
        padded.resize(self.keys() * self.width, 0.0);
        padded
    }
}

/// What a dense worker is built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenseWorkerParams {
    /// The zoo model.
    pub model: ModelSpec,
    /// Its data (the trainer's data specs).
    pub data: DataSpec,
    /// Seed of the initial parameters (as `Program::with_seed`).
    pub seed: u64,
    /// Values per key.
    pub width: usize,
    /// Its loop.
    pub settings: LoopSettings,
}

/// A model's blocks on this thread's CPU device.
pub type CpuBlocks = Vec<Box<dyn Block<CpuBackend>>>;

/// The model's blocks built on this thread's device, initialised as the trainer initialises
/// them (each parameter drawn from `(seed, name)`), and their flat parameters (block after block).
pub fn build_model(spec: &ModelSpec, seed: u64) -> Result<(CpuBlocks, Vec<f32>), String> {
    let builder = ZooModel(spec.clone());
    let desc = spec.desc();
    let mut blocks = Vec::new();
    let mut flat = Vec::new();
    for (index, info) in desc.blocks.iter().enumerate() {
        let ctx = BuildContext {
            seed,
            actor: 0,
            block: index,
            tp: Default::default(),
            sequence_parallel: false,
        };
        let block = ModelBuilder::<CpuBackend>::build_block(&builder, &ctx, &FlexDevice);
        let shapes = block.param_shapes();
        let described = if info.param_descs.is_empty() {
            describe_shapes(&info.name, &shapes)
        } else {
            check_described(&info.name, &info.param_descs, &shapes)?;
            info.param_descs.clone()
        };
        let init = initial_params(&described, seed);
        flat.extend_from_slice(&init);
        blocks.push(block.load_params(&init, false));
    }
    Ok((blocks, flat))
}

/// The samples of `data` for a model taking `input`.
enum Samples {
    Clusters(ClusterPool),
    Tokens(TokenStream, usize),
}

fn samples(data: &DataSpec, input: InputKind) -> Result<Samples, String> {
    Ok(match (data, input) {
        (DataSpec::Clusters { seed }, InputKind::Dense { features, classes }) => {
            Samples::Clusters(ClusterPool::new(*seed, features, classes))
        }
        (DataSpec::SyntheticBytes { seed }, InputKind::Tokens { vocab, ctx }) => {
            Samples::Tokens(TokenStream::synthetic(*seed, vocab), ctx)
        }
        (DataSpec::TextFile { path, tokenizer }, InputKind::Tokens { ctx, vocab }) => Samples::Tokens(
            crate::text_tokens::text_stream(path, tokenizer.as_deref(), ctx, vocab)?,
            ctx,
        ),
        (DataSpec::TensorFile { path }, _) => {
            return Err(format!(
                "the parameter server's dense workers read the synthetic data and text files, not tensor files yet ({path})"
            ));
        }
        (data, input) => return Err(format!("data {data:?} does not fit a model that takes {input:?}")),
    })
}

/// A worker training a dense zoo model.
pub struct DenseWorker<U: ServerUpdate> {
    params: DenseWorkerParams,
    layout: DenseLayout,
    blocks: CpuBlocks,
    initial: Vec<f32>,
    samples: Samples,
    tokens_per_sample: usize,
    _rule: std::marker::PhantomData<fn() -> U>,
}

impl<U: ServerUpdate> Actor for DenseWorker<U> {
    type Params = DenseWorkerParams;

    async fn new(params: DenseWorkerParams, _ctx: &Context<Self>) -> Result<Self, String> {
        if params.width == 0 || params.settings.local_batch == 0 {
            return Err("a dense worker needs keys of at least one value and at least one row".into());
        }
        let desc = params.model.desc();
        let samples = samples(&params.data, desc.input)?;
        let (blocks, initial) = build_model(&params.model, params.seed)?;
        Ok(DenseWorker {
            layout: DenseLayout {
                params: initial.len(),
                width: params.width,
            },
            tokens_per_sample: desc.input.tokens_per_sample(),
            blocks,
            initial,
            samples,
            params,
            _rule: std::marker::PhantomData,
        })
    }
}

impl<U: ServerUpdate> DenseWorker<U> {
    /// The input and targets of this worker's rows of `clock`.
    fn batch(&self, clock: u64) -> (Activation<CpuBackend>, Tensor<CpuBackend, 1, Int>) {
        let s = &self.params.settings;
        let (global, rows) = (s.global_batch(), s.local_batch);
        let range = s.rank * rows..(s.rank + 1) * rows;
        let step = clock + 1;
        match &self.samples {
            Samples::Clusters(pool) => {
                let b = pool.batch(step, global, range);
                let features = b.x.len() / rows;
                let x = Tensor::from_data(TensorData::new(b.x, [rows, features]), &FlexDevice);
                let labels: Vec<i32> = b.labels.iter().map(|&l| l as i32).collect();
                let targets = Tensor::from_data(TensorData::new(labels, [rows]), &FlexDevice);
                (Activation::Rows(x), targets)
            }
            Samples::Tokens(stream, ctx) => {
                let b = stream.batch(step, global, *ctx, range);
                let ids: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
                let targets: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
                let input = Tensor::from_data(TensorData::new(ids, [rows, *ctx]), &FlexDevice);
                let targets = Tensor::from_data(TensorData::new(targets, [rows * ctx]), &FlexDevice);
                (Activation::Tokens(input), targets)
            }
        }
    }

    /// Loads `params` (padded to whole keys), runs forward and backward on this worker's rows of
    /// `clock`; returns its share of the global loss and its padded flat gradient.
    fn gradient(&mut self, clock: u64, params: &[f32]) -> Result<(f32, Vec<f32>), String> {
        let mut at = 0;
        self.blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .map(|block| {
                let n = block.num_params();
                at += n;
                block.load_params(&params[at - n..at], false)
            })
            .collect();
        let (mut y, targets) = self.batch(clock);
        for block in &self.blocks {
            y = block.forward(y);
        }
        let logits = match y {
            Activation::Rows(l) => l,
            Activation::Seq(l) => {
                let [b, t, v] = l.dims();
                l.reshape([b * t, v])
            }
            Activation::Tokens(_) => return Err("the model's last block must output logits".into()),
        };
        let [n, _] = logits.dims();
        let scale = 1.0 / (self.params.settings.global_batch() * self.tokens_per_sample) as f32;
        let picked = log_softmax(logits, 1).gather(1, targets.reshape([n, 1]));
        let loss = picked.sum().neg().mul_scalar(scale);
        let value = loss.clone().into_scalar().elem::<f32>();
        let mut grads = loss.backward();
        let parts = self
            .blocks
            .iter()
            .flat_map(|b| b.take_grads(&mut grads))
            .collect();
        let mut grad = vec![0.0f32; self.layout.keys() * self.layout.width];
        read_flat(parts, &mut grad[..self.layout.params], false, false);
        Ok((value, grad))
    }
}

impl<U: ServerUpdate> Handler<SeedModel<U>> for DenseWorker<U> {
    async fn handle(&mut self, seed: SeedModel<U>, _ctx: &Context<Self>) -> Result<(), String> {
        let mut client = PsClient::new(
            self.params.settings.rank,
            self.layout.width,
            seed.ring,
            seed.servers,
        )?
        .replicated(seed.replicas)?;
        let padded = self.layout.pad(&self.initial);
        client.assign(&self.layout.key_list(), &padded).await
    }
}

impl<U: ServerUpdate> Handler<Train<U>> for DenseWorker<U> {
    async fn handle(&mut self, train: Train<U>, _ctx: &Context<Self>) -> Result<WorkerRun, String> {
        let settings = self.params.settings.clone();
        let mut client = PsClient::new(settings.rank, self.layout.width, train.ring, train.servers)?
            .replicated(train.replicas)?
            .logging_acked(settings.log_acked)
            .caching_keys(settings.key_caching)
            .filtering(settings.filter);
        let keys = self.layout.key_list();
        let mut steps = Vec::new();
        let wire_at_start = crate::runtime::remote::wire_bytes_out();
        for clock in train.first_clock..train.first_clock + train.clocks {
            let began = std::time::Instant::now();
            let pulled = client.pull(clock, &keys).await?;
            settings.before_compute(clock).await?;
            let (loss, grad) = self.gradient(clock, &pulled.values)?;
            client.push(clock, &keys, &grad).await?;
            steps.push(WorkerStep {
                clock,
                applied: pulled.applied,
                loss,
                refused: pulled.refused,
                time_s: began.elapsed().as_secs_f64(),
            });
        }
        Ok(WorkerRun {
            steps,
            figures: ClientFigures {
                wire_bytes_out: crate::runtime::remote::wire_bytes_out() - wire_at_start,
                ..client.figures()
            },
            acked: client.acked(),
        })
    }
}
