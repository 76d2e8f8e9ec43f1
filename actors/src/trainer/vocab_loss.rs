//! Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al. 2019, §3): each tensor-parallel
//! rank holds the logits of its slice of the vocabulary, never the whole row. `LossMax` writes each
//! token's largest logit in the slice (all-reduced to the maximum `M`); `LossSums` writes
//! `Σ exp(z − M)` over the slice and the target's logit where the target falls in it (all-reduced
//! to the sums `S` and `T`); the loss of a token is `ln S + M − T`. The backward needs no
//! collective: the gradient of the loss by this rank's logits is `softmax(z) − onehot` restricted
//! to the slice, which the surrogate `Σ (p − onehot) ⊙ z` (with `p = exp(z − M) / S` detached)
//! gives burn's backward. Padding columns (a vocabulary tp does not divide) are outside every
//! sum: their gradient is zero, so their weights stay zero.

use archipelago_dataflow::{InputKind, TensorId};

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::Trainer;
use crate::block::Activation;
use crate::executor::TensorTable;
use crate::transfer::{TransferKind, download, upload};
use crate::typed_tensor::TypedTensor;

/// The group's statistics of one micro-batch's logits, after their all-reduces (one value per
/// token each): kept from the loss for its backward (and a checkpointed recompute).
#[derive(Debug, Clone)]
pub(super) struct VocabStats {
    /// The largest logit over the whole vocabulary.
    max: Vec<f32>,
    /// `Σ exp(z − max)` over the whole vocabulary.
    sums: Vec<f32>,
    /// The target's logit.
    target: Vec<f32>,
}

impl VocabStats {
    /// The statistics the loss reads from the table: the all-reduced `max` and `sums` (the
    /// exponential sums, then the target logits), `tokens` values each.
    pub(super) fn take(
        table: &mut TensorTable,
        max: &TensorId,
        sums: &TensorId,
        tokens: usize,
    ) -> Result<VocabStats, String> {
        let mut take = |name: &TensorId, len: usize| {
            let t = table
                .remove(name)
                .ok_or_else(|| format!("`{name}` was not all-reduced before the loss"))?;
            let values = t.f32s();
            if values.len() != len {
                return Err(format!("`{name}` holds {} values, not {len}", values.len()));
            }
            Ok(values.to_vec())
        };
        let max = take(max, tokens)?;
        let both = take(sums, 2 * tokens)?;
        let (sums, target) = both.split_at(tokens);
        Ok(VocabStats {
            max,
            sums: sums.to_vec(),
            target: target.to_vec(),
        })
    }

    /// The summed cross-entropy of the tokens: `Σ ln S + M − T`.
    pub(super) fn loss_sum(&self) -> f64 {
        (self.sums.iter().zip(&self.max).zip(&self.target))
            .map(|((&s, &m), &t)| f64::from(s).ln() + f64::from(m) - f64::from(t))
            .sum()
    }
}

/// The rows (tokens) of logits, without touching their values.
pub(super) fn logit_count<B: AutodiffBackend>(output: &Activation<B>) -> Result<usize, String> {
    match output {
        Activation::Rows(l) => Ok(l.dims()[0]),
        Activation::Seq(l) => Ok(l.dims()[0] * l.dims()[1]),
        Activation::Tokens(_) => Err("the model's last block must output logits".into()),
    }
}

/// Logits as rows `[tokens, width]` in f32 (the loss is f32 whatever the compute dtype).
pub(super) fn logit_rows<B: AutodiffBackend>(output: &Activation<B>) -> Result<Tensor<B, 2>, String> {
    let rows = match output {
        Activation::Rows(l) => l.clone(),
        Activation::Seq(l) => {
            let [b, t, v] = l.dims();
            l.clone().reshape([b * t, v])
        }
        Activation::Tokens(_) => return Err("the model's last block must output logits".into()),
    };
    Ok(rows.cast(FloatDType::F32))
}

fn host_f32<B: AutodiffBackend, const D: usize>(t: Tensor<B, D>, what: &str) -> Result<Vec<f32>, String> {
    download(t, TransferKind::Scalar)
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("{what}: {e:?}"))
}

impl<B: AutodiffBackend> Trainer<B> {
    /// This rank's slice of the vocabulary for logits `width` wide: its first class and how many
    /// of its columns are classes (the rest pad a vocabulary tp does not divide).
    fn vocab_slice(&self, width: usize) -> (usize, usize) {
        let classes = match self.stage.desc.input {
            InputKind::Dense { classes, .. } => classes,
            InputKind::Tokens { vocab, .. } => vocab,
        };
        let first = self.stage.tp.rank * width;
        (first, classes.saturating_sub(first).min(width))
    }

