//! Continuous batching (Orca's iteration-level scheduling, Yu et al., OSDI 2022) over a paged cache
//! (vLLM's PagedAttention, Kwon et al., SOSP 2023): the batch is formed again at every decoding
//! step. A request that arrives joins at the next step when the pool has free blocks for its prompt
//! (its prompt prefilled in the same flattened pass as the others' next tokens,
//! [`StepModel::extend_paged`]: one device's model or one cut over tensor-parallel ranks), and one
//! that finishes leaves at once, its blocks back in the pool; requests past `max_sequences` or the
//! pool wait in arrival order, never an out-of-memory. Every attention layer's keys and values live
//! in one pool of fixed-size blocks allocated once ([`PagedCache`]); a sequence holds a block table
//! and gets a block from the free list when its next position needs one; when none is free it
//! preempts the latest admitted sequence, which gives its blocks back and waits at the front of the
//! queue, to be recomputed (its prompt and what it had generated prefilled again) — vLLM's
//! recompute preemption. Each sequence attends to its own blocks only, so what it gets does not
//! depend on what it was batched with (up to the order of float sums). [`Batcher::step_tokens`]
//! prefills long prompts in chunks; [`Batcher::whole_batches`] is the static batching it is
//! measured against.

use std::collections::VecDeque;

use archipelago_dataflow::ModelSpec;

use crate::generate::{PagedCache, Request, Sequence};
use crate::sampling::Sampler;
use crate::step_model::StepModel;

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Request `id`'s next token, and the logits it was chosen from.
    Token {
        /// The request.
        id: usize,
        /// The token.
        token: u32,
        /// Its logits (one per vocabulary entry).
        logits: Vec<f32>,
    },
    /// Request `id` generated its `max_tokens` and left the batch.
    Done {
        /// The request.
        id: usize,
    },
}

/// A request, waiting or running.
struct Entry {
    id: usize,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    sampler: Sampler,
    max_tokens: usize,
    /// Its cache: positions seen and the blocks holding them (none while it waits).
    sequence: Sequence,
}

impl Entry {
    /// What the model has not seen yet: everything so far when it (re)starts, the rest of its
    /// prompt while a chunked prefill goes on, else its last token.
    fn pending(&self) -> Vec<u32> {
        let seen = self.sequence.tokens.len();
        let all = self.prompt.len() + self.generated.len();
        (seen..all)
            .map(|i| match self.prompt.get(i) {
                Some(&token) => token,
                None => self.generated[i - self.prompt.len()],
            })
            .collect()
    }
}

/// The cache's blocks: `block_tokens` positions each, `total` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePool {
    /// Positions per block.
    pub block_tokens: usize,
    /// Blocks in the pool.
    pub total: usize,
}

impl CachePool {
    /// Blocks that `positions` positions take.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_tokens.max(1))
    }

    /// The bytes one block of `block_tokens` positions holds for `spec`: every layer's keys and
    /// values (`2 · layers · d` values a position) of `value_bytes` each.
    pub fn block_bytes(spec: &ModelSpec, block_tokens: usize, value_bytes: usize) -> u64 {
        let (layers, d) = (spec.get("layers").unwrap_or(0), spec.get("d").unwrap_or(0));
        (2 * layers * d * block_tokens * value_bytes) as u64
    }

    /// The pool of `block_tokens`-position blocks that `bytes` hold for `spec`.
    pub fn fitting(spec: &ModelSpec, bytes: u64, block_tokens: usize, value_bytes: usize) -> CachePool {
        let per_block = Self::block_bytes(spec, block_tokens, value_bytes).max(1);
        CachePool {
            block_tokens,
            total: (bytes / per_block) as usize,
        }
    }

    /// Positions the whole pool holds.
    pub fn tokens(&self) -> usize {
        self.total * self.block_tokens
    }
}

