//! Tests of calls passed to actors of other hosts (Ray's `ObjectRef` passed to a task): the
//! receiver awaits a call still pending at the driver and gets the caller's value; a tensor
//! result travels owner → consumer (the driver's link counters stay at zero); a failed call
//! arrives as its failure, naming the actor that failed, and so does a call that had failed
//! before it was passed; the same messages in one process (strict mode checks them as a
//! cluster would).

use std::time::Duration;

use archipelago_dataflow::DeviceSpec;
use serde::{Deserialize, Serialize};

use super::remote::Liveness;
use super::remote_tests::host;
use super::*;
use crate::typed_tensor::TypedTensor;

struct Worker;

impl Actor for Worker {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Worker)
    }
}

/// Answers `value` after `ms` milliseconds (a call still pending when it is passed on); a
/// negative value panics.
#[derive(Serialize, Deserialize)]
struct Later {
    ms: u64,
    value: i64,
}
impl Message for Later {
    type Reply = i64;
}
impl Handler<Later> for Worker {
    async fn handle(&mut self, Later { ms, value }: Later, _ctx: &Context<Self>) -> i64 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        assert!(value >= 0, "a negative value: {value}");
        value
    }
}

/// Adds one to what the call it carries resolves to.
#[derive(Serialize, Deserialize)]
struct PlusOne(Call<i64>);
impl Message for PlusOne {
    type Reply = Result<(i64, String), String>;
}
impl Handler<PlusOne> for Worker {
    async fn handle(
        &mut self,
        PlusOne(pending): PlusOne,
        ctx: &Context<Self>,
    ) -> Result<(i64, String), String> {
        let value = pending.await.map_err(|e| e.to_string())?;
        Ok((value + 1, ctx.info().host.clone()))
    }
}

/// Keeps `n` f32 values 0, 1, … after 200 ms and returns their reference.
#[derive(Serialize, Deserialize)]
struct Tensor(usize);
impl Message for Tensor {
    type Reply = TensorRef;
}
impl Handler<Tensor> for Worker {
    async fn handle(&mut self, Tensor(n): Tensor, ctx: &Context<Self>) -> TensorRef {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ctx.put(TypedTensor::from_values(vec![n], &values))
    }
}

/// Sums the tensor the call it carries resolves to.
#[derive(Serialize, Deserialize)]
struct SumOfCall(Call<TensorRef>);
impl Message for SumOfCall {
    type Reply = Result<f64, String>;
}
impl Handler<SumOfCall> for Worker {
    async fn handle(&mut self, SumOfCall(pending): SumOfCall, ctx: &Context<Self>) -> Result<f64, String> {
        let tensor = pending.await.map_err(|e| e.to_string())?;
        let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
        Ok(values.values::<f32>().iter().map(|v| *v as f64).sum())
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Worker>()
        .handles::<Worker, Later>()
        .handles::<Worker, PlusOne>()
        .handles::<Worker, Tensor>()
        .handles::<Worker, SumOfCall>()
}

/// Passes a pending call of `a` to `b`: the value, then a failure (`a` restarts after it).
fn pass_a_value(a: &ActorRef<Worker>, b: &ActorRef<Worker>, b_host: &str) {
    let pending = a.call(Later { ms: 300, value: 41 });
    assert_eq!(
        b.call(PlusOne(pending)).get().unwrap(),
        Ok((42, b_host.to_string()))
    );
    let failing = a.call(Later { ms: 100, value: -1 });
    let error = b.call(PlusOne(failing)).get().unwrap().unwrap_err();
    assert!(error.contains("a negative value: -1"), "{error}");
    let mut cancelled = a.call(Later { ms: 0, value: 1 });
    cancelled.cancel();
    let error = b.call(PlusOne(cancelled)).get().unwrap().unwrap_err();
    assert!(error.contains("cancelled"), "{error}");
}

#[test]
fn a_call_passed_to_an_actor_of_another_host_resolves_there_and_its_tensor_goes_owner_to_consumer() {
    registry().install();
    let (owner_host, _p1, mut slots) = host("host-c1", 1, "tok");
    let (_h2, _p2, more) = host("host-c2", 1, "tok");
    slots.extend(more);
    let driver = Runtime::on_cluster("passed-call-test", slots, "tok", Liveness::default()).unwrap();
    let restarts = SpawnOptions::default().restarts(1);
    let a = driver.spawn_at::<Worker>(0, (), restarts).get().unwrap();
    let b = driver
        .spawn_at::<Worker>(1, (), SpawnOptions::default())
        .get()
        .unwrap();
    pass_a_value(&a, &b, "host-c2");

    let n = 1 << 16;
    let pending = a.call(Tensor(n));
    let sum = b.call(SumOfCall(pending)).get().unwrap().unwrap();
    assert_eq!(sum, (n as f64) * (n as f64 - 1.0) / 2.0);
    assert_eq!(
        driver.link_bytes().touching(crate::fabric::DRIVER),
        0,
        "no tensor byte crossed the driver"
    );
    let served = owner_host
        .link_bytes()
        .between(a.info().id, crate::fabric::OTHER_PROCESS);
    assert_eq!(served, 4 * n as u64, "the owner served the consumer itself");
}

#[test]
fn the_same_messages_carry_calls_in_one_process() {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(2));
    let restarts = SpawnOptions::default().restarts(1);
    let a = runtime
        .spawn_with::<Worker>(DeviceSpec::Cpu(0), (), restarts)
        .get()
        .unwrap();
    let b = runtime.spawn::<Worker>(DeviceSpec::Cpu(1), ()).get().unwrap();
    pass_a_value(&a, &b, "local");
    let sum = b.call(SumOfCall(a.call(Tensor(10)))).get().unwrap().unwrap();
    assert_eq!(sum, 45.0);
}
