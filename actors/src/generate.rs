//! Generation with a KV cache on one device: prefill the prompt, then decode one token a step,
//! each block keeping what it has seen of the sequence ([`Past`]: an attention's keys and
//! values, Pope et al. 2022), so a step computes the new position only. [`WholeModel::generate`]
//! answers a request (sampling, `max_tokens`, stop sequences, text streamed as it comes);
//! batching over a paged cache and the service build on [`WholeModel::extend`].

use burn::backend::flex::FlexDevice;
use burn::tensor::{Tensor, TensorData};

use archipelago_dataflow::ModelSpec;

use crate::CpuBackend;
use crate::batching::{Batcher, CachePool, Event};
use crate::block::{Activation, Block, PagedStep, Past, Pasts};
use crate::inference::WholeModel;
use crate::kernels::paged_attention::PagedLayer;
use crate::sampling::Sampling;
use crate::step_model::StepModel;
use crate::text_stream::{Decode, TextStream};

/// One sequence being generated: every block's past and the tokens so far.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Each block's past, in block order (all at the same offset).
    pub pasts: Vec<Past<CpuBackend>>,
    /// The tokens the model has seen.
    pub tokens: Vec<u32>,
    /// Its blocks in a [`PagedCache`] (empty when its pasts hold their own keys and values).
    pub table: Vec<usize>,
}

impl Sequence {
    /// An empty sequence of a model of `blocks` blocks.
    pub fn empty(blocks: usize) -> Sequence {
        Sequence {
            pasts: (0..blocks).map(|_| Past::default()).collect(),
            tokens: Vec::new(),
            table: Vec::new(),
        }
    }
}

/// A replica's keys and values in one pool of fixed-size blocks per attention layer (vLLM's
/// PagedAttention), allocated at the first step that needs them and kept; sequences hold block
/// tables into it ([`WholeModel::extend_paged`]). Under tensor parallelism each rank keeps its
/// own heads' layers and a pipeline stage its blocks' layers, every one at the same block
/// tables.
#[derive(Debug)]
pub struct PagedCache {
    /// The blocks.
    pub pool: CachePool,
    /// Each rank's pool of each model block (empty for a block without attention).
    ranks: Vec<Vec<PagedLayer>>,
}

impl PagedCache {
    /// An unallocated cache of `pool`'s blocks.
    pub fn new(pool: CachePool) -> PagedCache {
        PagedCache {
            pool,
            ranks: Vec::new(),
        }
    }

    /// Bytes allocated (every rank's).
    pub fn bytes(&self) -> usize {
        self.ranks.iter().flatten().map(PagedLayer::bytes).sum()
    }

    /// Rank `rank`'s layers, with the pool.
    pub(crate) fn rank(&mut self, rank: usize) -> (CachePool, &mut Vec<PagedLayer>) {
        if self.ranks.len() <= rank {
            self.ranks.resize_with(rank + 1, Vec::new);
        }
        (self.pool, &mut self.ranks[rank])
    }

    /// The layers of `n` ranks (a sharded model's every stage's ranks, stage-major), with the
    /// pool.
    pub(crate) fn ranks(&mut self, n: usize) -> (CachePool, &mut [Vec<PagedLayer>]) {
        if self.ranks.len() < n {
            self.ranks.resize_with(n, Vec::new);
        }
        (self.pool, &mut self.ranks[..n])
    }
}

/// A greedy continuation: the new tokens and, for each, the logits it was the argmax of.
#[derive(Debug, Clone)]
pub struct Greedy {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// The logits (`vocab` values) each was picked from.
    pub logits: Vec<Vec<f32>>,
}

/// The new ids of several sequences side by side in one row `[1, total]`.
pub(crate) fn tokens_of(ids: &[&[u32]]) -> Activation<CpuBackend> {
    let data: Vec<i32> = (ids.iter())
        .flat_map(|ids| ids.iter().map(|&id| id as i32))
        .collect();
    let total = data.len();
    Activation::Tokens(Tensor::from_data(TensorData::new(data, [1, total]), &FlexDevice))
}

/// Logits `[1, total, vocab]` cut into each sequence's rows (`ids` of each), flat.
pub(crate) fn split_logits(
    logits: Tensor<CpuBackend, 3>,
    ids: &[&[u32]],
    vocab: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let flat = (logits.into_data().convert::<f32>().to_vec::<f32>())
        .map_err(|e| format!("cannot read the logits: {e:?}"))?;
    let mut at = 0;
    let mut out = Vec::with_capacity(ids.len());
    for ids in ids {
        out.push(flat[at * vocab..(at + ids.len()) * vocab].to_vec());
        at += ids.len();
    }
    Ok(out)
}

