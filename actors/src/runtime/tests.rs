//! Tests of the runtime API in one process: typed calls and casts, ordering, futures passed
//! into calls, tensor references (bytes counted per link, freed on the owner, owner death),
//! `wait`, supervision (panics, restarts, ends), timeouts, cancellation, self-calls, meshes and
//! the errors of bad input.

use std::time::{Duration, Instant};

use archipelago_dataflow::{DeviceSpec, Mesh};

use super::*;
use crate::fabric::DRIVER;
use crate::typed_tensor::TypedTensor;

/// A counter that logs what it was told, with messages to sleep, panic and call itself.
struct Counter {
    log: Vec<i64>,
}

impl Actor for Counter {
    type Params = Vec<i64>;
    async fn new(start: Vec<i64>, _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Counter { log: start })
    }
}

struct Add(i64);
impl Message for Add {
    type Reply = usize;
}
impl Handler<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> usize {
        self.log.push(n);
        self.log.len()
    }
}

#[derive(Clone)]
struct Log;
impl Message for Log {
    type Reply = (Vec<i64>, u32);
}
impl Handler<Log> for Counter {
    async fn handle(&mut self, _: Log, ctx: &Context<Self>) -> (Vec<i64>, u32) {
        (self.log.clone(), ctx.restarts())
    }
}

struct Sleep(u64);
impl Message for Sleep {
    type Reply = u64;
}
impl Handler<Sleep> for Counter {
    async fn handle(&mut self, Sleep(ms): Sleep, _ctx: &Context<Self>) -> u64 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        ms
    }
}

struct Boom;
impl Message for Boom {
    type Reply = ();
}
impl Handler<Boom> for Counter {
    async fn handle(&mut self, _: Boom, _ctx: &Context<Self>) {
        panic!("boom after {} entries", self.log.len());
    }
}

struct AskMyself;
impl Message for AskMyself {
    type Reply = Result<(Vec<i64>, u32), CallError>;
}
impl Handler<AskMyself> for Counter {
    async fn handle(&mut self, _: AskMyself, ctx: &Context<Self>) -> Result<(Vec<i64>, u32), CallError> {
        ctx.myself().call(Log).await
    }
}

fn runtime(devices: usize) -> Runtime {
    let runtime = Runtime::local(DeviceSpec::cpus(devices));
    // One-process semantics with local-only types (a `Call` in `SumOf`), none of them registered.
    runtime.set_strict_registry(false);
    runtime
}

#[test]
fn typed_calls_and_casts_keep_each_callers_order() {
    let rt = runtime(2);
    let counter = rt.spawn::<Counter>(DeviceSpec::Cpu(1), vec![]).get().unwrap();
    for n in 0..200 {
        counter.cast(Add(n)).unwrap();
    }
    let calls: Vec<_> = (200..300).map(|n| counter.call(Add(n))).collect();
    let lens: Vec<usize> = calls.into_iter().map(|c| c.get().unwrap()).collect();
    assert_eq!(lens, (201..=300).collect::<Vec<_>>());
    let (log, restarts) = counter.call(Log).get().unwrap();
    assert_eq!(log, (0..300).collect::<Vec<_>>());
    assert_eq!(restarts, 0);
    assert_eq!(counter.info().device, DeviceSpec::Cpu(1));
    assert_eq!(counter.info().type_name, "Counter");
    assert_eq!(rt.actors().len(), 1);
}

#[test]
fn wait_returns_the_first_k_and_leaves_the_rest_pending() {
    let rt = runtime(4);
    let actors: Vec<_> = (0..4)
        .map(|d| rt.spawn::<Counter>(DeviceSpec::Cpu(d), vec![]).get().unwrap())
        .collect();
    let calls: Vec<_> = [400u64, 10, 600, 20]
        .iter()
        .zip(&actors)
        .map(|(ms, a)| a.call(Sleep(*ms)))
        .collect();
    let waited = rt.wait(calls, 2, None);
    let mut ready: Vec<(usize, u64)> = waited.ready.into_iter().map(|(i, r)| (i, r.unwrap())).collect();
    ready.sort();
    assert_eq!(ready, vec![(1, 10), (3, 20)]);
    assert_eq!(
        waited.pending.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![0, 2]
    );
    // A timeout returns what is done by then.
    let pending: Vec<_> = waited.pending.into_iter().map(|(_, c)| c).collect();
    let started = Instant::now();
    let rest = rt.wait(pending, 2, Some(Duration::from_millis(50)));
    assert!(rest.ready.is_empty(), "nothing finishes within 50 ms");
    assert!(started.elapsed() < Duration::from_millis(350));
    let all = rt.wait(rest.pending.into_iter().map(|(_, c)| c).collect(), 5, None);
    assert_eq!(all.ready.len(), 2);
}

