//! Everything a program on the runtime API needs, in one `use`:
//! `use archipelago_controller::prelude::*;` — actors, messages, references, calls, meshes,
//! supervision, tensors and devices. The README's example:
//!
//! ```
//! use archipelago_controller::prelude::*;
//!
//! struct Counter { total: i64 }
//! impl Actor for Counter {
//!     type Params = i64; // cloned for every restart
//!     async fn new(start: i64, _ctx: &Context<Self>) -> Result<Self, String> { Ok(Counter { total: start }) }
//! }
//! #[derive(serde::Serialize, serde::Deserialize)] // messages cross processes as bincode
//! struct Add(i64);
//! impl Message for Add { type Reply = i64; }
//! impl Handler<Add> for Counter {
//!     async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> i64 { self.total += n; self.total }
//! }
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let registry = Registry::new().actor::<Counter>().handles::<Counter, Add>();
//!     let runtime = archipelago_controller::runtime::init(registry, DeviceSpec::cpus(2))?; // or a cluster
//!     let options = SpawnOptions::named("counter").restarts(3);
//!     let counter = runtime.spawn_with::<Counter>(DeviceSpec::Cpu(1), 10, options).get()?;
//!     counter.cast(Add(1))?;                                             // no reply
//!     let reply = counter.call(Add(2)).timeout(std::time::Duration::from_secs(1)); // a future
//!     println!("{}", reply.get()?);                                      // 13 (or .await it)
//!     Ok(())
//! }
//! ```

/// The program itself in `runtime.link_bytes()` (the bytes it fetched or sent).
pub use archipelago_actors::fabric::DRIVER;
/// The id of a tensor an actor holds (its owner and number), as a [`TensorRef`] carries it;
/// `archipelago_dataflow::TensorId` is another thing: a tensor an instruction names.
pub use archipelago_actors::runtime::TensorId as TensorRefId;
/// Records a chain (or graph) of calls once and runs it as a compiled program (README "Compiled
/// programs").
pub use archipelago_actors::runtime::compiled::Recorder;
pub use archipelago_actors::runtime::{
    Actor, ActorEnd, ActorInfo, ActorMesh, ActorRef, Call, CallError, Context, FindError, Handler,
    MeshPlacement, Message, Pending, Placement, RELEASED, Registry, Runtime, RuntimeHandle, Slot, SpawnError,
    SpawnOptions, TensorError, TensorRef, Waited, wait,
};
pub use archipelago_actors::typed_tensor::TypedTensor;
/// The element type of a [`TypedTensor`] (f32, bf16, f16, i8, u8, i32, i64), the workspace's one
/// dtype: the plan's parameters are held in the same.
pub use archipelago_dataflow::DType;
pub use archipelago_dataflow::{DeviceSpec, Mesh};

#[cfg(test)]
mod tests {
    /// A program may glob-import the prelude and the dataflow crate together and still name
    /// both kinds of tensor id: no name of the prelude collides with another item of the same
    /// name in `archipelago_dataflow` (a collision would make these paths ambiguous and the test
    /// would not build). `DType` is the same item in both.
    #[test]
    fn the_prelude_and_the_dataflow_crate_glob_import_together() {
        use super::*;
        use archipelago_dataflow::*;
        assert_eq!(DType::BF16.to_string(), "bf16");
        assert_eq!(DType::BF16.bytes(), 2);
        assert_eq!(TypedTensor::zeros(DType::BF16, vec![3]).unwrap().byte_len(), 6);
        let held = TensorRefId { owner: 3, index: 7 };
        let named = TensorId::Named("x".into());
        assert_ne!(held.to_string(), named.to_string());
        let _ = (DeviceSpec::Cpu(0), Mesh::new(&[("dp", 2)]).unwrap());
    }
}
