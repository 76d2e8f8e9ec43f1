//! Compiled programs with a recorded all-reduce: three actors each make a tensor from the input,
//! the program sums them with the collective training runs and each actor goes on with the
//! total — the same results as the calls made one by one and summed here, run after run, the
//! streams holding the collective; the negative controls — an all-reduce over one actor twice,
//! a member whose call fails — are refused, or fail the run naming the failing member instead
//! of a wrong total, a hang or a group broken for the next run.

use archipelago_dataflow::{DeviceSpec, Instruction};

use super::Recorder;
use crate::runtime::{Actor, Context, Handler, Message, Runtime, SpawnOptions};
use crate::typed_tensor::TypedTensor;

const LEN: usize = 1000;

/// Makes and scales tensors by its `scale` (and panics making one from input 13 when `fragile`).
struct Shard {
    scale: f32,
    fragile: bool,
}

impl Actor for Shard {
    type Params = (f32, bool);
    async fn new((scale, fragile): (f32, bool), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Shard { scale, fragile })
    }
}

struct Make(u64);
impl Message for Make {
    type Reply = TypedTensor;
}
impl Handler<Make> for Shard {
    async fn handle(&mut self, Make(x): Make, _ctx: &Context<Self>) -> TypedTensor {
        assert!(!(self.fragile && x == 13), "input 13");
        let values = (0..LEN)
            .map(|i| ((i as u64 + x) % 97) as f32 * self.scale)
            .collect();
        TypedTensor::new(vec![LEN], values)
    }
}

struct Scale(TypedTensor);
impl Message for Scale {
    type Reply = TypedTensor;
}
impl Handler<Scale> for Shard {
    async fn handle(&mut self, Scale(t): Scale, _ctx: &Context<Self>) -> TypedTensor {
        let values = t.values::<f32>().iter().map(|v| v * self.scale).collect();
        TypedTensor::new(vec![LEN], values)
    }
}

fn shards(params: &[(f32, bool)]) -> (Runtime, Vec<crate::runtime::ActorRef<Shard>>) {
    let runtime = Runtime::local(DeviceSpec::cpus(params.len()));
    runtime.set_strict_registry(false);
    let actors = (params.iter().enumerate())
        .map(|(d, p)| {
            // Rebuilt after a panic, so a run after a failed one finds every actor.
            let options = SpawnOptions {
                max_restarts: 10,
                ..Default::default()
            };
            (runtime.spawn_with::<Shard>(DeviceSpec::Cpu(d as u32), *p, options))
                .get()
                .unwrap()
        })
        .collect();
    (runtime, actors)
}

/// Make on every actor, all-reduce, Scale on every actor, gathered.
fn program(
    runtime: &Runtime,
    actors: &[crate::runtime::ActorRef<Shard>],
) -> super::CompiledProgram<u64, Vec<TypedTensor>> {
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let made: Vec<_> = actors.iter().map(|a| recorder.call(a, &input, Make)).collect();
    let totals = recorder.all_reduce(&made);
    let scaled: Vec<_> = (actors.iter().zip(&totals))
        .map(|(a, total)| recorder.call(a, total, Scale))
        .collect();
    let out = recorder.gather(&scaled);
    recorder.compile(runtime, &out).unwrap()
}

#[test]
fn a_recorded_all_reduce_equals_the_calls_summed() {
    let (runtime, actors) = shards(&[(1.0, false), (2.0, false), (3.0, false)]);
    let program = program(&runtime, &actors);
    for stream in &program.streams()[..actors.len()] {
        let collectives = (stream.iter())
            .filter(|i| matches!(i, Instruction::StartCollective { .. }))
            .count();
        assert_eq!(collectives, 1, "{stream:?}");
    }
    for x in 0..20 {
        let made: Vec<TypedTensor> = actors.iter().map(|a| a.call(Make(x)).get().unwrap()).collect();
        let total: Vec<f32> = (0..LEN)
            .map(|i| made.iter().map(|t| t.values::<f32>()[i]).sum())
            .collect();
        let got = program.run(x).get().unwrap();
        for (a, (actor, out)) in actors.iter().zip(&got).enumerate() {
            let want = actor
                .call(Scale(TypedTensor::new(vec![LEN], total.clone())))
                .get()
                .unwrap();
            assert_eq!(out.values::<f32>(), want.values::<f32>(), "run {x}, actor {a}");
        }
    }
}

#[test]
fn an_all_reduce_over_one_actor_twice_or_a_failing_member_is_refused_or_fails_the_run() {
    let (runtime, actors) = shards(&[(1.0, false), (2.0, true)]);
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let a = recorder.call(&actors[0], &input, Make);
    let b = recorder.call(&actors[0], &input, Make);
    let totals = recorder.all_reduce(&[a, b]);
    let refused = recorder.compile(&runtime, &totals[0]).err().expect("refused");
    assert!(refused.to_string().contains("distinct actors"), "{refused}");

    let program = program(&runtime, &actors);
    assert_eq!(program.run(12).get().unwrap().len(), 2);
    let failed = program.run(13).get().unwrap_err().to_string();
    eprintln!("a member's call failed: {failed}");
    assert!(
        failed.contains("member 1 (actor 1) has no value: its call failed"),
        "{failed}"
    );
    // The group is whole for the next run.
    assert_eq!(program.run(12).get().unwrap().len(), 2);
}