impl WholeModel {
    /// An empty sequence for this model.
    pub fn start(&self) -> Sequence {
        Sequence::empty(self.blocks.len())
    }

    /// The logits `[n, vocab]` (flat) of `ids`, the `n` positions after `sequence`'s, which
    /// keeps them.
    pub fn extend(&self, sequence: &mut Sequence, ids: &[u32]) -> Result<Vec<f32>, String> {
        let mut logits = self.extend_many(&mut [sequence], &[ids])?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// [`WholeModel::extend`] of several sequences in one pass: their new ids side by side in
    /// one row (continuous batching's flattened step), each attending to its own past only.
    pub fn extend_many(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, String> {
        self.extend_inner(sequences, ids, None)
    }

    /// [`WholeModel::extend_many`] with the keys and values in `cache`'s blocks, each sequence
    /// through its block table (which must hold its new positions).
    pub fn extend_paged(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        cache: &mut PagedCache,
    ) -> Result<Vec<Vec<f32>>, String> {
        self.extend_inner(sequences, ids, Some(cache))
    }

    /// [`check_step`] of this model.
    pub(crate) fn check_step(
        &self,
        sequences: &[&mut Sequence],
        ids: &[&[u32]],
        pool: Option<CachePool>,
    ) -> Result<usize, String> {
        check_step(&self.spec, sequences, ids, pool)
    }

    fn extend_inner(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        mut cache: Option<&mut PagedCache>,
    ) -> Result<Vec<Vec<f32>>, String> {
        let vocab = self.check_step(sequences, ids, cache.as_ref().map(|c| c.pool))?;
        let mut x = tokens_of(ids);
        for b in 0..self.blocks.len() {
            let layers = cache.as_deref_mut().map(|c| c.rank(0));
            x = step_block(self.blocks[b].as_ref(), b, x, sequences, ids, layers);
        }
        let Activation::Seq(logits) = x else {
            return Err(format!("{}'s last block gave no sequence of logits", self.spec));
        };
        let out = split_logits(logits, ids, vocab)?;
        for (sequence, ids) in sequences.iter_mut().zip(ids) {
            sequence.tokens.extend_from_slice(ids);
        }
        Ok(out)
    }

    /// The greedy continuation of `prompt` by `new_tokens` tokens: the prompt prefilled in one
    /// pass, then one decoding step per token.
    pub fn greedy(&self, prompt: &[u32], new_tokens: usize) -> Result<Greedy, String> {
        greedy(self, prompt, new_tokens)
    }
}

/// Refuses a step of `ids` after `sequences` that the model cannot take: new ids past the
/// context or the vocabulary, a block table (with `pool`) too short for the new positions.
/// The model's vocabulary.
pub(crate) fn check_step(
    spec: &ModelSpec,
    sequences: &[&mut Sequence],
    ids: &[&[u32]],
    pool: Option<CachePool>,
) -> Result<usize, String> {
    let (ctx, vocab) = (spec.get("ctx"), spec.get("vocab"));
    let (Some(ctx), Some(vocab)) = (ctx, vocab) else {
        return Err(format!("{} takes no tokens", spec));
    };
    if sequences.len() != ids.len() || sequences.is_empty() {
        return Err(format!(
            "{} sequences and {} lists of new ids",
            sequences.len(),
            ids.len()
        ));
    }
    for (sequence, ids) in sequences.iter().zip(ids) {
        let seen = sequence.tokens.len();
        if ids.is_empty() || seen + ids.len() > ctx {
            return Err(format!(
                "{} new tokens after {seen}: {} has {ctx} positions",
                ids.len(),
                spec
            ));
        }
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(format!("token id {id} is past {}'s vocabulary of {vocab}", spec));
        }
        if let Some(bt) = pool.map(|p| p.block_tokens)
            && sequence.table.len() * bt < seen + ids.len()
        {
            return Err(format!(
                "{} positions and {} blocks of {bt}: the sequence's table is short",
                seen + ids.len(),
                sequence.table.len()
            ));
        }
    }
    Ok(vocab)
}

/// Block `b`'s forward of the new positions `x` of `sequences` (`ids` of each), their pasts
/// (and `cache`'s layer) kept: one block of [`WholeModel::extend_many`], which a
/// sharded model's ranks run between their collectives (`b` indexes the sequences' pasts
/// and the cache's layers).
pub(crate) fn step_block(
    block: &dyn Block<CpuBackend>,
    b: usize,
    x: Activation<CpuBackend>,
    sequences: &mut [&mut Sequence],
    ids: &[&[u32]],
    mut cache: Option<(CachePool, &mut Vec<PagedLayer>)>,
) -> Activation<CpuBackend> {
    let seqs = (sequences.iter_mut().zip(ids))
        .map(|(s, ids)| (std::mem::take(&mut s.pasts[b]), ids.len()))
        .collect();
    let paged = cache.as_mut().map(|(pool, layers)| {
        if layers.len() <= b {
            layers.resize_with(b + 1, PagedLayer::default);
        }
        PagedStep {
            layer: std::mem::take(&mut layers[b]),
            blocks: pool.total,
            block_tokens: pool.block_tokens,
            tables: sequences.iter().map(|s| s.table.clone()).collect(),
        }
    });
    let mut pasts = Pasts { seqs, paged };
    let x = block.forward_cached(x, &mut pasts);
    if let (Some((_, layers)), Some(step)) = (cache, pasts.paged.take()) {
        layers[b] = step.layer;
    }
    for (sequence, (past, new)) in sequences.iter_mut().zip(pasts.seqs) {
        sequence.pasts[b] = Past {
            offset: past.offset + new,
            kv: past.kv,
        };
    }
    x
}

/// What to generate after a prompt.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Text that ends the answer where it first appears (not included).
    pub stop: Vec<String>,
}