#[test]
fn a_panic_fails_the_pending_calls_with_a_named_error_and_ends_the_actor() {
    let rt = runtime(1);
    let counter = rt.spawn::<Counter>(DeviceSpec::Cpu(0), vec![7]).get().unwrap();
    let slow = counter.call(Sleep(100));
    let boom = counter.call(Boom);
    let queued: Vec<_> = (0..3).map(|n| counter.call(Add(n))).collect();
    assert_eq!(slow.get().unwrap(), 100);
    let error = boom.get().unwrap_err();
    let text = error.to_string();
    for part in [
        "Counter",
        "cpu:0",
        "host local",
        "Boom",
        "boom after 1 entries",
        "handling message 2 `Boom`",
    ] {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
    for training_word in ["job ", "step "] {
        assert!(
            !text.contains(training_word),
            "`{training_word}` in a runtime error: {text}"
        );
    }
    for call in queued {
        assert_eq!(
            call.get().unwrap_err(),
            error,
            "a queued call fails with the same failure"
        );
    }
    assert!(matches!(counter.ended().get(), ActorEnd::Failed(f) if f.message.contains("boom")));
    let after = counter.call(Log).get().unwrap_err();
    assert!(after.to_string().contains("boom"), "{after}");
    assert!(counter.cast(Add(1)).is_err());
}

#[test]
fn the_restart_policy_rebuilds_the_actor_until_it_runs_out() {
    let rt = runtime(1);
    let options = SpawnOptions::named("flaky").restarts(1);
    let counter = rt
        .spawn_with::<Counter>(DeviceSpec::Cpu(0), vec![1, 2], options)
        .get()
        .unwrap();
    counter.call(Add(3)).get().unwrap();
    assert!(counter.call(Boom).get().is_err());
    // Rebuilt from the same parameters: the state is the constructor's again.
    assert_eq!(counter.call(Log).get().unwrap(), (vec![1, 2], 1));
    assert_eq!(counter.restarts(), 1);
    assert!(counter.end().is_none());
    let error = counter.call(Boom).get().unwrap_err();
    assert!(error.to_string().contains("\"flaky\""), "{error}");
    assert!(matches!(counter.ended().get(), ActorEnd::Failed(_)));
}

#[test]
fn timeouts_and_cancellation_take_queued_messages_back() {
    let rt = runtime(1);
    let counter = rt.spawn::<Counter>(DeviceSpec::Cpu(0), vec![]).get().unwrap();
    let slow = counter.call(Sleep(300));
    let started = Instant::now();
    let timed_out = counter.call(Add(1)).timeout(Duration::from_millis(50)).get();
    assert!(
        matches!(timed_out, Err(CallError::Timeout { .. })),
        "{timed_out:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(250));
    let mut cancelled = counter.call(Add(2));
    cancelled.cancel();
    assert!(matches!(cancelled.get(), Err(CallError::Cancelled { .. })));
    counter.call(Add(3)).get().unwrap();
    slow.get().unwrap();
    // Neither the timed-out nor the cancelled message ran.
    assert_eq!(counter.call(Log).get().unwrap().0, vec![3]);
}

#[test]
fn an_actor_calling_itself_gets_an_error_not_a_deadlock() {
    let rt = runtime(1);
    let counter = rt.spawn::<Counter>(DeviceSpec::Cpu(0), vec![]).get().unwrap();
    let inner = counter
        .call(AskMyself)
        .timeout(Duration::from_secs(5))
        .get()
        .unwrap();
    assert!(matches!(inner, Err(CallError::SelfCall { .. })), "{inner:?}");
}

#[test]
fn bad_input_is_refused_with_the_fix() {
    let rt = runtime(2);
    let error = rt.spawn::<Counter>(DeviceSpec::Cpu(5), vec![]).get().unwrap_err();
    assert!(error.to_string().contains("cpu:0, cpu:1"), "{error}");
    let mesh = Mesh::new(&[("dp", 2), ("pp", 2)]).unwrap();
    let error = rt.spawn_mesh::<Counter>(mesh, |_| vec![]).get().unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("needs 4 devices") && text.contains("has 2"),
        "{text}"
    );
    let error = rt.spawn::<Picky>(DeviceSpec::Cpu(0), -1).get().unwrap_err();
    assert!(error.to_string().contains("must be positive"), "{error}");
    let counter = rt.spawn::<Counter>(DeviceSpec::Cpu(0), vec![]).get().unwrap();
    counter.stop("done with it");
    assert!(matches!(counter.ended().get(), ActorEnd::Stopped { .. }));
    let error = counter.call(Log).get().unwrap_err();
    assert!(error.to_string().contains("done with it"), "{error}");
}

/// An actor whose constructor refuses bad parameters.
struct Picky;
impl Actor for Picky {
    type Params = i32;
    async fn new(n: i32, _ctx: &Context<Self>) -> Result<Self, String> {
        if n > 0 {
            Ok(Picky)
        } else {
            Err(format!("the size must be positive, not {n}"))
        }
    }
}

#[test]
fn meshes_call_every_member_at_once() {
    let rt = runtime(4);
    let mesh = Mesh::new(&[("dp", 2), ("pp", 2)]).unwrap();
    let actors = rt
        .spawn_mesh::<Counter>(mesh, |c| vec![c[0] as i64, c[1] as i64])
        .get()
        .unwrap();
    let logs: Vec<Vec<i64>> = actors
        .call_all(Log)
        .into_iter()
        .map(|c| c.get().unwrap().0)
        .collect();
    assert_eq!(logs, vec![vec![0, 0], vec![0, 1], vec![1, 0], vec![1, 1]]);
    assert_eq!(actors.at(&[1, 0]).info().device, DeviceSpec::Cpu(2));
    let dp_group: Vec<_> = actors.group(1, "dp").iter().map(|a| a.info().id).collect();
    assert_eq!(
        dp_group,
        vec![actors.members()[1].info().id, actors.members()[3].info().id]
    );

    // Members named by their coordinates, each with a restart budget of one.
    let mesh = Mesh::new(&[("dp", 2)]).unwrap();
    let named = rt
        .spawn_mesh_with::<Counter>(
            mesh,
            |_| vec![7],
            |c| SpawnOptions::named(format!("worker-{}", c[0])).restarts(1),
        )
        .get()
        .unwrap();
    let names: Vec<_> = named.members().iter().map(|a| a.info().name.clone()).collect();
    assert_eq!(names, ["worker-0", "worker-1"]);
    assert!(named.at(&[1]).call(Boom).get().is_err());
    assert_eq!(named.at(&[1]).call(Log).get().unwrap(), (vec![7], 1));
}

/// Makes tensors and keeps them; sums tensors it is given a reference (or a future of one) to.
struct Tensors;
impl Actor for Tensors {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Tensors)
    }
}

