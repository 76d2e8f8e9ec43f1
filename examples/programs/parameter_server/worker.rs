//! The worker of the parameter server (Li et al., OSDI 2014; see `../parameter_server.rs`): the
//! burn model, built in the constructor on the worker's own device thread and initialised as the
//! library's trainer initialises it, the worker's rows of each clock's global batch, and its
//! training loop. A [`Train`] hands the worker the servers' references; its handler runs every
//! clock — pull every range (asking again after a back-off while a server answers "not yet"),
//! load the values, forward and backward on its rows, push each server its slice of the
//! gradient — calling the servers itself, host to host on a cluster.

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

use super::server::{Pull, Pulled, Push, Server};
use super::{Fault, PsConfig, Role, WorkerStep};

/// The first back-off of a worker whose pull was refused.
const MIN_BACKOFF: Duration = Duration::from_micros(50);
/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_millis(2);

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

/// The worker's loss and gradient at one clock.
struct Computed {
    /// Its share of the global loss (its rows' loss sum over the global batch).
    loss: f32,
    /// The gradient of that share, flat.
    grad: Vec<f32>,
}

/// Worker `worker` pulls every server's range for `clock`, asking again after a back-off while
/// a server answers [`Pulled::Wait`]; returns the flat values, the fewest clocks applied to a
/// range, and how many times a pull was refused.
async fn pull(
    worker: usize,
    servers: &[ActorRef<Server>],
    clock: u64,
) -> Result<(Vec<f32>, u64, u32), String> {
    let mut ranges: Vec<Option<Vec<f32>>> = vec![None; servers.len()];
    let (mut applied, mut refused, mut backoff) = (u64::MAX, 0, MIN_BACKOFF);
    loop {
        let asks: Vec<_> = (0..servers.len())
            .filter(|&s| ranges[s].is_none())
            .map(|s| (s, servers[s].call(Pull { worker, clock })))
            .collect();
        for (s, ask) in asks {
            let answer = ask.await.map_err(|e| format!("pull from server {s}: {e}"))??;
            if let Pulled::Granted { applied: a, values } = answer {
                applied = applied.min(a);
                ranges[s] = Some(values);
            }
        }
        if ranges.iter().all(Option::is_some) {
            let values = ranges.into_iter().flatten().flatten().collect();
            return Ok((values, applied, refused));
        }
        refused += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Worker `worker` pushes each server its slice of `grad` for `clock`.
async fn push(
    worker: usize,
    config: &PsConfig,
    servers: &[ActorRef<Server>],
    clock: u64,
    grad: &[f32],
) -> Result<(), String> {
    let pushes: Vec<_> = (0..servers.len())
        .map(|s| {
            let grad = grad[config.key_range(s, grad.len())].to_vec();
            servers[s].call(Push { worker, clock, grad })
        })
        .collect();
    for (s, push) in pushes.into_iter().enumerate() {
        push.await.map_err(|e| format!("push to server {s}: {e}"))??;
    }
    Ok(())
}

/// Runs the worker's every clock against `servers` (in key-range order); the reply is each
/// clock as the worker saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Train {
    /// The servers, by key range.
    pub servers: Vec<ActorRef<Server>>,
}

impl Message for Train {
    type Reply = Result<Vec<WorkerStep>, String>;
}

impl Handler<Train> for Worker {
    async fn handle(
        &mut self,
        Train { servers }: Train,
        _ctx: &Context<Self>,
    ) -> Result<Vec<WorkerStep>, String> {
        let delay = self.config.delay_ms.get(self.rank).copied().unwrap_or(0);
        let mut steps = Vec::new();
        for clock in 0..self.config.clocks {
            if self.config.fault == Fault::FailAt(self.rank, clock) {
                return Err(format!("a planted failure at clock {clock}"));
            }
            let (params, applied, refused) = pull(self.rank, &servers, clock).await?;
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let Computed { loss, grad } = self.gradient(clock, &params)?;
            push(self.rank, &self.config, &servers, clock, &grad).await?;
            steps.push(WorkerStep {
                clock,
                applied,
                loss,
                refused,
            });
        }
        Ok(steps)
    }
}
