//! Continuous batching (Orca's iteration-level scheduling, Yu et al., OSDI 2022): the batch is
//! formed again at every decoding step. A request that arrives joins at the next step (its
//! prompt prefilled in the same flattened pass as the others' next tokens,
//! [`WholeModel::extend_many`]), and one that finishes leaves at once; requests past
//! `max_sequences` wait in arrival order. Each sequence attends to its own past only, so what
//! it gets does not depend on what it was batched with (up to the order of float sums). Tokens
//! here; text, stop sequences and the paged cache pool sit on top.

use std::collections::VecDeque;

use crate::generate::{Request, Sequence};
use crate::inference::WholeModel;
use crate::sampling::Sampler;

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

struct Running {
    id: usize,
    sequence: Sequence,
    sampler: Sampler,
    max_tokens: usize,
    /// What the next pass feeds it: the prompt, then its last token.
    next: Vec<u32>,
    generated: usize,
}

/// The requests of one model replica, stepped together.
pub struct Batcher<'m> {
    model: &'m WholeModel,
    max_sequences: usize,
    waiting: VecDeque<(usize, Request)>,
    running: Vec<Running>,
    submitted: usize,
}

impl<'m> Batcher<'m> {
    /// A batcher running at most `max_sequences` sequences a step.
    pub fn new(model: &'m WholeModel, max_sequences: usize) -> Batcher<'m> {
        Batcher {
            model,
            max_sequences: max_sequences.max(1),
            waiting: VecDeque::new(),
            running: Vec::new(),
            submitted: 0,
        }
    }

    /// Queues `request` (checked now, so a bad one never joins a batch); its id.
    pub fn submit(&mut self, request: Request) -> Result<usize, String> {
        request.sampling.check()?;
        let ctx = self.model.spec().get("ctx").unwrap_or(0);
        if request.prompt.is_empty()
            || request.max_tokens == 0
            || request.prompt.len() + request.max_tokens > ctx
        {
            return Err(format!(
                "a prompt of {} tokens and max_tokens {}: give 1 token or more and max_tokens ≥ 1, \
                 at most {ctx} together",
                request.prompt.len(),
                request.max_tokens
            ));
        }
        let id = self.submitted;
        self.submitted += 1;
        self.waiting.push_back((id, request));
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

    /// One decoding step: the waiting requests that fit join, every sequence in the batch gets
    /// its next token in one pass, and those done leave.
    pub fn step(&mut self) -> Result<Vec<Event>, String> {
        while self.running.len() < self.max_sequences
            && let Some((id, request)) = self.waiting.pop_front()
        {
            self.running.push(Running {
                id,
                sequence: self.model.start(),
                sampler: Sampler::new(request.sampling),
                max_tokens: request.max_tokens,
                next: request.prompt,
                generated: 0,
            });
        }
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let inputs: Vec<Vec<u32>> = self
            .running
            .iter_mut()
            .map(|r| std::mem::take(&mut r.next))
            .collect();
        let slices: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let mut sequences: Vec<&mut Sequence> = self.running.iter_mut().map(|r| &mut r.sequence).collect();
        let logits = self.model.extend_many(&mut sequences, &slices)?;
        let vocab = self.model.spec().get("vocab").unwrap_or(0);
        let mut events = Vec::new();
        for (running, all) in self.running.iter_mut().zip(logits) {
            let last = all[all.len() - vocab..].to_vec();
            let token = running.sampler.next(&last);
            running.next = vec![token];
            running.generated += 1;
            events.push(Event::Token {
                id: running.id,
                token,
                logits: last,
            });
            if running.generated == running.max_tokens {
                events.push(Event::Done { id: running.id });
            }
        }
        self.running.retain(|r| r.generated < r.max_tokens);
        Ok(events)
    }
}
