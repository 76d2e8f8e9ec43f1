//! `archipelago-dataflow`: the pure, deterministic half of archipelago.
//!
//! It turns a [`Program`] (a model description, a parallel plan, an optimizer and a data source)
//! into a [`Plan`]: the mesh, the placement of blocks on actors, one instruction stream per actor
//! (MPMD) and a memory estimate per actor. Nothing here starts a thread, opens a socket or touches
//! a tensor: plans are serde data that print as JSON and are checked before any actor starts.
//!
//! The pipeline of [`compile`]:
//! 1. [`passes::partition`] cuts the blocks into `pp × V` chunks; [`passes::schedule`] orders
//!    each pipeline device's forward and backward passes (GPipe, 1F1B, interleaved, ZB-H1);
//!    [`passes::step`] builds the dataflow [`graph::Graph`] of one training step on the
//!    `dp × pp` [`Mesh`] by passes, each in its own file: [`passes::pipeline`] (segments per
//!    micro-batch, send/recv edges between stages), [`passes::data_parallel`] (gradient
//!    all-reduce edges between replicas), [`passes::optimizer`], [`passes::offload`],
//!    [`passes::zero`] and [`passes::islands`]. Tensors are typed ids ([`TensorId`]).
//! 2. [`passes::lower`] splits that graph into one [`ActorStream`] per actor.
//! 3. [`verify::verify`] simulates the streams: every send has its receive, every group enters its
//!    collectives in the same order, every tensor is defined before it is used; a deadlock is
//!    reported naming who waits for whom.
//! 4. [`simulate::simulate`] predicts the step time and each stage's bubble from a cost model;
//!    [`simulate_comm`] adds the communication term (bandwidth and latency per link kind).
//! 5. [`memory::estimate`] accounts parameters, gradients, optimizer state, activations and
//!    communication buffers per actor, and refuses plans over a device's memory budget.
//!
//! The same graph IR serves user-declared dataflow graphs ([`flow::FlowGraph`]) that are not
//! training loops at all: the runtime's compiled programs are built with it.
//!
//! ```
//! use archipelago_dataflow::{compile, ModelSpec, Program, ParallelPlan};
//! let program = Program::new(ModelSpec::parse("mlp:in=16,hidden=32,layers=2,out=4").unwrap())
//!     .with_plan(ParallelPlan { dp: 2, batch: 8, ..ParallelPlan::default() });
//! let plan = compile(&program).unwrap();
//! assert_eq!(plan.actors.len(), 2);
//! ```

pub mod activation_checkpoints;
pub mod actor_training;
pub mod codec;
pub mod data;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fabric_bytes;
pub mod family;
pub mod flow;
pub mod graph;
pub mod instruction;
pub mod memory;
pub mod mesh;
pub mod model_spec;
pub mod offload_bytes;
pub mod optimizer;
pub mod param_desc;
pub mod param_names;
pub mod passes;
pub mod plan;
pub mod precision;
pub use precision::{LossScale, Precision};
mod plan_summary;
pub use plan_summary::count;
pub mod program;
/// The property tests' seed (test support: fixed under CI, random and printed elsewhere).
#[doc(hidden)]
pub mod property_seed;
pub mod rng;
pub mod sequence_parallel;
pub mod simulate;
pub mod simulate_comm;
pub mod state_layout;
pub mod stream_class;
pub mod tensor_id;
pub mod tensor_parallel;
pub mod ties;
pub mod trained_layout;
pub mod verify;

pub use activation_checkpoints::{ActivationCheckpoints, CheckpointBytes, KeptInput};
pub use actor_training::{ActorTraining, SegmentPlan, ZeroStage, shard_range};
pub use codec::{Codec, Compression};
pub use device::DeviceSpec;
pub use dtype::DType;
pub use error::PlanError;
pub use fabric_bytes::{FabricBytes, FabricKind};
pub use instruction::{ActorStream, CollectiveKind, ComputeOp, Instruction, UpdateScope};
pub use mesh::Mesh;
pub use model_spec::{BlockInfo, InputKind, ModelDesc, ModelSpec};
pub use offload_bytes::OffloadTraffic;
pub use optimizer::{LrDecay, LrSchedule, OptimizerSpec, ParamGroups};
pub use param_desc::{ParamDesc, ParamInit, Split};
pub use plan::{ActorPlan, Bucket, Plan, compile, compile_every_actor};
pub use program::{Offload, ParallelPlan, Program, StatePlacement, TestFault};
pub use simulate::CostModel;
pub use state_layout::{SliceState, Tier};
pub use tensor_id::{GatherFor, TensorId};
pub use ties::Tie;
pub use trained_layout::TrainedLayout;

/// Index of an actor in a plan: its rank in the mesh.
pub type ActorId = usize;
