//! CPU kernels behind burn's backend API: the matmul of CPU devices by OpenBLAS, and causal
//! self-attention as one op from the fused `qkv` projection.
//!
//! Flex (burn's CPU backend) multiplies with the `gemm` crate, whose kernels ran at 42–62
//! GFLOP/s at gpt-tiny's shapes on one AVX-512 core where OpenBLAS's SkylakeX kernels ran at
//! 130–145 (docs/PERFORMANCE.md). Models call [`matmul`] and [`linear`] (bound `B: Kernels`)
//! instead of `Tensor::matmul` and `Linear::forward`; on `Autodiff<Flex>` these run OpenBLAS in the
//! forward and in both gradient products of the backward, on every other backend they are burn's.
//! [`causal_attention`] is one graph node on `Autodiff<Flex>` with OpenBLAS (`attention.rs`: each
//! head's products read and written where the heads lie, no head-split copies, one softmax pass
//! per row) and burn's composed ops elsewhere ([`composed_causal_attention`], its reference).
//! [`gelu`] is one vectorised node on `Autodiff<Flex>` (forward and derivative in one pass), and
//! [`layer_norm`] one node (burn composes it of nine). With 16-bit parameters (mixed precision)
//! [`linear`] is one node too: the product, the bias and the gradients in f32, rounded once.
//!
//! Which library does the work is the process's choice, `ARCHIPELAGO_CPU_MATMUL`:
//! `auto` (the default: OpenBLAS where a thread-safe build loads and one of its core types
//! multiplies as Flex does, Flex's gemm otherwise), `openblas` (an error at job start if it
//! cannot be had) or `flex`. OpenBLAS's core type is chosen from the CPU's features where its own
//! detection is older than they allow (`core_type.rs`; a user's `OPENBLAS_CORETYPE` is kept).
//! [`describe`] says what is in use and why (`train`, the run report and the bench carry it).

mod attention;
mod attention_past;
pub mod paged_attention;
pub use attention_past::attention_with_past;
mod autodiff_attention;
mod autodiff_linear;
mod autodiff_matmul;
mod cast;
pub mod core_type;
mod flex_blas;
mod gelu;
pub mod int8;
mod layer_norm;
pub mod openblas;
mod openblas_check;
#[cfg(test)]
mod tests;

use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::nn::Linear;
use burn::tensor::activation::softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, FloatDType, Tensor, TensorPrimitive};

use openblas::OpenBlas;

/// A tensor of `Autodiff<Flex, C>`'s graph (what the fused nodes take and make).
pub(crate) type Tracked<C> = FloatTensor<Autodiff<Flex, C>>;

/// The environment variable that picks the CPU matmul of a process (and of the host processes it
/// starts, which inherit it).
pub const CPU_MATMUL_ENV: &str = "ARCHIPELAGO_CPU_MATMUL";

/// Which library multiplies f32 matrices on CPU devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuMatmul {
    /// OpenBLAS where a thread-safe build loads and passes its checks, Flex's gemm otherwise.
    Auto,
    /// OpenBLAS, or an error.
    OpenBlas,
    /// Flex's own gemm.
    Flex,
}

impl FromStr for CpuMatmul {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "" => Ok(CpuMatmul::Auto),
            "openblas" => Ok(CpuMatmul::OpenBlas),
            "flex" => Ok(CpuMatmul::Flex),
            other => Err(format!(
                "{CPU_MATMUL_ENV}={other}: expected auto, openblas or flex"
            )),
        }
    }
}

const UNSET: u8 = 0;
const USE_FLEX: u8 = 1;
const USE_OPENBLAS: u8 = 2;

/// The kernel in force: unset until the first matmul or [`select`].
static IN_FORCE: AtomicU8 = AtomicU8::new(UNSET);

/// Puts `choice` in force for this process and says what now multiplies; an error (nothing
/// changed) where OpenBLAS was asked for and cannot be had.
pub fn select(choice: CpuMatmul) -> Result<String, String> {
    let kernel = match (choice, openblas::library()) {
        (CpuMatmul::Flex, _) => USE_FLEX,
        (_, Ok(_)) => USE_OPENBLAS,
        (CpuMatmul::Auto, Err(why)) => {
            tracing::info!("CPU matmul: Flex's gemm ({why})");
            USE_FLEX
        }
        (CpuMatmul::OpenBlas, Err(why)) => {
            return Err(format!(
                "{CPU_MATMUL_ENV}=openblas, but {why}; or set {CPU_MATMUL_ENV}=auto"
            ));
        }
    };
    IN_FORCE.store(kernel, Ordering::Release);
    Ok(describe())
}