/// Why generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Finish {
    /// `max_tokens` were generated.
    Length,
    /// A stop sequence appeared.
    Stop,
}

/// A finished answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The tokens generated (the one that completed a stop sequence included).
    pub tokens: Vec<u32>,
    /// The text sent, up to any stop sequence.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
}

impl WholeModel {
    /// Answers `request`: the prompt prefilled, then a token a step under its sampling until
    /// `max_tokens` or a stop sequence, each piece of text handed to `on_text` as soon as it can
    /// go out ([`TextStream`]); the request runs alone through a [`Batcher`] (the one decoding
    /// loop), cancelled at its stop. Refused before any work: an empty prompt, `max_tokens` 0, a
    /// bad sampling parameter, a prompt and `max_tokens` that do not fit the model's positions.
    pub fn generate(
        &self,
        request: &Request,
        decode: &Decode,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Completion, String> {
        let mut stream = TextStream::new(decode, &request.stop);
        let mut tokens = Vec::with_capacity(request.max_tokens);
        run_alone(self, request.clone(), &mut |token, _| {
            tokens.push(token);
            let chunk = stream.push(token)?;
            if !chunk.is_empty() {
                on_text(&chunk);
            }
            Ok(!stream.stopped())
        })?;
        let rest = stream.finish()?;
        if !rest.is_empty() {
            on_text(&rest);
        }
        Ok(Completion {
            tokens,
            text: stream.text().to_string(),
            finish: if stream.stopped() {
                Finish::Stop
            } else {
                Finish::Length
            },
        })
    }
}

/// The index of the largest value (the first of equals).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The greedy continuation of `prompt` by `new_tokens` tokens on `model`, each token with its
/// logits.
pub fn greedy(model: &dyn StepModel, prompt: &[u32], new_tokens: usize) -> Result<Greedy, String> {
    let request = Request {
        prompt: prompt.to_vec(),
        max_tokens: new_tokens,
        sampling: Sampling::greedy(),
        stop: Vec::new(),
    };
    let mut out = Greedy {
        tokens: Vec::with_capacity(new_tokens),
        logits: Vec::with_capacity(new_tokens),
    };
    run_alone(model, request, &mut |token, logits| {
        out.tokens.push(token);
        out.logits.push(logits);
        Ok(true)
    })?;
    Ok(out)
}

/// Runs `request` alone through a [`Batcher`] whose pool holds the model's whole context,
/// handing each token and its logits to `on_token`, which says whether to go on.
fn run_alone(
    model: &dyn StepModel,
    request: Request,
    on_token: &mut dyn FnMut(u32, Vec<f32>) -> Result<bool, String>,
) -> Result<(), String> {
    let ctx = model.spec().get("ctx").unwrap_or(0).max(1);
    let pool = CachePool {
        block_tokens: ctx,
        total: 1,
    };
    let mut batcher = Batcher::new(model, 1, pool);
    let id = batcher.submit(request)?;
    loop {
        let events = batcher.step()?;
        if events.is_empty() {
            return Err("the request never joined the batch".into());
        }
        for event in events {
            match event {
                Event::Token { token, logits, .. } => {
                    if !on_token(token, logits)? {
                        batcher.cancel(id);
                        return Ok(());
                    }
                }
                Event::Done { .. } => return Ok(()),
            }
        }
    }
}
