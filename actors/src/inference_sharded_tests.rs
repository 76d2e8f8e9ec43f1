//! Sharded generation against one device: the same greedy tokens wherever one device's top-1
//! beats its top-2 by more than 1e-3, logits within 1e-4, for gpt at tp=2, tp=4, pp=2, pp=3 and
//! tp=2 × pp=2 and for the fixture's GPT-2 (tied head) at tp=2, pp=2 and tp=2 × pp=2, one
//! sequence at a time and continuously batched as micro-batches over the paged cache; the
//! negative controls (one block's all-reduce skipped, a block dropped at a stage boundary) are
//! caught.

use super::*;
use crate::batching::{Batcher, CachePool, Event};
use crate::block::initial_params;
use crate::generate::Request;
use crate::inference::WholeModel;
use crate::sampling::Sampling;

/// One device's greedy continuation and logits beside tp's; the largest logit difference.
fn compare(
    spec: &ModelSpec,
    values: &[Vec<f32>],
    model: impl std::borrow::Borrow<ShardedModel>,
    prompt: &[u32],
    n: usize,
) -> f32 {
    let model = model.borrow();
    let one = WholeModel::load(spec, values).unwrap().greedy(prompt, n).unwrap();
    let crate::generate::Greedy { tokens, logits } = model.greedy(prompt, n).unwrap();
    let vocab = spec.get("vocab").unwrap();
    assert_eq!((one.logits.len(), logits.len()), (n, n));
    assert!(logits.iter().chain(&one.logits).all(|row| row.len() == vocab));
    let mut worst = 0.0f32;
    for (i, (want, got)) in one.logits.iter().zip(&logits).enumerate() {
        for (a, b) in want.iter().zip(got) {
            worst = worst.max((a - b).abs());
        }
        let mut sorted = want.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 1e-3 && worst < 1e-4 {
            assert_eq!(
                tokens[i],
                one.tokens[i],
                "token {i} of {spec} at {}",
                model.layout()
            );
        }
        if worst >= 1e-4 {
            break;
        }
    }
    worst
}

fn gpt() -> (ModelSpec, Vec<Vec<f32>>) {
    let spec = ModelSpec::parse("gpt:vocab=61,ctx=48,d=32,layers=2,heads=4").unwrap();
    let values = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 7))
        .collect();
    (spec, values)
}

fn layout(tp: usize, pp: usize) -> Layout {
    Layout { tp, pp }
}

#[test]
fn sharded_generation_equals_one_device() {
    let (spec, values) = gpt();
    let prompt = [3, 14, 15, 9, 26, 5];
    for (tp, pp) in [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)] {
        let model = ShardedModel::load(&spec, &values, layout(tp, pp)).unwrap();
        assert_eq!(model.stages().len(), pp);
        let worst = compare(&spec, &values, model, &prompt, 24);
        eprintln!("gpt at tp={tp} × pp={pp}: largest logit difference {worst:.2e}");
        assert!(
            worst < 1e-4,
            "gpt at tp={tp} × pp={pp}: logits {worst} from one device's"
        );
    }
}

fn gpt2_fixture() -> (ModelSpec, Vec<Vec<f32>>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../integration-tests/fixtures/gpt2/model.safetensors"
    );
    let spec = ModelSpec::parse("gpt2:vocab=320,ctx=16,d=16,layers=2,heads=4").unwrap();
    let values = crate::inference::read_weights(&spec, std::path::Path::new(path), None).unwrap();
    (spec, values)
}

