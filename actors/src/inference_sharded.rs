//! A served model cut over devices the way training cuts it (issue 42): `pp` pipeline stages of
//! contiguous blocks balanced by parameters (GPipe's and DeepSpeed's partition, the plan's
//! [`balanced`]), each stage cut over `tp` tensor-parallel ranks (`TpStage`). Every rank runs
//! on its own thread with its own slices of the weights and its own layers of the paged cache
//! (its heads of its stage's blocks); a stage's ranks meet at training's collectives on an
//! in-process fabric (all-reduce after each block, all-gather of the head's vocabulary
//! columns). A batcher step's sequences go through the pipeline as micro-batches (GPipe's
//! forward, Huang et al. 2019): rank `r` of stage `s` hands each micro-batch's activation to
//! rank `r` of stage `s + 1` and takes the next, so the stages work on different micro-batches
//! at once. [`Fault`] breaks it on purpose (the negative controls).

use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Tensor;

use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::passes::partition::balanced;

use crate::CpuBackend;
use crate::batching::CachePool;
use crate::block::Activation;
use crate::collectives::Collectives;
use crate::fabric::{Fabric, InProcessFabric};
use crate::generate::{
    Greedy, PagedCache, Sequence, check_step, greedy, split_logits, step_block, tokens_of,
};
use crate::inference_tp::{RankGroup, TpStage, lock};
use crate::kernels::paged_attention::PagedLayer;
use crate::step_model::StepModel;

/// How long a rank waits at a collective for the rest of its stage.
const PATIENCE: Duration = Duration::from_secs(30);

/// How a served model is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel ranks of each stage.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp={} × pp={}", self.tp, self.pp)
    }
}

/// A deliberately broken variant (the negative controls of the equivalence tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// None: the model's arithmetic.
    None,
    /// Block `b`'s all-reduce skipped: each rank goes on with its own summand.
    SkipSum(usize),
    /// Block `b`'s output dropped (its input goes on; its cache is still written): a stage
    /// boundary off by one block.
    SkipBlock(usize),
    /// The last rank of block `b`'s stage panics at block `b` (a failing device).
    PanicAt(usize),
}

/// A model cut into pipeline stages of tensor-parallel ranks.
pub struct ShardedModel {
    spec: ModelSpec,
    layout: Layout,
    stages: Vec<TpStage>,
    /// Where the ranks meet: a fresh one after a step that failed (a failure aborts it).
    fabric: Mutex<Arc<InProcessFabric>>,
    fault: Mutex<Fault>,
    micro_batches: usize,
}

impl ShardedModel {
    /// `spec` cut as `layout` says, every rank with its slice of block `i`'s whole flat
    /// parameters `values[i]`; refused where the model does not divide (heads by `tp`, blocks
    /// into `pp` stages). A step runs its sequences as `pp` micro-batches.
    pub fn load(spec: &ModelSpec, values: &[Vec<f32>], layout: Layout) -> Result<ShardedModel, String> {
        let Layout { tp, pp } = layout;
        if tp == 0 || pp == 0 {
            return Err(format!("{layout}: tp and pp must be 1 or more"));
        }
        let desc = spec.desc();
        if let Some(heads) = spec.get("heads").filter(|h| h % tp != 0) {
            return Err(format!("{spec}: {heads} heads do not divide over tp={tp}"));
        }
        crate::inference::check_values(spec, values)?;
        let chunks = balanced(&desc, pp);
        if chunks.len() != pp {
            return Err(format!(
                "{spec}'s {} blocks do not cut into pp={pp} stages",
                desc.blocks.len()
            ));
        }
        let stages = (chunks.into_iter())
            .map(|(start, end)| TpStage::load(spec, values, tp, start..end))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(ShardedModel {
            spec: spec.clone(),
            layout,
            stages,
            fabric: Mutex::new(Arc::new(fabric(layout))),
            fault: Mutex::new(Fault::None),
            micro_batches: pp,
        })
    }

    /// The same model, broken as `fault` says.
    pub fn with_fault(self, fault: Fault) -> ShardedModel {
        self.set_fault(fault);
        self
    }

    /// Breaks the model as `fault` says from the next step on (`Fault::None` mends it).
    pub fn set_fault(&self, fault: Fault) {
        *self.fault.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }

    /// The same model running a step's sequences as `micro_batches` micro-batches (at most one
    /// per sequence; 0 counts as 1).
    pub fn with_micro_batches(self, micro_batches: usize) -> ShardedModel {
        ShardedModel {
            micro_batches: micro_batches.max(1),
            ..self
        }
    }

    /// How it is cut.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The model's blocks each stage runs.
    pub fn stages(&self) -> Vec<Range<usize>> {
        self.stages.iter().map(|s| s.blocks.clone()).collect()
    }

