//! The controller at scale (WORKLOADS.md): the time to compile and verify a plan for 4096
//! devices (dp=256 × pp=16, and tp=8 × pp=16 × dp=32, on a 64-layer gpt), and the time of
//! one step dispatched to 1024 in-process no-op actors (`RunStep` called on all → every reply
//! received).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use archipelago_actors::device_actor::ComputationFactory;
use archipelago_actors::executor::{Computation, StepMetrics, TensorTable};
use archipelago_actors::fabric::InProcessFabric;
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{ActorStream, ComputeOp, DeviceSpec, ModelSpec, ParallelPlan, Program, compile};

use crate::actor_gang::ActorGang;
use crate::process_stats::load_avg;
use crate::report::median;

/// The 64-layer gpt of the 4096-device plans (8 heads: tp=8 divides them).
const SCALE_MODEL: &str = "gpt:vocab=256,ctx=64,d=64,layers=64,heads=8";

/// The program of a 4096-device plan: `dp × pp × tp`, 1F1B with 16 micro-batches.
fn scale_program(dp: usize, pp: usize, tp: usize) -> anyhow::Result<Program> {
    let m = 16;
    let mut program = Program::new(ModelSpec::parse(SCALE_MODEL)?).with_plan(ParallelPlan {
        dp,
        pp,
        tp,
        microbatches: m,
        schedule: Schedule::OneFOneB,
        batch: dp * m,
        ..ParallelPlan::default()
    });
    program.devices = DeviceSpec::cpus(dp * pp * tp);
    Ok(program)
}

/// The median seconds of `reps` compiles (with the verifier) of `program`, its instructions
/// (every actor's) and the instructions built (one stream per class: `stream_class`).
fn time_compile(program: &Program, reps: usize) -> anyhow::Result<(f64, usize, usize)> {
    let mut times = Vec::new();
    let (mut instructions, mut built) = (0, 0);
    for _ in 0..reps {
        let began = Instant::now();
        let plan = compile(program)?;
        times.push(began.elapsed().as_secs_f64());
        instructions = plan.streams.instructions();
        built = plan.streams.built_instructions();
    }
    Ok((median(&mut times), instructions, built))
}

/// Compile + verify of two 4096-device plans of the same model, `reps` times each, alternated in
/// one run: dp=256 × pp=16, and tp=8 × pp=16 × dp=32 (every block its own segment, Megatron's
/// f and g all-reduces in every stream), with the ratio of their medians.
pub fn plan_4096_devices(reps: usize) -> anyhow::Result<Value> {
    let (dp, pp, m) = (256, 16, 16);
    let program = scale_program(dp, pp, 1)?;
    let tp_program = scale_program(32, pp, 8)?;
    let (mut times, mut tp_times) = (Vec::new(), Vec::new());
    let (mut instructions, mut tp_instructions, mut built, mut tp_built) = (0, 0, 0, 0);
    for _ in 0..reps {
        let (s, n, b) = time_compile(&program, 1)?;
        times.push(s);
        (instructions, built) = (n, b);
        let (s, n, b) = time_compile(&tp_program, 1)?;
        tp_times.push(s);
        (tp_instructions, tp_built) = (n, b);
    }
    let tp_s = median(&mut tp_times);
    let s = median(&mut times);
    let plan = compile(&program)?;
    let began = Instant::now();
    let json_bytes = serde_json::to_vec(&plan)?;
    let json_encode_s = began.elapsed().as_secs_f64();
    let began = Instant::now();
    let _: archipelago_dataflow::Plan = serde_json::from_slice(&json_bytes)?;
    let json_decode_s = began.elapsed().as_secs_f64();
    let began = Instant::now();
    let bincode_bytes = archipelago_actors::codec::encode(&plan)?;
    let bincode_encode_s = began.elapsed().as_secs_f64();
    let began = Instant::now();
    let decoded: Result<archipelago_dataflow::Plan, _> = archipelago_actors::codec::decode(&bincode_bytes);
    let bincode_decode_s = began.elapsed().as_secs_f64();
    // What one host of 8 devices is sent: its host part carries only its actors' streams.
    let began = Instant::now();
    let per_host = archipelago_actors::codec::encode(&plan.for_actors(&(0..8).collect::<Vec<_>>()))?;
    let per_host_encode_s = began.elapsed().as_secs_f64();
    Ok(json!({
        "name": "compile_and_verify_4096_devices",
        "launch_plan": {
            "what": "the whole compiled plan (what every host was sent before per-host plans)",
            "json_bytes": json_bytes.len(), "json_encode_s": json_encode_s, "json_decode_s": json_decode_s,
            "bincode_bytes": bincode_bytes.len(), "bincode_encode_s": bincode_encode_s, "bincode_decode_s": bincode_decode_s,
            "bincode_decodes_within_the_codec_limit": decoded.is_ok(),
            "per_host_of_8_devices": { "what": "the plan of one host part of 8 devices (its actors' streams, everyone's placement)", "bincode_bytes": per_host.len(), "select_and_encode_s": per_host_encode_s },
        },
        "config": { "model": program.model.name, "dp": dp, "pp": pp, "tp": 1, "microbatches": m, "schedule": "1f1b", "reps": reps },
        "median_s": s,
        "instructions": instructions,
        "instructions_built": built,
        "instructions_per_s": instructions as f64 / s,
        "tensor_parallel": {
            "config": { "dp": 32, "pp": pp, "tp": 8, "microbatches": m, "schedule": "1f1b" },
            "median_s": tp_s,
            "instructions": tp_instructions,
            "instructions_built": tp_built,
            "over_dp_pp": tp_s / s,
            "aim": "at most 3× the dp × pp plan's time (issue 39)",
        },
        "load_avg": load_avg(),
    }))
}

