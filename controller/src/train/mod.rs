//! A training job, by part: what it is asked (`options`), what it checks and loads before any
//! actor starts (`preflight`; a resume checked against the run that wrote the checkpoint:
//! `resume_check`), how its gang of device actors starts from the plan (`launch`: the
//! one way, in this process and on every host), the step loop (`step_loop`), the figures and the
//! report it makes of them (`figures`), and the job in this process (`local_job`).
//!
//! A job on a cluster ([`crate::cluster::remote_job`]) runs the same preflight and step loop
//! against actors on hosts, each host starting its share with the same `launch`. Nothing here
//! knows of the cluster, nor of the [`Controller`](crate::Controller) that picks the way:
//!
//! ```text
//! Controller::train ─┬─▶ train::local_job ─────────────▶ preflight, launch, step_loop ─▶ figures
//!                    └─▶ cluster::client ──Submit──▶ cluster::remote_job ─▶ preflight, step_loop
//!                                             on each host: cluster::host_part ─▶ launch
//! ```

pub(crate) mod figures;
pub(crate) mod launch;
pub(crate) mod local_job;
pub mod options;
pub(crate) mod preflight;
#[cfg(test)]
mod preflight_tests;
pub mod resume_check;
pub(crate) mod step_loop;

pub use options::{DEFAULT_PATIENCE, ProgressFn, StepProgress, TrainOptions};
