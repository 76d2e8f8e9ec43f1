//! A zoo model's weights as a safetensors file with PyTorch's names and layouts: read by
//! `--init FILE.safetensors`, written by `archipelago export`.
//!
//! The names, shapes and transposes are [`archipelago_dataflow::param_names`]'s: a file holds
//! exactly one f32 tensor per parameter, under its PyTorch `state_dict` key, in PyTorch's layout
//! (a `Linear` weight `[out, in]`, which burn holds as `[in, out]`). A family may let names lack
//! a prefix (GPT-2's `transformer.`) and ignore buffers (GPT-2's `attn.bias` masks); a mirror
//! (GPT-2's tied `lm_head.weight`) is read from the parameter it mirrors, may be absent, must
//! equal it when present, and is never written. [`InitWeights`] reads one
//! block at a time, in the runtime's flattening order, so an actor reads only the blocks it holds.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::{Dtype, View};

use archipelago_dataflow::ParamDesc;
use archipelago_dataflow::family::ModelFamily;
use archipelago_dataflow::family::lora::is_adapter;
use archipelago_dataflow::param_names::{NamedParam, block_params};
use archipelago_dataflow::{ModelDesc, ModelSpec};

use crate::peft::PeftAdapters;
use crate::tensor_file::TensorFile;

/// The zoo spec of `model` (the parameters of a user's own blocks have no PyTorch names).
fn zoo_spec(model: &ModelDesc, what: &str) -> Result<ModelSpec, String> {
    ModelSpec::parse(&model.name).map_err(|_| {
        format!(
            "{what} names parameters as the zoo's models do; `{}` is not a zoo model",
            model.name
        )
    })
}

/// How one file keys a model's parameters: by their names, or without the family's optional
/// prefix (GPT-2's `transformer.`, absent from a `GPT2Model` file).
#[derive(Debug, Clone, Copy)]
struct FileKeys {
    /// The prefix the file leaves off (empty: none).
    dropped: &'static str,
}

impl FileKeys {
    /// Whichever keying finds more of `params`' own (untied) names in `file`.
    fn of(file: &TensorFile, params: &[NamedParam], family: &dyn ModelFamily) -> FileKeys {
        let found = |keys: FileKeys| {
            (params.iter().filter(|p| p.tied_to.is_none()))
                .filter(|p| file.info(keys.key(&p.name)).is_some())
                .count()
        };
        let (with, without) = (
            FileKeys { dropped: "" },
            FileKeys {
                dropped: family.optional_prefix(),
            },
        );
        if !without.dropped.is_empty() && found(without) > found(with) {
            without
        } else {
            with
        }
    }

    /// The file's key for parameter name `name`.
    fn key<'a>(&self, name: &'a str) -> &'a str {
        name.strip_prefix(self.dropped).unwrap_or(name)
    }
}

/// Refuses a weights file that does not hold exactly `params` (the family's buffers aside),
/// naming every missing name, every extra one and every tensor of the wrong shape or dtype; a
/// mirror (GPT-2's `lm_head.weight`) may be absent, and if present must equal its parameter.
fn check_weights(
    file: &TensorFile,
    params: &[NamedParam],
    family: &dyn ModelFamily,
) -> Result<FileKeys, String> {
    let keys = FileKeys::of(file, params, family);
    let mut problems = Vec::new();
    let own: Vec<&NamedParam> = params.iter().filter(|p| p.tied_to.is_none()).collect();
    let missing: Vec<&str> = (own.iter())
        .filter(|p| file.info(keys.key(&p.name)).is_none())
        .map(|p| keys.key(&p.name))
        .collect();
    if !missing.is_empty() {
        problems.push(format!("missing {}", missing.join(", ")));
    }
    let known: HashSet<&str> = params.iter().map(|p| keys.key(&p.name)).collect();
    let ignored = |n: &str| family.ignored_suffixes().iter().any(|s| n.ends_with(s));
    let extra: Vec<&str> = (file.names().into_iter())
        .filter(|n| !known.contains(n) && !ignored(n))
        .collect();
    if !extra.is_empty() {
        problems.push(format!("not parameters of this model: {}", extra.join(", ")));
    }
    for p in params {
        let Some((dtype, shape)) = file.info(keys.key(&p.name)) else {
            continue;
        };
        let torch_shape = p.torch_shape();
        if dtype != Dtype::F32 || shape != torch_shape.as_slice() {
            let fix = if dtype == Dtype::F32 {
                ""
            } else {
                " (save the weights in float32: `torch_dtype=torch.float32`)"
            };
            problems.push(format!(
                "`{}` is {dtype:?} {shape:?}, expected F32 {torch_shape:?}{fix}",
                keys.key(&p.name)
            ));
        }
    }
    if problems.is_empty() {
        check_mirrors(file, params, keys)?;
        return Ok(keys);
    }
    Err(format!(
        "{} does not hold this model's weights: {}",
        file.path().display(),
        problems.join("; ")
    ))
}

