//! Continuous batching (issue 41; Orca's iteration-level scheduling): 16 requests of different
//! prompt lengths and answer lengths, greedy and seeded sampling, arriving two a step into a
//! batch of at most 6 sequences (so some wait), each get the tokens they get alone and logits
//! within 1e-4 of those, wherever the alone run's top-1 beats its top-2 by more than 1e-3 (past
//! such a near tie the two runs may part, and the comparison stops); so do they through a cache
//! pool too small for the load, which makes them wait and preempts them. The control: a
//! sequence decoding over another sequence's cache is caught by the same comparison. A cache
//! block's bytes are what the cache holds; a cancelled request gives its blocks back at once.
//! Chunked prefill gives the same answers; static batching (the bench's baseline) makes a late
//! request wait for the batch's longest one.

use std::collections::BTreeMap;

use archipelago_actors::batching::{Batcher, CachePool, Event};
use archipelago_actors::block::initial_params;
use archipelago_actors::generate::Request;
use archipelago_actors::inference::WholeModel;
use archipelago_actors::sampling::Sampling;
use archipelago_dataflow::ModelSpec;
use archipelago_integration_tests::{MARGIN, assert_caught};

const VOCAB: usize = 97;
/// The small pool: 12 blocks of 4 positions, where a request needs up to 7.
const SMALL: CachePool = CachePool {
    block_tokens: 4,
    total: 12,
};

/// A pool that never runs out for these requests (16 × 48 positions).
fn roomy() -> CachePool {
    CachePool {
        block_tokens: 4,
        total: 192,
    }
}

fn model() -> WholeModel {
    let spec = ModelSpec::parse("gpt2:vocab=97,ctx=48,d=32,layers=2,heads=4").unwrap();
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 3))
        .collect();
    WholeModel::load(&spec, &values).unwrap()
}

fn request(i: usize) -> Request {
    let prompt = (0..1 + (i * 5) % 13)
        .map(|j| ((i * 31 + j * 7) % VOCAB) as u32)
        .collect();
    let sampling = if i.is_multiple_of(2) {
        Sampling::greedy()
    } else {
        Sampling {
            temperature: 0.8,
            top_k: Some(20),
            top_p: Some(0.9),
            seed: i as u64,
        }
    };
    Request {
        prompt,
        max_tokens: 4 + (i * 3) % 9,
        sampling,
        stop: Vec::new(),
    }
}

/// Each request's (token, logits) in order, by request.
type Answers = BTreeMap<usize, Vec<(u32, Vec<f32>)>>;

/// Each request's (token, logits) in order, run through `batcher` with request `i` submitted
/// at step `arrival(i)`; also the most requests that waited at once.
fn run(batcher: &mut Batcher, ids: &[usize], arrival: impl Fn(usize) -> usize) -> (Answers, usize) {
    let mut out = Answers::new();
    let mut ours = BTreeMap::new();
    let (mut done, mut step, mut peak_waiting) = (0, 0, 0);
    while done < ids.len() {
        for &i in ids.iter().filter(|&&i| arrival(i) == step) {
            ours.insert(batcher.submit(request(i)).unwrap(), i);
        }
        peak_waiting = peak_waiting.max(batcher.waiting());
        let events = batcher.step().unwrap();
        assert!(
            batcher.blocks_used() <= batcher.pool().total,
            "the pool overflowed"
        );
        for event in events {
            match event {
                Event::Token { id, token, logits } => out.entry(ours[&id]).or_default().push((token, logits)),
                Event::Done { .. } => done += 1,
            }
        }
        step += 1;
        assert!(step < 400, "the batch never drained");
    }
    assert_eq!(batcher.blocks_used(), 0, "every block went back to the pool");
    (out, peak_waiting)
}

fn margin(logits: &[f32]) -> f32 {
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    sorted[0] - sorted[1]
}

/// Holds each request's batched answer to its alone answer (see the module docs); returns the
/// tokens compared and the largest logit difference.
fn compare_with_alone(model: &WholeModel, batched: &Answers) -> (usize, f32) {
    let (mut worst, mut compared) = (0.0f32, 0);
    for (&i, got) in batched {
        let (alone, _) = run(&mut Batcher::new(model, 1, roomy()), &[i], |_| 0);
        let alone = &alone[&i];
        assert_eq!(got.len(), request(i).max_tokens, "request {i}'s answer length");
        for ((token, logits), (want_token, want)) in got.iter().zip(alone) {
            let diff = logits
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            worst = worst.max(diff);
            assert!(diff <= 1e-4, "request {i}: logits differ by {diff:e}");
            if margin(want) <= 1e-3 {
                break;
            }
            assert_eq!(token, want_token, "request {i}");
            compared += 1;
        }
    }
    (compared, worst)
}

