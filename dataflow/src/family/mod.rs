//! Model families: each is one file (its keys and presets, its parameters by name and layout at
//! the file boundary, their descriptions and splits, its blocks as the compiler sees them, its
//! `config.json`), registered in [`FAMILIES`]; a [`ModelSpec`] is a family with its dimensions.
//!
//! Adding a family adds a file here, a line to [`FAMILIES`], and its burn builder to the actors
//! crate's one table (`archipelago_actors::zoo`); nothing else matches on a family. The pure
//! facts live here because the compiler plans with them (no burn in this crate).

mod gpt;
mod gpt2;
pub mod lora;
mod mlp;

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::PlanError;
use crate::model_spec::{BlockInfo, InputKind, ModelDesc};
use crate::param_desc::ParamDesc;
use crate::param_names::NamedParam;

pub use gpt2::{GPT2_IGNORED_SUFFIXES, spec_from_config as gpt2_from_config};
pub use lora::LoraSpec;

/// One family of models: everything the compiler, the weights files and the reports know of it.
/// `dims` are the values of [`ModelFamily::keys`], in that order.
pub trait ModelFamily: Send + Sync + 'static {
    /// Its name, the spec's prefix (`gpt` in `gpt:vocab=…`).
    fn name(&self) -> &'static str;
    /// Its keys in spec order, each with its default.
    fn keys(&self) -> &'static [(&'static str, usize)];
    /// Named specs (`gpt-tiny`), each with its dimensions in key order.
    fn presets(&self) -> &'static [(&'static str, &'static [usize])] {
        &[]
    }
    /// Why these dimensions make no model of the family, if they do not.
    fn check(&self, _dims: &[usize]) -> Result<(), String> {
        Ok(())
    }
    /// What a sample is.
    fn input(&self, dims: &[usize]) -> InputKind;
    /// Each block's parameters by their names and layouts at the file boundary, blocks in model
    /// order, parameters in the runtime's flattening order.
    fn block_params(&self, dims: &[usize]) -> Vec<Vec<NamedParam>>;
    /// Each block's parameter descriptions (initialisation, split), in the same order.
    fn describe(&self, dims: &[usize]) -> Vec<Vec<ParamDesc>>;
    /// The compiler's view of the model named `name`.
    fn desc(&self, name: String, dims: &[usize]) -> ModelDesc;
    /// Its sequence-parallel form, if it has one.
    fn sequence_parallel(&self, _name: String, _dims: &[usize]) -> Option<ModelDesc> {
        None
    }
    /// The unit tensor parallelism cuts and how many there are (a gpt's attention heads).
    fn tp_unit(&self, dims: &[usize]) -> (&'static str, usize);
    /// Model FLOPs of one training step per token (per sample for dense rows).
    fn training_flops_per_token(&self, dims: &[usize]) -> f64;
    /// The architecture's facts a reader of its weights cannot find in them (`config.json`).
    fn config(&self, dims: &[usize]) -> Value;
    /// A prefix every name may carry or lack in a file (`transformer.` for GPT-2 files saved
    /// from `GPT2Model` rather than `GPT2LMHeadModel`); empty for none.
    fn optional_prefix(&self) -> &'static str {
        ""
    }
    /// Suffixes of file keys that hold buffers, not parameters, and are ignored on reading.
    fn ignored_suffixes(&self) -> &'static [&'static str] {
        &[]
    }
    /// The last path component of the modules LoRA may adapt (its projections); none: the
    /// family takes no adapters.
    fn projections(&self) -> &'static [&'static str] {
        &[]
    }
    /// The modules `--lora-rank` adapts without `--lora-targets` (PEFT's defaults).
    fn lora_default_targets(&self) -> &'static [&'static str] {
        &[]
    }
    /// Whether PEFT stores this family's projection weights `[in, out]` (`fan_in_fan_out`:
    /// GPT-2's `Conv1D`).
    fn fan_in_fan_out(&self) -> bool {
        false
    }
}

/// Every registered family.
pub static FAMILIES: &[&dyn ModelFamily] = &[&mlp::Mlp, &gpt::Gpt, &gpt2::Gpt2];

/// The family named `name`.
pub fn family(name: &str) -> Option<&'static dyn ModelFamily> {
    FAMILIES.iter().copied().find(|f| f.name() == name)
}

/// A model of a registered family: the family and its dimensions. Serialized as its explicit
/// spec string.
#[derive(Clone)]
pub struct ModelSpec {
    family: &'static dyn ModelFamily,
    dims: [usize; MAX_KEYS],
    lora: Option<LoraSpec>,
}

/// What separates a spec from its adapters in its string (`gpt2/lora:r=8,alpha=16,targets=c_attn`).
const LORA_SEPARATOR: &str = "/lora:";

/// The most keys a family may have.
const MAX_KEYS: usize = 8;

impl PartialEq for ModelSpec {
    fn eq(&self, other: &ModelSpec) -> bool {
        self.family.name() == other.family.name() && self.dims == other.dims && self.lora == other.lora
    }
}

