//! Tests of compiled programs: the same results as the same calls made one by one, streams in
//! which the program only sends the input and receives the output, a failing actor that ends a
//! run with its error instead of a hang, and programs over other hosts refused.

use archipelago_dataflow::{DeviceSpec, Instruction};

use super::Recorder;
use crate::runtime::{Actor, CallError, Context, Handler, Message, Runtime};

/// Applies `x → a·x + b` (and panics on a negative input).
struct Affine {
    a: i64,
    b: i64,
}

impl Actor for Affine {
    type Params = (i64, i64);
    async fn new((a, b): (i64, i64), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Affine { a, b })
    }
}

struct Apply(i64);
impl Message for Apply {
    type Reply = i64;
}
impl Handler<Apply> for Affine {
    async fn handle(&mut self, Apply(x): Apply, _ctx: &Context<Self>) -> i64 {
        assert!(x >= 0, "negative input {x}");
        self.a * x + self.b
    }
}

/// A runtime on `devices` for these one-process tests, strict mode off: their values and
/// parameters (`Counted`, `Arc<Mutex<…>>`) are local-only by design (`remote_tests.rs` runs
/// compiled programs across processes, registered).
fn local(devices: Vec<DeviceSpec>) -> Runtime {
    let runtime = Runtime::local(devices);
    runtime.set_strict_registry(false);
    runtime
}

/// One [`Affine`] per `(a, b)`, each on a device of its own.
fn affines(params: &[(i64, i64)]) -> (Runtime, Vec<crate::runtime::ActorRef<Affine>>) {
    let runtime = local(DeviceSpec::cpus(params.len()));
    let actors = (params.iter().enumerate())
        .map(|(d, p)| {
            runtime
                .spawn::<Affine>(DeviceSpec::Cpu(d as u32), *p)
                .get()
                .unwrap()
        })
        .collect();
    (runtime, actors)
}

