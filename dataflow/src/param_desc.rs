//! Parameters described one by one: each parameter of a block with its name, shape, dtype,
//! whether it trains, how it may be split across devices and how it is initialised.
//!
//! These descriptions are the single source of what the plan knows about weights: gradient
//! buckets count the bytes of trainable parameters, the memory estimate takes bytes from each
//! dtype (a frozen parameter has no gradient and no optimizer state), the runtime initialises
//! every parameter from `(seed, name)` as a whole and then keeps the slice its layout needs (so
//! every layout — dp, pp, ZeRO shards, later tensor parallelism — starts from the same weights),
//! and checkpoint pieces are named parameters or slices of one.
//!
//! Splits follow Megatron-LM (Shoeybi et al., 2019): a column-parallel `Linear` (burn's weight is
//! `[in, out]`) is cut along its output columns, its bias with it (a fused query/key/value
//! projection per head inside each of q, k and v); a row-parallel one along its
//! input rows, its bias replicated; LayerNorm vectors are replicated; an embedding table may be
//! cut by rows (vocabulary-parallel). Frozen parameters are LoRA's base weights (Hu et al., 2021).
//!
//! ```
//! use archipelago_dataflow::{DType, ModelSpec, Split};
//! let desc = ModelSpec::parse("gpt:vocab=16,ctx=4,d=8,layers=1,heads=2").unwrap().desc();
//! let qkv = desc.blocks[1].param_descs.iter().find(|p| p.name == "layers.0.qkv.weight").unwrap();
//! assert_eq!(
//!     (qkv.shape.clone(), qkv.dtype, qkv.split),
//!     (vec![8, 24], DType::F32, Split::HeadColumns { parts: 3 })
//! );
//! ```

use serde::{Deserialize, Serialize};

pub use crate::dtype::DType;
use crate::model_spec::ModelSpec;
use crate::param_names::NamedParam;

/// How a parameter may be split across the devices of a tensor-parallel group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Split {
    /// Every device holds all of it (LayerNorm, a row-parallel layer's bias).
    #[default]
    Replicated,
    /// Cut along dimension 0 (a row-parallel `Linear` weight `[in, out]`, an embedding table).
    Rows,
    /// Cut along the last dimension (a column-parallel `Linear` weight, and its bias: a vector
    /// cut along its only dimension).
    Columns,
    /// Cut along the last dimension inside each of `parts` equal column groups: a fused
    /// query/key/value projection `[d, 3d]` (and its bias), whose rank `r` holds `[q_r | k_r |
    /// v_r]`, the heads of q, k and v it computes attention for (Megatron-LM's per-head split;
    /// a contiguous cut would give rank 0 all of q and half of k).
    HeadColumns {
        /// Column groups (3: q, k and v).
        parts: usize,
    },
}

impl Split {
    /// The dimension a parameter of `rank` dimensions is cut along (`None` when replicated).
    pub fn dim(self, rank: usize) -> Option<usize> {
        match self {
            Split::Replicated => None,
            Split::Rows => Some(0),
            Split::Columns | Split::HeadColumns { .. } => Some(rank.saturating_sub(1)),
        }
    }
}

/// The distribution a parameter's initial values are drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ParamInit {
    /// All zeros (LayerNorm's shift).
    Zeros,
    /// All ones (LayerNorm's gain).
    Ones,
    /// `N(0, std²)` (embedding tables: GPT-2's 0.02).
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// `U(−1/√fan_in, 1/√fan_in)`: burn's and PyTorch's `Linear` default, for its weight and
    /// its bias alike.
    UniformFanIn {
        /// The input width of the layer.
        fan_in: usize,
    },
}

// The only floats are finite constants of a description, so equality is reflexive.
impl Eq for ParamInit {}

/// One parameter of a block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamDesc {
    /// Its name, unique in the model (PyTorch's `state_dict` key for the zoo's models, e.g.
    /// `layers.0.qkv.weight`): initialisation is keyed by it, checkpoint pieces are named by it.
    pub name: String,
    /// Its shape as the runtime (burn) holds it; elements are flattened row-major.
    pub shape: Vec<usize>,
    /// The element type it is held in.
    pub dtype: DType,
    /// Whether it trains (a frozen parameter has no gradient and no optimizer state).
    pub trainable: bool,
    /// How it may be split across a tensor-parallel group.
    pub split: Split,
    /// Its initial distribution.
    pub init: ParamInit,
    /// The parameter whose values this one mirrors (GPT-2's output head, tied to the token
    /// embedding `transformer.wte.weight`): initialised and read from files under that name,
    /// never written to a file itself; described frozen (no state of its own). When the
    /// parameter it mirrors trains, the step sums the two uses' gradients into it and copies its
    /// values back into the mirror ([`crate::ties`]); [`ModelDesc::check`] refuses a tie whose
    /// shapes or splits differ.
    ///
    /// [`ModelDesc::check`]: crate::ModelDesc::check
    #[serde(default)]
    pub tied_to: Option<String>,
}

