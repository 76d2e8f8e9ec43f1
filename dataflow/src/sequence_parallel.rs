//! Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//! Transformer Models", §4.2.2): under tensor parallelism the LayerNorms and the residual stream
//! are cut along the tokens instead of held whole on every rank, and Megatron's all-reduces
//! become a reduce-scatter (after each row-parallel layer) and an all-gather (before each
//! column-parallel one): the same bytes, the LayerNorm and residual activations 1/tp.
//!
//! A gpt half-layer `x + f(ln(x))` becomes two blocks: the LayerNorm block, on this rank's
//! tokens, whose input is the half before's reduce-scattered output plus the residual stream
//! (`x = z + x`: the trainer adds the two tensors) and which passes that sum on as the stream;
//! and the mixing block (attention, or the MLP) between the all-gather and the reduce-scatter.
//! The residual skips the mixing block as a tensor of its own (`TensorId::Residual`), so no
//! collective ever moves it: the step's collectives are exactly Megatron's. The embedding's
//! partial output is reduce-scattered; the final LayerNorm runs on the tokens and its output is
//! all-gathered for the vocabulary-parallel head. With `--partition-activations` alone, the
//! mixing blocks keep only the rank's tokens of their inputs and are recomputed in the backward
//! (`ActivationCheckpoints::gathered_only`).

use crate::PlanError;
use crate::model_spec::{BlockInfo, InputKind, ModelDesc, ModelSpec};
use crate::param_desc::ParamDesc;
use crate::program::Program;
use crate::tensor_parallel::TpHeld;

/// Whether `model` is described in its sequence-parallel form (some block holds its tokens cut
/// across the group).
pub fn is_sequence_parallel(model: &ModelDesc) -> bool {
    let cut = |h: TpHeld| h == TpHeld::SeqSharded;
    (model.blocks.iter()).any(|b| b.tp.is_some_and(|t| cut(t.input) || cut(t.output)))
}

/// The sequence-parallel form of a zoo model (a transformer family's: `gpt`, `gpt2`): the
/// embedding, per layer `[ln1, attention, ln2, mlp]`, then the final LayerNorm and the head, the
/// parameters named and laid out as in [`ModelSpec::desc`] (checkpoints and `--init` files are
/// the same).
pub fn desc(spec: &ModelSpec) -> Result<ModelDesc, PlanError> {
    spec.sequence_parallel().ok_or_else(|| {
        PlanError::Conflict(format!(
            "--sequence-parallel cuts a transformer's LayerNorm and residual regions along the \
             sequence, and {spec} has none: drop --sequence-parallel (--tp alone splits its layers)"
        ))
    })
}

/// The sequence-parallel form of a `vocab, ctx, d, layers, heads` transformer named `name`
/// whose parameters are `params` (blocks as in its plain form: the embedding, attention and MLP
/// halves, the head).
pub(crate) fn transformer_desc(name: String, dims: &[usize], params: Vec<Vec<ParamDesc>>) -> ModelDesc {
    let [vocab, ctx, d, layers, heads]: [usize; 5] =
        dims.try_into().expect("a transformer's five dimensions");
    let (seq, replicated, partial) = (TpHeld::SeqSharded, TpHeld::Replicated, TpHeld::Partial);
    let tokens = |floats: usize| (ctx * floats) as u64;
    let mut params = params.into_iter();
    let mut blocks = vec![
        BlockInfo::described(
            "embedding",
            params.next().unwrap_or_default(),
            tokens(d),
            tokens(d),
        )
        .with_tp(replicated, partial),
    ];
    // A LayerNorm block keeps, on its own tokens, its input (the sum), the normalised values
    // and its output (3d); the mixing block after it keeps the gathered output whole (d, which
    // Megatron keeps cut and gathers again in the backward: burn's graph holds what a linear
    // read), the rest cut by tp as in plain tp (its row-parallel output is not kept).
    let norm = |name: String, params, first: bool, last: bool| {
        let kept = 3 * d;
        let mut b = BlockInfo::described(name, params, tokens(kept), tokens(d)).with_tp(seq, seq);
        let tp = b.tp.as_mut().expect("with_tp");
        *tp = tp.with_residual(!first, !last);
        b.with_sharded_activations(tokens(kept))
    };
    for i in 0..layers {
        let halves = [
            ("attn", 5 * d + 3 * heads * ctx, 4 * d + 3 * heads * ctx),
            ("mlp", 9 * d, 8 * d),
        ];
        for (h, (half, kept, sharded)) in halves.into_iter().enumerate() {
            let mut both = params.next().unwrap_or_default();
            let mix = both.split_off(2.min(both.len()));
            blocks.push(norm(format!("{half}.{i}.ln"), both, i == 0 && h == 0, false));
            blocks.push(
                BlockInfo::described(format!("{half}.{i}"), mix, tokens(kept), tokens(d))
                    .with_tp(replicated, partial)
                    .with_sharded_activations(tokens(sharded)),
            );
        }
    }
    let mut head = params.next().unwrap_or_default();
    let linear = head.split_off(2.min(head.len()));
    blocks.push(norm("head.ln".into(), head, layers == 0, true));
    blocks.push(
        BlockInfo::described("head", linear, tokens(d + 3 * vocab), tokens(vocab))
            .with_tp(replicated, TpHeld::Sharded)
            .with_sharded_activations(tokens(3 * vocab)),
    );
    ModelDesc {
        name,
        input: InputKind::Tokens { vocab, ctx },
        blocks,
    }
}

