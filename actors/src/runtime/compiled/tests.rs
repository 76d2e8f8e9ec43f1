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

#[test]
fn a_compiled_chain_equals_its_calls_and_keeps_the_program_out_of_the_loop() {
    let runtime = Runtime::local(DeviceSpec::cpus(3));
    let actors: Vec<_> = [(2, 1), (3, 4), (1, 7)]
        .iter()
        .enumerate()
        .map(|(d, p)| {
            runtime
                .spawn::<Affine>(DeviceSpec::Cpu(d as u32), *p)
                .get()
                .unwrap()
        })
        .collect();
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
    let runtime = Runtime::local(DeviceSpec::cpus(2));
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