/// The requests of one model replica, stepped together.
pub struct Batcher<'m> {
    model: &'m dyn StepModel,
    max_sequences: usize,
    pool: CachePool,
    /// The keys and values, in the pool's blocks.
    cache: PagedCache,
    /// Blocks no sequence holds.
    free: Vec<usize>,
    waiting: VecDeque<Entry>,
    running: Vec<Entry>,
    submitted: usize,
    preemptions: usize,
    /// Static batching: a batch forms only once the last one has ended.
    whole_batches: bool,
    /// The most positions one pass computes (chunked prefill); `usize::MAX`: no limit.
    step_tokens: usize,
}

impl<'m> Batcher<'m> {
    /// A batcher running at most `max_sequences` sequences a step over a cache of `pool`.
    pub fn new(model: &'m dyn StepModel, max_sequences: usize, pool: CachePool) -> Batcher<'m> {
        Batcher {
            model,
            max_sequences: max_sequences.max(1),
            pool,
            cache: PagedCache::new(pool),
            free: (0..pool.total).rev().collect(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            submitted: 0,
            preemptions: 0,
            whole_batches: false,
            step_tokens: usize::MAX,
        }
    }

    /// Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI 2024; vLLM's `max_num_batched_tokens`):
    /// a pass computes at most `tokens` positions — every decoding sequence's next one, then
    /// prompts in admission order, a long one cut into chunks over several steps — so that a
    /// prompt joining the batch delays the others' next tokens by at most a chunk.
    pub fn step_tokens(mut self, tokens: usize) -> Batcher<'m> {
        self.step_tokens = tokens.max(1);
        self
    }

    /// Static batching, the baseline continuous batching is measured against: waiting requests
    /// join only when the batch is empty, and the batch runs until its last request ends.
    pub fn whole_batches(mut self) -> Batcher<'m> {
        self.whole_batches = true;
        self
    }

