//! Tests of actors on another host, with the host served in this process over a real TCP
//! actor port on 127.0.0.1: spawning registered types by name, calls and casts in order, a
//! panic named with its host, unregistered messages refused with the fix, a wrong token, and a
//! host that goes away failing the pending calls.

use std::time::{Duration, Instant};

use archipelago_dataflow::DeviceSpec;
use serde::{Deserialize, Serialize};

use super::remote::{ActorPort, Liveness, serve_actor_port};
use super::*;

struct Keeper {
    values: Vec<i64>,
}

impl Actor for Keeper {
    type Params = Vec<i64>;
    async fn new(values: Vec<i64>, _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Keeper { values })
    }
}

#[derive(Serialize, Deserialize)]
struct Push(i64);
impl Message for Push {
    type Reply = usize;
}
impl Handler<Push> for Keeper {
    async fn handle(&mut self, Push(v): Push, _ctx: &Context<Self>) -> usize {
        self.values.push(v);
        self.values.len()
    }
}

#[derive(Serialize, Deserialize)]
struct Dump;
impl Message for Dump {
    type Reply = (Vec<i64>, String, DeviceSpec);
}
impl Handler<Dump> for Keeper {
    async fn handle(&mut self, _: Dump, ctx: &Context<Self>) -> (Vec<i64>, String, DeviceSpec) {
        (self.values.clone(), ctx.info().host.clone(), ctx.device())
    }
}

#[derive(Serialize, Deserialize)]
struct Crash;
impl Message for Crash {
    type Reply = ();
}
impl Handler<Crash> for Keeper {
    async fn handle(&mut self, _: Crash, _ctx: &Context<Self>) {
        panic!("crashed holding {} values", self.values.len());
    }
}

#[derive(Serialize, Deserialize)]
struct Hold(u64);
impl Message for Hold {
    type Reply = ();
}
impl Handler<Hold> for Keeper {
    async fn handle(&mut self, Hold(ms): Hold, _ctx: &Context<Self>) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Serializable, but never registered.
#[derive(Serialize, Deserialize)]
struct Secret;
impl Message for Secret {
    type Reply = ();
}
impl Handler<Secret> for Keeper {
    async fn handle(&mut self, _: Secret, _ctx: &Context<Self>) {}
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Keeper>()
        .handles::<Keeper, Push>()
        .handles::<Keeper, Dump>()
        .handles::<Keeper, Crash>()
        .handles::<Keeper, Hold>()
}

/// A host runtime serving its actor port on 127.0.0.1; returns it, the port and its slots.
fn host(name: &str, devices: usize, token: &str) -> (Runtime, ActorPort, Vec<Slot>) {
    let runtime = Runtime::new("remote-test", name, DeviceSpec::cpus(devices));
    let handle = runtime.handle().clone();
    let port = runtime
        .block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            serve_actor_port(listener, handle, token)
        })
        .unwrap();
    let slots = DeviceSpec::cpus(devices)
        .into_iter()
        .map(|device| Slot {
            host: name.to_string(),
            island: "a".into(),
            addr: port.addr.to_string(),
            device,
        })
        .collect();
    (runtime, port, slots)
}

#[test]
fn actors_on_another_host_take_calls_and_casts_in_order_and_name_their_failures() {
    registry().install();
    let (_host, _port, slots) = host("host-a", 2, "secret");
    let driver = Runtime::on_cluster("remote-test", slots, "secret", Liveness::default()).unwrap();
    let keeper = driver
        .spawn_at::<Keeper>(1, vec![-1], SpawnOptions::named("keeper"))
        .get()
        .unwrap();
    assert_eq!(keeper.info().host, "host-a");
    for v in 0..100 {
        keeper.cast(Push(v)).unwrap();
    }
    let lens: Vec<usize> = (100..150)
        .map(|v| keeper.call(Push(v)))
        .map(|c| c.get().unwrap())
        .collect();
    assert_eq!(lens, (102..152).collect::<Vec<_>>());
    let (values, host, device) = keeper.call(Dump).get().unwrap();
    assert_eq!(values, std::iter::once(-1).chain(0..150).collect::<Vec<_>>());
    assert_eq!((host.as_str(), device), ("host-a", DeviceSpec::Cpu(1)));

    let error = keeper.call(Secret).get().unwrap_err();
    assert!(
        error.to_string().contains(".handles::<Keeper, Secret>()"),
        "{error}"
    );

    let queued = keeper.call(Push(7));
    let crashed = keeper.call(Crash).get().unwrap_err();
    queued.get().unwrap();
    let text = crashed.to_string();
    for part in [
        "host host-a",
        "cpu:1",
        "Keeper",
        "\"keeper\"",
        "Crash",
        "crashed holding 152 values",
    ] {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
    assert!(matches!(keeper.ended().get(), ActorEnd::Failed(_)));
    assert!(
        keeper.call(Dump).get().is_err(),
        "an ended actor refuses calls at once"
    );
}

#[test]
fn a_lost_host_fails_the_pending_calls_and_a_wrong_token_is_refused() {
    registry().install();
    let (_host, port, slots) = host("host-b", 1, "right");
    let refused = Runtime::on_cluster("remote-test", slots.clone(), "wrong", Liveness::default()).unwrap();
    let error = refused
        .spawn_at::<Keeper>(0, vec![], SpawnOptions::default())
        .get()
        .unwrap_err();
    assert!(error.to_string().contains("host-b"), "{error}");

    let driver = Runtime::on_cluster("remote-test", slots, "right", Liveness::default()).unwrap();
    let keeper = driver
        .spawn_at::<Keeper>(0, vec![], SpawnOptions::default())
        .get()
        .unwrap();
    let pending = keeper.call(Hold(60_000));
    std::thread::sleep(Duration::from_millis(100));
    port.close();
    let started = Instant::now();
    let error = pending.get().unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let text = error.to_string();
    assert!(
        text.contains("host host-b") && text.contains("was lost"),
        "{text}"
    );
    assert!(matches!(keeper.ended().get(), ActorEnd::Failed(_)));
    assert!(
        keeper
            .call(Dump)
            .get()
            .unwrap_err()
            .to_string()
            .contains("was lost")
    );
}