struct Make(usize);
impl Message for Make {
    type Reply = TensorRef;
}
impl Handler<Make> for Tensors {
    async fn handle(&mut self, Make(n): Make, ctx: &Context<Self>) -> TensorRef {
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ctx.put(TypedTensor::from_values(vec![n], &values))
    }
}

struct SumOf(Call<TensorRef>);
impl Message for SumOf {
    type Reply = Result<f64, String>;
}
impl Handler<SumOf> for Tensors {
    async fn handle(&mut self, SumOf(future): SumOf, ctx: &Context<Self>) -> Result<f64, String> {
        let tensor = future.await.map_err(|e| e.to_string())?;
        let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
        Ok(values.values::<f32>().iter().map(|v| *v as f64).sum())
    }
}

#[test]
fn futures_pass_into_calls_and_tensor_bytes_go_owner_to_consumer() {
    let rt = runtime(2);
    let producer = rt.spawn::<Tensors>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let consumer = rt.spawn::<Tensors>(DeviceSpec::Cpu(1), ()).get().unwrap();
    let (p, c) = (producer.info().id, consumer.info().id);
    let n = 1 << 18;
    // The consumer gets the future of the producer's tensor, not the tensor.
    let sum = consumer
        .call(SumOf(producer.call(Make(n))))
        .get()
        .unwrap()
        .unwrap();
    assert_eq!(sum, (n as f64) * (n as f64 - 1.0) / 2.0);
    let links = rt.link_bytes();
    assert_eq!(
        links.between(p, c),
        4 * n as u64,
        "the bytes went producer → consumer"
    );
    assert_eq!(links.touching(DRIVER), 0, "and never through the program");
    // The consumer dropped its reference: the producer freed the tensor.
    assert_eq!(rt.held_bytes(p), 0);
    // A reference the program holds keeps the bytes on the owner until dropped.
    let kept = producer.call(Make(1000)).get().unwrap();
    assert_eq!(rt.held_bytes(p), 4000);
    let copy = kept.clone();
    drop(kept);
    assert_eq!(rt.held_bytes(p), 4000);
    assert_eq!(rt.fetch(&copy).get().unwrap().elements(), 1000);
    assert_eq!(
        links.between(p, DRIVER),
        4000,
        "fetching to the program is explicit and counted"
    );
    drop(copy);
    assert_eq!(rt.held_bytes(p), 0);
}

#[test]
fn a_reference_whose_owner_ended_says_so() {
    let rt = runtime(1);
    let producer = rt.spawn::<Tensors>(DeviceSpec::Cpu(0), ()).get().unwrap();
    let tensor = producer.call(Make(16)).get().unwrap();
    producer.stop("scaled down");
    producer.ended().get();
    let error = rt.fetch(&tensor).get().unwrap_err();
    let text = error.to_string();
    assert!(text.contains("owner") && text.contains("scaled down"), "{text}");
}