impl ParamDesc {
    /// A trainable, replicated f32 parameter initialised with `init`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, init: ParamInit) -> ParamDesc {
        ParamDesc {
            name: name.into(),
            shape,
            dtype: DType::F32,
            trainable: true,
            split: Split::Replicated,
            init,
            tied_to: None,
        }
    }

    /// The same parameter with split `split`.
    pub fn with_split(mut self, split: Split) -> ParamDesc {
        self.split = split;
        self
    }

    /// The same parameter held as `dtype`.
    pub fn with_dtype(mut self, dtype: DType) -> ParamDesc {
        self.dtype = dtype;
        self
    }

    /// The same parameter as a mirror of `name` (frozen: see [`ParamDesc::tied_to`]).
    pub fn tied_to(mut self, name: impl Into<String>) -> ParamDesc {
        self.tied_to = Some(name.into());
        self.frozen()
    }

    /// The name its values are drawn and read under: the tied parameter's for a mirror.
    pub fn value_name(&self) -> &str {
        self.tied_to.as_deref().unwrap_or(&self.name)
    }

    /// The same parameter, frozen (no gradient, no optimizer state).
    pub fn frozen(mut self) -> ParamDesc {
        self.trainable = false;
        self
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of its values.
    pub fn bytes(&self) -> u64 {
        self.len() as u64 * self.dtype.bytes()
    }

    /// Bytes of its gradient: as many as its values when it trains, none when frozen.
    pub fn grad_bytes(&self) -> u64 {
        if self.trainable { self.bytes() } else { 0 }
    }

    /// Elements the optimizer keeps state for (its length when it trains, 0 when frozen).
    pub fn optimized_len(&self) -> u64 {
        if self.trainable { self.len() as u64 } else { 0 }
    }

    /// Why the trainer cannot hold this parameter yet, if it cannot: it holds every parameter in
    /// f32 (16-bit parameters are described, not yet trained; frozen f32 ones are kept whole by
    /// every actor that holds their block, outside the trained layout). `compile` refuses such a
    /// model with this reason, so an accepted plan is never refused at actor start.
    pub fn not_trainable_yet(&self) -> Option<String> {
        (self.dtype != DType::F32).then(|| {
            format!(
                "parameter `{}` is described as {}{}: the trainer holds every parameter in f32 for \
                 now (16-bit parameters are planned, not yet trained); describe it as f32",
                self.name,
                if self.trainable { "" } else { "frozen " },
                self.dtype
            )
        })
    }
}

/// Each block's parameter descriptions for a zoo model, in the runtime's flattening order (its
/// family's: [`crate::family::ModelFamily::describe`]).
pub fn describe(model: &ModelSpec) -> Vec<Vec<ParamDesc>> {
    model.describe()
}

/// The descriptions of the `gpt` and `mlp` families: the names and shapes of `blocks`, the
/// zoo's initialisation (LayerNorm gain 1 and shift 0, embeddings `N(0, 0.02²)`, `Linear`
/// weights and biases `U(±1/√fan_in)`) and the Megatron splits (`columns` says which layers are
/// column-parallel, the others' weights are cut by rows; the token table by rows).
pub(crate) fn describe_zoo(
    blocks: Vec<Vec<NamedParam>>,
    columns: impl Fn(&str) -> bool,
) -> Vec<Vec<ParamDesc>> {
    (blocks.into_iter())
        .map(|block| {
            (block.iter())
                .map(|p| describe_one(p, &block, &columns))
                .collect()
        })
        .collect()
}

