//! The worker of the parameter server (Li et al., OSDI 2014; see `../parameter_server.rs`): the
//! burn model, built in the constructor on the worker's own device thread and initialised as the
//! library's trainer initialises it, and the worker's rows of each clock's global batch. A
//! [`Compute`] loads the pulled values and returns the worker's share of the global loss and its
//! flat gradient.

use std::time::Duration;

use burn::backend::flex::FlexDevice;
use burn::tensor::activation::log_softmax;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use archipelago_actors::CpuBackend;
use archipelago_actors::block::{Activation, Block, deterministic_init, read_flat};
use archipelago_actors::zoo::{BuildContext, ModelBuilder, ZooModel};
use archipelago_controller::prelude::*;
use archipelago_dataflow::data::ClusterPool;
use archipelago_dataflow::{InputKind, ModelSpec};

use super::{PsConfig, Role};

/// The model's blocks built on this thread's device, initialised as the trainer initialises
/// them, and their flat parameters (block after block).
pub(super) fn build_model(spec: &ModelSpec, seed: u64) -> (Vec<Box<dyn Block<CpuBackend>>>, Vec<f32>) {
    let builder = ZooModel(spec.clone());
    let mut blocks = Vec::new();
    let mut flat = Vec::new();
    for index in 0..spec.desc().blocks.len() {
        let ctx = BuildContext {
            seed,
            actor: 0,
            block: index,
        };
        let block = ModelBuilder::<CpuBackend>::build_block(&builder, &ctx, &FlexDevice);
        let init = deterministic_init(&block.param_shapes(), seed, index);
        flat.extend_from_slice(&init);
        blocks.push(block.load_params(&init, false));
    }
    (blocks, flat)
}

/// A worker: the burn model on its device and its data shard.
pub struct Worker {
    rank: usize,
    config: PsConfig,
    blocks: Vec<Box<dyn Block<CpuBackend>>>,
    params: usize,
    features: usize,
    pool: ClusterPool,
}

impl Actor for Worker {
    type Params = Role;
    async fn new(role: Role, _ctx: &Context<Self>) -> Result<Self, String> {
        let desc = role.config.model.desc();
        let InputKind::Dense { features, classes } = desc.input else {
            return Err(format!("a worker trains dense inputs, not {:?}", desc.input));
        };
        let (blocks, flat) = build_model(&role.config.model, role.config.seed);
        Ok(Worker {
            rank: role.index,
            blocks,
            params: flat.len(),
            features,
            pool: ClusterPool::new(role.config.seed, features, classes),
            config: role.config,
        })
    }
}

impl Worker {
    /// Loads `params`, runs forward and backward on this worker's rows of `clock`; returns its
    /// share of the global loss and its flat gradient.
    fn gradient(&mut self, clock: u64, params: &[f32]) -> Result<Computed, String> {
        if params.len() != self.params {
            return Err(format!(
                "{} values pulled for a model of {}",
                params.len(),
                self.params
            ));
        }
        let mut at = 0;
        self.blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .map(|block| {
                let n = block.num_params();
                at += n;
                block.load_params(&params[at - n..at], false)
            })
            .collect();
        let (global, rows) = (self.config.global_batch(), self.config.local_batch);
        let batch = self
            .pool
            .batch(clock + 1, global, self.rank * rows..(self.rank + 1) * rows);
        let x = TensorData::new(batch.x, [rows, self.features]);
        let labels: Vec<i32> = batch.labels.iter().map(|&l| l as i32).collect();
        let targets = Tensor::<CpuBackend, 1, Int>::from_data(TensorData::new(labels, [rows]), &FlexDevice);
        let mut y = Activation::Rows(Tensor::<CpuBackend, 2>::from_data(x, &FlexDevice));
        for block in &self.blocks {
            y = block.forward(y);
        }
        let Activation::Rows(logits) = y else {
            return Err("the model's last block must output logits".into());
        };
        let picked = log_softmax(logits, 1).gather(1, targets.reshape([rows, 1]));
        let loss = picked.sum().neg().mul_scalar(1.0 / global as f32);
        let value = loss.clone().into_scalar().elem::<f32>();
        let mut grads = loss.backward();
        let parts = self
            .blocks
            .iter()
            .flat_map(|b| b.take_grads(&mut grads))
            .collect();
        let mut grad = vec![0.0f32; self.params];
        read_flat(parts, &mut grad, false, false);
        Ok(Computed { loss: value, grad })
    }
}

/// Computes the gradient of the worker's rows of `clock` at `params`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Compute {
    /// The clock.
    pub clock: u64,
    /// The whole flat parameter vector, as pulled.
    pub params: Vec<f32>,
}

/// A worker's loss and gradient.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Computed {
    /// Its share of the global loss (its rows' loss sum over the global batch).
    pub loss: f32,
    /// The gradient of that share, flat.
    pub grad: Vec<f32>,
}

impl Message for Compute {
    type Reply = Result<Computed, String>;
}

impl Handler<Compute> for Worker {
    async fn handle(
        &mut self,
        Compute { clock, params }: Compute,
        _ctx: &Context<Self>,
    ) -> Result<Computed, String> {
        let delay = self.config.delay_ms.get(self.rank).copied().unwrap_or(0);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        self.gradient(clock, &params)
    }
}
