//! Tests of actors on another host, with the host served in this process over a real TCP
//! actor port on 127.0.0.1: spawning registered types by name, calls and casts in order, a
//! panic named with its host, unregistered messages refused with the fix, a wrong token, and a
//! host that goes away failing the pending calls.

use std::time::{Duration, Instant};

use archipelago_dataflow::DeviceSpec;
use serde::{Deserialize, Serialize};

use super::remote::{ActorPort, Liveness, serve_actor_port};
use super::*;
use crate::typed_tensor::TypedTensor;

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
pub(super) fn host(
    name: &str,
    devices: usize,
    credentials: impl Into<crate::trust::Credentials>,
) -> (Runtime, ActorPort, Vec<Slot>) {
    let credentials = credentials.into();
    let runtime = Runtime::new("remote-test", name, DeviceSpec::cpus(devices));
    let handle = runtime.handle().clone();
    let port = runtime
        .block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            serve_actor_port(listener, handle, credentials)
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

    // A timeout and a cancel reach the host: the messages queued behind a busy one never run.
    let busy = keeper.call(Hold(300));
    let timed_out = keeper.call(Push(1000)).timeout(Duration::from_millis(50)).get();
    assert!(
        matches!(timed_out, Err(CallError::Timeout { .. })),
        "{timed_out:?}"
    );
    let mut cancelled = keeper.call(Push(2000));
    cancelled.cancel();
    assert!(matches!(cancelled.get(), Err(CallError::Cancelled { .. })));
    busy.get().unwrap();
    let (values, _, _) = keeper.call(Dump).get().unwrap();
    assert!(!values.contains(&1000) && !values.contains(&2000), "{values:?}");

    let mut recorder = super::compiled::Recorder::<i64>::new();
    let input = recorder.input();
    let pushed = recorder.call(&keeper, &input, Push);
    // A compiled call to another host's actor must be registered (the host builds the message).
    let refused = recorder.compile(&driver, &pushed).err().expect("refused");
    assert!(
        refused.to_string().contains(".compiled::<A, M, T>(make)"),
        "{refused}"
    );

    let error = keeper.call(Secret).get().unwrap_err();
    assert!(
        error.to_string().contains(".handles::<Keeper, Secret>()"),
        "{error}"
    );

    let queued = keeper.call(Push(7));
    let slow = keeper.call(Hold(100));
    let crash = keeper.call(Crash);
    // Calls queued behind the panic: the actor ends without handling them, and each caller
    // still hears why (no hang).
    let behind: Vec<_> = (0..20)
        .map(|_| keeper.call(Dump).timeout(Duration::from_secs(5)))
        .collect();
    let crashed = crash.get().unwrap_err();
    queued.get().unwrap();
    slow.get().unwrap();
    for call in behind {
        let error = call.get().unwrap_err();
        assert!(matches!(error, CallError::Failed(_)), "{error}");
    }
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
    let text = error.to_string();
    assert!(
        text.contains("host-b") && text.contains("wrong or missing cluster token"),
        "{text}"
    );

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

/// Makes tensors of every dtype and of a given size; sums tensors from elsewhere.
struct Tensors;

impl Actor for Tensors {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Tensors)
    }
}

/// One tensor of each dtype, holding its type's extreme values.
fn every_dtype() -> Vec<TypedTensor> {
    vec![
        TypedTensor::from_values(vec![4], &[f32::MIN, -0.0, f32::EPSILON, f32::MAX]),
        TypedTensor::from_values(vec![2], &[half::bf16::MIN, half::bf16::MAX]),
        TypedTensor::from_values(vec![1, 2], &[half::f16::MIN_POSITIVE, half::f16::MAX]),
        TypedTensor::from_values(vec![3], &[i8::MIN, 0, i8::MAX]),
        TypedTensor::from_values(vec![3], &[0u8, 128, 255]),
        TypedTensor::from_values(vec![2], &[i32::MIN, i32::MAX]),
        TypedTensor::from_values(vec![2, 1], &[i64::MIN, i64::MAX]),
    ]
}