    /// The model it runs.
    pub fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }

    /// The most sequences a step runs.
    pub fn max_sequences(&self) -> usize {
        self.max_sequences
    }

    /// Queues `request` (checked now, so a bad one never joins a batch: one the whole pool
    /// cannot hold is refused); its id.
    pub fn submit(&mut self, request: Request) -> Result<usize, String> {
        request.sampling.check()?;
        let ctx = self.model.spec().get("ctx").unwrap_or(0);
        let positions = request.prompt.len() + request.max_tokens;
        if request.prompt.is_empty() || request.max_tokens == 0 || positions > ctx {
            return Err(format!(
                "a prompt of {} tokens and max_tokens {}: give 1 token or more and max_tokens ≥ 1, \
                 at most {ctx} together",
                request.prompt.len(),
                request.max_tokens
            ));
        }
        if self.pool.blocks_for(positions) > self.pool.total {
            return Err(format!(
                "{positions} positions need {} cache blocks of {}; the pool has {}",
                self.pool.blocks_for(positions),
                self.pool.block_tokens,
                self.pool.total
            ));
        }
        let id = self.submitted;
        self.submitted += 1;
        self.waiting.push_back(Entry {
            id,
            prompt: request.prompt,
            generated: Vec::new(),
            sampler: Sampler::new(request.sampling),
            max_tokens: request.max_tokens,
            sequence: self.model.start(),
        });
        Ok(id)
    }

    /// Requests waiting for a place in the batch.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences in the batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The cache's blocks.
    pub fn pool(&self) -> CachePool {
        self.pool
    }

    /// Cache blocks held by the running sequences.
    pub fn blocks_used(&self) -> usize {
        self.pool.total - self.free.len()
    }

    /// Bytes the cache pool has allocated (its keys and values, allocated at the first step).
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Gives `entry`'s blocks back to the pool.
    fn release(&mut self, entry: &mut Entry) {
        self.free.append(&mut entry.sequence.table);
    }

    /// Sequences preempted so far (each recomputed when it ran again).
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    /// Drops request `id` wherever it is (its client went away): a running sequence's blocks go
    /// back to the pool at once and it gets no further event. False for an id not waiting or
    /// running (unknown, or already done).
    pub fn cancel(&mut self, id: usize) -> bool {
        if let Some(at) = self.running.iter().position(|e| e.id == id) {
            let mut entry = self.running.remove(at);
            self.release(&mut entry);
            return true;
        }
        let before = self.waiting.len();
        self.waiting.retain(|e| e.id != id);
        self.waiting.len() < before
    }

    /// One decoding step: the running sequences get the blocks their next position needs
    /// (preempting the latest admitted when the pool is out), the waiting requests that fit
    /// join, every sequence in the batch gets its next token in one pass, and those done leave.
    pub fn step(&mut self) -> Result<Vec<Event>, String> {
        self.grow_running();
        self.admit_waiting();
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let pending: Vec<Vec<u32>> = self.running.iter().map(Entry::pending).collect();
        let fed = self.chunks(&pending);
        let mut sequences = Vec::new();
        let mut slices = Vec::new();
        for ((entry, pending), &n) in self.running.iter_mut().zip(&pending).zip(&fed) {
            if n > 0 {
                sequences.push(&mut entry.sequence);
                slices.push(&pending[..n]);
            }
        }
        let logits = self
            .model
            .extend_paged(&mut sequences, &slices, &mut self.cache)?;
        let vocab = self.model.spec().get("vocab").unwrap_or(0);
        let mut events = Vec::new();
        let mut logits = logits.into_iter();
        for ((entry, pending), &n) in self.running.iter_mut().zip(&pending).zip(&fed) {
            if n == 0 {
                continue;
            }
            let mut last = logits.next().expect("logits for each sequence fed");
            if n < pending.len() {
                continue; // a prefill chunk: no token until the whole prompt is in
            }
            // The last position's row (a prefill computed the prompt's every position).
            last.drain(..last.len() - vocab);
            let token = entry.sampler.next(&last);
            entry.generated.push(token);
            events.push(Event::Token {
                id: entry.id,
                token,
                logits: last,
            });
            if entry.generated.len() == entry.max_tokens {
                events.push(Event::Done { id: entry.id });
            }
        }
        let (done, running): (Vec<Entry>, Vec<Entry>) =
            (self.running.drain(..)).partition(|e| e.generated.len() == e.max_tokens);
        for mut entry in done {
            self.release(&mut entry);
        }
        self.running = running;
        Ok(events)
    }

    /// How many of its pending positions each running sequence feeds this pass: a decoding
    /// sequence its one, prompts what the step's budget leaves, in admission order (at least one
    /// position a pass, so a prefill always progresses).
    fn chunks(&self, pending: &[Vec<u32>]) -> Vec<usize> {
        let decoding = pending.iter().filter(|p| p.len() == 1).count();
        let mut left = self.step_tokens.saturating_sub(decoding).max(1);
        (pending.iter())
            .map(|p| {
                if p.len() == 1 {
                    return 1;
                }
                let n = p.len().min(left);
                left -= n;
                n
            })
            .collect()
    }

    /// Each running sequence's next position gets its block, in admission order; when the
    /// pool is out, the latest admitted sequence goes back to the queue's front.
    fn grow_running(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let entry = &self.running[i];
            let needed = self.pool.blocks_for(entry.sequence.tokens.len() + 1);
            if needed <= entry.sequence.table.len() {
                i += 1;
            } else if let Some(block) = self.free.pop() {
                self.running[i].sequence.table.push(block);
                i += 1;
            } else {
                let mut victim = self.running.pop().expect("a running sequence");
                self.release(&mut victim);
                victim.sequence = self.model.start();
                self.waiting.push_front(victim);
                self.preemptions += 1;
            }
        }
    }

    /// Waiting requests join in order while the batch and the pool have room (under static
    /// batching, only into an empty batch).
    fn admit_waiting(&mut self) {
        if self.whole_batches && !self.running.is_empty() {
            return;
        }
        while self.running.len() < self.max_sequences
            && let Some(entry) = self.waiting.front()
        {
            let needed = self.pool.blocks_for(entry.prompt.len() + entry.generated.len());
            if needed > self.free.len() {
                break;
            }
            let mut entry = self.waiting.pop_front().expect("a waiting request");
            let at = self.free.len() - needed;
            entry.sequence.table = self.free.split_off(at);
            self.running.push(entry);
        }
    }
}
