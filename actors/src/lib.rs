//! `archipelago-actors`: everything that runs on a host.
//!
//! - [`device_actor`]: the ractor actor that owns a burn device and runs an instruction stream;
//! - [`executor`]: the interpreter of a stream (compute, sends, receives, collectives);
//! - [`trainer`]: the training computations (segments, loss, backward, optimizer) on burn;
//! - [`runtime`]: the runtime API — typed actors, futures, tensor references, meshes,
//!   supervision (see its module docs for the guarantees);
//! - [`ps`]: the parameter server (Li et al., OSDI 2014) as a library on the runtime API — key
//!   ranges on a consistent-hash ring, server actors with user-defined updates, consistency per
//!   task, dense and sparse workers, checkpoints;
//! - [`weights_file`], [`batch_file`] and [`tensor_file`]: weights and batches as safetensors
//!   files with PyTorch's names and layouts (`--init`, `archipelago export`, `--data`);
//! - [`trust`]: the cluster token and mutual TLS on every connection between processes;
//! - [`codec`]: the one bincode codec for control data that crosses processes;
//! - [`typed_tensor`]: tensors of every dtype as raw bytes;
//! - [`fabric`]: how tensors move between actors, with the in-process implementation;
//! - [`collectives`]: the chunked, pipelined ring all-reduce and the per-actor collective worker;
//! - [`optim`]: optimizers on flat shards (Adam, AdamW, SGD with momentum and Nesterov, LAMB),
//!   gradient clipping and parameter groups ([`flat_optimizer`] is its former name);
//! - [`allocator`]: glibc malloc kept from unmapping tensor buffers after every op;
//! - [`kernels`]: the CPU matmul by OpenBLAS behind burn's backend API (`Kernels`);
//! - [`block`] and [`zoo`]: the burn glue (block trait, parameter flattening) and the models;
//! - [`backend`] and [`gpus`]: the burn backends per device kind (`cpu:N`, `cuda:N` with the
//!   `cuda` feature) and the GPUs a host offers.

pub mod allocator;
pub mod backend;
pub mod batch_file;
pub mod batching;
pub mod block;
pub mod block_frozen;
pub mod checkpoint;
pub mod codec;
pub mod collectives;
pub mod device_actor;
pub mod error;
pub mod executor;
pub mod fabric;
pub mod generate;
pub mod generator;
pub mod gpus;
pub mod host_tensor;
pub mod inference;
pub mod inference_sharded;
pub(crate) mod inference_tp;
pub(crate) mod interpret;
pub mod kernels;
pub mod offload;
pub mod optim;
pub mod peak;
pub mod peft;
#[doc(hidden)]
pub mod precision;
pub mod prerequisite;
pub mod progress;
pub mod proto;
pub mod ps;
pub mod runtime;
pub mod sampling;
pub mod serving;
pub mod step_model;
pub mod tensor_file;
pub mod text_stream;
pub mod text_tokens;
pub mod trainer;
pub mod transfer;
pub mod trust;
pub mod typed_tensor;
pub mod weights_file;
pub mod zoo;

#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
pub use backend::{Builders, CpuBackend, check_devices};
pub use error::ActorFailure;
/// The optimizers' former module name (examples and programs written against it still build).
pub use optim as flat_optimizer;
pub use typed_tensor::TypedTensor;