#[derive(Serialize, Deserialize)]
struct MakeAll;
impl Message for MakeAll {
    type Reply = Vec<TensorRef>;
}
impl Handler<MakeAll> for Tensors {
    async fn handle(&mut self, _: MakeAll, ctx: &Context<Self>) -> Vec<TensorRef> {
        every_dtype().into_iter().map(|t| ctx.put(t)).collect()
    }
}

#[derive(Serialize, Deserialize)]
struct MakeF32(usize);
impl Message for MakeF32 {
    type Reply = TensorRef;
}
impl Handler<MakeF32> for Tensors {
    async fn handle(&mut self, MakeF32(n): MakeF32, ctx: &Context<Self>) -> TensorRef {
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ctx.put(TypedTensor::from_values(vec![n], &values))
    }
}

#[derive(Serialize, Deserialize)]
struct SumOf(TensorRef);
impl Message for SumOf {
    type Reply = Result<f64, String>;
}
impl Handler<SumOf> for Tensors {
    async fn handle(&mut self, SumOf(tensor): SumOf, ctx: &Context<Self>) -> Result<f64, String> {
        let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
        Ok(values.values::<f32>().iter().map(|v| *v as f64).sum())
    }
}

#[derive(Serialize, Deserialize)]
struct Held;
impl Message for Held {
    type Reply = u64;
}
impl Handler<Held> for Tensors {
    async fn handle(&mut self, _: Held, ctx: &Context<Self>) -> u64 {
        ctx.runtime().held_bytes(ctx.info().id)
    }
}

fn tensor_registry() -> Registry {
    Registry::new()
        .actor::<Tensors>()
        .handles::<Tensors, MakeAll>()
        .handles::<Tensors, MakeF32>()
        .handles::<Tensors, SumOf>()
        .handles::<Tensors, Held>()
}