#[test]
fn sixteen_requests_batched_get_what_they_get_alone() {
    let model = model();
    let all: Vec<usize> = (0..16).collect();
    let (batched, peak_waiting) = run(&mut Batcher::new(&model, 6, roomy()), &all, |i| i / 2);
    assert!(peak_waiting > 0, "some requests waited for a place");
    let (compared, worst) = compare_with_alone(&model, &batched);
    eprintln!("16 requests, batch ≤ 6: {compared} tokens compared, largest logit difference {worst:e}");

    // The control: two sequences prefilled alone, then decoded with their caches swapped.
    let (a, b) = (request(2).prompt, request(4).prompt);
    let (mut sa, mut sb) = (model.start(), model.start());
    model.extend(&mut sa, &a).unwrap();
    model.extend(&mut sb, &b).unwrap();
    let want = model.extend(&mut sa.clone(), &[5]).unwrap();
    std::mem::swap(&mut sa.pasts, &mut sb.pasts);
    let crossed = model.extend_many(&mut [&mut sa, &mut sb], &[&[5], &[5]]).unwrap();
    let diff = crossed[0]
        .iter()
        .zip(&want)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert_caught(
        "a sequence decoding over another's cache",
        diff as f64,
        1e-4,
        MARGIN,
    );
}

/// A pool too small for the load (12 blocks of 4 positions; a request needs up to 7): requests
/// wait, running ones are preempted and recomputed, the pool never overflows and is empty at
/// the end, and every request gets its alone answer all the same.
#[test]
fn a_small_pool_makes_requests_wait_and_every_one_finishes() {
    let model = model();
    let all: Vec<usize> = (0..16).collect();
    let mut batcher = Batcher::new(&model, 6, SMALL);
    let (batched, peak_waiting) = run(&mut batcher, &all, |i| i / 2);
    assert!(
        peak_waiting > 0 && batcher.preemptions() > 0,
        "the pool was short"
    );
    assert_eq!(batched.len(), 16, "every request finished");
    let (compared, worst) = compare_with_alone(&model, &batched);
    eprintln!(
        "16 requests, {} blocks of {}: {} preemptions, peak {peak_waiting} waiting, {compared} tokens \
         compared, largest logit difference {worst:e}",
        SMALL.total,
        SMALL.block_tokens,
        batcher.preemptions()
    );
    let too_long = Request {
        prompt: vec![1; 20],
        max_tokens: 20,
        ..request(0)
    };
    let tiny = CachePool {
        block_tokens: 4,
        total: 5,
    };
    let refused = Batcher::new(&model, 6, tiny).submit(too_long).unwrap_err();
    assert!(
        refused.contains("need 10 cache blocks of 4; the pool has 5"),
        "{refused}"
    );
}

/// A block's bytes are what a sequence's keys and values take for that many positions (read
/// from its cache after a prefill of one block), a budget gives the pool of its whole blocks, and
/// the paged pool allocates those bytes once.
#[test]
fn a_cache_block_costs_what_the_cache_holds() {
    let model = model();
    let mut sequence = model.start();
    model.extend(&mut sequence, &[1, 2, 3, 4]).unwrap();
    let held: usize = (sequence.pasts.iter())
        .filter_map(|p| p.kv.as_ref())
        .map(|(k, v)| k.shape().num_elements() + v.shape().num_elements())
        .sum();
    assert_eq!(CachePool::block_bytes(model.spec(), 4, 4), 4 * held as u64);
    let pool = CachePool::fitting(model.spec(), 10 * 4 * held as u64 + 5, 4, 4);
    assert_eq!((pool.total, pool.tokens()), (10, 40));
    // The paged pool allocates exactly its blocks' bytes, once, at the first step.
    let mut batcher = Batcher::new(&model, 2, pool);
    assert_eq!(batcher.cache_bytes(), 0);
    batcher.submit(request(3)).unwrap();
    batcher.step().unwrap();
    let allocated = batcher.cache_bytes();
    assert_eq!(allocated as u64, 10 * CachePool::block_bytes(model.spec(), 4, 4));
    while batcher.running() > 0 {
        batcher.step().unwrap();
    }
    assert_eq!(batcher.cache_bytes(), allocated, "kept, not grown");
}

