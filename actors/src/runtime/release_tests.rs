//! Tests of actors tied to their handles and actors found by name: dropping the last clone of a
//! spawn's reference ends the actor after the calls already sent (its tensors freed), locally
//! and on another host, and a compiled program keeps its actors as a reference does; a detached
//! actor (the control) lives on, and a detached named actor is found by name from this process,
//! from the driver (twice: both references see its end) and from another host.

use std::time::{Duration, Instant};

use archipelago_dataflow::DeviceSpec;
use serde::{Deserialize, Serialize};

use super::remote::Liveness;
use super::remote_tests::host;
use super::*;
use crate::typed_tensor::TypedTensor;

struct Holder;

impl Actor for Holder {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Holder)
    }
}

/// Sleeps this many milliseconds, then answers with the actor's host.
#[derive(Serialize, Deserialize)]
struct Slow(u64);
impl Message for Slow {
    type Reply = String;
}
impl Handler<Slow> for Holder {
    async fn handle(&mut self, Slow(ms): Slow, ctx: &Context<Self>) -> String {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        ctx.info().host.clone()
    }
}

/// Keeps a tensor on the actor and returns its reference.
#[derive(Serialize, Deserialize)]
struct Hold;
impl Message for Hold {
    type Reply = TensorRef;
}
impl Handler<Hold> for Holder {
    async fn handle(&mut self, _: Hold, ctx: &Context<Self>) -> TensorRef {
        ctx.put(TypedTensor::from_values(vec![2], &[1.0f32, 2.0]))
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Holder>()
        .handles::<Holder, Slow>()
        .handles::<Holder, Hold>()
        .compiled::<Holder, Slow, u64>(Slow)
}

/// Waits up to 5 s for `done`.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "not within 5 s: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn dropping_the_last_handle_ends_an_actor_after_its_calls_and_frees_its_tensors() {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let actor = runtime.spawn::<Holder>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let held = actor.call(Hold).get().unwrap();
    let ended = actor.ended();
    let clone = actor.clone();
    let in_flight = actor.call(Slow(200));
    drop(actor);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(runtime.actors().len(), 1, "a clone still holds it");
    drop(clone);
    assert_eq!(
        in_flight.get().unwrap(),
        "local",
        "a call sent before the drop is answered"
    );
    assert_eq!(
        ended.get(),
        ActorEnd::Stopped {
            reason: RELEASED.into()
        }
    );
    let gone = runtime.fetch(&held).get().unwrap_err();
    assert!(matches!(gone, TensorError::OwnerGone { .. }), "{gone}");
    eventually("the runtime forgets the actor", || runtime.actors().is_empty());

    // A compiled program keeps its actor as a reference does; a spawn dropped before it
    // resolved leaves no actor behind.
    let actor = runtime.spawn::<Holder>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let ended = actor.ended();
    let mut recorder = compiled::Recorder::<u64>::new();
    let input = recorder.input();
    let output = recorder.call(&actor, &input, Slow);
    let program = recorder.compile(&runtime, &output).unwrap();
    drop(actor);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        program.run(0).get().unwrap(),
        "local",
        "the program's actor ended"
    );
    drop(program);
    assert_eq!(
        ended.get(),
        ActorEnd::Stopped {
            reason: RELEASED.into()
        }
    );
    drop(runtime.spawn::<Holder>(DeviceSpec::Cpu(0), ()));
    std::thread::sleep(Duration::from_millis(100));
    eventually("an abandoned spawn's actor ends", || runtime.actors().is_empty());

    // The control: a detached actor outlives its handles, and is found by name; a found
    // reference does not keep it alive either way, so it ends only when stopped.
    let options = SpawnOptions::named("keeper").detached();
    let detached = runtime
        .spawn_with::<Holder>(DeviceSpec::Cpu(0), (), options)
        .get()
        .unwrap();
    drop(detached);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        runtime.actors().len(),
        1,
        "a detached actor ended with its handle"
    );
    let found = runtime.handle().find::<Holder>("keeper").get().unwrap();
    assert_eq!(found.call(Slow(0)).get().unwrap(), "local");
    drop(found);
    std::thread::sleep(Duration::from_millis(100));
    let found = runtime.handle().find::<Holder>("keeper").get().unwrap();
    found.stop("done");
    assert_eq!(
        found.ended().get(),
        ActorEnd::Stopped {
            reason: "done".into()
        }
    );
    let missing = runtime.handle().find::<Holder>("keeper").get().unwrap_err();
    assert!(matches!(missing, FindError::NotFound { .. }), "{missing}");
    assert!(missing.to_string().contains(".detached()"), "{missing}");
}

#[test]
fn a_detached_named_actor_outlives_its_creators_handles_and_is_found_from_another_host() {
    registry().install();
    let (host_a, port_a, mut slots) = host("host-a", 1, "secret");
    let (host_b, _port_b, slots_b) = host("host-b", 1, "secret");
    slots.extend(slots_b);
    let driver = Runtime::on_cluster("release-test", slots, "secret", Liveness::default()).unwrap();

    // Not detached: the host's actor ends once the driver drops its handle (after the call
    // sent before), and its tensor goes with it.
    let temporary = driver
        .spawn_at::<Holder>(0, (), SpawnOptions::named("temporary"))
        .get()
        .unwrap();
    let held = temporary.call(Hold).get().unwrap();
    let ended = temporary.ended();
    let in_flight = temporary.call(Slow(200));
    drop(temporary);
    assert_eq!(in_flight.get().unwrap(), "host-a");
    assert_eq!(
        ended.get(),
        ActorEnd::Stopped {
            reason: RELEASED.into()
        }
    );
    eventually("host-a's actor ends", || host_a.actors().is_empty());
    let gone = driver.fetch(&held).get().unwrap_err();
    assert!(matches!(gone, TensorError::OwnerGone { .. }), "{gone}");

    // Detached: it stays on host-a after the driver's handle is dropped, and host-b finds it.
    let options = SpawnOptions::named("directory").detached();
    drop(driver.spawn_at::<Holder>(0, (), options).get().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        host_a.actors().len(),
        1,
        "the detached actor ended with its handle"
    );
    let addr_a = port_a.addr.to_string();
    host_b.handle().set_peer_hosts(std::sync::Arc::new(move || {
        let hosts = vec![("host-a".to_string(), addr_a.clone())];
        Box::pin(std::future::ready(Ok(hosts)))
    }));
    let from_b = host_b.handle().find::<Holder>("directory").get().unwrap();
    assert!(from_b.is_remote());
    assert_eq!(from_b.call(Slow(0)).get().unwrap(), "host-a");
    let from_driver = driver.handle().find::<Holder>("directory").get().unwrap();
    assert_eq!(from_driver.call(Slow(0)).get().unwrap(), "host-a");
    let again = driver.handle().find::<Holder>("directory").get().unwrap();

    // The released one is not found anywhere, and the error says where it looked.
    let missing = host_b.handle().find::<Holder>("temporary").get().unwrap_err();
    let text = missing.to_string();
    assert!(text.contains("host host-a") && text.contains("host-b"), "{text}");
    from_driver.stop("done");
    eventually("host-a's detached actor ends when stopped", || {
        host_a.actors().is_empty()
    });
    let done = ActorEnd::Stopped {
        reason: "done".into(),
    };
    assert_eq!(
        (from_driver.ended().get(), again.ended().get()),
        (done.clone(), done)
    );
}
