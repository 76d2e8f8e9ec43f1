//! Errors of compiling and verifying a plan. Each one says what to change.

use thiserror::Error;

/// Why a program was refused before any actor started.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// The global batch cannot be split evenly over the data-parallel replicas.
    #[error(
        "global batch {batch} does not divide over dp={dp}: each replica needs the same number of rows; \
         use --batch {lower} or --batch {upper}, or a --dp that divides {batch}"
    )]
    BatchNotDivisible {
        /// The global batch asked for.
        batch: usize,
        /// The data-parallel degree asked for.
        dp: usize,
        /// The nearest smaller batch that divides (0 when none).
        lower: usize,
        /// The nearest larger batch that divides.
        upper: usize,
    },
    /// A degree or size that must be positive was zero.
    #[error("{what} must be at least 1 (got 0)")]
    Zero {
        /// Which flag or field.
        what: &'static str,
    },
    /// The mesh needs more devices than were given.
    #[error(
        "the mesh {mesh} needs {needed} devices but {given} were given; pass more devices or lower the degrees"
    )]
    NotEnoughDevices {
        /// The mesh, printed.
        mesh: String,
        /// Devices the mesh needs.
        needed: usize,
        /// Devices available.
        given: usize,
    },
    /// A model specification string could not be parsed.
    #[error("cannot read model spec `{spec}`: {why}")]
    BadModelSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong and what is expected.
        why: String,
    },
    /// A device string could not be parsed.
    #[error("cannot read device `{0}`: expected `cpu:N` or `cuda:N`")]
    BadDevice(String),
    /// The model has no blocks.
    #[error("the model has no blocks; a model is an ordered list of at least one block")]
    EmptyModel,
    /// An actor's estimated memory exceeds its budget.
    #[error(
        "actor {actor} ({device}) needs about {needed} bytes ({breakdown}) but its budget is {budget} bytes; \
         lower --batch, raise --device-memory, or split the model over more devices"
    )]
    DoesNotFit {
        /// The actor.
        actor: usize,
        /// Its device.
        device: String,
        /// Estimated bytes.
        needed: u64,
        /// The budget.
        budget: u64,
        /// Parameters, gradients, optimizer, activations, buffers.
        breakdown: String,
    },
    /// The verifier found streams that cannot all run to completion.
    #[error("the plan would deadlock: {0}")]
    Deadlock(String),
    /// The verifier found a malformed stream (an unmatched send, a tensor used before it exists).
    #[error("the plan is malformed: {0}")]
    Malformed(String),
    /// A user dataflow graph is malformed.
    #[error("dataflow graph: {0}")]
    Flow(String),
}
