//! Collectives on top of the fabric, and the worker thread that runs them beside compute.

pub mod hierarchical;
pub mod ring_all_reduce;
pub mod worker;

pub use hierarchical::hierarchical_all_reduce;
pub use ring_all_reduce::{ChunkPool, ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_range};
pub use worker::{CollectiveWorker, PendingCollective};

/// Default chunk of a pipelined collective: 1 MiB of f32 (fits in cache, amortises messaging).
pub const DEFAULT_CHUNK_ELEMS: usize = 1 << 18;