/// Waits (up to 5 s) until `probe` gives `want`.
fn eventually(want: u64, probe: impl Fn() -> u64) -> u64 {
    let started = Instant::now();
    loop {
        let got = probe();
        if got == want || started.elapsed() > Duration::from_secs(5) {
            return got;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn tensors_cross_hosts_exactly_and_are_freed_when_every_borrower_drops() {
    tensor_registry().install();
    let (owner_host, _p1, mut slots) = host("host-t1", 1, "tok");
    let (_h2, _p2, more) = host("host-t2", 1, "tok");
    slots.extend(more);
    let driver = Runtime::on_cluster("remote-test", slots, "tok", Liveness::default()).unwrap();
    let producer = driver
        .spawn_at::<Tensors>(0, (), SpawnOptions::default())
        .get()
        .unwrap();
    let consumer = driver
        .spawn_at::<Tensors>(1, (), SpawnOptions::default())
        .get()
        .unwrap();

    // Every dtype comes back bit for bit, fetched explicitly by the program.
    let refs = producer.call(MakeAll).get().unwrap();
    let mut fetched_bytes = 0;
    for (r, expected) in refs.iter().zip(every_dtype()) {
        assert_eq!((r.dtype(), r.shape()), (expected.dtype(), expected.shape()));
        let got = driver.fetch(r).get().unwrap();
        assert_eq!(got.bytes(), expected.bytes(), "{}", expected.dtype());
        fetched_bytes += got.byte_len() as u64;
    }
    drop(refs);

    // A reference the program passes to an actor of another host: the bytes go owner → consumer.
    let n = 1 << 16;
    let tensor = producer.call(MakeF32(n)).get().unwrap();
    assert_eq!(producer.call(Held).get().unwrap(), 4 * n as u64);
    let sum = consumer.call(SumOf(tensor.clone())).get().unwrap().unwrap();
    assert_eq!(sum, (n as f64) * (n as f64 - 1.0) / 2.0);
    assert_eq!(driver.link_bytes().touching(crate::fabric::DRIVER), fetched_bytes);
    let owner_links = owner_host.link_bytes();
    let producer_id = producer.info().id;
    assert_eq!(
        owner_links.between(producer_id, crate::fabric::OTHER_PROCESS),
        fetched_bytes + 4 * n as u64,
        "the owner served every byte itself"
    );
    // The consumer dropped its borrow; once the program drops its own, the owner frees it.
    assert_eq!(
        eventually(4 * n as u64, || producer.call(Held).get().unwrap()),
        4 * n as u64
    );
    drop(tensor);
    assert_eq!(eventually(0, || producer.call(Held).get().unwrap()), 0);

    // A reference whose owner ended says so.
    let orphan = producer.call(MakeF32(4)).get().unwrap();
    producer.stop("its work is done");
    producer.ended().get();
    let error = driver.fetch(&orphan).get().unwrap_err().to_string();
    assert!(
        error.contains("owner") && error.contains("its work is done"),
        "{error}"
    );
}

/// Calls the keeper it is handed (an actor reference inside a message).
struct Relay;

impl Actor for Relay {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Relay)
    }
}

#[derive(Serialize, Deserialize)]
struct PushVia(ActorRef<Keeper>, i64);
impl Message for PushVia {
    type Reply = Result<usize, String>;
}
impl Handler<PushVia> for Relay {
    async fn handle(&mut self, PushVia(keeper, v): PushVia, _ctx: &Context<Self>) -> Result<usize, String> {
        keeper.call(Push(v)).await.map_err(|e| e.to_string())
    }
}

#[test]
fn an_actor_reference_travels_in_a_message_and_is_called_by_the_receiver() {
    registry()
        .merge(Registry::new().actor::<Relay>().handles::<Relay, PushVia>())
        .install();
    let (_host, _port, slots) = host("host-r", 2, "tok");
    let driver = Runtime::on_cluster("remote-test", slots, "tok", Liveness::default()).unwrap();
    let keeper = driver
        .spawn_at::<Keeper>(0, vec![], SpawnOptions::default())
        .get()
        .unwrap();
    let relay = driver
        .spawn_at::<Relay>(1, (), SpawnOptions::default())
        .get()
        .unwrap();
    for v in 0..5 {
        assert_eq!(
            relay.call(PushVia(keeper.clone(), v)).get().unwrap(),
            Ok(v as usize + 1)
        );
    }
    assert_eq!(keeper.call(Dump).get().unwrap().0, vec![0, 1, 2, 3, 4]);
    // A reference whose actor has ended arrives as an error, not a hang.
    keeper.stop("done");
    keeper.ended().get();
    let error = relay.call(PushVia(keeper.clone(), 9)).get().unwrap_err();
    assert!(error.to_string().contains("ended"), "{error}");
}

/// Over mutual TLS the actor port takes calls as in clear; a driver in clear, one with a
/// certificate another CA signed and one that does not trust the cluster's CA are refused.
#[test]
fn an_actor_port_over_mutual_tls_serves_members_and_refuses_strangers() {
    registry().install();
    let certs = crate::trust::testing::TestCerts::new();
    let (_host, _port, slots) = host("host-tls", 1, certs.member("tls-token"));
    for (who, stranger) in [
        ("in clear", crate::trust::Credentials::new("tls-token")),
        (
            "with a foreign certificate",
            certs.foreign_certificate("tls-token"),
        ),
        ("trusting another CA", certs.foreign_trust("tls-token")),
    ] {
        let refused = Runtime::on_cluster("remote-test", slots.clone(), stranger, Liveness::default())
            .and_then(|driver| {
                driver
                    .spawn_at::<Keeper>(0, vec![], SpawnOptions::default())
                    .get()
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
        assert!(refused.is_err(), "a driver {who} spawned an actor over TLS");
    }
    // The negative control: a member spawns and calls.
    let driver = Runtime::on_cluster(
        "remote-test",
        slots,
        certs.member("tls-token"),
        Liveness::default(),
    )
    .unwrap();
    let keeper = driver
        .spawn_at::<Keeper>(0, vec![7], SpawnOptions::default())
        .get()
        .unwrap();
    keeper.cast(Push(8)).unwrap();
    let (values, host, _) = keeper.call(Dump).get().unwrap();
    assert_eq!((values, host.as_str()), (vec![7, 8], "host-tls"));
}