/// Puts the environment's choice ([`CPU_MATMUL_ENV`], `auto` when unset) in force; what jobs call
/// before their actors start, so that a bad value or a missing library is an error there.
pub fn select_from_env() -> Result<String, String> {
    let choice = std::env::var(CPU_MATMUL_ENV).unwrap_or_default().parse()?;
    select(choice)
}

/// What multiplies f32 matrices on CPU devices now (after [`select`] or the first matmul).
pub fn describe() -> String {
    match IN_FORCE.load(Ordering::Acquire) {
        USE_OPENBLAS => match openblas::library() {
            Ok(blas) => blas.description.clone(),
            Err(why) => format!("flex gemm ({why})"),
        },
        USE_FLEX => "flex gemm".to_string(),
        _ => "not chosen yet".to_string(),
    }
}

/// OpenBLAS if it is the kernel in force (choosing from the environment on first use).
fn active_openblas() -> Option<&'static OpenBlas> {
    let mut kernel = IN_FORCE.load(Ordering::Acquire);
    if kernel == UNSET {
        if let Err(why) = select_from_env() {
            tracing::warn!("{why}: using Flex's gemm");
            IN_FORCE.store(USE_FLEX, Ordering::Release);
        }
        kernel = IN_FORCE.load(Ordering::Acquire);
    }
    (kernel == USE_OPENBLAS)
        .then(|| openblas::library().ok())
        .flatten()
}

/// The training backends' kernels that models call by name (burn's where a backend has no own).
pub trait Kernels: AutodiffBackend {
    /// `lhs · rhs` over the last two dimensions (burn's `float_matmul` semantics).
    fn kernel_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// Causal multi-head self-attention from the fused projection `qkv` `[b, t, 3d]` (queries,
    /// keys, values side by side) to `[b, t, d]` (see [`causal_attention`]).
    fn kernel_causal_attention(qkv: Tensor<Self, 3>, heads: usize) -> Tensor<Self, 3> {
        composed_causal_attention(qkv, heads)
    }

    /// Whether [`linear`] flattens its input's leading dimensions into the rows of one 2-D
    /// product (else it is burn's `Linear::forward`, a product per batch).
    fn flattens_linear() -> bool {
        true
    }

    /// `x · weight + bias` of the flattened [`linear`]: `x` `[rows, d_in]`, `weight`
    /// `[d_in, d_out]`, `bias` `[d_out]` ([`composed_linear`] unless the backend has its own).
    fn kernel_linear(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        composed_linear(x, weight, bias)
    }

    /// GELU, the erf form (see [`gelu`]).
    fn kernel_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ActivationOps<Self>>::gelu(x)
    }

    /// LayerNorm over the last dimension (see [`layer_norm`]).
    fn kernel_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        // The statistics in f32 whatever the compute dtype, the result rounded back to it.
        let dtype = burn::tensor::TensorMetadata::dtype(&x).into();
        let wide = |t| cast_to::<Self>(t, FloatDType::F32);
        let y = <Self as burn::tensor::ops::ModuleOps<Self>>::layer_norm(
            wide(x),
            wide(gamma),
            beta.map(wide),
            epsilon,
        );
        cast_to::<Self>(y, dtype)
    }
}

/// A float primitive as a tensor.
fn float<B: burn::tensor::backend::Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `x` in `dtype` through the backend's own cast (none when it already is one).
fn cast_to<B: burn::tensor::backend::Backend>(x: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    if x.dtype() == DType::from(dtype) {
        x
    } else {
        B::float_cast(x, dtype)
    }
}