    /// Parameter elements each rank of each stage holds (`[stage][rank]`).
    pub fn rank_params(&self) -> Vec<Vec<usize>> {
        self.stages.iter().map(TpStage::rank_params).collect()
    }

    /// Parameter elements held by every rank together.
    pub fn params(&self) -> usize {
        self.rank_params().iter().flatten().sum()
    }

    /// Every rank's weights in bf16 ([`WholeModel::to_bf16`](crate::inference::WholeModel::to_bf16));
    /// the weights' bytes after.
    pub fn to_bf16(&mut self) -> u64 {
        self.stages.iter_mut().map(TpStage::cast_to_bf16).sum()
    }

    /// The greedy continuation of `prompt` by `new_tokens` tokens, each with its logits.
    pub fn greedy(&self, prompt: &[u32], new_tokens: usize) -> Result<Greedy, String> {
        greedy(self, prompt, new_tokens)
    }
}

impl StepModel for ShardedModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn start(&self) -> Sequence {
        Sequence::empty(self.spec.desc().blocks.len())
    }

    /// The step's sequences through the pipeline as micro-batches, every rank on a thread of
    /// its own with its copy of its stage's pasts (paged: offsets only) and its layers of
    /// `cache`; the last stage's first rank hands back the logits.
    fn extend_paged(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        cache: &mut PagedCache,
    ) -> Result<Vec<Vec<f32>>, String> {
        let vocab = check_step(&self.spec, sequences, ids, Some(cache.pool))?;
        let micro_batches = self.micro_batches.min(sequences.len());
        let groups: Vec<Range<usize>> = (0..micro_batches)
            .map(|m| m * sequences.len() / micro_batches..(m + 1) * sequences.len() / micro_batches)
            .collect();
        let views = self.stage_views(sequences);
        let (pool, layers) = cache.ranks(self.layout.tp * self.layout.pp);
        let outputs = self.run_ranks(views, pool, layers, &groups, ids)?;
        let mut logits = Vec::new();
        for (stage, out) in self.stages.iter().zip(outputs) {
            for (sequence, view) in sequences.iter_mut().zip(out.views) {
                for (b, past) in stage.blocks.clone().zip(view.pasts) {
                    sequence.pasts[b] = past;
                }
            }
            logits.extend(out.logits);
        }
        let logits = Tensor::cat(logits, 1);
        let [rows, t, width] = logits.dims();
        let logits = logits.slice([0..rows, 0..t, 0..vocab.min(width)]);
        for (sequence, ids) in sequences.iter_mut().zip(ids) {
            sequence.tokens.extend_from_slice(ids);
        }
        split_logits(logits, ids, vocab)
    }
}

/// What a rank's thread needs for one step.
struct RankStep<'a> {
    stage: usize,
    rank: usize,
    views: Vec<Sequence>,
    layers: &'a mut Vec<PagedLayer>,
    input: Option<Receiver<Activation<CpuBackend>>>,
    output: Option<Sender<Activation<CpuBackend>>>,
}

/// What a rank's thread hands back: its pasts after the step, and (the last stage's first rank)
/// each micro-batch's logits.
struct RankOutput {
    views: Vec<Sequence>,
    logits: Vec<Tensor<CpuBackend, 3>>,
}

impl ShardedModel {
    /// Each stage's view of the sequences: their pasts of its blocks (taken out of them) and
    /// their tables.
    fn stage_views(&self, sequences: &mut [&mut Sequence]) -> Vec<Vec<Sequence>> {
        (self.stages.iter())
            .map(|stage| {
                (sequences.iter_mut())
                    .map(|s| Sequence {
                        pasts: stage
                            .blocks
                            .clone()
                            .map(|b| std::mem::take(&mut s.pasts[b]))
                            .collect(),
                        tokens: Vec::new(),
                        table: s.table.clone(),
                    })
                    .collect()
            })
            .collect()
    }

