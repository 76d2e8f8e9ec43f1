//! Compiled programs over actors of other hosts (two hosts served in this process on real TCP
//! actor ports on 127.0.0.1): the same results as the same calls made one by one, values moving
//! host to host, a panic on a host ending the run with an error naming it, and a lost host
//! failing the next run instead of hanging it.

use std::time::{Duration, Instant};

use archipelago_dataflow::Instruction;
use serde::{Deserialize, Serialize};

use super::Recorder;
use crate::runtime::remote::Liveness;
use crate::runtime::remote_tests::host;
use crate::runtime::{Actor, ActorRef, Context, Handler, Message, Registry, Runtime, SpawnOptions};

/// Applies `x → a·x + b` (and panics on a negative input).
struct Scale {
    a: i64,
    b: i64,
}

impl Actor for Scale {
    type Params = (i64, i64);
    async fn new((a, b): (i64, i64), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Scale { a, b })
    }
}

#[derive(Serialize, Deserialize)]
struct Apply(i64);
impl Message for Apply {
    type Reply = i64;
}
impl Handler<Apply> for Scale {
    async fn handle(&mut self, Apply(x): Apply, _ctx: &Context<Self>) -> i64 {
        assert!(x >= 0, "negative input {x}");
        self.a * x + self.b
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Scale>()
        .handles::<Scale, Apply>()
        .compiled::<Scale, Apply, i64>(Apply)
}

fn spawn(driver: &Runtime, slot: usize, params: (i64, i64)) -> ActorRef<Scale> {
    driver
        .spawn_at::<Scale>(slot, params, SpawnOptions::default())
        .get()
        .unwrap()
}

#[test]
fn a_program_over_two_hosts_equals_its_calls_and_names_a_failure_and_a_lost_host() {
    registry().install();
    let (_host_a, _port_a, mut slots) = host("host-a", 2, "secret");
    let (host_b, port_b, slots_b) = host("host-b", 1, "secret");
    slots.extend(slots_b);
    let driver = Runtime::on_cluster("compiled-test", slots, "secret", Liveness::default()).unwrap();
    // input → a (host-a) → b (host-b) → c (host-a) → output
    let chain = [
        spawn(&driver, 0, (2, 1)),
        spawn(&driver, 2, (3, 4)),
        spawn(&driver, 1, (1, 7)),
    ];
    assert_eq!(chain[1].info().host, "host-b");
    let mut recorder = Recorder::<i64>::new();
    let mut value = recorder.input();
    for actor in &chain {
        value = recorder.call(actor, &value, Apply);
    }
    let program = recorder.compile(&driver, &value).unwrap();
    for x in 0..200 {
        let classic = chain.iter().fold(x, |v, a| a.call(Apply(v)).get().unwrap());
        assert_eq!(program.run(x).get().unwrap(), classic);
    }
    // The program only hands the input to a and takes the output from c: b's value goes
    // host to host.
    let own = program.streams().last().unwrap();
    let sends: Vec<usize> = own
        .iter()
        .filter_map(|i| match i {
            Instruction::Send { to, .. } => Some(*to),
            _ => None,
        })
        .collect();
    let recvs: Vec<usize> = own
        .iter()
        .filter_map(|i| match i {
            Instruction::Recv { from, .. } => Some(*from),
            _ => None,
        })
        .collect();
    assert_eq!((sends, recvs), (vec![0], vec![2]));

    // An actor called twice (its part an interpreter on host-a) beside parts on the direct path.
    let twice = [&chain[0], &chain[1], &chain[0]];
    let mut recorder = Recorder::<i64>::new();
    let mut value = recorder.input();
    for actor in twice {
        value = recorder.call(actor, &value, Apply);
    }
    let interpreted = recorder.compile(&driver, &value).unwrap();
    for x in 0..50 {
        let classic = twice.iter().fold(x, |v, a| a.call(Apply(v)).get().unwrap());
        assert_eq!(interpreted.run(x).get().unwrap(), classic);
    }

    // A panic on host-a ends that run with the actor's failure, naming its host.
    let error = program.run(-5).get().unwrap_err().to_string();
    assert!(
        error.contains("negative input -5") && error.contains("host-a"),
        "{error}"
    );

    // A fresh chain whose middle host goes away: the next run fails within seconds, naming it.
    let chain = [spawn(&driver, 0, (1, 0)), spawn(&driver, 2, (1, 1))];
    let mut recorder = Recorder::<i64>::new();
    let input = recorder.input();
    let x = recorder.call(&chain[0], &input, Apply);
    let y = recorder.call(&chain[1], &x, Apply);
    let program = recorder.compile(&driver, &y).unwrap();
    assert_eq!(program.run(41).get().unwrap(), 42);
    port_b.close();
    drop(host_b);
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let run = program.run(1);
    std::thread::spawn(move || tx.send(run.get()));
    let outcome = rx.recv_timeout(Duration::from_secs(10)).expect("no hang");
    let error = outcome.unwrap_err().to_string();
    assert!(error.contains("host-b"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_call_not_registered_for_compiled_programs_is_refused_before_it_runs() {
    /// Registered as an actor and message, but not for compiled programs.
    struct Echo;
    impl Actor for Echo {
        type Params = ();
        async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
            Ok(Echo)
        }
    }
    #[derive(Serialize, Deserialize)]
    struct Say(u32);
    impl Message for Say {
        type Reply = u32;
    }
    impl Handler<Say> for Echo {
        async fn handle(&mut self, Say(n): Say, _ctx: &Context<Self>) -> u32 {
            n
        }
    }
    Registry::new().actor::<Echo>().handles::<Echo, Say>().install();
    let (_host, _port, slots) = host("host-c", 1, "secret-c");
    let driver = Runtime::on_cluster("compiled-test", slots, "secret-c", Liveness::default()).unwrap();
    let echo = driver
        .spawn_at::<Echo>(0, (), SpawnOptions::default())
        .get()
        .unwrap();
    let mut recorder = Recorder::<u32>::new();
    let input = recorder.input();
    let said = recorder.call(&echo, &input, Say);
    let error = recorder
        .compile(&driver, &said)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        error.contains("host host-c") && error.contains(".compiled::<A, M, T>(make)"),
        "{error}"
    );
}
