//! `archipelago-controller`: the single controller of an archipelago job.
//!
//! It compiles a [`Program`](archipelago_dataflow::Program) into a verified plan, starts one
//! device actor (an actor of the runtime API) per mesh position with its instruction stream, then
//! drives the steps: each step is one run of a compiled program of the runtime (`RunStep(n)` to
//! every actor at once, the step reports gathered: Pathways-style parallel dispatch); on a
//! cluster each host's [`HostPart`](cluster::host_part::HostPart), on the host's actor port,
//! runs its actors' step. It never touches tensor bytes: control is typed messages, data moves
//! actor to actor.
//!
//! Programs that are not training loops use the runtime API re-exported in [`prelude`]: typed
//! actors, futures, tensor references and meshes (see `archipelago_actors::runtime`).
//!
//! ```no_run
//! use archipelago_controller::{Controller, TrainOptions};
//! use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program};
//! let program = Program::new(ModelSpec::parse("mlp-8x1024").unwrap())
//!     .with_plan(ParallelPlan { dp: 2, batch: 64, ..ParallelPlan::default() });
//! let controller = Controller::local(DeviceSpec::cpus(2));
//! let report = controller.train(&program, &TrainOptions { steps: 30, ..TrainOptions::default() }).unwrap();
//! println!("final loss {}", report.final_loss);
//! ```

mod actor_gang;
pub mod bench;
pub mod calibrate;
pub mod cli;
pub mod cluster;
pub mod controller;
pub mod dashboard;
pub mod error;
pub mod eval;
pub mod export;
pub mod export_merged;
pub mod fabric_check;
pub mod gang;
pub mod hang;
pub mod host_devices;
pub mod plan_table;
pub mod preemption;
pub mod prelude;
pub mod process_stats;
pub mod ps_job;
pub mod replay;
pub mod replica_check;
pub mod report;
pub mod runtime;
pub mod serve;
pub mod telemetry;
pub mod trace;
pub mod train;
pub mod weight_args;

pub use controller::Controller;
pub use error::JobError;
pub use report::{ActorParams, RestartRecord, StepRecord, TrainReport};
pub use train::{StepProgress, TrainOptions};