/// A mirror the file holds (a tied `lm_head.weight`) equals its parameter bit for bit.
fn check_mirrors(file: &TensorFile, params: &[NamedParam], keys: FileKeys) -> Result<(), String> {
    for p in params {
        let Some(target) = &p.tied_to else { continue };
        if file.info(keys.key(&p.name)).is_none() {
            continue;
        }
        let (mirror, tied) = (
            file.read_f32(keys.key(&p.name))?,
            file.read_f32(keys.key(target))?,
        );
        if let Some(at) = (mirror.iter().zip(&tied)).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!(
                "{}: `{}` differs from `{target}` (element {at}: {} against {}): an untied head, and \
                 this family ties it to the token embedding; give weights whose head is tied, or drop \
                 `{}` from the file",
                file.path().display(),
                p.name,
                mirror[at],
                tied[at],
                p.name
            ));
        }
    }
    Ok(())
}

/// Reads parameter `p` in burn's layout (transposing a `Linear` weight; a mirror's values from
/// the parameter it mirrors).
fn read_param(file: &TensorFile, p: &NamedParam, keys: FileKeys) -> Result<Vec<f32>, String> {
    let values = file.read_f32(keys.key(p.tied_to.as_deref().unwrap_or(&p.name)))?;
    if !p.transposed {
        return Ok(values);
    }
    let torch = p.torch_shape();
    Ok(transpose(&values, torch[0], torch[1]))
}

/// The transpose of row-major `rows × cols` `values`.
pub(crate) fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// A checked weights file for a model: each block's flat parameters on demand.
#[derive(Debug)]
pub struct InitWeights {
    file: TensorFile,
    blocks: Vec<Vec<NamedParam>>,
    keys: FileKeys,
    adapters: AdapterValues,
}

/// Where a model's LoRA adapters start, beside a base weights file.
#[derive(Debug, Clone, Copy)]
pub enum AdapterStart<'a> {
    /// Drawn from `(seed, name)` as every parameter is (PEFT's init: A Kaiming-uniform, B zero).
    Seeded(u64),
    /// Read from a PEFT adapter directory (`--lora-init`).
    Peft(&'a Path),
}

/// The adapters' values.
#[derive(Debug)]
enum AdapterValues {
    Seeded {
        seed: u64,
        descs: HashMap<String, ParamDesc>,
    },
    Peft(PeftAdapters),
}