impl<C: CheckpointStrategy> Kernels for Autodiff<Flex, C> {
    fn kernel_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        // 16-bit operands are widened inside the kernel (`autodiff_matmul::inner_matmul`).
        autodiff_matmul::matmul::<C>(lhs, rhs)
    }

    /// With OpenBLAS one product of `b·t` rows; on Flex's own gemm a product per batch, as
    /// burn's `Linear` does: gpt-tiny's forward took 0.61–0.65 s flattened against 0.43 s per
    /// batch (2026-11-26, docs/PERFORMANCE.md).
    fn flattens_linear() -> bool {
        active_openblas().is_some()
    }

    /// 16-bit operands with a bias and OpenBLAS in force: one node (`autodiff_linear.rs`), the
    /// product, the bias add and the three gradients in f32, each result rounded once. The rest
    /// (f32 among them) is [`composed_linear`], as before.
    fn kernel_linear(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let Some(bias) = bias else {
            return composed_linear(x, weight, None);
        };
        let (x, weight) = (x.into_primitive().tensor(), weight.into_primitive().tensor());
        let bias = bias.into_primitive().tensor();
        match autodiff_linear::applies(&x.primitive, &weight.primitive, &bias.primitive) {
            Some(blas) => float(autodiff_linear::linear::<C>(x, weight, bias, blas)),
            None => composed_linear(float(x), float(weight), Some(float(bias))),
        }
    }

    /// One vectorised pass forward (output and derivative), one multiply backward
    /// (`gelu.rs`), whichever library multiplies.
    fn kernel_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let dtype = x.primitive.dtype().into();
        cast::cast::<C>(gelu::gelu::<C>(cast::cast::<C>(x, FloatDType::F32)), dtype)
    }

    /// One node (`layer_norm.rs`) where there is a β and everything is f32; burn's otherwise.
    fn kernel_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        // The statistics in f32 whatever the compute dtype, the result rounded back to it.
        let dtype = x.primitive.dtype().into();
        let wide = |t| cast::cast::<C>(t, FloatDType::F32);
        let (x, gamma, beta) = (wide(x), wide(gamma), beta.map(wide));
        let fused = (beta.as_ref()).and_then(|beta| layer_norm::layer_norm::<C>(&x, &gamma, beta, epsilon));
        let y = fused.unwrap_or_else(|| {
            <Self as burn::tensor::ops::ModuleOps<Self>>::layer_norm(x, gamma, beta, epsilon)
        });
        cast::cast::<C>(y, dtype)
    }

    fn kernel_causal_attention(qkv: Tensor<Self, 3>, heads: usize) -> Tensor<Self, 3> {
        let qkv = qkv.into_primitive().tensor();
        let dtype: FloatDType = qkv.primitive.dtype().into();
        if dtype != FloatDType::F32 {
            // The fused kernel in f32 between two casts (softmax in f32 as the composed one).
            let wide = Tensor::from_primitive(TensorPrimitive::Float(cast::cast::<C>(qkv, FloatDType::F32)));
            let y = Self::kernel_causal_attention(wide, heads)
                .into_primitive()
                .tensor();
            return Tensor::from_primitive(TensorPrimitive::Float(cast::cast::<C>(y, dtype)));
        }
        match autodiff_attention::applies(&qkv.primitive, heads) {
            Some((blas, dims)) => Tensor::from_primitive(TensorPrimitive::Float(
                autodiff_attention::attention::<C>(qkv, blas, dims),
            )),
            None => composed_causal_attention(Tensor::from_primitive(TensorPrimitive::Float(qkv)), heads),
        }
    }
}

#[cfg(feature = "cuda")]
impl Kernels for crate::CudaBackend {}

/// `lhs · rhs` with the backend's kernel (see [`Kernels`]).
pub fn matmul<B: Kernels, const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) -> Tensor<B, D> {
    let product = B::kernel_matmul(lhs.into_primitive().tensor(), rhs.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(product))
}

/// GELU, `x·Φ(x)` with the normal distribution's exact (erf) `Φ`, with the backend's kernel: on
/// `Autodiff<Flex>` one graph node computing the output and the derivative in one vectorised
/// pass (within 4·10⁻⁷·(1 + |exact|) of the exact function and its derivative on −12…12,
/// tested); burn's `gelu` elsewhere.
pub fn gelu<B: Kernels, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::kernel_gelu(
        x.into_primitive().tensor(),
    )))
}