#[test]
fn sharded_generation_of_gpt2_with_its_tied_head_equals_one_device() {
    let (spec, values) = gpt2_fixture();
    for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
        let model = ShardedModel::load(&spec, &values, layout(tp, pp)).unwrap();
        // Each rank holds its share of every attention and MLP; each stage its blocks.
        let stages = model.stages();
        for (s, ranks) in model.rank_params().iter().enumerate() {
            let whole: usize = stages[s].clone().map(|b| values[b].len()).sum();
            for (r, &held) in ranks.iter().enumerate() {
                assert!(
                    held < whole || (tp == 1 && held == whole),
                    "stage {s} rank {r}: {held} of {whole}"
                );
            }
        }
        let worst = compare(&spec, &values, model, &[1, 2, 3, 4, 5, 6], 8);
        eprintln!("gpt2 at tp={tp} × pp={pp}: largest logit difference {worst:.2e}");
        assert!(
            worst < 1e-4,
            "gpt2 at tp={tp} × pp={pp}: logits {worst} from one device's"
        );
    }
    // A vocabulary the ranks split unevenly (the tied head's padding columns dropped).
    let odd = ModelSpec::parse("gpt2:vocab=257,ctx=16,d=16,layers=2,heads=4").unwrap();
    let odd_values: Vec<Vec<f32>> = (odd.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 11))
        .collect();
    let model = ShardedModel::load(&odd, &odd_values, layout(2, 2)).unwrap();
    let worst = compare(&odd, &odd_values, model, &[1, 256, 3], 8);
    eprintln!("gpt2 of vocabulary 257 at tp=2 × pp=2: largest logit difference {worst:.2e}");
    assert!(worst < 1e-4, "{worst}");
    // The comparison sees this model's sums too.
    let broken = ShardedModel::load(&spec, &values, layout(2, 2))
        .unwrap()
        .with_fault(Fault::SkipSum(2));
    let off = compare(&spec, &values, broken, &[1, 2, 3, 4, 5, 6], 2);
    eprintln!("gpt2, block 2's sum skipped: logits {off:.2e} off");
    assert!(off > 1e-3, "gpt2: a skipped sum went unseen ({off})");
}

/// The negative controls: with one block's all-reduce skipped, or the block after a stage
/// boundary dropped, the logits are far off.
#[test]
fn a_skipped_all_reduce_or_a_dropped_boundary_block_is_caught() {
    let (spec, values) = gpt();
    for b in [1, 2] {
        let broken = ShardedModel::load(&spec, &values, layout(2, 1))
            .unwrap()
            .with_fault(Fault::SkipSum(b));
        let worst = compare(&spec, &values, broken, &[3, 14, 15, 9], 4);
        eprintln!("block {b}'s sum skipped: logits {worst:.2e} off");
        assert!(worst > 1e-2, "skipping block {b}'s sum went unseen ({worst})");
    }
    for (tp, pp) in [(1, 2), (2, 2)] {
        let model = ShardedModel::load(&spec, &values, layout(tp, pp)).unwrap();
        let boundary = model.stages()[1].start;
        let broken = model.with_fault(Fault::SkipBlock(boundary));
        let worst = compare(&spec, &values, broken, &[3, 14, 15, 9], 4);
        eprintln!("tp={tp} × pp={pp}, block {boundary} after the boundary dropped: logits {worst:.2e} off");
        assert!(worst > 1e-2, "a dropped boundary block went unseen ({worst})");
    }
    let refused = ShardedModel::load(&spec, &values, layout(3, 1))
        .err()
        .expect("tp=3 refused");
    assert!(refused.contains("4 heads do not divide over tp=3"), "{refused}");
    let blocks = spec.desc().blocks.len();
    let refused =
        (ShardedModel::load(&spec, &values, layout(1, blocks + 1)).err()).expect("too many stages refused");
    assert!(refused.contains("do not cut into"), "{refused}");
}

/// Every request's tokens and logits through a batcher over `model`.
fn batched(
    model: &dyn crate::step_model::StepModel,
    prompts: &[Vec<u32>],
    pool: CachePool,
) -> Vec<Vec<(u32, Vec<f32>)>> {
    let mut batcher = Batcher::new(model, 4, pool);
    for prompt in prompts {
        let request = Request {
            prompt: prompt.clone(),
            max_tokens: 12,
            sampling: Sampling::greedy(),
            stop: Vec::new(),
        };
        batcher.submit(request).unwrap();
    }
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = 0;
    while done < prompts.len() {
        for event in batcher.step().unwrap() {
            match event {
                Event::Token { id, token, logits } => out[id].push((token, logits)),
                Event::Done { .. } => done += 1,
            }
        }
    }
    out
}