impl InitWeights {
    /// Opens `path` for `model` and checks it holds exactly the model's parameters (its base's,
    /// for a model with LoRA adapters, whose values come from `adapters`).
    pub fn open(path: &Path, model: &ModelDesc, adapters: AdapterStart) -> Result<InitWeights, String> {
        let spec = zoo_spec(model, "--init")?;
        let file = TensorFile::open(path).map_err(|e| format!("--init: {e}"))?;
        let blocks = block_params(&spec);
        let all: Vec<NamedParam> = (blocks.iter().flatten())
            .filter(|p| !is_adapter(&p.name))
            .cloned()
            .collect();
        let adapters = match adapters {
            AdapterStart::Peft(dir) => AdapterValues::Peft(PeftAdapters::open(dir, &spec)?),
            AdapterStart::Seeded(seed) => AdapterValues::Seeded {
                seed,
                descs: (spec.describe().into_iter().flatten())
                    .map(|p| (p.name.clone(), p))
                    .collect(),
            },
        };
        let keys = check_weights(&file, &all, spec.family()).map_err(|e| format!("--init: {e}"))?;
        // Tensors that fit may still be another model's: a file that says which model it holds
        // must hold this one (the shapes alone cannot tell, say, a gpt's heads).
        let other = |m: &&String| ModelSpec::parse(m).map_or(true, |held| held.base() != spec.base());
        if let Some(held) = file.meta().get("archipelago_model").filter(other) {
            return Err(format!(
                "--init: {} holds the weights of `{held}`, this job trains `{spec}`: train `{held}`, or \
                 give the weights of `{spec}`",
                path.display()
            ));
        }
        // The model's blocks as it runs them, by name: the sequence-parallel form cuts the same
        // parameters into other blocks than the file's (the plain form's).
        let by_name: HashMap<&str, &NamedParam> =
            blocks.iter().flatten().map(|p| (p.name.as_str(), p)).collect();
        let blocks = (model.blocks.iter())
            .map(|b| {
                (b.param_descs.iter())
                    .map(|d| {
                        (by_name.get(d.name.as_str()).map(|p| (*p).clone()))
                            .ok_or_else(|| format!("--init: `{}` is not a parameter of {spec}", d.name))
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(InitWeights {
            file,
            blocks,
            keys,
            adapters,
        })
    }

    /// Block `index`'s parameters, flat in the runtime's order and burn's layouts.
    pub fn block(&self, index: usize) -> Result<Vec<f32>, String> {
        let params = self
            .blocks
            .get(index)
            .ok_or_else(|| format!("the model has no block {index}"))?;
        let mut out = Vec::with_capacity(params.iter().map(NamedParam::len).sum());
        for p in params {
            if !is_adapter(&p.name) {
                out.extend(read_param(&self.file, p, self.keys)?);
                continue;
            }
            match &self.adapters {
                AdapterValues::Peft(file) => out.extend(file.read(p)?),
                AdapterValues::Seeded { seed, descs } => {
                    let desc = descs
                        .get(&p.name)
                        .ok_or_else(|| format!("`{}` is not described", p.name))?;
                    out.extend(crate::block::init_param(desc, *seed));
                }
            }
        }
        Ok(out)
    }
}

/// Where a LoRA model's adapters start beside its `--init` base: `--lora-init`'s PEFT directory,
/// or the seeded initialisation.
pub fn adapter_start(program: &archipelago_dataflow::Program) -> AdapterStart<'_> {
    match &program.lora_init {
        Some(dir) => AdapterStart::Peft(std::path::Path::new(dir)),
        None => AdapterStart::Seeded(program.seed),
    }
}

/// One f32 tensor to write (the safetensors crate's [`View`]).
struct F32Tensor {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &F32Tensor {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `model`'s weights to `path`: `blocks[i]` is block `i`'s flat parameters in the
/// runtime's order and burn's layouts; the file has PyTorch's names and layouts, and its
/// `__metadata__` says `{"format": "pt"}` (what Hugging Face's loaders check). The same weights
/// always give the same bytes (the crate orders tensors by name; the metadata has one entry, as
/// the crate writes it from a `HashMap` whose order would vary between runs).
pub fn write_weights(path: &Path, model: &ModelSpec, blocks: &[Vec<f32>]) -> Result<(), String> {
    let named = block_params(model);
    if named.len() != blocks.len() {
        return Err(format!(
            "{model} has {} blocks, {} were given",
            named.len(),
            blocks.len()
        ));
    }
    let mut tensors = Vec::new();
    for (index, (params, flat)) in named.iter().zip(blocks).enumerate() {
        let total: usize = params.iter().map(NamedParam::len).sum();
        if total != flat.len() {
            return Err(format!(
                "block {index} of {model} has {total} parameters, {} were given",
                flat.len()
            ));
        }
        let mut at = 0;
        for p in params {
            let values = &flat[at..at + p.len()];
            at += p.len();
            if p.tied_to.is_some() {
                continue;
            }
            let torch = if p.transposed {
                transpose(values, p.shape[0], p.shape[1])
            } else {
                values.to_vec()
            };
            tensors.push((p.name.clone(), p.torch_shape(), torch));
        }
    }
    // What the file holds, for a reader who has only the file (`config.json` beside an export
    // holds the same).
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("archipelago_model".to_string(), model.explicit()),
        ("config".to_string(), model.config().to_string()),
    ]);
    write_f32_tensors(path, tensors, metadata)
}

/// Writes named f32 tensors (name, shape, values) as a safetensors file with `metadata`, its
/// header's keys sorted (the same tensors always give the same bytes).
pub(crate) fn write_f32_tensors(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    metadata: HashMap<String, String>,
) -> Result<(), String> {
    let tensors: Vec<(String, F32Tensor)> = (tensors.into_iter())
        .map(|(name, shape, values)| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, F32Tensor { shape, bytes })
        })
        .collect();
    let bytes = safetensors::serialize(tensors.iter().map(|(name, t)| (name.as_str(), t)), Some(metadata))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let bytes = with_sorted_header(bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A safetensors file's bytes with its header's keys in sorted order (the crate writes the
/// metadata map in a hash map's order, which differs from process to process): the same model
/// gives the same bytes. The header stays padded with spaces to a multiple of 8 bytes.
fn with_sorted_header(bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    let len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or("no header")?;
    let header = bytes.get(8..8 + len).ok_or("a header past the end")?;
    let sorted: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("the header written is not JSON: {e}"))?;
    let sorted: std::collections::BTreeMap<String, serde_json::Value> = (sorted.into_iter())
        .map(|(k, v)| match v {
            serde_json::Value::Object(map) => {
                let inner: std::collections::BTreeMap<String, serde_json::Value> = map.into_iter().collect();
                (k, serde_json::to_value(inner).expect("a map of JSON values"))
            }
            other => (k, other),
        })
        .collect();
    let mut text = serde_json::to_vec(&sorted).map_err(|e| e.to_string())?;
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + text.len() + bytes.len() - 8 - len);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + len..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;

    use super::*;
    use crate::CpuBackend;
    use crate::zoo::{BuildContext, ModelBuilder, ZooModel};

    /// `param_names` lists each zoo block's parameters in `Block::param_shapes`' order, with the
    /// same shapes, and its PyTorch names end as burn's paths do (`gamma`/`beta` → `weight`/`bias`).
    #[test]
    fn param_names_follow_the_runtime_flattening_order() {
        for spec in [
            "mlp:in=5,hidden=7,layers=3,out=2",
            "gpt:vocab=11,ctx=6,d=8,layers=2,heads=2",
        ] {
            let model = ModelSpec::parse(spec).unwrap();
            let zoo = ZooModel(model.clone());
            for (index, named) in block_params(&model).iter().enumerate() {
                let ctx = BuildContext::whole(index);
                let block = ModelBuilder::<CpuBackend>::build_block(&zoo, &ctx, &FlexDevice);
                let shapes = block.param_shapes();
                assert_eq!(shapes.len(), named.len(), "{spec} block {index}");
                for ((path, shape), p) in shapes.iter().zip(named) {
                    assert_eq!(shape, &p.shape, "{spec} {path} vs {}", p.name);
                    let leaf = match path.rsplit('.').next().unwrap() {
                        "gamma" => "weight",
                        "beta" => "bias",
                        other => other,
                    };
                    assert!(p.name.ends_with(leaf), "{spec} {path} vs {}", p.name);
                    assert_eq!(p.transposed, shape.len() == 2 && !path.contains("embedding"));
                }
            }
        }
    }

    /// Written weights read back block by block equal what was written; the file holds PyTorch
    /// layouts (a `Linear` weight transposed); a file for another model is refused naming the
    /// missing, extra and misshapen tensors.
    #[test]
    fn weights_round_trip_and_wrong_files_are_refused() {
        let model = ModelSpec::parse("mlp:in=3,hidden=4,layers=1,out=2").unwrap();
        let blocks: Vec<Vec<f32>> = model
            .desc()
            .blocks
            .iter()
            .enumerate()
            .map(|(b, info)| (0..info.params).map(|i| (100 * b as u64 + i) as f32).collect())
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        write_weights(&path, &model, &blocks).unwrap();
        let init = InitWeights::open(&path, &model.desc(), AdapterStart::Seeded(0)).unwrap();
        for (index, flat) in blocks.iter().enumerate() {
            assert_eq!(&init.block(index).unwrap(), flat);
        }
        // burn's [3, 4] weight w[i][o] = 4i + o; PyTorch's [4, 3] holds w[o][i] = 4i + o.
        let file = TensorFile::open(&path).unwrap();
        assert_eq!(file.info("layers.0.weight").unwrap().1, [4, 3]);
        assert_eq!(
            &file.read_f32("layers.0.weight").unwrap()[..4],
            [0.0, 4.0, 8.0, 1.0]
        );
        let other = ModelSpec::parse("mlp:in=3,hidden=5,layers=2,out=2").unwrap();
        let err = InitWeights::open(&path, &other.desc(), AdapterStart::Seeded(0)).unwrap_err();
        assert!(err.contains("missing layers.2.weight, layers.2.bias"), "{err}");
        assert!(
            err.contains("`layers.0.weight` is F32 [4, 3], expected F32 [5, 3]"),
            "{err}"
        );
        let deeper = ModelSpec::parse("mlp:in=3,hidden=4,layers=2,out=2").unwrap();
        let deeper_blocks: Vec<Vec<f32>> = deeper
            .desc()
            .blocks
            .iter()
            .map(|b| vec![0.5; b.params as usize])
            .collect();
        write_weights(&path, &deeper, &deeper_blocks).unwrap();
        let err = InitWeights::open(&path, &model.desc(), AdapterStart::Seeded(0)).unwrap_err();
        assert!(
            err.contains("not parameters of this model: layers.2.bias, layers.2.weight"),
            "{err}"
        );
    }
}