/// `layer` (burn's `LayerNorm`, made with `epsilon`) applied to `x` with the backend's kernel: on
/// `Autodiff<Flex>` one graph node (two passes forward, one backward, per row); burn's
/// composition of nine ops elsewhere. burn keeps a `LayerNorm`'s epsilon private, so the caller
/// passes the one it configured.
pub fn layer_norm<B: Kernels, const D: usize>(
    layer: &burn::nn::LayerNorm<B>,
    x: Tensor<B, D>,
    epsilon: f64,
) -> Tensor<B, D> {
    let gamma = layer.gamma.val().into_primitive().tensor();
    let beta = layer.beta.as_ref().map(|b| b.val().into_primitive().tensor());
    let y = B::kernel_layer_norm(x.into_primitive().tensor(), gamma, beta, epsilon);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// Causal multi-head self-attention (GPT-2's) from the fused projection `qkv` `[b, t, 3d]`:
/// per head, `softmax(Q Kᵀ / √hd + causal mask) V`, heads side by side in the `[b, t, d]` result.
/// On `Autodiff<Flex>` with OpenBLAS one graph node with its own backward; elsewhere burn's ops.
pub fn causal_attention<B: Kernels>(qkv: Tensor<B, 3>, heads: usize) -> Tensor<B, 3> {
    B::kernel_causal_attention(qkv, heads)
}

/// Part `part` (0 the queries, 1 the keys, 2 the values) of a fused projection `qkv`
/// `[b, t, 3d]`, by head: `[b, heads, t, d / heads]`.
pub fn qkv_part<B: burn::tensor::backend::Backend>(
    qkv: &Tensor<B, 3>,
    part: usize,
    heads: usize,
) -> Tensor<B, 4> {
    let [b, t, d3] = qkv.dims();
    let d = d3 / 3;
    (qkv.clone().narrow(2, part * d, d))
        .reshape([b, t, heads, d / heads])
        .swap_dims(1, 2)
}

/// [`causal_attention`] composed of burn's ops (narrow, reshape, swap_dims, matmul, masked
/// softmax): what every backend can run, and the reference the fused version is tested against.
pub fn composed_causal_attention<B: Kernels>(qkv: Tensor<B, 3>, heads: usize) -> Tensor<B, 3> {
    composed_attention(qkv, heads, true)
}

/// Attention composed of burn's ops, with or without the causal mask (without: the tests'
/// negative control, a model that sees later positions).
fn composed_attention<B: Kernels>(qkv: Tensor<B, 3>, heads: usize, causal: bool) -> Tensor<B, 3> {
    let [b, t, d3] = qkv.dims();
    let (d, h) = (d3 / 3, heads);
    let hd = d / h;
    let (q, k, v) = (qkv_part(&qkv, 0, h), qkv_part(&qkv, 1, h), qkv_part(&qkv, 2, h));
    let dtype = q.dtype();
    // The scores' scale, mask and softmax in f32 whatever the compute dtype (mixed precision),
    // the weights rounded back to it for their product with the values.
    let scores = matmul(q, k.swap_dims(2, 3))
        .cast(FloatDType::F32)
        .div_scalar((hd as f32).sqrt());
    // The causal mask, made on the device (no host upload per layer and forward): -1e9 where a
    // query would see a later key.
    let scores = if causal {
        let device = scores.device();
        let future = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &device);
        let mask = Tensor::<B, 2>::zeros([t, t], &device).mask_fill(future, -1e9);
        scores + mask.reshape([1, 1, t, t])
    } else {
        scores
    };
    let weights = softmax(scores, 3).cast(dtype);
    matmul(weights, v).swap_dims(1, 2).reshape([b, t, d])
}

/// `layer.forward(x)` with the backend's matmul: the leading dimensions of `x` are flattened
/// into the rows of one 2-D product `[rows, d_in] · [d_in, d_out]`, then the bias is added —
/// where the backend's kernel gains by it ([`Kernels::flattens_linear`]; burn's `Linear`
/// otherwise).
pub fn linear<B: Kernels, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    if !B::flattens_linear() {
        return layer.forward(x);
    }
    flat_linear(layer, x, true)
}

/// [`linear`] without the layer's bias: `x · W` (a row-parallel layer's summand on a
/// tensor-parallel rank that is not the first).
pub fn linear_without_bias<B: Kernels, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    if !B::flattens_linear() {
        return burn::tensor::module::linear(x, layer.weight.val(), None);
    }
    flat_linear(layer, x, false)
}

/// `x` flattened to rows, through the backend's linear kernel (with the bias when `bias`).
fn flat_linear<B: Kernels, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>, bias: bool) -> Tensor<B, D> {
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let bias = layer.bias.as_ref().filter(|_| bias).map(|bias| bias.val());
    let y = B::kernel_linear(x.reshape([rows, d_in]), layer.weight.val(), bias);
    dims[D - 1] = y.dims()[1];
    y.reshape(dims)
}

/// The flattened [`linear`] composed of the backend's [`matmul`] and burn's broadcast add: what
/// every backend can run, and the reference the fused 16-bit linear is tested against.
pub fn composed_linear<B: Kernels>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    let y = matmul(x, weight);
    match bias {
        Some(bias) => y + bias.unsqueeze_dim(0),
        None => y,
    }
}
