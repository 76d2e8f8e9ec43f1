//! The zoo's tensor-parallel blocks against one device's, with the all-reduces done by hand: at
//! tp=2 (and tp=4 for gpt's halves) each rank's block, loaded with its slice of the same global
//! initial values ([`take_local`]), gives outputs whose sum over the group (g) is one device's
//! output (gpt's embedding and half-layers, mlp's row-parallel layers), or whose concatenation
//! is its logits (vocabulary-parallel heads). A qkv cut contiguously instead of per head is
//! caught (the negative control).

use burn::backend::flex::FlexDevice;
use burn::tensor::{Distribution, Int, Tensor, TensorData};

use archipelago_dataflow::tensor_parallel::take_local;
use archipelago_dataflow::{ModelSpec, ParamDesc, Split};

use super::tp::TpPlace;
use super::{BuildContext, ModelBuilder, ZooModel};
use crate::CpuBackend;
use crate::block::{Activation, Block, initial_params};

type B = CpuBackend;

/// Block `index` of `spec` on rank `tp`, loaded with its slice of the global initial values
/// (qkv cut with `qkv_split`: per head, or contiguously for the negative control).
fn block_on(spec: &str, index: usize, tp: TpPlace, qkv_split: Split) -> Box<dyn Block<B>> {
    let model = ZooModel(ModelSpec::parse(spec).unwrap());
    let desc = ModelBuilder::<B>::desc(&model);
    let params: &[ParamDesc] = &desc.blocks[index].param_descs;
    let global = initial_params(params, 7);
    let mut local = Vec::new();
    let mut at = 0;
    for p in params {
        let mut p = p.clone();
        if p.name.contains("qkv") {
            p.split = qkv_split;
        }
        local.extend(take_local(&p, &global[at..at + p.len()], tp.rank, tp.size));
        at += p.len();
    }
    let ctx = BuildContext {
        seed: 7,
        actor: tp.rank,
        block: index,
        tp,
        sequence_parallel: false,
    };
    ModelBuilder::<B>::build_block(&model, &ctx, &FlexDevice).load_params(&local, false)
}

fn values(a: Activation<B>) -> Vec<f32> {
    match a {
        Activation::Seq(t) => t.into_data().convert::<f32>().to_vec().unwrap(),
        Activation::Rows(t) => t.into_data().convert::<f32>().to_vec().unwrap(),
        Activation::Tokens(_) => unreachable!("blocks output floats"),
    }
}

fn sum(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let mut total = vec![0.0; parts[0].len()];
    for part in parts {
        total.iter_mut().zip(part).for_each(|(t, p)| *t += p);
    }
    total
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const GPT: &str = "gpt:vocab=11,ctx=6,d=16,layers=1,heads=4";

/// `input` through block `index` of the gpt on every rank of `tp`, the outputs summed (g).
fn gpt_summed(index: usize, tp: usize, input: &Activation<B>, qkv: Split) -> Vec<f32> {
    sum((0..tp)
        .map(|rank| values(block_on(GPT, index, TpPlace::new(rank, tp), qkv).forward(input.clone())))
        .collect())
}

/// The embedding (vocabulary-parallel, 11 tokens padded to 12 at tp=2 and 4) and both halves of a
/// layer, summed over the group, are one device's to f32 rounding; a contiguous qkv cut is not.
#[test]
fn gpt_blocks_sum_over_the_group_to_one_devices() {
    let per_head = Split::HeadColumns { parts: 3 };
    let ids: Vec<i64> = (0..12).map(|i| (i * 7 + 3) % 11).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 6]), &FlexDevice);
    let seq = Tensor::<B, 3>::random([2, 6, 16], Distribution::Default, &FlexDevice);
    let cases = [
        (0, Activation::Tokens(tokens)),
        (1, Activation::Seq(seq.clone())),
        (2, Activation::Seq(seq)),
    ];
    for (index, input) in &cases {
        let one = values(block_on(GPT, *index, TpPlace::default(), per_head).forward(input.clone()));
        for tp in [2, 4] {
            let summed = gpt_summed(*index, tp, input, per_head);
            let off = max_difference(&one, &summed);
            assert!(off < 1e-5, "block {index} at tp={tp}: {off}");
        }
    }
    let (_, attention_input) = &cases[1];
    let one = values(block_on(GPT, 1, TpPlace::default(), per_head).forward(attention_input.clone()));
    let contiguous = gpt_summed(1, 2, attention_input, Split::Columns);
    let off = max_difference(&one, &contiguous);
    assert!(off > 1e-2, "a contiguous qkv cut went unnoticed: {off}");
}

/// The head's slices, concatenated and the padding dropped, are one device's logits.
#[test]
fn the_vocabulary_parallel_head_holds_a_slice_of_the_logits() {
    let x = Activation::Seq(Tensor::<B, 3>::random(
        [2, 6, 16],
        Distribution::Default,
        &FlexDevice,
    ));
    let one = values(block_on(GPT, 3, TpPlace::default(), Split::Replicated).forward(x.clone()));
    let tp = 2;
    let slices: Vec<Vec<f32>> = (0..tp)
        .map(|rank| values(block_on(GPT, 3, TpPlace::new(rank, tp), Split::Replicated).forward(x.clone())))
        .collect();
    let width = 6; // ceil(11 / 2)
    let mut joined = Vec::new();
    for token in 0..12 {
        for slice in &slices {
            joined.extend_from_slice(&slice[token * width..(token + 1) * width]);
        }
        joined.truncate(joined.len() - 1); // the last rank's padded column
    }
    assert!(max_difference(&one, &joined) < 1e-5);
}

/// mlp at tp=2 and 3: column layer, row layer summed (g), column layer (ReLU of its input
/// first), row output summed, equal one device's four layers.
#[test]
fn mlp_layers_alternate_to_one_devices_output() {
    let spec = "mlp:in=5,hidden=12,layers=3,out=4";
    let x = Tensor::<B, 2>::random([3, 5], Distribution::Default, &FlexDevice);
    let one = (0..4).fold(Activation::Rows(x.clone()), |a, k| {
        block_on(spec, k, TpPlace::default(), Split::Replicated).forward(a)
    });
    let one = values(one);
    for tp in [2, 3] {
        let on = |k: usize, rank: usize, input: Activation<B>| {
            block_on(spec, k, TpPlace::new(rank, tp), Split::Replicated).forward(input)
        };
        let pair = |first: usize, input: Tensor<B, 2>| -> Tensor<B, 2> {
            let parts = (0..tp)
                .map(|rank| {
                    values(on(
                        first + 1,
                        rank,
                        on(first, rank, Activation::Rows(input.clone())),
                    ))
                })
                .collect();
            let rows = input.dims()[0];
            let summed = sum(parts);
            let width = summed.len() / rows;
            Tensor::from_data(TensorData::new(summed, [rows, width]), &FlexDevice)
        };
        let out = pair(2, pair(0, x.clone()));
        let off = max_difference(&one, &out.into_data().convert::<f32>().to_vec().unwrap());
        assert!(off < 1e-5, "tp={tp}: {off}");
    }
}
