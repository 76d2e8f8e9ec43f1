//! A whole zoo model on one CPU device, for inference: every block built, loaded with given
//! weights and run forward without autodiff — what `archipelago eval` scores a text with and
//! what the tests hold to `transformers`' logits.
//!
//! The evaluation loss follows the usual sliding-free perplexity of a causal model: windows of
//! `ctx` inputs start every `ctx` tokens, each predicts the token after each of its inputs, so
//! every token but the first is predicted once (with at most `ctx` tokens of context); the loss
//! is the mean cross-entropy over them (in f64) and the perplexity its exponential.

use std::path::Path;

use burn::backend::flex::FlexDevice;
use burn::tensor::{Int, Tensor, TensorData};

use archipelago_dataflow::ModelSpec;

use crate::CpuBackend;
use crate::block::{Activation, Block};
use crate::weights_file::{AdapterStart, InitWeights};
use crate::zoo::{BuildContext, ModelBuilder, ZooModel};

/// A token model's blocks, loaded.
pub struct WholeModel {
    pub(crate) spec: ModelSpec,
    pub(crate) blocks: Vec<Box<dyn Block<CpuBackend>>>,
}

/// Refuses whole flat parameters `values` that are not one per block of `spec`, each of its
/// block's length.
pub(crate) fn check_values(spec: &ModelSpec, values: &[Vec<f32>]) -> Result<(), String> {
    let desc = spec.desc();
    if values.len() != desc.blocks.len() {
        return Err(format!(
            "{spec} has {} blocks, {} were given",
            desc.blocks.len(),
            values.len()
        ));
    }
    let wrong = (desc.blocks.iter().zip(values).enumerate())
        .find(|(_, (info, flat))| flat.len() as u64 != info.params);
    match wrong {
        Some((index, (info, flat))) => Err(format!(
            "block {index} (`{}`) of {spec} has {} parameters, {} were given",
            info.name,
            info.params,
            flat.len()
        )),
        None => Ok(()),
    }
}

/// A text's loss under a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// Tokens predicted (every token of the text but the first).
    pub predicted: usize,
    /// Mean cross-entropy (nats per token).
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
}

impl WholeModel {
    /// Every attention and MLP projection in int8 (LLM.int8: input features reaching
    /// `threshold` through f32; [`crate::kernels::int8`]), their f32 weights dropped; the bytes
    /// before and after. The embeddings, LayerNorms and the output head stay in f32.
    pub fn quantize_int8(&mut self, threshold: f32) -> Result<crate::zoo::int8_layers::Int8Bytes, String> {
        if threshold.is_nan() || threshold <= 0.0 {
            return Err(format!(
                "the outlier threshold {threshold} must be a number > 0 (LLM.int8's is 6)"
            ));
        }
        let mut total = crate::zoo::int8_layers::Int8Bytes::default();
        for block in &mut self.blocks {
            total += block.quantize_int8(threshold)?;
        }
        if total.layers == 0 {
            return Err(format!("{} has no linear layers to quantize", self.spec));
        }
        Ok(total)
    }

    /// Every weight in bf16 (half the bytes; rounded to nearest even): activations follow in
    /// bf16, the logits are read out as f32 and the paged cache keeps its keys and values in f32.
    /// For a model not quantized to int8 (whose outliers run in f32). The weights' bytes after.
    pub fn to_bf16(&mut self) -> u64 {
        let blocks = std::mem::take(&mut self.blocks);
        self.blocks = (blocks.into_iter())
            .map(|b| b.cast_params(burn::tensor::FloatDType::BF16))
            .collect();
        self.blocks.iter().map(|b| 2 * b.num_params() as u64).sum()
    }

    /// `spec` with block `i`'s flat parameters `values[i]` (the runtime's order and layouts).
    pub fn load(spec: &ModelSpec, values: &[Vec<f32>]) -> Result<WholeModel, String> {
        let zoo = ZooModel(spec.clone());
        Self::load_built(spec, values, &|ctx| {
            ModelBuilder::<CpuBackend>::build_block(&zoo, ctx, &FlexDevice)
        })
    }

