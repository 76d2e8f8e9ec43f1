//! Activation checkpointing (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost")
//! must lower what a step holds, not only the plan's estimate: this binary counts every live heap
//! byte (its own global allocator) and trains the same gpt with and without
//! `checkpoint_activations`. On CPU devices the tensors are heap memory, so the peak of live
//! bytes during a step is the peak of what the actor held. The first GPU run (H200, 2026-11-26)
//! found checkpointing held as much as no checkpointing (29.6 GB live either way, 4.7 GB
//! estimated): the forward recorded burn's graph (burn's `detach` keeps a parameter's
//! `require_grad`) and detached its output, and burn frees a recorded graph only at a backward.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use archipelago_controller::TrainReport;
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program};
use archipelago_integration_tests::{assert_equivalent, train_plan};

/// The system allocator, counting the bytes live now and the most live since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let now = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Twelve blocks of attention whose scores dominate the activations (8 × 4 heads × 256² f32 =
/// 8 MiB per layer and copy), with a bucket per block so each block is its own segment. Twelve
/// so that holding every activation (the control) lands far past the bound: with four the plain
/// step held only 4.5 slacks above the checkpointed estimate, with twelve about 17.
fn gpt() -> String {
    std::env::var("XGPT").unwrap_or("gpt:vocab=64,ctx=256,d=64,layers=12,heads=4".into())
}

/// Trains 2 steps; returns the report and the most heap bytes live at once above what was live
/// before the job started.
fn peak_of(checkpoint_activations: bool) -> (TrainReport, usize) {
    let plan = ParallelPlan {
        batch: 8,
        bucket_bytes: 16 << 10,
        checkpoint_activations,
        ..ParallelPlan::default()
    };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let report = train_plan(&gpt(), plan, 2);
    (report, PEAK.load(Ordering::Relaxed) - before)
}

/// One measurement at a time: the counters are the process's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn checkpointing_lowers_the_live_bytes_of_a_step() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (plain, plain_peak) = peak_of(false);
    let (checkpointed, checkpointed_peak) = peak_of(true);
    assert_equivalent(&plain, &checkpointed, 1e-5, "checkpointed vs plain");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak live heap: plain {:.1} MiB, checkpointed {:.1} MiB; estimates {:.1} / {:.1} MiB",
        mib(plain_peak),
        mib(checkpointed_peak),
        mib(plain.actors[0].estimated_device_bytes as usize),
        mib(checkpointed.actors[0].estimated_device_bytes as usize),
    );
    // The bound: the plan's estimate for the checkpointed job (one segment's activations at a
    // time, the segment outputs and the state), with a quarter for the runtime's own buffers
    // and the test harness (the tolerance). The control: a step that holds every activation
    // (the plain job, as the unfixed checkpointing did) lands at least 10 such quarters above
    // the estimate.
    let estimate = checkpointed.actors[0].estimated_device_bytes as usize;
    let bound = estimate * 5 / 4;
    assert!(
        checkpointed_peak <= bound,
        "checkpointing held {:.1} MiB at its peak, over its estimate's bound {:.1} MiB: the forward \
         kept its graph",
        mib(checkpointed_peak),
        mib(bound)
    );
    let slack = bound - estimate;
    let margin = plain_peak.saturating_sub(estimate) as f64 / slack as f64;
    eprintln!(
        "control: holding every activation, {:.1} MiB above the estimate: {margin:.1}× the \
         tolerance {:.1} MiB (bar 10×)",
        mib(plain_peak.saturating_sub(estimate)),
        mib(slack)
    );
    assert!(
        plain_peak >= estimate + 10 * slack,
        "negative control: holding every activation ({:.1} MiB) lands only {margin:.1}× the \
         tolerance {:.1} MiB above the estimate {:.1} MiB (10× needed)",
        mib(plain_peak),
        mib(slack),
        mib(estimate)
    );
}

/// The most heap bytes live at once (above what was live before) while `program` trains 2
/// steps.
fn peak_of_program(program: &Program) -> usize {
    let options = archipelago_controller::TrainOptions {
        steps: 2,
        ..Default::default()
    };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    archipelago_integration_tests::train_program(program, &options);
    PEAK.load(Ordering::Relaxed) - before
}

/// Sequence parallelism (Korthikanti et al. 2022) cuts the LayerNorm and residual regions that
/// plain tp keeps whole on every rank; with `--partition-activations` each rank also keeps only
/// its tokens of the mixing blocks' gathered inputs (Megatron's sequence parallelism keeps the
/// rank's share of a column-parallel layer's input; here the backward gathers it again and
/// recomputes the block). A rank's activations are measured as what a step's peak of live heap
/// grows by when the batch doubles (the parameters, gradients and buffers stay), on a gpt whose
/// width dominates its attention scores: with the mixing blocks' inputs partitioned they are at
/// most 1/tp of one device's. The control: plain tp, which keeps the LayerNorm and residual
/// regions whole, is past 1/tp, and sequence parallelism alone keeps less than plain tp
/// (2026-11-28, 32 sequences of 64 tokens, d = 128: one device 78.3 MiB; per rank at tp 2 65.6,
/// with sequence parallelism 61.6, partitioned 27.0).
#[test]
fn sequence_parallelism_cuts_the_activations_of_a_rank() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let spec = ModelSpec::parse("gpt:vocab=64,ctx=64,d=128,layers=4,heads=4").unwrap();
    // sp: 0 plain, 1 sequence-parallel, 2 also with the mixing blocks' inputs partitioned.
    let program = |tp: usize, sp: u8, batch: usize| {
        let p = Program::new(spec.clone())
            .with_optimizer(OptimizerSpec::sgd(0.1))
            .with_plan(ParallelPlan {
                tp,
                batch,
                partition_activations: sp == 2,
                ..ParallelPlan::default()
            });
        if sp > 0 {
            p.sequence_parallel(&spec).unwrap()
        } else {
            p
        }
    };
    // Large enough that the activations, not the state, make both peaks (at 8 against 16 the
    // state made the smaller one's, and the difference read a third of the activations).
    let base = 32;
    let activations = |tp: usize, sp: u8| {
        let (small, large) = (
            peak_of_program(&program(tp, sp, base)),
            peak_of_program(&program(tp, sp, 2 * base)),
        );
        assert!(
            large > small,
            "tp {tp} ({sp}): a peak {large} at twice the batch, not above {small}"
        );
        (large - small) / tp
    };
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let (one, plain, cut, parted) = (
        activations(1, 0),
        activations(2, 0),
        activations(2, 1),
        activations(2, 2),
    );
    eprintln!(
        "activations of {base} sequences (peak live heap, batch {} less batch {base}): one device {:.1} MiB; per rank at tp=2 \
         {:.1} MiB, with sequence parallelism {:.1} MiB, and with its mixing blocks' inputs partitioned {:.1} MiB",
        2 * base,
        mib(one),
        mib(plain),
        mib(cut),
        mib(parted)
    );
    assert!(
        2 * parted <= one,
        "partitioned: {:.1} MiB per rank, past half of one device's {:.1} MiB",
        mib(parted),
        mib(one)
    );
    assert!(
        cut < plain,
        "sequence parallelism keeps {:.1} MiB per rank, plain tp {:.1}",
        mib(cut),
        mib(plain)
    );
    assert!(
        2 * plain > one,
        "control: plain tp keeps {:.1} MiB per rank, within half of one device's",
        mib(plain)
    );
}
