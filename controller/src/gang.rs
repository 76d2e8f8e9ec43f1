//! What the training loop needs from the actors of a job, wherever they run: in this process
//! (`ActorGang`) or on hosts behind the controller service
//! ([`RemoteGang`](crate::cluster::remote_gang::RemoteGang)).

use std::future::Future;
use std::path::Path;

use archipelago_actors::checkpoint::ShardFile;
use archipelago_actors::executor::{HeldParams, StepReport};
use archipelago_dataflow::ActorId;

use crate::JobError;

/// The running actors of one job.
pub trait Gang {
    /// Runs step `n` on every actor; one report per actor, in actor order.
    fn step(&mut self, n: u64) -> impl Future<Output = Result<Vec<StepReport>, JobError>> + Send;
    /// Every actor's sums of squares of parameters by block (see
    /// [`Computation::block_squares`](archipelago_actors::executor::Computation::block_squares)).
    fn block_squares(&mut self) -> impl Future<Output = Result<Vec<(usize, f64)>, JobError>> + Send;
    /// A copy of every parameter every actor holds, by actor (see
    /// [`Computation::block_params`](archipelago_actors::executor::Computation::block_params)):
    /// what [`TrainOptions::keep_params`](crate::TrainOptions::keep_params) puts in the report.
    fn held_params(
        &mut self,
    ) -> impl Future<Output = Result<Vec<(ActorId, Vec<HeldParams>)>, JobError>> + Send;
    /// Every actor writes its shard of the state after step `step` into `dir`; the files written.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
    ) -> impl Future<Output = Result<Vec<ShardFile>, JobError>> + Send;
}