/// A request cancelled mid-answer (its client gone) gives its blocks back at once and gets no
/// further token; the others go on; a waiting one cancelled never runs; an unknown id is no-op.
#[test]
fn a_cancelled_request_gives_its_blocks_back() {
    let model = model();
    let mut batcher = Batcher::new(&model, 2, roomy());
    let ids: Vec<usize> = (0..3).map(|i| batcher.submit(request(i)).unwrap()).collect();
    batcher.step().unwrap();
    batcher.step().unwrap();
    let (used, running) = (batcher.blocks_used(), batcher.running());
    assert_eq!((running, batcher.waiting()), (2, 1));
    assert!(batcher.cancel(ids[0]));
    assert!(batcher.cancel(ids[2]), "the waiting one");
    assert!(batcher.blocks_used() < used, "its blocks went back");
    assert!(!batcher.cancel(ids[0]) && !batcher.cancel(99));
    let mut seen = Vec::new();
    while batcher.running() > 0 {
        for event in batcher.step().unwrap() {
            if let Event::Token { id, .. } = event {
                seen.push(id);
            }
        }
    }
    assert!(seen.iter().all(|&id| id == ids[1]), "{seen:?}");
    assert_eq!(batcher.blocks_used(), 0);
}

/// Static batching (the serving bench's baseline): a request that arrives while a batch runs
/// waits until that batch's longest request has ended, then gets what it gets alone; under
/// continuous batching the same arrival joins at the next step (the control).
#[test]
fn a_static_batch_runs_to_its_longest_request_before_the_next_joins() {
    let model = model();
    let first_token_step = |whole_batches: bool| {
        let mut batcher = Batcher::new(&model, 4, roomy());
        if whole_batches {
            batcher = batcher.whole_batches();
        }
        let short = batcher.submit(request(0)).unwrap(); // 4 tokens
        let long = batcher.submit(request(2)).unwrap(); // 10 tokens
        let (mut late, mut done, mut first_late) = (None, BTreeMap::new(), None);
        let mut late_tokens = Vec::new();
        for step in 0.. {
            if step == 1 {
                late = Some(batcher.submit(request(4)).unwrap());
            }
            let events = batcher.step().unwrap();
            if events.is_empty() && batcher.waiting() == 0 {
                break;
            }
            for event in events {
                match event {
                    Event::Token { id, token, logits } if Some(id) == late => {
                        first_late.get_or_insert(step);
                        late_tokens.push((token, logits));
                    }
                    Event::Done { id } => {
                        done.insert(id, step);
                    }
                    _ => {}
                }
            }
        }
        assert!(done[&short] < done[&long]);
        let late_answer: Answers = BTreeMap::from([(4, late_tokens)]);
        (first_late.unwrap(), done[&long], late_answer)
    };
    let (first, long_done, answers) = first_token_step(true);
    assert_eq!(
        first,
        long_done + 1,
        "the late request starts right after the batch's longest ends"
    );
    let (compared, worst) = compare_with_alone(&model, &answers);
    assert!(
        compared > 0 && worst < 1e-4,
        "{compared} tokens, logits off by {worst}"
    );
    let (first_continuous, _, _) = first_token_step(false);
    assert_eq!(
        first_continuous, 1,
        "continuous batching admits it at the next step"
    );
}

/// Chunked prefill (at most 3 positions a pass): a 13-token prompt alone is fed over 5 steps
/// before its first token, and the 16 requests arriving two a step still get their alone
/// answers (each chunk attends to the chunks cached before it).
#[test]
fn chunked_prefill_gives_the_same_answers() {
    let model = model();
    let long = (0..16)
        .find(|&i| request(i).prompt.len() == 13)
        .expect("a 13-token prompt");
    let mut alone = Batcher::new(&model, 6, roomy()).step_tokens(3);
    alone.submit(request(long)).unwrap();
    let silent = (0..).take_while(|_| alone.step().unwrap().is_empty()).count();
    assert_eq!(
        silent, 4,
        "13 positions in chunks of 3: the token comes on the fifth pass"
    );

    let all: Vec<usize> = (0..16).collect();
    let mut batcher = Batcher::new(&model, 6, roomy()).step_tokens(3);
    let (batched, _) = run(&mut batcher, &all, |i| i / 2);
    assert_eq!(batched.len(), 16, "every request finished");
    let (compared, worst) = compare_with_alone(&model, &batched);
    eprintln!("chunked prefill (3 a pass): {compared} tokens compared, largest logit difference {worst:e}");
    assert!(compared > 50);
}