    /// Every rank's step on its own thread; each stage's first rank's output (its pasts, and
    /// the logits from the last stage).
    fn run_ranks(
        &self,
        views: Vec<Vec<Sequence>>,
        pool: CachePool,
        layers: &mut [Vec<PagedLayer>],
        groups: &[Range<usize>],
        ids: &[&[u32]],
    ) -> Result<Vec<RankOutput>, String> {
        let Layout { tp, pp } = self.layout;
        let mut steps: Vec<RankStep> = Vec::with_capacity(tp * pp);
        let mut layers = layers.iter_mut();
        for (stage, stage_views) in views.into_iter().enumerate() {
            let mut copies: Vec<Vec<Sequence>> = (1..tp).map(|_| stage_views.clone()).collect();
            copies.push(stage_views);
            for (rank, views) in copies.into_iter().enumerate() {
                steps.push(RankStep {
                    stage,
                    rank,
                    views,
                    layers: layers.next().expect("a cache layer per rank"),
                    input: None,
                    output: None,
                });
            }
        }
        for i in tp..steps.len() {
            let (tx, rx) = channel();
            steps[i - tp].output = Some(tx);
            steps[i].input = Some(rx);
        }
        let fabric = self.fabric.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let joined: Vec<Result<Option<RankOutput>, String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (steps.into_iter())
                .map(|step| {
                    let (stage, rank, fabric) = (step.stage, step.rank, fabric.as_ref());
                    let at = format!("{} stage {stage} rank {rank}", self.spec);
                    let handle = scope.spawn(move || {
                        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.run_rank(step, fabric, pool, groups, ids)
                        }));
                        let out = match ran {
                            Ok(Ok(out)) => Ok(out),
                            Ok(Err(e)) => Err(format!("{at}: {e}")),
                            Err(panic) => Err(format!("{at} panicked: {}", panic_text(&panic))),
                        };
                        // The others wake now instead of after the patience.
                        if let Err(e) = &out {
                            fabric.abort(e);
                        }
                        out
                    });
                    (rank, handle)
                })
                .collect();
            (handles.into_iter())
                .map(|(rank, handle)| match handle.join() {
                    Ok(out) => out.map(|out| (rank == 0).then_some(out)),
                    Err(panic) => Err(format!("a rank's thread panicked: {}", panic_text(&panic))),
                })
                .collect()
        });
        if joined.iter().any(Result::is_err) {
            // The aborted fabric stays broken: the next step meets at a fresh one.
            *self.fabric.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(self::fabric(self.layout));
            return Err(root_cause(joined.into_iter().filter_map(Result::err).collect()));
        }
        let mut outputs = Vec::with_capacity(pp);
        for out in joined {
            if let Some(out) = out? {
                outputs.push(out);
            }
        }
        Ok(outputs)
    }

    /// One rank's step: each micro-batch in turn, from the stage before (or the tokens), through
    /// its blocks and its stage's collectives, to the stage after (or the logits).
    fn run_rank(
        &self,
        mut step: RankStep,
        fabric: &InProcessFabric,
        pool: CachePool,
        groups: &[Range<usize>],
        ids: &[&[u32]],
    ) -> Result<RankOutput, String> {
        let Layout { tp, pp } = self.layout;
        let stage = &self.stages[step.stage];
        let blocks = lock(&stage.ranks[step.rank]);
        let head = self.spec.desc().blocks.len() - 1;
        let first = step.stage * tp;
        let mut group = RankGroup {
            fabric,
            me: first + step.rank,
            group: (first..first + tp).collect(),
            pool: Default::default(),
        };
        let mut logits = Vec::new();
        for (m, range) in groups.iter().enumerate() {
            let mut x = match &step.input {
                None => tokens_of(&ids[range.clone()]),
                Some(input) => (input.recv()).map_err(|_| format!("stage {} stopped", step.stage - 1))?,
            };
            let mut views: Vec<&mut Sequence> = step.views[range.clone()].iter_mut().collect();
            for (local, b) in stage.blocks.clone().enumerate() {
                let layers = Some((pool, &mut *step.layers));
                let out = step_block(
                    blocks[local].as_ref(),
                    local,
                    x.clone(),
                    &mut views,
                    &ids[range.clone()],
                    layers,
                );
                let edge = (m * (head + 1) + b) as u64;
                if b == head {
                    let columns = group.gather_columns(out, edge)?;
                    if step.rank == 0 {
                        logits.push(columns);
                    }
                    break;
                }
                let fault = *self.fault.lock().unwrap_or_else(|e| e.into_inner());
                assert!(
                    !(fault == Fault::PanicAt(b) && step.rank + 1 == tp),
                    "a deliberate failure at block {b}"
                );
                x = match fault {
                    Fault::SkipBlock(skip) if skip == b => x,
                    Fault::SkipSum(skip) if skip == b => out,
                    _ => group.all_reduce(out, edge)?,
                };
            }
            if let Some(output) = &step.output {
                (output.send(x)).map_err(|_| format!("stage {} stopped", step.stage + 1))?;
            }
        }
        debug_assert!(step.stage + 1 == pp || logits.is_empty());
        Ok(RankOutput {
            views: step.views,
            logits,
        })
    }
}

/// A fabric for `layout`'s ranks.
fn fabric(layout: Layout) -> InProcessFabric {
    InProcessFabric::with_collectives(layout.tp * layout.pp, PATIENCE, Collectives::Shared)
}

/// The error that caused the others: the first that is not a rank hearing that a peer stopped
/// or that the fabric was aborted.
fn root_cause(errors: Vec<String>) -> String {
    let secondary = |e: &String| e.contains("stopped") || e.contains("aborted");
    let first = errors.iter().find(|e| !secondary(e)).or(errors.first());
    first.cloned().unwrap_or_else(|| "a rank failed".into())
}

/// A panic's message.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    (panic.downcast_ref::<String>().cloned())
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
#[path = "inference_sharded_tests.rs"]
mod tests;