    /// [`WholeModel::load`] with blocks from `build` (a test's deliberately wrong variant).
    pub fn load_built(
        spec: &ModelSpec,
        values: &[Vec<f32>],
        build: &dyn Fn(&BuildContext) -> Box<dyn Block<CpuBackend>>,
    ) -> Result<WholeModel, String> {
        check_values(spec, values)?;
        let blocks = (values.iter().enumerate())
            .map(|(index, flat)| {
                build(&BuildContext::whole(index))
                    .load_params(flat, false)
                    .untracked_copy()
            })
            .collect();
        Ok(WholeModel {
            spec: spec.clone(),
            blocks,
        })
    }

    /// `spec` with the weights of safetensors file `path` (as `--init` reads them).
    pub fn from_file(spec: &ModelSpec, path: &Path) -> Result<WholeModel, String> {
        Self::load(spec, &read_weights(spec, path, None)?)
    }

    /// The model.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Logits `[rows, t, vocab]` (flat, row-major) of `rows` sequences of `t` token ids each
    /// (`ids.len() == rows · t`, `t` at most the context).
    pub fn logits(&self, ids: &[u32], rows: usize) -> Result<Vec<f32>, String> {
        let t = ids.len() / rows.max(1);
        let ctx = self
            .spec
            .get("ctx")
            .ok_or_else(|| format!("{} takes no tokens", self.spec))?;
        if rows == 0 || t == 0 || rows * t != ids.len() || t > ctx {
            return Err(format!(
                "{} ids do not make {rows} sequences of 1 to {ctx} tokens",
                ids.len()
            ));
        }
        let vocab = self.spec.get("vocab").unwrap_or(0);
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(format!(
                "token id {id} is past {}'s vocabulary of {vocab}",
                self.spec
            ));
        }
        let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
        let tokens = Tensor::<CpuBackend, 2, Int>::from_data(TensorData::new(ids, [rows, t]), &FlexDevice);
        let mut x = Activation::Tokens(tokens);
        for block in &self.blocks {
            x = block.forward(x);
        }
        let Activation::Seq(logits) = x else {
            return Err(format!("{}'s last block gave no sequence of logits", self.spec));
        };
        logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|e| format!("cannot read the logits: {e:?}"))
    }

    /// The loss and perplexity of token stream `ids` (see the module docs).
    pub fn evaluate(&self, ids: &[u32]) -> Result<Evaluation, String> {
        let ctx = self
            .spec
            .get("ctx")
            .ok_or_else(|| format!("{} takes no tokens", self.spec))?;
        let vocab = self.spec.get("vocab").unwrap_or(0);
        if ids.len() < 2 {
            return Err(format!("{} tokens: evaluation needs at least 2", ids.len()));
        }
        let (mut total, mut predicted) = (0.0f64, 0usize);
        for start in (0..ids.len() - 1).step_by(ctx) {
            let window = &ids[start..(start + ctx + 1).min(ids.len())];
            let (inputs, targets) = (&window[..window.len() - 1], &window[1..]);
            let logits = self.logits(inputs, 1)?;
            for (row, &target) in logits.chunks(vocab).zip(targets) {
                total += cross_entropy(row, target as usize);
            }
            predicted += targets.len();
        }
        let loss = total / predicted as f64;
        Ok(Evaluation {
            predicted,
            loss,
            perplexity: loss.exp(),
        })
    }
}

/// Every block's flat parameters from safetensors file `path` (as `--init` reads them), a LoRA
/// model's adapters from PEFT directory `lora_init` (seeded as training starts them without).
pub fn read_weights(
    spec: &ModelSpec,
    path: &Path,
    lora_init: Option<&Path>,
) -> Result<Vec<Vec<f32>>, String> {
    let desc = spec.desc();
    let adapters = lora_init.map_or(AdapterStart::Seeded(0), AdapterStart::Peft);
    let weights = InitWeights::open(path, &desc, adapters)?;
    (0..desc.blocks.len()).map(|index| weights.block(index)).collect()
}

/// `−log softmax(row)[target]`, in f64.
fn cross_entropy(row: &[f32], target: usize) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    max + sum.ln() - f64::from(row[target])
}
