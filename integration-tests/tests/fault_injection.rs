//! A block that panics ends the run with an error naming job, step, actor, device and
//! instruction — without a hang — and the other actors stop too.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::tensor::backend::Backend;

use archipelago_actors::CpuBackend;
use archipelago_actors::block::{Activation, Block, BlockModule};
use archipelago_actors::kernels::Kernels;
use archipelago_actors::zoo::{BuildContext, LinearReluBlock, ModelBuilder, ZooModel};
use archipelago_controller::{Controller, JobError, TrainOptions};
use archipelago_dataflow::{DeviceSpec, ModelDesc, ModelSpec, ParallelPlan, Program};

static FORWARDS_ON_FAULTY_ACTOR: AtomicUsize = AtomicUsize::new(0);

/// A Linear+ReLU block that panics on its third forward when it lives on the faulty actor.
#[derive(Module, Debug)]
struct Faulty<B: Backend> {
    inner: LinearReluBlock<B>,
    armed: usize,
}

impl<B: Kernels> BlockModule<B> for Faulty<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        if self.armed == 1 && FORWARDS_ON_FAULTY_ACTOR.fetch_add(1, Ordering::SeqCst) == 2 {
            panic!("injected fault");
        }
        BlockModule::forward(&self.inner, x)
    }
}

struct FaultyModel {
    spec: ModelSpec,
    faulty_actor: usize,
    faulty_block: usize,
}

impl ModelBuilder<CpuBackend> for FaultyModel {
    fn desc(&self) -> ModelDesc {
        self.spec.desc()
    }
    fn build_block(
        &self,
        ctx: &BuildContext,
        device: &burn::backend::flex::FlexDevice,
    ) -> Box<dyn Block<CpuBackend>> {
        if ctx.block == self.faulty_block {
            let armed = usize::from(ctx.actor == self.faulty_actor);
            Box::new(Faulty {
                inner: LinearReluBlock::new(32, 32, device),
                armed,
            })
        } else {
            ModelBuilder::<CpuBackend>::build_block(&ZooModel(self.spec.clone()), ctx, device)
        }
    }
}

#[test]
fn a_panicking_block_names_actor_step_and_instruction_without_hanging() {
    let spec = ModelSpec::parse("mlp:in=32,hidden=32,layers=3,out=4").unwrap();
    let program = Program::new(spec.clone()).with_plan(ParallelPlan {
        dp: 3,
        batch: 12,
        ..ParallelPlan::default()
    });
    let builder = Arc::new(FaultyModel {
        spec,
        faulty_actor: 1,
        faulty_block: 1,
    });
    let options = TrainOptions {
        steps: 10,
        job: "fault-test".into(),
        patience: Duration::from_secs(30),
        ..TrainOptions::default()
    };
    let started = Instant::now();
    let err = Controller::local(DeviceSpec::cpus(3))
        .train_with(&program, builder, &options)
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, JobError::Actor(_)), "{text}");
    for needle in [
        "job fault-test",
        "step 3",
        "actor 1 on cpu:1",
        "Forward(blocks",
        "injected fault",
    ] {
        assert!(text.contains(needle), "`{needle}` missing from: {text}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "the failure took {:?} to surface",
        started.elapsed()
    );
}

#[test]
fn a_block_that_does_not_match_its_description_is_refused_at_start() {
    struct Lying;
    impl ModelBuilder<CpuBackend> for Lying {
        fn desc(&self) -> ModelDesc {
            ModelSpec::parse("mlp:in=8,hidden=8,layers=1,out=2")
                .unwrap()
                .desc()
        }
        fn build_block(
            &self,
            _: &BuildContext,
            device: &burn::backend::flex::FlexDevice,
        ) -> Box<dyn Block<CpuBackend>> {
            Box::new(LinearReluBlock::new(8, 9, device))
        }
    }
    let program = Program::custom(
        Lying.desc(),
        archipelago_dataflow::data::DataSpec::Clusters { seed: 0 },
    )
    .with_plan(ParallelPlan {
        dp: 2,
        batch: 4,
        ..ParallelPlan::default()
    });
    let err = Controller::local(DeviceSpec::cpus(2))
        .train_with(&program, Arc::new(Lying), &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("building its blocks") && err.contains("parameters"),
        "{err}"
    );
}

/// Trains a pp=2 mlp with a stream fault and returns the job's error and how long it took.
fn pipeline_with_fault(fault: archipelago_dataflow::TestFault) -> (JobError, Duration) {
    let mut program = Program::new(ModelSpec::parse("mlp:in=16,hidden=16,layers=4,out=4").unwrap())
        .with_plan(ParallelPlan {
            pp: 2,
            microbatches: 2,
            batch: 8,
            ..ParallelPlan::default()
        });
    program.test_fault = Some(fault);
    let options = TrainOptions {
        steps: 2,
        // The fabric alone would fail the receive after a minute with a timeout, not a hang
        // report: a `Deadlock` error shows the detector found it first (the time is printed).
        patience: Duration::from_secs(60),
        ..TrainOptions::default()
    };
    let started = Instant::now();
    let error = Controller::local(DeviceSpec::cpus(2))
        .train(&program, &options)
        .expect_err("a hung pipeline must fail");
    (error, started.elapsed())
}

#[test]
fn a_send_that_never_happens_is_reported_in_seconds_ending_at_the_idle_sender() {
    use archipelago_controller::hang::ChainEnd;
    let (error, took) = pipeline_with_fault(archipelago_dataflow::TestFault::SkipLastSend { actor: 1 });
    let JobError::Deadlock { report, .. } = &error else {
        panic!("expected a hang report, got: {error}");
    };
    let text = error.to_string();
    assert_eq!(report.chains.len(), 1, "{text}");
    let (links, end) = &report.chains[0];
    assert_eq!(*end, ChainEnd::Idle, "{text}");
    assert_eq!(
        links.iter().map(|l| l.actor).collect::<Vec<_>>(),
        vec![0, 1],
        "{text}"
    );
    assert!(text.contains("Recv(") && text.contains("from actor 1"), "{text}");
    println!("skipped send reported after {took:?}: {text}");
    assert!(
        took < Duration::from_secs(30),
        "the report took {took:?}, the fabric's patience is 60 s"
    );
}

#[test]
fn two_stages_waiting_for_each_other_are_reported_as_a_cycle() {
    use archipelago_controller::hang::ChainEnd;
    let (error, took) = pipeline_with_fault(archipelago_dataflow::TestFault::RecvBeforeSend { actor: 0 });
    let JobError::Deadlock { report, .. } = &error else {
        panic!("expected a hang report, got: {error}");
    };
    let text = error.to_string();
    assert!(!report.chains.is_empty(), "{text}");
    assert!(
        report.chains.iter().all(|(_, end)| *end == ChainEnd::Cycle),
        "{text}"
    );
    assert!(
        text.contains("actor 0") && text.contains("actor 1") && text.contains("a cycle"),
        "{text}"
    );
    println!("cycle reported after {took:?}: {text}");
    assert!(
        took < Duration::from_secs(30),
        "the report took {took:?}, the fabric's patience is 60 s"
    );
}
