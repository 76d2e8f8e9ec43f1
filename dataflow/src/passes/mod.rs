//! Compiler passes, one file each: a parallelism is a pass that builds or rewrites the graph.

pub mod data_parallel;
pub mod lower;
pub mod optimizer;
pub mod partition;
pub mod pipeline;
pub mod schedule;
