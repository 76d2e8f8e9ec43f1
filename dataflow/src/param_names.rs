//! Every parameter of a zoo model by its PyTorch name: the names and layouts weights cross the
//! boundary with (`--init FILE.safetensors`, `archipelago export`).
//!
//! The runtime holds a block's parameters as one flat `f32` vector in the burn module's
//! declaration order (`Block::param_shapes` in the actors crate); [`block_params`] lists that same
//! order, each parameter with the name `scripts/torch_reference.py`'s PyTorch modules give it,
//! its shape as burn holds it, and whether it is transposed at the boundary: burn's `Linear`
//! weight is `[in, out]`, PyTorch's `nn.Linear` weight `[out, in]`. Embedding tables
//! (`[rows, d]`) and LayerNorm vectors have the same layout on both sides; LayerNorm's
//! `gamma`/`beta` are PyTorch's `weight`/`bias`.
//!
//! Names: a gpt has `tok.weight`, `pos.weight`,
//! `layers.{i}.{ln1,qkv,proj,ln2,fc1,fc2}.{weight,bias}`, `ln_f.weight`, `ln_f.bias` and
//! `head.weight` (the head has no bias); its fused `qkv` is one `[3d, d]` matrix whose rows are
//! the query, key and value projections in that order, as in the torch script. An mlp has
//! `layers.{k}.weight` and `layers.{k}.bias` for its k-th `Linear`, counting from 0, the output
//! `Linear` included.
//!
//! ```
//! use archipelago_dataflow::ModelSpec;
//! use archipelago_dataflow::param_names::block_params;
//! let mlp = ModelSpec::parse("mlp:in=4,hidden=8,layers=1,out=3").unwrap();
//! let names: Vec<_> = block_params(&mlp).into_iter().flatten().map(|p| p.name).collect();
//! assert_eq!(names, ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]);
//! ```

use crate::ModelSpec;

/// One parameter as it crosses the PyTorch boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedParam {
    /// PyTorch's name for it (a `state_dict` key), e.g. `layers.0.qkv.weight`.
    pub name: String,
    /// Its shape as the runtime (burn) holds it; a transposed matrix is `[in, out]` here.
    pub shape: Vec<usize>,
    /// Whether PyTorch holds the transpose of `shape` (a `Linear` weight: `[out, in]`).
    pub transposed: bool,
    /// The parameter this one mirrors (GPT-2's head, tied to the token embedding): read from
    /// files under that name, never written.
    pub tied_to: Option<String>,
}

impl NamedParam {
    /// Number of `f32` values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it holds no value (never for a zoo model).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its shape as PyTorch holds it (the reverse of [`NamedParam::shape`] when transposed).
    pub fn torch_shape(&self) -> Vec<usize> {
        if self.transposed {
            self.shape.iter().rev().copied().collect()
        } else {
            self.shape.clone()
        }
    }
}

pub(crate) fn linear(prefix: &str, d_in: usize, d_out: usize, bias: bool) -> Vec<NamedParam> {
    let mut out = vec![NamedParam {
        name: format!("{prefix}.weight"),
        shape: vec![d_in, d_out],
        transposed: true,
        tied_to: None,
    }];
    if bias {
        out.push(vector(&format!("{prefix}.bias"), d_out));
    }
    out
}

pub(crate) fn vector(name: &str, n: usize) -> NamedParam {
    NamedParam {
        name: name.to_string(),
        shape: vec![n],
        transposed: false,
        tied_to: None,
    }
}

pub(crate) fn layer_norm(prefix: &str, d: usize) -> Vec<NamedParam> {
    vec![
        vector(&format!("{prefix}.weight"), d),
        vector(&format!("{prefix}.bias"), d),
    ]
}

pub(crate) fn table(name: &str, rows: usize, d: usize) -> NamedParam {
    NamedParam {
        name: name.to_string(),
        shape: vec![rows, d],
        transposed: false,
        tied_to: None,
    }
}

/// Each block's parameters, blocks in model order, parameters in the runtime's flattening order
/// (its family's names and layouts: [`crate::family::ModelFamily::block_params`]). A gpt layer is
/// two blocks, its attention half (`ln1`, `qkv`, `proj`) and its MLP half (`ln2`, `fc1`, `fc2`),
/// so that a tensor-parallel all-reduce can sit between them (Megatron-LM's g).
pub fn block_params(model: &ModelSpec) -> Vec<Vec<NamedParam>> {
    model.block_params()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each block's listed parameters add up to the compiler's parameter count for it.
    #[test]
    fn every_block_lists_exactly_its_parameter_count() {
        for spec in [
            "mlp:in=5,hidden=7,layers=3,out=2",
            "gpt:vocab=11,ctx=6,d=8,layers=2,heads=2",
        ] {
            let model = ModelSpec::parse(spec).unwrap();
            let named = block_params(&model);
            let desc = model.desc();
            assert_eq!(named.len(), desc.blocks.len(), "{spec}");
            for (params, info) in named.iter().zip(&desc.blocks) {
                let total: usize = params.iter().map(NamedParam::len).sum();
                assert_eq!(total as u64, info.params, "{spec} {}", info.name);
            }
        }
    }

    /// Names are unique and PyTorch's; only Linear weights are transposed.
    #[test]
    fn gpt_names_are_pytorch_state_dict_keys() {
        let model = ModelSpec::parse("gpt:vocab=11,ctx=6,d=8,layers=1,heads=2").unwrap();
        let all: Vec<NamedParam> = block_params(&model).into_iter().flatten().collect();
        let names: Vec<&str> = all.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "tok.weight",
                "pos.weight",
                "layers.0.ln1.weight",
                "layers.0.ln1.bias",
                "layers.0.qkv.weight",
                "layers.0.qkv.bias",
                "layers.0.proj.weight",
                "layers.0.proj.bias",
                "layers.0.ln2.weight",
                "layers.0.ln2.bias",
                "layers.0.fc1.weight",
                "layers.0.fc1.bias",
                "layers.0.fc2.weight",
                "layers.0.fc2.bias",
                "ln_f.weight",
                "ln_f.bias",
                "head.weight",
            ]
        );
        let qkv = &all[4];
        assert_eq!((qkv.shape.clone(), qkv.torch_shape()), (vec![8, 24], vec![24, 8]));
        assert!(all.iter().all(|p| p.transposed
            == (p.shape.len() == 2 && !p.name.starts_with("tok") && !p.name.starts_with("pos"))));
    }
}
