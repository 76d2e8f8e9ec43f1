//! The model zoo: the workloads of `shared/WORKLOADS.md` as blocks, and the [`ModelBuilder`]
//! trait through which users bring their own.
//!
//! Every actor builds its own copy of each block it holds (burn's autodiff graph must not be
//! shared between actor threads), and every parameter is initialised whole from `(seed, its
//! name)` alone (then sliced to what the actor keeps), so every layout starts from exactly the
//! weights of dp=1. The zoo's parameters are described by [`archipelago_dataflow::ModelSpec::desc`]
//! (PyTorch's names, burn's shapes).

mod gpt;
mod gpt2;
mod gpt_sp;
pub mod int8_layers;
pub mod lora;
mod mlp;
pub mod tp;

pub use gpt::{AttentionHalf, GptEmbedding, GptHead, MlpHalf};
pub use gpt_sp::{AttentionMix, Gelu, HeadLinear, MlpMix, SeqLayerNorm};
pub use gpt2::TiedHead;
pub use mlp::{LinearBlock, LinearReluBlock, TpLinearBlock};

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{ActorId, ModelDesc, ModelSpec};

use crate::block::Block;
use crate::kernels::Kernels;

/// Where and why a block is being built.
#[derive(Debug, Clone, Copy)]
pub struct BuildContext {
    /// The job's seed.
    pub seed: u64,
    /// The actor that will hold the block.
    pub actor: ActorId,
    /// The block's index in the model.
    pub block: usize,
    /// Its place in its tensor-parallel group (the default: no tensor parallelism).
    pub tp: tp::TpPlace,
    /// Whether the model is in its sequence-parallel form
    /// (`archipelago_dataflow::sequence_parallel`), whose blocks differ.
    pub sequence_parallel: bool,
}

impl BuildContext {
    /// Block `block` of a model held whole by one actor (actor 0, seed 0, no tensor or sequence
    /// parallelism): what inference and the description tests build.
    pub fn whole(block: usize) -> BuildContext {
        BuildContext {
            seed: 0,
            actor: 0,
            block,
            tp: Default::default(),
            sequence_parallel: false,
        }
    }
}

/// Builds a model's blocks on an actor. The runtime overwrites the parameters a builder produces
/// with [`crate::block::initial_params`] of the block's descriptions (or, under ZeRO-3, with
/// gathered values each time a
/// segment runs), so builders need not be seeded; the zoo's builders use burn's zeros
/// initializer, which costs a memset instead of a random draw per parameter.
pub trait ModelBuilder<B: AutodiffBackend>: Send + Sync {
    /// The compiler's view of the model (must agree with the blocks built).
    fn desc(&self) -> ModelDesc;
    /// Builds block `ctx.block` on `device`.
    fn build_block(&self, ctx: &BuildContext, device: &B::Device) -> Box<dyn Block<B>>;
}

/// A zoo model from its spec.
#[derive(Debug, Clone)]
pub struct ZooModel(pub ModelSpec);

impl<B: Kernels> ModelBuilder<B> for ZooModel {
    fn desc(&self) -> ModelDesc {
        self.0.desc()
    }

    fn build_block(&self, ctx: &BuildContext, device: &B::Device) -> Box<dyn Block<B>> {
        let build = builder::<B>(self.0.family().name())
            .unwrap_or_else(|| panic!("no burn builder for the family of {}", self.0));
        build(ctx, &self.0, device)
    }
}

/// The adapter of module `module` of `spec`, if its LoRA targets it.
pub fn adapter_shape(spec: &ModelSpec, module: &str) -> Option<lora::AdapterShape> {
    let lora = spec.lora().filter(|l| l.targets_module(module))?;
    Some(lora::AdapterShape {
        rank: lora.rank,
        scale: lora.scale(),
    })
}

/// The burn builder of each family of [`archipelago_dataflow::family::FAMILIES`]: the one place
/// a family's name meets its blocks.
/// A builder makes block `ctx.block` of a model (its dimensions, its adapters).
#[allow(clippy::type_complexity)]
pub fn builder<B: Kernels>(
    family: &str,
) -> Option<fn(&BuildContext, &ModelSpec, &B::Device) -> Box<dyn Block<B>>> {
    match family {
        "mlp" => Some(mlp::block::<B>),
        "gpt" => Some(gpt::block::<B>),
        "gpt2" => Some(gpt2::block::<B>),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;

    use super::*;
    use crate::CpuBackend;
    use crate::block::check_described;

    /// The compiler's description of every zoo block lists the runtime block's parameters: the
    /// same count, order and shapes, and names that are the burn paths' PyTorch names
    /// (LayerNorm's `gamma`/`beta` are `weight`/`bias`).
    #[test]
    fn descriptions_match_the_runtime_blocks() {
        for spec in [
            "mlp:in=5,hidden=7,layers=3,out=2",
            "gpt:vocab=11,ctx=6,d=8,layers=2,heads=2",
            "gpt2:vocab=11,ctx=6,d=8,layers=2,heads=2",
        ] {
            let model = ZooModel(ModelSpec::parse(spec).unwrap());
            let desc = ModelBuilder::<CpuBackend>::desc(&model);
            for (index, info) in desc.blocks.iter().enumerate() {
                let ctx = BuildContext::whole(index);
                let block = ModelBuilder::<CpuBackend>::build_block(&model, &ctx, &FlexDevice);
                let shapes = block.param_shapes();
                check_described(&info.name, &info.param_descs, &shapes).unwrap();
                for ((path, _), p) in shapes.iter().zip(&info.param_descs) {
                    let leaf = path.rsplit('.').next().unwrap();
                    let torch_leaf = match leaf {
                        "gamma" => "weight",
                        "beta" => "bias",
                        other => other,
                    };
                    assert!(
                        p.name.ends_with(torch_leaf),
                        "{spec}: {path} described as {}",
                        p.name
                    );
                }
                let mut wrong = info.param_descs.clone();
                wrong.reverse();
                if wrong.len() > 1 && wrong != info.param_descs {
                    assert!(check_described(&info.name, &wrong, &shapes).is_err());
                }
            }
        }
    }

    /// Every registered family has a burn builder, and a name no family has, none.
    #[test]
    fn every_family_has_a_builder() {
        for family in archipelago_dataflow::family::FAMILIES {
            assert!(
                builder::<crate::CpuBackend>(family.name()).is_some(),
                "{}",
                family.name()
            );
        }
        assert!(builder::<crate::CpuBackend>("cnn").is_none());
    }
}

#[cfg(test)]
mod tp_tests;
