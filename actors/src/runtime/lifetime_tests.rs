//! Tests of how actors end and where they go: `kill` ends an actor busy in a long handler at once
//! (locally and on another host; `stop`, the control, waits for the handler), its tensors are
//! freed; on a cluster `spawn_with` places by device kind (spread across hosts, or packed), a mesh
//! can be kept on one host or spread, and mesh members are named by their coordinates.

use std::time::{Duration, Instant};

use archipelago_dataflow::{DeviceSpec, Mesh};
use serde::{Deserialize, Serialize};

use super::remote::Liveness;
use super::remote_tests::host;
use super::*;
use crate::typed_tensor::TypedTensor;

struct Sleeper;

impl Actor for Sleeper {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Sleeper)
    }
}

/// Sleeps this many milliseconds (a long handler that awaits).
#[derive(Serialize, Deserialize)]
struct Nap(u64);
impl Message for Nap {
    type Reply = ();
}
impl Handler<Nap> for Sleeper {
    async fn handle(&mut self, Nap(ms): Nap, _ctx: &Context<Self>) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Keeps a tensor on the actor and returns its reference.
#[derive(Serialize, Deserialize)]
struct Keep;
impl Message for Keep {
    type Reply = TensorRef;
}
impl Handler<Keep> for Sleeper {
    async fn handle(&mut self, _: Keep, ctx: &Context<Self>) -> TensorRef {
        ctx.put(TypedTensor::from_values(vec![4], &[1.0f32, 2.0, 3.0, 4.0]))
    }
}

/// Where the actor runs.
#[derive(Clone, Serialize, Deserialize)]
struct Where;
impl Message for Where {
    type Reply = (String, DeviceSpec, String);
}
impl Handler<Where> for Sleeper {
    async fn handle(&mut self, _: Where, ctx: &Context<Self>) -> (String, DeviceSpec, String) {
        (ctx.info().host.clone(), ctx.device(), ctx.info().name.clone())
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Sleeper>()
        .handles::<Sleeper, Nap>()
        .handles::<Sleeper, Keep>()
        .handles::<Sleeper, Where>()
}

/// Kills `actor` while it sleeps in a 60 s handler with a call queued behind: both calls fail at
/// once with the kill's reason and `ended()` says it was killed. Returns how long the end took.
fn kill_while_busy(actor: &ActorRef<Sleeper>) -> Duration {
    let busy = actor.call(Nap(60_000));
    let queued = actor.call(Where);
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    actor.kill("the test is done with it");
    let end = actor.ended().get();
    let took = start.elapsed();
    assert_eq!(
        end,
        ActorEnd::Stopped {
            reason: "killed: the test is done with it".into()
        }
    );
    for error in [busy.get().unwrap_err(), queued.get().map(|_| ()).unwrap_err()] {
        assert!(
            matches!(&error, CallError::Stopped { reason, .. } if reason.starts_with("killed")),
            "{error}"
        );
    }
    took
}

#[test]
fn kill_ends_an_actor_busy_in_a_long_handler_at_once_and_frees_its_tensors() {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let actor = runtime.spawn::<Sleeper>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let kept = actor.call(Keep).get().unwrap();
    assert_eq!(runtime.fetch(&kept).get().unwrap().byte_len(), 16);
    let took = kill_while_busy(&actor);
    assert!(took < Duration::from_secs(5), "kill took {took:?}");
    let gone = runtime.fetch(&kept).get().unwrap_err();
    assert!(matches!(gone, TensorError::OwnerGone { .. }), "{gone}");
    assert!(runtime.actors().is_empty(), "a killed actor leaves the runtime");

    // The control: `stop` lets the handler finish, so the actor is still there 300 ms later.
    let stopped = runtime.spawn::<Sleeper>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let busy = stopped.call(Nap(1_000));
    std::thread::sleep(Duration::from_millis(100));
    stopped.stop("graceful");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stopped.end(), None, "stop must wait for the handler");
    busy.get().unwrap();
    assert_eq!(
        stopped.ended().get(),
        ActorEnd::Stopped {
            reason: "graceful".into()
        }
    );
}

#[test]
fn kill_reaches_an_actor_on_another_host() {
    registry().install();
    let (host_runtime, _port, slots) = host("host-k", 1, "secret");
    let driver = Runtime::on_cluster("lifetime-test", slots, "secret", Liveness::default()).unwrap();
    let actor = driver
        .spawn_with::<Sleeper>(DeviceSpec::Cpu(0), (), SpawnOptions::named("napper"))
        .get()
        .unwrap();
    let took = kill_while_busy(&actor);
    assert!(took < Duration::from_secs(5), "kill took {took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !host_runtime.actors().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(host_runtime.actors().is_empty(), "the host's actor ended too");
}

#[test]
fn spawn_with_places_by_device_kind_on_a_cluster_and_meshes_follow_their_placement() {
    registry().install();
    let (_h1, _p1, mut slots) = host("host-1", 2, "secret");
    let (_h2, _p2, more) = host("host-2", 3, "secret");
    slots.extend(more);
    let driver = Runtime::on_cluster("placement-test", slots, "secret", Liveness::default()).unwrap();
    let place = |options: SpawnOptions| {
        let actor = driver
            .spawn_with::<Sleeper>(DeviceSpec::Cpu(9), (), options)
            .get()
            .unwrap();
        let (host, device, _) = actor.call(Where).get().unwrap();
        (host, device.to_string())
    };
    let spread: Vec<_> = (0..3).map(|_| place(SpawnOptions::default())).collect();
    assert_eq!(
        spread,
        [("host-1", "cpu:0"), ("host-2", "cpu:0"), ("host-1", "cpu:1")].map(|(h, d)| (h.into(), d.into()))
    );
    let packed = place(SpawnOptions::default().pack());
    assert_eq!(
        packed,
        ("host-2".into(), "cpu:1".into()),
        "the first device with no actor yet"
    );
    let refused = driver
        .spawn_with::<Sleeper>(DeviceSpec::Cuda(0), (), SpawnOptions::default())
        .get();
    let text = refused.expect_err("no GPU on the cluster").to_string();
    assert!(
        text.contains("no GPU device on any host: host host-1: cpu:0, cpu:1; host host-2"),
        "{text}"
    );

    let mesh = Mesh::new(&[("x", 3)]).unwrap();
    let one_host = (driver.spawn_mesh_placed::<Sleeper>(
        mesh.clone(),
        MeshPlacement::OneHost,
        |_| (),
        |_| SpawnOptions::default(),
    ))
    .get()
    .unwrap();
    let wheres: Vec<_> = (one_host.call_all(Where).into_iter())
        .map(|c| c.get().unwrap())
        .collect();
    assert!(wheres.iter().all(|(h, _, _)| h == "host-2"), "{wheres:?}");
    let names: Vec<&str> = wheres.iter().map(|(_, _, n)| n.as_str()).collect();
    assert_eq!(names, ["Sleeper[x=0]", "Sleeper[x=1]", "Sleeper[x=2]"]);
    let too_big = Mesh::new(&[("x", 4)]).unwrap();
    let refused = (driver.spawn_mesh_placed::<Sleeper>(
        too_big,
        MeshPlacement::OneHost,
        |_| (),
        |_| SpawnOptions::default(),
    ))
    .get();
    let text = refused.expect_err("no host has 4 devices").to_string();
    assert!(
        text.contains("no host has 4 devices") && text.contains("the largest has 3"),
        "{text}"
    );
    let spread = (driver.spawn_mesh_placed::<Sleeper>(
        mesh,
        MeshPlacement::Spread,
        |_| (),
        |_| SpawnOptions::default(),
    ))
    .get()
    .unwrap();
    let hosts: Vec<String> = (spread.call_all(Where).into_iter())
        .map(|c| c.get().unwrap().0)
        .collect();
    assert_eq!(hosts, ["host-1", "host-2", "host-1"]);
}