#[test]
fn a_compiled_chain_equals_its_calls_and_keeps_the_program_out_of_the_loop() {
    let (runtime, actors) = affines(&[(2, 1), (3, 4), (1, 7)]);
    let mut recorder = Recorder::<i64>::new();
    let mut value = recorder.input();
    for actor in &actors {
        value = recorder.call(actor, &value, Apply);
    }
    let program = recorder.compile(&runtime, &value).unwrap();
    for x in 0..200 {
        let classic = actors.iter().fold(x, |v, a| a.call(Apply(v)).get().unwrap());
        assert_eq!(program.run(x).get().unwrap(), classic);
    }
    // The program's own stream only sends the input and receives the output.
    let own = program.streams().last().unwrap();
    let sends = own
        .iter()
        .filter(|i| matches!(i, Instruction::Send { .. }))
        .count();
    let recvs = own
        .iter()
        .filter(|i| matches!(i, Instruction::Recv { .. }))
        .count();
    assert_eq!((sends, recvs), (1, 1), "{own:?}");
    // Each actor receives from its predecessor and sends to its successor.
    for (i, stream) in program.streams()[..3].iter().enumerate() {
        let to: Vec<usize> = stream
            .iter()
            .filter_map(|s| {
                if let Instruction::Send { to, .. } = s {
                    Some(*to)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(to, vec![if i == 2 { 3 } else { i + 1 }], "actor {i}: {stream:?}");
    }
}

#[test]
fn a_failing_actor_ends_the_run_with_its_error_and_later_runs_do_not_hang() {
    let runtime = local(DeviceSpec::cpus(2));
    let first = runtime
        .spawn::<Affine>(DeviceSpec::Cpu(0), (1, -10))
        .get()
        .unwrap();
    let second = runtime.spawn::<Affine>(DeviceSpec::Cpu(1), (1, 0)).get().unwrap();
    let mut recorder = Recorder::<i64>::new();
    let input = recorder.input();
    let x = recorder.call(&first, &input, Apply);
    let y = recorder.call(&second, &x, Apply);
    let program = recorder.compile(&runtime, &y).unwrap();
    assert_eq!(program.run(15).get().unwrap(), 5);
    let error = program.run(3).get().unwrap_err();
    assert!(
        matches!(&error, CallError::Failed(f) if f.message.contains("negative input -7")),
        "{error}"
    );
    assert!(program.run(20).get().is_err(), "the failed actor has ended");
}

/// A fan-out to every actor and a gather of their replies: one run equals the calls made one
/// by one, in recording order; a failing actor fails the gathered value with its error.
#[test]
fn a_gather_collects_a_fan_out_in_order_and_fails_with_a_failed_call() {
    let (runtime, actors) = affines(&[(2, 1), (3, 4), (1, -7)]);
    let mut recorder = Recorder::<i64>::new();
    let input = recorder.input();
    let replies: Vec<_> = actors.iter().map(|a| recorder.call(a, &input, Apply)).collect();
    let all = recorder.gather(&replies);
    let program = recorder.compile(&runtime, &all).unwrap();
    for x in 0..50 {
        let classic: Vec<i64> = actors.iter().map(|a| a.call(Apply(x)).get().unwrap()).collect();
        assert_eq!(program.run(x).get().unwrap(), classic);
    }
    // The program sends the input to each actor and receives each reply: nothing else.
    let own = program.streams().last().unwrap();
    let count = |send: bool| {
        own.iter()
            .filter(|i| {
                matches!(
                    (i, send),
                    (Instruction::Send { .. }, true) | (Instruction::Recv { .. }, false)
                )
            })
            .count()
    };
    assert_eq!((count(true), count(false)), (3, 3), "{own:?}");
    let error = program.run(-1).get().unwrap_err();
    assert!(
        matches!(&error, CallError::Failed(f) if f.message.contains("negative input -1")),
        "{error}"
    );
}

/// Hands a token to its partner and waits (blocking its thread, as compute does) for the
/// partner's: both must run at once.
struct Partner {
    give: std::sync::mpsc::Sender<()>,
    take: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Actor for Partner {
    type Params = std::sync::Arc<std::sync::Mutex<Option<Partner>>>;
    async fn new(slot: Self::Params, _ctx: &Context<Self>) -> Result<Self, String> {
        slot.lock()
            .unwrap()
            .take()
            .ok_or_else(|| "built once".to_string())
    }
}

struct Meet;
impl Message for Meet {
    type Reply = bool;
}
impl Handler<Meet> for Partner {
    async fn handle(&mut self, _: Meet, _ctx: &Context<Self>) -> bool {
        let _ = self.give.send(());
        let take = self.take.lock().unwrap();
        take.recv_timeout(std::time::Duration::from_secs(2)).is_ok()
    }
}

fn partners() -> [std::sync::Arc<std::sync::Mutex<Option<Partner>>>; 2] {
    let (a_give, b_take) = std::sync::mpsc::channel();
    let (b_give, a_take) = std::sync::mpsc::channel();
    let partner = |give: std::sync::mpsc::Sender<()>, take: std::sync::mpsc::Receiver<()>| {
        std::sync::Arc::new(std::sync::Mutex::new(Some(Partner {
            give,
            take: take.into(),
        })))
    };
    [partner(a_give, a_take), partner(b_give, b_take)]
}

/// Two actors of one device on two threads (a device named twice): each one's interpreter runs
/// on its own actor's thread, so both calls of a step run at once even though each blocks its
/// thread. The control: the same two actors on one thread cannot meet, and the test sees it.
#[test]
fn each_interpreter_runs_on_its_own_actors_thread() {
    let meet = |threads: [usize; 2]| -> Vec<bool> {
        let runtime = local(vec![DeviceSpec::Cpu(0), DeviceSpec::Cpu(0)]);
        let [a, b] = partners();
        let options = crate::runtime::SpawnOptions::default;
        let a = runtime
            .spawn_at::<Partner>(threads[0], a, options())
            .get()
            .unwrap();
        let b = runtime
            .spawn_at::<Partner>(threads[1], b, options())
            .get()
            .unwrap();
        let mut recorder = Recorder::<()>::new();
        let input = recorder.input();
        let replies = [
            recorder.call(&a, &input, |()| Meet),
            recorder.call(&b, &input, |()| Meet),
        ];
        let both = recorder.gather(&replies);
        let program = recorder.compile(&runtime, &both).unwrap();
        program.run(()).get().unwrap()
    };
    assert_eq!(meet([0, 1]), vec![true, true]);
    assert!(
        meet([0, 0]).contains(&false),
        "two actors on one thread met: the test cannot tell"
    );
}

/// A value gathered twice, and gathered beside being the input of a later gather, is there for
/// every reader (a gather moves a value out only when nothing else reads it).
#[test]
fn a_value_read_twice_by_gathers_is_there_for_both() {
    let runtime = local(DeviceSpec::cpus(1));
    let actor = runtime.spawn::<Affine>(DeviceSpec::Cpu(0), (2, 1)).get().unwrap();
    let mut recorder = Recorder::<i64>::new();
    let input = recorder.input();
    let x = recorder.call(&actor, &input, Apply);
    let twice = recorder.gather(&[x.clone(), x.clone()]);
    let nested = recorder.gather(&[twice.clone(), twice]);
    let program = recorder.compile(&runtime, &nested).unwrap();
    assert_eq!(program.run(3).get().unwrap(), vec![vec![7, 7], vec![7, 7]]);
}

/// Sums what it is given.
struct Sum(Vec<i64>);
impl Message for Sum {
    type Reply = i64;
}
impl Handler<Sum> for Affine {
    async fn handle(&mut self, Sum(values): Sum, _ctx: &Context<Self>) -> i64 {
        values.iter().sum::<i64>() * self.a + self.b
    }
}

/// [`Apply`], after 100 ms.
struct SlowApply(i64);
impl Message for SlowApply {
    type Reply = i64;
}
impl Handler<SlowApply> for Affine {
    async fn handle(&mut self, SlowApply(x): SlowApply, _ctx: &Context<Self>) -> i64 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        self.a * x + self.b
    }
}

/// A run dropped while its stream still had a send to make (the gathered value for a later
/// call, never sent because the value it gathers had not come) leaves the program unusable, and
/// the next run says so instead of waiting for ever for a reply that never comes; runs that
/// finish leave it usable (the control).
#[test]
fn a_run_dropped_before_a_later_send_fails_the_next_run_instead_of_hanging() {
    let runtime = local(DeviceSpec::cpus(2));
    let first = runtime.spawn::<Affine>(DeviceSpec::Cpu(0), (2, 0)).get().unwrap();
    let second = runtime.spawn::<Affine>(DeviceSpec::Cpu(1), (1, 1)).get().unwrap();
    let mut recorder = Recorder::<i64>::new();
    let input = recorder.input();
    let x = recorder.call(&first, &input, SlowApply);
    let gathered = recorder.gather(&[x]);
    let y = recorder.call(&second, &gathered, Sum);
    let program = recorder.compile(&runtime, &y).unwrap();
    assert_eq!(program.run(3).get().unwrap(), 7);
    assert_eq!(program.run(4).get().unwrap(), 9);
    let driver = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Dropped while waiting for the first actor: its gathered value is never sent on.
    let late = driver
        .block_on(async { tokio::time::timeout(std::time::Duration::from_millis(20), program.run(5)).await });
    assert!(
        late.is_err(),
        "the run finished within 20 ms: the test did not drop it midway"
    );
    let next = std::thread::scope(|s| {
        let run = s.spawn(|| program.run(6).get());
        let began = std::time::Instant::now();
        while !run.is_finished() && began.elapsed() < std::time::Duration::from_secs(3) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(run.is_finished(), "the run after an abandoned one hangs");
        run.join().unwrap()
    });
    let error = next.unwrap_err();
    assert!(error.to_string().contains("abandoned"), "{error}");
}

/// Counts its clones (a value that would be costly to copy).
struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Clone for Counted {
    fn clone(&self) -> Self {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Counted(self.0.clone())
    }
}

/// Hands its value on.
struct Pass(Counted);
impl Message for Pass {
    type Reply = Counted;
}
impl Handler<Pass> for Affine {
    async fn handle(&mut self, Pass(value): Pass, _ctx: &Context<Self>) -> Counted {
        value
    }
}

/// A value read once on each actor is moved from the input through every message (and a
/// gather) to the output, never copied.
#[test]
fn a_value_moves_actor_to_actor_without_a_copy() {
    let (runtime, actors) = affines(&[(1, 0), (1, 0)]);
    let clones = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = || clones.load(std::sync::atomic::Ordering::Relaxed);
    let mut recorder = Recorder::<Counted>::new();
    let input = recorder.input();
    let x = recorder.call(&actors[0], &input, Pass);
    let y = recorder.call(&actors[1], &x, Pass);
    let chain = recorder.compile(&runtime, &y).unwrap();
    for _ in 0..20 {
        chain.run(Counted(clones.clone())).get().unwrap();
    }
    assert_eq!(count(), 0, "a chain copied its value");
    let mut recorder = Recorder::<Counted>::new();
    let input = recorder.input();
    let x = recorder.call(&actors[0], &input, Pass);
    let gathered = recorder.gather(&[x]);
    let program = recorder.compile(&runtime, &gathered).unwrap();
    assert_eq!(program.run(Counted(clones.clone())).get().unwrap().len(), 1);
    assert_eq!(count(), 0, "a gathered value was copied");
}

/// An actor called twice in one run (a → b → a) runs its part as an interpreter (its stream
/// receives twice), beside b on the direct path: the same results as the calls one by one, and
/// a failure in either part ends the run with its error.
#[test]
fn an_actor_called_twice_runs_as_an_interpreter_beside_direct_ones() {
    let (runtime, actors) = affines(&[(2, 1), (3, -20)]);
    let mut recorder = Recorder::<i64>::new();
    let mut value = recorder.input();
    for actor in [&actors[0], &actors[1], &actors[0]] {
        value = recorder.call(actor, &value, Apply);
    }
    let program = recorder.compile(&runtime, &value).unwrap();
    let receives = |stream: &[Instruction]| {
        (stream.iter())
            .filter(|i| matches!(i, Instruction::Recv { .. }))
            .count()
    };
    assert_eq!(receives(&program.streams()[0]), 2, "{:?}", program.streams()[0]);
    for x in 7..60 {
        let classic = [&actors[0], &actors[1], &actors[0]]
            .iter()
            .fold(x, |v, a| a.call(Apply(v)).get().unwrap());
        assert_eq!(program.run(x).get().unwrap(), classic);
    }
    // x = 2: a gives 5, b gives 3·5 − 20 = −5, on which a panics.
    let error = program.run(2).get().unwrap_err();
    assert!(
        matches!(&error, CallError::Failed(f) if f.message.contains("negative input -5")),
        "{error}"
    );
}