fn describe_one(p: &NamedParam, block: &[NamedParam], columns: &dyn Fn(&str) -> bool) -> ParamDesc {
    let (layer, leaf) = p.name.rsplit_once('.').unwrap_or(("", p.name.as_str()));
    let component = layer.rsplit('.').next().unwrap_or(layer);
    // A bias takes the fan-in of the weight beside it.
    let fan_in = block
        .iter()
        .find(|q| q.shape.len() == 2 && q.name.rsplit_once('.').map(|(l, _)| l) == Some(layer))
        .map_or(p.shape[0], |w| w.shape[0]);
    let init = match (component, leaf) {
        (c, "weight") if c.starts_with("ln") => ParamInit::Ones,
        (c, "bias") if c.starts_with("ln") => ParamInit::Zeros,
        ("tok" | "pos", _) => ParamInit::Normal { std: 0.02 },
        _ => ParamInit::UniformFanIn { fan_in },
    };
    let split = match (leaf, columns(component)) {
        _ if component == "tok" => Split::Rows,
        _ if component == "qkv" => Split::HeadColumns { parts: 3 },
        _ if component == "pos" || component.starts_with("ln") => Split::Replicated,
        (_, true) => Split::Columns,
        ("weight", false) => Split::Rows,
        _ => Split::Replicated,
    };
    ParamDesc::new(p.name.clone(), p.shape.clone(), init).with_split(split)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(blocks: &'a [Vec<ParamDesc>], name: &str) -> &'a ParamDesc {
        blocks.iter().flatten().find(|p| p.name == name).expect(name)
    }

    /// The gpt's parameters carry the zoo's initialisation and Megatron's splits.
    #[test]
    fn gpt_parameters_carry_their_init_and_split() {
        let model = ModelSpec::parse("gpt:vocab=16,ctx=4,d=8,layers=1,heads=2").unwrap();
        let blocks = describe(&model);
        let expect = [
            ("tok.weight", ParamInit::Normal { std: 0.02 }, Split::Rows),
            ("pos.weight", ParamInit::Normal { std: 0.02 }, Split::Replicated),
            ("layers.0.ln1.weight", ParamInit::Ones, Split::Replicated),
            ("layers.0.ln1.bias", ParamInit::Zeros, Split::Replicated),
            (
                "layers.0.qkv.weight",
                ParamInit::UniformFanIn { fan_in: 8 },
                Split::HeadColumns { parts: 3 },
            ),
            (
                "layers.0.qkv.bias",
                ParamInit::UniformFanIn { fan_in: 8 },
                Split::HeadColumns { parts: 3 },
            ),
            (
                "layers.0.proj.weight",
                ParamInit::UniformFanIn { fan_in: 8 },
                Split::Rows,
            ),
            (
                "layers.0.proj.bias",
                ParamInit::UniformFanIn { fan_in: 8 },
                Split::Replicated,
            ),
            (
                "layers.0.fc2.weight",
                ParamInit::UniformFanIn { fan_in: 32 },
                Split::Rows,
            ),
            (
                "layers.0.fc2.bias",
                ParamInit::UniformFanIn { fan_in: 32 },
                Split::Replicated,
            ),
            ("ln_f.weight", ParamInit::Ones, Split::Replicated),
            (
                "head.weight",
                ParamInit::UniformFanIn { fan_in: 8 },
                Split::Columns,
            ),
        ];
        for (name, init, split) in expect {
            let p = find(&blocks, name);
            assert_eq!((p.init, p.split), (init, split), "{name}");
            assert!(p.trainable && p.dtype == DType::F32, "{name}");
        }
        assert_eq!(Split::Columns.dim(2), Some(1));
        assert_eq!(Split::Columns.dim(1), Some(0));
        assert_eq!(Split::Rows.dim(2), Some(0));
    }

    /// An mlp's layers alternate column- and row-parallel, biases following their weight.
    #[test]
    fn mlp_layers_alternate_columns_and_rows() {
        let model = ModelSpec::parse("mlp:in=4,hidden=6,layers=2,out=3").unwrap();
        let blocks = describe(&model);
        assert_eq!(find(&blocks, "layers.0.weight").split, Split::Columns);
        assert_eq!(find(&blocks, "layers.0.bias").split, Split::Columns);
        assert_eq!(find(&blocks, "layers.1.weight").split, Split::Rows);
        assert_eq!(find(&blocks, "layers.1.bias").split, Split::Replicated);
        assert_eq!(
            find(&blocks, "layers.2.bias").init,
            ParamInit::UniformFanIn { fan_in: 6 }
        );
    }

    /// The compiled plan carries every description, through its JSON form too (what a host
    /// receives).
    #[test]
    fn the_plan_carries_the_descriptions() {
        use crate::{ParallelPlan, Program, compile};
        let model = ModelSpec::parse("gpt:vocab=16,ctx=4,d=8,layers=2,heads=2").unwrap();
        let program = Program::new(model.clone()).with_plan(ParallelPlan {
            dp: 2,
            batch: 4,
            ..ParallelPlan::default()
        });
        let plan = compile(&program).unwrap();
        let carried: Vec<Vec<ParamDesc>> = plan
            .program
            .model
            .blocks
            .iter()
            .map(|b| b.param_descs.clone())
            .collect();
        assert_eq!(carried, describe(&model));
        let back: crate::Plan = serde_json::from_str(&plan.to_json()).unwrap();
        assert_eq!(back.program.model, plan.program.model);
    }

    /// Bytes follow the dtype; a frozen parameter has no gradient and no optimizer state.
    #[test]
    fn bytes_follow_dtype_and_frozen_parameters_have_no_gradient() {
        let p = ParamDesc::new("w", vec![3, 5], ParamInit::Zeros);
        assert_eq!((p.bytes(), p.grad_bytes(), p.optimized_len()), (60, 60, 15));
        let half = p.clone().with_dtype(DType::BF16);
        assert_eq!((half.bytes(), half.grad_bytes()), (30, 30));
        let frozen = p.frozen();
        assert_eq!(
            (frozen.bytes(), frozen.grad_bytes(), frozen.optimized_len()),
            (60, 0, 0)
        );
    }
}
