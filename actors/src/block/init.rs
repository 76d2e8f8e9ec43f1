//! Each parameter's initial value and description: drawn whole from `(seed, its name)` with its
//! description's distribution (so that every layout starts from the same weights, whatever
//! slice an actor keeps), and descriptions made from, or checked against, a built module's
//! parameter paths and shapes.

use std::ops::Range;

use archipelago_dataflow::rng::SplitMix64;
use archipelago_dataflow::tensor_parallel::{TpPlace, take_local};
use archipelago_dataflow::{ParamDesc, ParamInit};

/// A parameter's key in the initialisation stream: FNV-1a over its name, so that the stream of
/// a parameter depends on its name alone, never on where a layout put it.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The whole initial value of parameter `param` under `seed`, drawn from its description's
/// distribution with a stream keyed by `(seed, name)`: the same on every actor of every layout.
pub fn init_param(param: &ParamDesc, seed: u64) -> Vec<f32> {
    let n = param.len();
    let mut rng = SplitMix64::keyed(&[seed, name_key(param.value_name()), 0x1417]);
    match param.init {
        ParamInit::Zeros => vec![0.0; n],
        ParamInit::Ones => vec![1.0; n],
        ParamInit::Normal { std } => (0..n).map(|_| (f64::from(std) * rng.gaussian()) as f32).collect(),
        ParamInit::UniformFanIn { fan_in } => {
            let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
            (0..n).map(|_| rng.uniform_in(-bound, bound) as f32).collect()
        }
    }
}

/// Elements `range` of the flat initial values of a block whose parameters are `params` (in
/// flattening order): each parameter the range touches is drawn whole from `(seed, name)` and
/// then sliced, so a shard of a block (ZeRO-3's) holds exactly the values the whole block has.
///
/// # Panics
/// When `range` reaches past the block's parameters.
pub fn init_range(params: &[ParamDesc], seed: u64, range: Range<usize>) -> Vec<f32> {
    values_in_range(params.iter().map(|p| (p.len(), p)), range, |p| {
        init_param(p, seed)
    })
}

/// Elements `range` of the flat initial values of tensor-parallel rank `tp`'s slice of a block:
/// `local` its parameters as the rank holds them, `global` the same parameters whole (in the same
/// order). Each parameter the range touches is drawn whole from `(seed, name)`, then the rank's
/// elements taken ([`take_local`], padding zero), so tp=N starts from exactly tp=1's weights; at
/// tp=1 this is [`init_range`].
///
/// # Panics
/// When `range` reaches past the slice's parameters, or the two lists differ in length.
pub fn init_local_range(
    local: &[ParamDesc],
    global: &[ParamDesc],
    seed: u64,
    tp: TpPlace,
    range: Range<usize>,
) -> Vec<f32> {
    assert_eq!(
        local.len(),
        global.len(),
        "a slice describes every parameter of its block"
    );
    let lens = local.iter().map(ParamDesc::len).zip(global);
    values_in_range(lens, range, |g| {
        take_local(g, &init_param(g, seed), tp.rank, tp.size)
    })
}

/// Elements `range` of the concatenation of parameters given as `(length, what)`, each parameter
/// the range touches made whole by `values(what)` (of that length) and then sliced.
fn values_in_range<'a>(
    params: impl Iterator<Item = (usize, &'a ParamDesc)>,
    range: Range<usize>,
    values: impl Fn(&ParamDesc) -> Vec<f32>,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(range.len());
    let mut at = 0;
    for (len, p) in params {
        let span = at..at + len;
        at = span.end;
        let (from, to) = (span.start.max(range.start), span.end.min(range.end));
        if from < to {
            out.extend_from_slice(&values(p)[from - span.start..to - span.start]);
        }
    }
    assert_eq!(
        out.len(),
        range.len(),
        "range {range:?} is past the block's {at} parameters"
    );
    out
}

/// The flat initial values of a block whose parameters are `params`.
pub fn initial_params(params: &[ParamDesc], seed: u64) -> Vec<f32> {
    let len = params.iter().map(ParamDesc::len).sum();
    init_range(params, seed, 0..len)
}

/// Descriptions of a block's parameters from its burn paths and shapes, for a model that gives
/// only a parameter count: named `{block}.{path}`, f32, trainable, replicated, initialised as the
/// zoo's: LayerNorm `gamma` 1 and `beta` 0; embedding tables `N(0, 0.02²)`; other matrices
/// `[fan_in, fan_out]` and the vectors beside a matrix (biases) `U(±1/√fan_in)`; other vectors 0.
pub fn describe_shapes(block: &str, shapes: &[(String, Vec<usize>)]) -> Vec<ParamDesc> {
    shapes
        .iter()
        .map(|(path, shape)| {
            let leaf = path.rsplit('.').next().unwrap_or(path);
            let parent = path.rsplit_once('.').map_or("", |(p, _)| p);
            let sibling_fan_in = shapes
                .iter()
                .find(|(p, s)| s.len() == 2 && p.rsplit_once('.').map_or("", |(q, _)| q) == parent)
                .map(|(_, s)| s[0]);
            let init = match (leaf, shape.len()) {
                ("gamma", _) => ParamInit::Ones,
                ("beta", _) => ParamInit::Zeros,
                (_, 2) if path.contains("embedding") => ParamInit::Normal { std: 0.02 },
                (_, 2) => ParamInit::UniformFanIn { fan_in: shape[0] },
                _ => sibling_fan_in.map_or(ParamInit::Zeros, |fan_in| ParamInit::UniformFanIn { fan_in }),
            };
            ParamDesc::new(format!("{block}.{path}"), shape.clone(), init)
        })
        .collect()
}

