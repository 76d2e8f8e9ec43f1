//! The `mlp` family: `in → layers × (Linear(·, hidden) + ReLU) → Linear(hidden, out)`,
//! cross-entropy loss (`shared/WORKLOADS.md`'s `mlp-8x1024`). Its k-th `Linear` (the output one
//! included) is `layers.{k}.weight`/`.bias`; under tp, Megatron's MLP: even layers
//! column-parallel, odd ones row-parallel.

use serde_json::{Value, json};

use super::{ModelFamily, dims};
use crate::model_spec::{BlockInfo, InputKind, ModelDesc};
use crate::param_desc::{ParamDesc, describe_zoo};
use crate::param_names::{NamedParam, linear};
use crate::tensor_parallel::TpHeld;

/// The `mlp` family.
pub(super) struct Mlp;

impl ModelFamily for Mlp {
    fn name(&self) -> &'static str {
        "mlp"
    }

    fn keys(&self) -> &'static [(&'static str, usize)] {
        &[("in", 1024), ("hidden", 1024), ("layers", 8), ("out", 10)]
    }

    fn presets(&self) -> &'static [(&'static str, &'static [usize])] {
        &[("mlp-8x1024", &[1024, 1024, 8, 10])]
    }

    fn input(&self, d: &[usize]) -> InputKind {
        let [input, _, _, out] = dims(d);
        InputKind::Dense {
            features: input,
            classes: out,
        }
    }

    fn block_params(&self, d: &[usize]) -> Vec<Vec<NamedParam>> {
        let [input, hidden, layers, out] = dims(d);
        (0..=layers)
            .map(|k| {
                let d_in = if k == 0 { input } else { hidden };
                let d_out = if k < layers { hidden } else { out };
                linear(&format!("layers.{k}"), d_in, d_out, true)
            })
            .collect()
    }

    fn describe(&self, d: &[usize]) -> Vec<Vec<ParamDesc>> {
        let even = |component: &str| component.parse::<usize>().is_ok_and(|k| k % 2 == 0);
        describe_zoo(self.block_params(d), even)
    }

    fn desc(&self, name: String, d: &[usize]) -> ModelDesc {
        let [input, hidden, layers, out] = dims(d);
        let mut params = self.describe(d).into_iter();
        let mut blocks = Vec::with_capacity(layers + 1);
        let mut width = input;
        // Megatron's MLP: even layers column-parallel (a replicated input, a sharded output),
        // odd ones row-parallel (a sharded input, a partial output).
        let tp = |k: usize| {
            if k.is_multiple_of(2) {
                (TpHeld::Replicated, TpHeld::Sharded)
            } else {
                (TpHeld::Sharded, TpHeld::Partial)
            }
        };
        // What tp cuts of a layer's kept activations: a column-parallel layer's outputs, a
        // row-parallel layer's input.
        let sharded = |held_in: TpHeld, input: usize, outputs: usize| match held_in {
            TpHeld::Replicated => outputs as u64,
            _ => input as u64,
        };
        for i in 0..layers {
            let (held_in, held_out) = tp(i);
            blocks.push(
                BlockInfo::described(
                    format!("linear_relu.{i}"),
                    params.next().unwrap_or_default(),
                    (width + 2 * hidden) as u64,
                    hidden as u64,
                )
                .with_tp(held_in, held_out)
                .with_sharded_activations(sharded(held_in, width, 2 * hidden)),
            );
            width = hidden;
        }
        let (held_in, held_out) = tp(layers);
        blocks.push(
            BlockInfo::described(
                "output",
                params.next().unwrap_or_default(),
                (width + 3 * out) as u64,
                out as u64,
            )
            .with_tp(held_in, held_out)
            .with_sharded_activations(sharded(held_in, width, 3 * out)),
        );
        ModelDesc {
            name,
            input: self.input(d),
            blocks,
        }
    }

    fn tp_unit(&self, d: &[usize]) -> (&'static str, usize) {
        ("hidden width", d[1])
    }

    fn training_flops_per_token(&self, d: &[usize]) -> f64 {
        let [input, hidden, layers, out] = dims(d);
        let weights = input * hidden + layers.saturating_sub(1) * hidden * hidden + hidden * out;
        6.0 * weights as f64
    }

    fn config(&self, d: &[usize]) -> Value {
        let [input, hidden, layers, out] = dims(d);
        json!({
            "family": "mlp",
            "in_features": input,
            "hidden": hidden,
            "hidden_layers": layers,
            "classes": out,
            "activation": "relu",
            "bias": true,
        })
    }
}
