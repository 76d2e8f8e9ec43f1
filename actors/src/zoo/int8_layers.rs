//! The zoo's linear layers in int8 for inference (LLM.int8, [`crate::kernels::int8`]): a
//! mixing block's two projections quantized in place, their f32 weights dropped, and the
//! forward through the int8 kernel wherever a block has them. The output head (GPT-2's, tied
//! to the embedding) and the embeddings stay in f32, as bitsandbytes leaves `lm_head`.

use std::sync::Arc;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::kernels::int8::Int8Linear;
use crate::kernels::{Kernels, linear};
use crate::zoo::tp::{TpPlace, row_parallel};

/// Bytes of a model's quantized linear weights, before and after.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Int8Bytes {
    /// Linear layers quantized.
    pub layers: usize,
    /// Their weights' bytes in f32.
    pub f32_bytes: usize,
    /// Their int8 values' bytes (one per weight).
    pub int8_bytes: usize,
    /// Their column scales' bytes (four per output column).
    pub scale_bytes: usize,
}

impl std::ops::AddAssign for Int8Bytes {
    fn add_assign(&mut self, other: Int8Bytes) {
        self.layers += other.layers;
        self.f32_bytes += other.f32_bytes;
        self.int8_bytes += other.int8_bytes;
        self.scale_bytes += other.scale_bytes;
    }
}

/// A block's pair of projections in int8 (`qkv` and `proj`, or `fc1` and `fc2`).
pub type Int8Pair = Option<Arc<[Int8Linear; 2]>>;

/// `layers` in int8 at `threshold` into `pair`, their f32 weights replaced by empty ones;
/// refused under tensor parallelism (inference runs whole blocks).
pub fn quantize_pair<B: Backend>(
    layers: [&mut Linear<B>; 2],
    pair: &mut Int8Pair,
    threshold: f32,
    tp: TpPlace,
) -> Result<Int8Bytes, String> {
    if tp.size > 1 {
        return Err(
            "int8 weights run whole blocks: quantize a model loaded without tensor parallelism".into(),
        );
    }
    let mut bytes = Int8Bytes::default();
    let [first, second] = layers.map(|layer| {
        let quantized = int8_of(layer, threshold);
        bytes += Int8Bytes {
            layers: 1,
            f32_bytes: 4 * quantized.weight.values.len(),
            int8_bytes: quantized.weight.values.len(),
            scale_bytes: 4 * quantized.weight.scales.len(),
        };
        quantized
    });
    *pair = Some(Arc::new([first, second]));
    Ok(bytes)
}

/// One layer in int8; its f32 weight is dropped (an empty `[0, out]` tensor in its place).
fn int8_of<B: Backend>(layer: &mut Linear<B>, threshold: f32) -> Int8Linear {
    let weight = layer.weight.val();
    let [rows, cols] = weight.dims();
    let device = weight.device();
    let read = |t: Tensor<B, 1>| {
        t.into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 parameters")
    };
    let values = read(weight.reshape([rows * cols]));
    let bias = layer.bias.as_ref().map(|b| read(b.val()));
    layer.weight = Param::from_tensor(Tensor::zeros([0, cols], &device));
    Int8Linear::new(&values, rows, cols, bias, threshold)
}

/// Projection `which` of a pair: in int8 when the block has them, else `layer` in f32; the
/// second of a pair is row-parallel (its bias on the leading rank only).
pub fn project<B: Kernels>(
    int8: &Int8Pair,
    which: usize,
    layer: &Linear<B>,
    x: Tensor<B, 3>,
    tp: TpPlace,
) -> Tensor<B, 3> {
    match (int8, which) {
        (Some(pair), _) => pair[which].forward(x, which == 0 || tp.leads()),
        (None, 0) => linear(layer, x),
        (None, _) => row_parallel(layer, x, tp),
    }
}