impl Eq for ModelSpec {}

impl fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.explicit())
    }
}

impl ModelSpec {
    fn new(family: &'static dyn ModelFamily, values: &[usize]) -> ModelSpec {
        assert!(values.len() <= MAX_KEYS, "a family has at most {MAX_KEYS} keys");
        let mut dims = [0; MAX_KEYS];
        dims[..values.len()].copy_from_slice(values);
        ModelSpec {
            family,
            dims,
            lora: None,
        }
    }

    fn preset(name: &str) -> ModelSpec {
        Self::parse(name).expect("a registered preset")
    }

    /// The `mlp-8x1024` workload.
    pub fn mlp_8x1024() -> ModelSpec {
        Self::preset("mlp-8x1024")
    }

    /// The `gpt-tiny` workload.
    pub fn gpt_tiny() -> ModelSpec {
        Self::preset("gpt-tiny")
    }

    /// Its family.
    pub fn family(&self) -> &'static dyn ModelFamily {
        self.family
    }

    /// Its dimensions, in its family's key order.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.family.keys().len()]
    }

    /// The value of key `key` (`ctx`), if its family has it.
    pub fn get(&self, key: &str) -> Option<usize> {
        let keys = self.family.keys();
        (keys.iter().position(|(k, _)| *k == key)).map(|i| self.dims[i])
    }

    /// Its LoRA adapters, if any.
    pub fn lora(&self) -> Option<&LoraSpec> {
        self.lora.as_ref()
    }

    /// The same model with adapters `lora` (every other parameter frozen), refused where a target
    /// matches no projection or the rank is too large.
    pub fn with_lora(mut self, lora: LoraSpec) -> Result<ModelSpec, String> {
        if self.family.projections().is_empty() {
            return Err(format!(
                "{self} takes no LoRA adapters: it has no projections to adapt"
            ));
        }
        lora.check(&self.projections())?;
        self.lora = Some(lora);
        Ok(self)
    }

    /// The same model without adapters (its base).
    pub fn base(&self) -> ModelSpec {
        ModelSpec {
            lora: None,
            ..self.clone()
        }
    }

    /// Every projection LoRA may adapt: its module path and `[d_in, d_out]`.
    pub fn projections(&self) -> Vec<(String, [usize; 2])> {
        let leaves = self.family.projections();
        (self.family.block_params(self.dims()).into_iter().flatten())
            .filter(|p| p.shape.len() == 2 && p.tied_to.is_none())
            .filter_map(|p| {
                let module = p.name.strip_suffix(".weight")?;
                let leaf = module.rsplit('.').next()?;
                leaves
                    .contains(&leaf)
                    .then(|| (module.to_string(), [p.shape[0], p.shape[1]]))
            })
            .collect()
    }

    /// Whether a module's last path component is one of the family's projections.
    fn is_projection(&self) -> impl Fn(&str) -> bool + 'static {
        let leaves = self.family.projections();
        move |leaf: &str| leaves.contains(&leaf)
    }

    /// Each block's parameters at the file boundary (its adapters after their modules').
    pub fn block_params(&self) -> Vec<Vec<NamedParam>> {
        let blocks = self.family.block_params(self.dims());
        match &self.lora {
            Some(lora) => lora.adapt_names(blocks, &self.is_projection()),
            None => blocks,
        }
    }

    /// Each block's parameter descriptions (with adapters, the rest frozen).
    pub fn describe(&self) -> Vec<Vec<ParamDesc>> {
        let blocks = self.family.describe(self.dims());
        match &self.lora {
            Some(lora) => lora.adapt(blocks, &self.is_projection()),
            None => blocks,
        }
    }

    /// `desc` (the family's, plain or sequence-parallel) with this spec's adapters.
    fn adapted(&self, mut desc: ModelDesc) -> ModelDesc {
        let Some(lora) = &self.lora else { return desc };
        for block in &mut desc.blocks {
            let params = lora.adapt(
                vec![std::mem::take(&mut block.param_descs)],
                &self.is_projection(),
            );
            let params = params.into_iter().next().unwrap_or_default();
            *block = BlockInfo {
                tp: block.tp,
                ..BlockInfo::described(
                    block.name.clone(),
                    params,
                    block.activation_floats_per_sample,
                    block.output_floats_per_sample,
                )
            };
        }
        desc
    }

    /// Its sequence-parallel form, if its family has one.
    pub fn sequence_parallel(&self) -> Option<ModelDesc> {
        let desc = self.family.sequence_parallel(self.to_string(), self.dims())?;
        Some(self.adapted(desc))
    }

    /// What a sample is.
    pub fn input(&self) -> InputKind {
        self.family.input(self.dims())
    }

    /// The compiler's view of this model.
    pub fn desc(&self) -> ModelDesc {
        self.adapted(self.family.desc(self.to_string(), self.dims()))
    }

    /// Model FLOPs of one training step (forward + backward) per token for a token model, per
    /// sample for dense rows — the numerator of model FLOP utilisation (Chowdhery et al., 2022,
    /// appendix B): 6 per weight of every matmul (embedding lookups are not matmuls) plus, for a
    /// transformer, the attention scores and mix, 12 · layers · d · ctx.
    pub fn training_flops_per_token(&self) -> f64 {
        self.family.training_flops_per_token(self.dims())
    }

    /// The facts of its architecture for `config.json`, with the spec itself under
    /// `archipelago_model`.
    pub fn config(&self) -> Value {
        let mut config = self.family.config(self.dims());
        if let Value::Object(map) = &mut config {
            map.insert("archipelago_model".into(), Value::String(self.explicit()));
        }
        config
    }

    /// The spec spelled out (`gpt:vocab=…,ctx=…,d=…,layers=…,heads=…`), never a preset's name:
    /// what a reader outside this workspace can parse (an export's metadata).
    pub fn explicit(&self) -> String {
        let pairs: Vec<String> = (self.family.keys().iter().zip(self.dims()))
            .map(|((k, _), v)| format!("{k}={v}"))
            .collect();
        format!("{}:{}{}", self.family.name(), pairs.join(","), self.lora_suffix())
    }

    /// `/lora:…` when it has adapters.
    fn lora_suffix(&self) -> String {
        (self.lora.as_ref()).map_or(String::new(), |l| format!("{LORA_SEPARATOR}{l}"))
    }

    /// Parses a preset (`mlp-8x1024`, `gpt-tiny`, `gpt2`) or `FAMILY:key=value,…` (omitted keys
    /// take the family's defaults).
    pub fn parse(spec: &str) -> Result<ModelSpec, PlanError> {
        let bad = |why: &str| PlanError::BadModelSpec {
            spec: spec.to_string(),
            why: why.to_string(),
        };
        if let Some((base, lora)) = spec.split_once(LORA_SEPARATOR) {
            let lora = LoraSpec::parse(lora).map_err(|e| bad(&e))?;
            return Self::parse(base)?.with_lora(lora).map_err(|e| bad(&e));
        }
        for family in FAMILIES {
            if let Some((_, dims)) = family.presets().iter().find(|(name, _)| *name == spec) {
                return Ok(ModelSpec::new(*family, dims));
            }
        }
        let (kind, args) = spec
            .split_once(':')
            .ok_or_else(|| bad(&format!("expected {}", spellings())))?;
        let family = family(kind).ok_or_else(|| {
            let names: Vec<String> = FAMILIES.iter().map(|f| format!("`{}`", f.name())).collect();
            bad(&format!("the family must be one of {}", names.join(", ")))
        })?;
        let keys = family.keys();
        let mut dims: Vec<usize> = keys.iter().map(|(_, default)| *default).collect();
        for pair in args.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad("each option is key=value"))?;
            let k = k.trim();
            let v: usize = v
                .trim()
                .parse()
                .map_err(|_| bad(&format!("`{k}` needs a whole number")))?;
            if v == 0 {
                return Err(bad(&format!("`{k}` must be at least 1")));
            }
            let Some(at) = keys.iter().position(|(key, _)| *key == k) else {
                let guess = (keys.iter())
                    .map(|&(key, _)| (edit_distance(k, key), key))
                    .filter(|&(distance, _)| distance <= 2)
                    .min()
                    .map_or(String::new(), |(_, key)| format!(" (did you mean `{key}`?)"));
                let known: Vec<&str> = keys.iter().map(|(key, _)| *key).collect();
                return Err(bad(&format!(
                    "unknown option `{k}`{guess}; `{kind}` takes {}",
                    known.join(", ")
                )));
            };
            dims[at] = v;
        }
        family.check(&dims).map_err(|why| bad(&why))?;
        Ok(ModelSpec::new(family, &dims))
    }
}

