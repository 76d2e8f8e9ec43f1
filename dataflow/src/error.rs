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
    /// A block's parameter descriptions are inconsistent.
    #[error(
        "block {block} `{name}`: {why}; describe each parameter once, with a unique name, so that the \
         descriptions add up to the block's parameter count"
    )]
    BadParams {
        /// The block.
        block: usize,
        /// Its name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The model has no blocks.
    #[error("the model has no blocks; a model is an ordered list of at least one block")]
    EmptyModel,
    /// An actor's estimated memory exceeds its budget.
    #[error(
        "actor {actor} ({device}) needs about {needed} bytes ({breakdown}) but its budget is {budget} bytes; {fixes}"
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
        /// Parameters, gradients, optimizer, activations, buffers, backward temporaries.
        breakdown: String,
        /// What would make it fit, found by re-planning with each remedy.
        fixes: String,
    },
    /// The verifier found streams that cannot all run to completion.
    #[error("the plan would deadlock: {0}")]
    Deadlock(String),
    /// The verifier found a malformed stream (an unmatched send, a tensor used before it exists).
    #[error("the plan is malformed: {0}")]
    Malformed(String),
    /// More pipeline chunks than blocks: some stage would be empty.
    #[error(
        "pp={pp} × virtual-stages={virtual_stages} = {chunks} pipeline chunks, but the model has only {blocks} blocks \
         and every chunk needs at least one; use --pp {max_pp} or less (or fewer --virtual-stages)"
    )]
    TooManyStages {
        /// Pipeline degree.
        pp: usize,
        /// Chunks per device.
        virtual_stages: usize,
        /// `pp × virtual_stages`.
        chunks: usize,
        /// Blocks in the model.
        blocks: usize,
        /// The largest pp that fits.
        max_pp: usize,
    },
    /// A replica's batch does not split into equal micro-batches.
    #[error(
        "each replica's batch of {per_replica} does not split into {microbatches} equal micro-batches; \
         use --microbatches {suggest} (a divisor of {per_replica}) or --batch {batch_fix}"
    )]
    MicrobatchesNotDivisible {
        /// Rows per replica.
        per_replica: usize,
        /// Micro-batches asked for.
        microbatches: usize,
        /// The nearest divisor of `per_replica` not above `microbatches`.
        suggest: usize,
        /// The smallest global batch above the current one that divides.
        batch_fix: usize,
    },
    /// A hand-pinned stage split is wrong.
    #[error(
        "--stages {given}: {why}; give one inclusive block range per chunk, in order, covering blocks \
         0..={last} exactly once (e.g. --stages {example})"
    )]
    BadStages {
        /// The split as given.
        given: String,
        /// What is wrong.
        why: String,
        /// The last block index.
        last: usize,
        /// A split that would be accepted.
        example: String,
    },
    /// A parameter the trainer cannot hold (see `ParamDesc::not_trainable_yet`).
    #[error("block {block} `{name}`: {why}")]
    NotTrainable {
        /// The block.
        block: usize,
        /// Its name.
        name: String,
        /// Which parameter, and what to change.
        why: String,
    },
    /// Options that do not go together.
    #[error("{0}")]
    Conflict(String),
    /// A user dataflow graph is malformed.
    #[error("dataflow graph: {0}")]
    Flow(String),
}
