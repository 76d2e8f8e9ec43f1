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
//! struct Add(i64);
//! impl Message for Add { type Reply = i64; }
//! impl Handler<Add> for Counter {
//!     async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> i64 { self.total += n; self.total }
//! }
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let runtime = Runtime::local(DeviceSpec::cpus(2));
//!     let options = SpawnOptions::named("counter").restarts(3);
//!     let counter = runtime.spawn_with::<Counter>(DeviceSpec::Cpu(1), 10, options).get()?;
//!     counter.cast(Add(1))?;                                             // no reply
//!     let reply = counter.call(Add(2)).timeout(std::time::Duration::from_secs(1)); // a future
//!     println!("{}", reply.get()?);                                      // 13 (or .await it)
//!     Ok(())
//! }
//! ```

pub use archipelago_actors::runtime::{
    Actor, ActorEnd, ActorInfo, ActorMesh, ActorRef, Call, CallError, Context, Handler, Message, Pending,
    Registry, Runtime, RuntimeHandle, Slot, SpawnError, SpawnOptions, TensorError, TensorId, TensorRef,
    Waited, wait,
};
pub use archipelago_actors::typed_tensor::{DType, TypedTensor};
pub use archipelago_dataflow::{DeviceSpec, Mesh};