/// Every family's spelling, for an error.
fn spellings() -> String {
    let mut all = Vec::new();
    for family in FAMILIES {
        all.extend(family.presets().iter().map(|(name, _)| format!("`{name}`")));
        let keys: Vec<String> = (family.keys().iter())
            .map(|(k, _)| format!("{k}={}", k[..1].to_uppercase()))
            .collect();
        all.push(format!("`{}:{}`", family.name(), keys.join(",")));
    }
    all.join(", ")
}

impl fmt::Display for ModelSpec {
    /// A preset's name where the spec is one, else [`ModelSpec::explicit`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let preset = (self.family.presets().iter()).find(|(_, dims)| *dims == self.dims());
        match preset {
            Some((name, _)) => write!(f, "{name}{}", self.lora_suffix()),
            None => f.write_str(&self.explicit()),
        }
    }
}

impl Serialize for ModelSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.explicit())
    }
}

impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<ModelSpec, D::Error> {
        let text = String::deserialize(deserializer)?;
        ModelSpec::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A family's dimensions as a fixed array (they were parsed with exactly its keys).
pub(crate) fn dims<const N: usize>(dims: &[usize]) -> [usize; N] {
    dims.try_into().expect("dimensions parsed with the family's keys")
}

/// Levenshtein distance between `a` and `b` (for "did you mean").
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}
