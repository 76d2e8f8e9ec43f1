//! Compiler passes, one file each: a parallelism is a pass that builds or rewrites the graph of a
//! training step ([`step::build_step`] runs them in order).

pub mod compress;
pub mod data_parallel;
pub mod islands;
pub mod layout;
pub mod lower;
pub mod offload;
pub mod optimizer;
pub mod partition;
pub mod pipeline;
pub mod precision;
pub mod runs;
pub mod schedule;
pub mod step;
pub mod tensor_parallel;
pub mod tied;
pub mod zero;