/// Continuous batching over the paged cache, the step's sequences as micro-batches through the
/// stages (each rank its heads' layers of its stage's blocks, the block tables shared), answers
/// as one device does; a pool too small for all makes some wait.
#[test]
fn sharded_continuous_batching_over_the_paged_cache_equals_one_device() {
    let (spec, values) = gpt();
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 14, 15],
        vec![9, 26, 5, 35, 8, 9, 7],
        vec![1],
        vec![2, 7, 18, 28, 18],
    ];
    let pool = CachePool {
        block_tokens: 4,
        total: 12,
    };
    let one = WholeModel::load(&spec, &values).unwrap();
    let want = batched(&one, &prompts, pool);
    for (tp, pp, micro_batches) in [(2, 1, 1), (1, 2, 2), (1, 2, 4), (2, 2, 3)] {
        let model = ShardedModel::load(&spec, &values, layout(tp, pp))
            .unwrap()
            .with_micro_batches(micro_batches);
        let got = batched(&model, &prompts, pool);
        let mut worst = 0.0f32;
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w.len(), g.len());
            for ((wt, wl), (gt, gl)) in w.iter().zip(g) {
                assert_eq!(wt, gt);
                worst = wl.iter().zip(gl).fold(worst, |m, (a, b)| m.max((a - b).abs()));
            }
        }
        eprintln!(
            "tp={tp} × pp={pp}, {micro_batches} micro-batches, batched over the paged cache: largest logit difference {worst:.2e}"
        );
        assert!(worst < 1e-4, "{worst}");
    }
}

/// A model with LoRA adapters (PEFT's, on `c_attn` and `c_proj`, their B made non-zero) cut at
/// tp=2, pp=2 and tp=2 × pp=2 gives one device's logits: the adapters are split with the
/// projections they adapt.
#[test]
fn sharded_generation_with_lora_adapters_equals_one_device() {
    let spec =
        ModelSpec::parse("gpt2:vocab=64,ctx=16,d=16,layers=2,heads=4/lora:r=2,alpha=4,targets=c_attn+c_proj")
            .unwrap();
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| {
            let mut v = initial_params(&b.param_descs, 5);
            // Every value non-zero (a fresh adapter's B is zero and would hide a wrong split).
            for (i, x) in v.iter_mut().enumerate() {
                *x += ((i % 13) as f32 - 6.0) * 1e-2;
            }
            v
        })
        .collect();
    for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
        let model = ShardedModel::load(&spec, &values, layout(tp, pp)).unwrap();
        let worst = compare(&spec, &values, model, &[1, 2, 3, 40, 5], 6);
        eprintln!("gpt2 with LoRA at tp={tp} × pp={pp}: largest logit difference {worst:.2e}");
        assert!(worst < 1e-4, "gpt2 with LoRA at tp={tp} × pp={pp}: {worst}");
    }
}

/// A rank that fails mid-step fails the step at once with its own error (not a peer's "stopped"
/// or a timeout), and the next step meets at a fresh fabric: the mended model answers as one
/// device does.
#[test]
fn a_failing_rank_fails_its_step_naming_it_and_the_next_steps_run() {
    let (spec, values) = gpt();
    let model = ShardedModel::load(&spec, &values, layout(2, 2)).unwrap();
    let boundary = model.stages()[1].start;
    for b in [1, boundary] {
        model.set_fault(Fault::PanicAt(b));
        let started = std::time::Instant::now();
        let failed = model.greedy(&[3, 14, 15], 4).unwrap_err();
        eprintln!(
            "a rank panicking at block {b}: {failed} ({:.2?})",
            started.elapsed()
        );
        assert!(
            failed.contains("panicked: a deliberate failure at block"),
            "{failed}"
        );
        assert!(failed.contains("rank 1"), "{failed}");
        model.set_fault(Fault::None);
        let worst = compare(&spec, &values, &model, &[3, 14, 15], 4);
        assert!(worst < 1e-4, "after a failed step: {worst}");
    }
}
