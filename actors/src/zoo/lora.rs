//! A LoRA adapter on a projection (Hu et al., 2021): `x ↦ (x·A)·B · α/r` added to the frozen
//! projection's output, `A` `[d_in, r]` and `B` `[r, d_out]` in burn's layout (the dataflow
//! crate's `family::lora` describes them and names them `{module}.lora_A.weight`,
//! `{module}.lora_B.weight`). Under tensor parallelism a rank holds the slices its base weight's
//! split gives it: `B`'s columns beside a column-parallel weight, `A`'s rows beside a row-parallel
//! one (whose partial product the group's all-reduce sums with the base's).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use archipelago_dataflow::Split;
use archipelago_dataflow::tensor_parallel::local_extent;

use crate::zoo::tp::TpPlace;

/// One projection's adapter.
#[derive(Module, Debug)]
pub struct Adapter<B: Backend> {
    /// `A` `[d_in, r]` (this rank's rows beside a row-parallel weight).
    pub lora_a: Param<Tensor<B, 2>>,
    /// `B` `[r, d_out]` (this rank's columns beside a column-parallel weight).
    pub lora_b: Param<Tensor<B, 2>>,
    /// `α/r`.
    pub scale: f64,
}

/// Where a projection's adapter goes and its shape: rank, scale, and the base weight's split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterShape {
    /// The rank `r`.
    pub rank: usize,
    /// `α/r`.
    pub scale: f64,
}

impl<B: Backend> Adapter<B> {
    /// Rank `tp`'s adapter of a `d_in × d_out` projection split as `split` (zeros: the runtime
    /// loads the described values).
    pub fn sliced(
        d_in: usize,
        d_out: usize,
        shape: AdapterShape,
        split: Split,
        tp: TpPlace,
        device: &B::Device,
    ) -> Self {
        let (rows, columns) = match split {
            Split::Rows => (local_extent(d_in, tp.size), d_out),
            Split::Replicated => (d_in, d_out),
            Split::Columns | Split::HeadColumns { .. } => (d_in, tp.part(d_out)),
        };
        Adapter {
            lora_a: Param::from_tensor(Tensor::zeros([rows, shape.rank], device)),
            lora_b: Param::from_tensor(Tensor::zeros([shape.rank, columns], device)),
            scale: shape.scale,
        }
    }

    /// `(x·A)·B · α/r` for `x` `[b, t, d_in]`.
    pub fn update(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d_in] = x.dims();
        let (a, bm) = (self.lora_a.val(), self.lora_b.val());
        let d_out = bm.dims()[1];
        let low = x.reshape([b * t, d_in]).matmul(a);
        low.matmul(bm).mul_scalar(self.scale).reshape([b, t, d_out])
    }
}

/// `base + adapter.update(x)` where there is an adapter.
pub fn adapted<B: Backend>(
    base: Tensor<B, 3>,
    adapter: &Option<Adapter<B>>,
    x: Tensor<B, 3>,
) -> Tensor<B, 3> {
    match adapter {
        Some(adapter) => base + adapter.update(x),
        None => base,
    }
}