/// Checks that a block built at run time has the parameters its description lists: the same
/// number, in the same order, with the same shapes (names differ: burn's module paths against
/// the description's, e.g. PyTorch's).
pub fn check_described(
    block: &str,
    described: &[ParamDesc],
    shapes: &[(String, Vec<usize>)],
) -> Result<(), String> {
    let listed: Vec<&[usize]> = described.iter().map(|p| &p.shape[..]).collect();
    let built: Vec<&[usize]> = shapes.iter().map(|(_, s)| &s[..]).collect();
    if listed != built {
        return Err(format!(
            "block `{block}` is built with parameters {:?} but its description lists {:?}: describe the \
             parameters in the module's declaration order with the module's shapes",
            shapes,
            described.iter().map(|p| (&p.name, &p.shape)).collect::<Vec<_>>()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor-parallel rank's initial values are its elements of each parameter drawn whole
    /// (the per-head qkv cut included); at tp=1 they are the block's.
    #[test]
    fn a_tp_rank_starts_from_its_slice_of_the_whole_parameters() {
        use archipelago_dataflow::ModelSpec;
        use archipelago_dataflow::tensor_parallel::local_model;
        let model = ModelSpec::parse("gpt:vocab=9,ctx=4,d=8,layers=1,heads=2")
            .unwrap()
            .desc();
        let local = local_model(&model, 2);
        for (g, l) in model.blocks.iter().zip(&local.blocks) {
            let len: usize = l.param_descs.iter().map(ParamDesc::len).sum();
            let rank1 = init_local_range(&l.param_descs, &g.param_descs, 3, TpPlace::new(1, 2), 0..len);
            let want: Vec<f32> = (g.param_descs.iter())
                .flat_map(|p| take_local(p, &init_param(p, 3), 1, 2))
                .collect();
            assert_eq!(rank1, want, "{}", g.name);
            let n: usize = g.param_descs.iter().map(ParamDesc::len).sum();
            let one = init_local_range(&g.param_descs, &g.param_descs, 3, TpPlace::default(), 2..n);
            assert_eq!(one, init_range(&g.param_descs, 3, 2..n));
        }
    }

    /// A parameter's initial values depend on `(seed, name)` alone: the same name gives the same
    /// values whatever block it sits in and whatever comes before it; any slice of a block is
    /// the slice of the whole; each kind keeps its distribution.
    #[test]
    fn initialisation_is_the_whole_parameter_from_seed_and_name_then_sliced() {
        let w = ParamDesc::new(
            "layers.0.weight",
            vec![16, 8],
            ParamInit::UniformFanIn { fan_in: 16 },
        );
        let b = ParamDesc::new("layers.0.bias", vec![8], ParamInit::UniformFanIn { fan_in: 16 });
        let g = ParamDesc::new("ln.weight", vec![8], ParamInit::Ones);
        let e = ParamDesc::new("tok.weight", vec![64, 8], ParamInit::Normal { std: 0.02 });
        let block = [g.clone(), w.clone(), b.clone()];
        let whole = initial_params(&block, 3);
        assert_eq!(&whole[..8], &[1.0; 8]);
        assert_eq!(
            &whole[8..8 + 128],
            &init_param(&w, 3)[..],
            "position does not matter"
        );
        assert_eq!(initial_params(std::slice::from_ref(&w), 3), init_param(&w, 3));
        for range in [0..1, 5..40, 100..144, 0..144] {
            assert_eq!(init_range(&block, 3, range.clone()), whole[range]);
        }
        assert_ne!(init_param(&w, 3), init_param(&w, 4), "another seed");
        let renamed = ParamDesc {
            name: "layers.1.weight".into(),
            ..w.clone()
        };
        assert_ne!(init_param(&w, 3), init_param(&renamed, 3), "another name");
        let bound = 0.25f32;
        assert!(init_param(&w, 3).iter().all(|x| x.abs() <= bound));
        let normal = init_param(&e, 3);
        let std = (normal.iter().map(|x| x * x).sum::<f32>() / normal.len() as f32).sqrt();
        assert!((std - 0.02).abs() < 0.004, "{std}");
    }
}
