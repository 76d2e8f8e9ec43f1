//! Programs on the runtime API, shared by the examples' binaries and their tests.

pub mod actors_basics;
pub mod dataflow_basics;
pub mod parameter_server;
pub mod sharded_store;
pub mod tensor_exchange;
pub mod trial_search;