/// A computation that does nothing.
struct NoOp;

impl Computation for NoOp {
    fn compute(
        &mut self,
        _: u64,
        _: &ComputeOp,
        _: &[archipelago_dataflow::TensorId],
        _: &[archipelago_dataflow::TensorId],
        _: &mut TensorTable,
    ) -> Result<(), String> {
        Ok(())
    }
    fn finish_step(&mut self) -> StepMetrics {
        StepMetrics::default()
    }
}

/// One step (`RunStep` to all, every reply back) over `actors` no-op actors, `steps` times.
pub fn noop_step(actors: usize, steps: u64) -> anyhow::Result<Value> {
    dispatch(actors, steps, false)
}

/// [`noop_step`] with actors that each have one instruction (a compute that does nothing): an
/// actor with work keeps a device thread of its own, so a step wakes one thread per actor.
pub fn working_step(actors: usize, steps: u64) -> anyhow::Result<Value> {
    dispatch(actors, steps, true)
}

fn dispatch(actors: usize, steps: u64, working: bool) -> anyhow::Result<Value> {
    let work = || {
        working
            .then(|| archipelago_dataflow::Instruction::Compute {
                op: archipelago_dataflow::ComputeOp::LoadBatch { start: 0, end: 0 },
                inputs: Vec::new(),
                outputs: Vec::new(),
            })
            .into_iter()
            .collect::<Vec<_>>()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (start_s, mut times) = runtime.block_on(async {
        let fabric = Arc::new(InProcessFabric::new(actors, Duration::from_secs(60)));
        let streams: Vec<ActorStream> = (0..actors)
            .map(|actor| ActorStream {
                actor,
                device: DeviceSpec::Cpu(actor as u32),
                instructions: work(),
            })
            .collect();
        let factories: Vec<ComputationFactory> = (0..actors)
            .map(|_| Box::new(|| Ok(Box::new(NoOp) as Box<dyn Computation>)) as ComputationFactory)
            .collect();
        let began = Instant::now();
        let mut gang = ActorGang::start(
            "noop",
            (streams, factories),
            fabric,
            Duration::from_secs(60),
            (None, Vec::new()),
        )
        .await?;
        let start_s = began.elapsed().as_secs_f64();
        let mut times = Vec::new();
        for n in 1..=steps {
            let t = Instant::now();
            gang.step(n).await?;
            times.push(t.elapsed().as_secs_f64());
        }
        gang.stop().await;
        Ok::<_, crate::JobError>((start_s, times))
    })?;
    let s = median(&mut times);
    let bound = working.then(|| thread_wakes(actors, steps));
    Ok(json!({
        "name": format!("step_dispatch_{actors}_{}_actors", if working { "working" } else { "noop" }),
        "bound_thread_wakes_s": bound.map(|b| json!({
            "what": "the floor for actors on threads of their own, in the same run: one message to each of as many parked OS threads, every answer back on one channel (nothing else done), median",
            "median_s": b,
            "step_over_bound": s / b,
        })),
        "config": { "actors": actors, "steps": steps, "transport": if working { "in-process (runtime-API device actors with one no-op compute instruction each: a device thread each)" } else { "in-process (runtime-API device actors with empty streams: one shared device thread)" } },
        "gang_start_s": start_s,
        "median_step_s": s,
        "steps_per_s": 1.0 / s,
        "load_avg": load_avg(),
    }))
}

/// The time to wake `threads` parked OS threads with a message each and get every answer back on
/// one channel: what a step over actors with a thread each cannot go below. Median of `rounds`.
fn thread_wakes(threads: usize, rounds: u64) -> f64 {
    let (answers_tx, answers) = std::sync::mpsc::channel::<()>();
    let (senders, threads_spawned): (Vec<std::sync::mpsc::Sender<()>>, Vec<_>) = (0..threads)
        .map(|_| {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let answer = answers_tx.clone();
            let thread = std::thread::spawn(move || {
                while rx.recv().is_ok() {
                    let _ = answer.send(());
                }
            });
            (tx, thread)
        })
        .unzip();
    let mut times = Vec::new();
    for _ in 0..rounds {
        let began = Instant::now();
        for tx in &senders {
            let _ = tx.send(());
        }
        for _ in 0..threads {
            let _ = answers.recv();
        }
        times.push(began.elapsed().as_secs_f64());
    }
    // Dropping the senders ends the threads; they are joined before the next figure is taken.
    drop(senders);
    for thread in threads_spawned {
        let _ = thread.join();
    }
    median(&mut times)
}