/// Refuses `--sequence-parallel` where it cannot run, naming the fix: without a tensor-parallel
/// group, with a model not in its sequence-parallel form (or one in it without the flag),
/// or micro-batches whose tokens the group does not divide (stage cuts: [`can_cut_before`],
/// checked where the plan cuts its chunks).
pub(crate) fn check(program: &Program) -> Result<(), PlanError> {
    let plan = &program.plan;
    let described = is_sequence_parallel(&program.model);
    if !plan.sequence_parallel {
        if described {
            return Err(PlanError::Conflict(format!(
                "{} is described in its sequence-parallel form (blocks hold their tokens cut across the \
                 tensor-parallel group): add --sequence-parallel, or describe it with ModelSpec::desc",
                program.model.name
            )));
        }
        return Ok(());
    }
    if plan.tp < 2 {
        return Err(PlanError::Conflict(format!(
            "--sequence-parallel cuts the LayerNorm and residual regions over the tensor-parallel group, \
             and --tp is {}: use --tp 2 or more, or drop --sequence-parallel",
            plan.tp
        )));
    }
    if !described {
        return Err(PlanError::Conflict(format!(
            "--sequence-parallel needs the model in its sequence-parallel form, and {} is not (no block \
             holds its tokens cut across the group): build the program with \
             Program::sequence_parallel, or drop --sequence-parallel",
            program.model.name
        )));
    }
    residual_sources(&program.model)?;
    let per_microbatch = plan.batch / plan.dp.max(1) / plan.microbatches.max(1);
    let tokens = per_microbatch * program.model.input.tokens_per_sample();
    if !tokens.is_multiple_of(plan.tp) {
        return Err(PlanError::Conflict(format!(
            "--sequence-parallel cuts each micro-batch's {tokens} tokens ({per_microbatch} sequences of {}) \
             into --tp {} equal shares, which do not divide: use a context length or a --batch whose \
             tokens per micro-batch divide by {}",
            program.model.input.tokens_per_sample(),
            plan.tp,
            plan.tp
        )));
    }
    Ok(())
}

/// Whether a pipeline stage may start at block `start` of `model`: anywhere without sequence
/// parallelism; with it, only where a reduce-scatter leaves the tokens cut (before a LayerNorm
/// block: the rank's share of the activation and the residual stream cross, cut along the
/// tokens), never between a LayerNorm block and the mixing block that reads its gathered output.
pub fn can_cut_before(model: &ModelDesc, start: usize) -> bool {
    let form = |k: usize| model.blocks.get(k).and_then(|b| b.tp).unwrap_or_default();
    if start == 0 || !is_sequence_parallel(model) {
        return true;
    }
    let (before, after) = (form(start - 1), form(start));
    before.output == TpHeld::Partial && after.input == TpHeld::SeqSharded
}

/// For each block, the block whose residual it reads (`None`: it reads none): the last block
/// before it that passed one on. Refuses a block that reads a residual no block passed on, one
/// passed on while another is still unread, and one no block reads.
pub fn residual_sources(model: &ModelDesc) -> Result<Vec<Option<usize>>, PlanError> {
    let refuse = |what: String| Err(PlanError::Conflict(format!("{what} (`BlockTp::with_residual`)")));
    let mut pending: Option<usize> = None;
    let mut sources = Vec::with_capacity(model.blocks.len());
    for (k, b) in model.blocks.iter().enumerate() {
        let tp = b.tp.unwrap_or_default();
        let source = if tp.residual_in { pending.take() } else { None };
        if tp.residual_in && source.is_none() {
            return refuse(format!(
                "block `{}` of {} reads a residual stream no block before it passes on",
                b.name, model.name
            ));
        }
        if tp.residual_out
            && let Some(from) = pending
        {
            return refuse(format!(
                "block `{}` of {} passes a residual stream on while block `{}`'s is still unread",
                b.name, model.name, model.blocks[from].name
            ));
        }
        sources.push(source);
        if tp.residual_out {
            pending = Some(k);
        }
    }
    match pending {
        Some(from) => refuse(format!(
            "block `{}` of {} passes a residual stream on and no block after it reads it",
            model.blocks[from].name, model.name
        )),
        None => Ok(sources),
    }
}

#[cfg(test)]
#[path = "sequence_parallel_tests.rs"]
mod tests;