    /// The logits this actor's forward left under `name`, detached, as f32 rows.
    fn held_logits(&self, name: &TensorId) -> Result<Tensor<B, 2>, String> {
        let key = (self.step.by_name.get(name)).ok_or_else(|| format!("no segment produced `{name}`"))?;
        Ok(logit_rows(self.step.segments[key].output()?)?.detach())
    }

    /// `LossMax`: each token's largest logit in this rank's slice (`-∞` for a slice of padding
    /// only), into `out`.
    pub(super) fn loss_max(
        &mut self,
        logits: &TensorId,
        out: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let z = self.held_logits(logits)?;
        let [n, width] = z.dims();
        let (_, valid) = self.vocab_slice(width);
        let max = match valid {
            0 => vec![f32::NEG_INFINITY; n],
            _ => host_f32(z.slice([0..n, 0..valid]).max_dim(1), "the logits' maxima")?,
        };
        if let Some(fault) = &mut self.fault {
            fault.keep_local_max(out, &max);
        }
        table.insert(out.clone(), TypedTensor::flat(max));
        Ok(())
    }

    /// `LossSums`: each token's `Σ exp(z − M)` over this rank's slice (with the group's maximum
    /// `M` from `max`), then its target's logit where the target is in the slice (0 elsewhere),
    /// into `out`.
    pub(super) fn loss_sums(
        &mut self,
        logits: &TensorId,
        batch: &TensorId,
        max: &TensorId,
        out: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let z = self.held_logits(logits)?;
        let [n, width] = z.dims();
        let (first, valid) = self.vocab_slice(width);
        let m = (table.get(max)).ok_or_else(|| format!("`{max}` was not all-reduced before `LossSums`"))?;
        if m.elements() != n {
            return Err(format!("`{max}` holds {} values for {n} tokens", m.elements()));
        }
        let device = &self.stage.device;
        let own = self.fault.as_ref().and_then(|f| f.local_max(max));
        let m = Tensor::<B, 1>::from_data(TensorData::new(own.unwrap_or(m.f32s()).to_vec(), [n]), device);
        let mut values = match valid {
            0 => vec![0.0; n],
            _ => host_f32(
                (z.clone().slice([0..n, 0..valid]) - m.reshape([n, 1]))
                    .exp()
                    .sum_dim(1),
                "the logits' exponential sums",
            )?,
        };
        let labels = &(self.step.batches.get(batch))
            .ok_or_else(|| format!("batch `{batch}` is not loaded"))?
            .labels;
        let (index, inside) = local_targets(labels, first, valid);
        let picked = host_f32(z.gather(1, self.index_column(index)), "the target logits")?;
        values.extend(picked.iter().zip(&inside).map(|(&v, &i)| if i { v } else { 0.0 }));
        table.insert(out.clone(), TypedTensor::flat(values));
        Ok(())
    }

    fn index_column(&self, index: Vec<i32>) -> Tensor<B, 2, Int> {
        let n = index.len();
        upload(
            TensorData::new(index, [n, 1]),
            &self.stage.device,
            TransferKind::Batch,
        )
    }

    /// The surrogate whose gradient by this rank's `logits` is the vocabulary-parallel loss's:
    /// `Σ (p − onehot) ⊙ z` over the slice, `p = exp(z − M) / S` from the group's `stats`.
    pub(super) fn vocab_surrogate(
        &self,
        logits: Tensor<B, 2>,
        stats: &VocabStats,
        labels: &[i32],
    ) -> Result<Tensor<B, 1>, String> {
        let [n, width] = logits.dims();
        let (first, valid) = self.vocab_slice(width);
        if stats.max.len() != n {
            return Err(format!(
                "the loss's statistics cover {} tokens, the logits {n}",
                stats.max.len()
            ));
        }
        if valid == 0 {
            // A slice of padding only holds no class: nothing of it reaches the loss.
            return Ok(logits.sum().mul_scalar(0.0));
        }
        let device = &self.stage.device;
        let column =
            |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [n]), device).reshape([n, 1]);
        let z = logits.slice([0..n, 0..valid]);
        let p = (z.clone().detach() - column(&stats.max)).exp() / column(&stats.sums);
        let (index, inside) = local_targets(labels, first, valid);
        let inside: Vec<f32> = inside.iter().map(|&i| f32::from(u8::from(i))).collect();
        let target = z.clone().gather(1, self.index_column(index)) * column(&inside);
        Ok((p * z).sum() - target.sum())
    }
}

/// Each target's column in the slice `first..first + valid` (0 when outside it) and whether
/// it is inside.
fn local_targets(labels: &[i32], first: usize, valid: usize) -> (Vec<i32>, Vec<bool>) {
    labels
        .iter()
        .map(|&t| {
            let local = t as i64 - first as i64;
            let inside = local >= 0 && (local as usize) < valid;
            (if inside { local as i32 } else { 0 }, inside)
        })
        .unzip()
}
