//! The visitors and mappers through which a block's burn parameters cross to and from the
//! runtime's flat `f32` vectors: shapes, flattening, gradients, loading (in the module's dtype,
//! rounded to nearest even), freezing, casting and fresh autodiff leaves.

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

use crate::transfer::{TransferKind, download, upload_float};

pub(super) struct ShapeVisitor {
    pub(super) path: Vec<String>,
    pub(super) out: Vec<(String, Vec<usize>)>,
}

impl<B: Backend> ModuleVisitor<B> for ShapeVisitor {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.out.push((self.path.join("."), param.val().dims().to_vec()));
    }
}

pub(super) struct FlattenVisitor<'a> {
    pub(super) out: &'a mut [f32],
    pub(super) offset: usize,
    /// Also the parameters out of autodiff (frozen), else only the trainable ones.
    pub(super) frozen_too: bool,
}

impl<B: Backend> ModuleVisitor<B> for FlattenVisitor<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        if !self.frozen_too && !tensor.is_require_grad() && B::ad_enabled(&tensor.device()) {
            return;
        }
        let data = download(tensor, TransferKind::Parameter).convert::<f32>();
        let values = data.as_slice::<f32>().expect("f32 parameters");
        self.out[self.offset..self.offset + values.len()].copy_from_slice(values);
        self.offset += values.len();
    }
}

pub(super) struct GradVisitor<'a, B: AutodiffBackend> {
    pub(super) grads: &'a mut B::Gradients,
    pub(super) parts: Vec<Tensor<B::InnerBackend, 1>>,
    /// Only the parameters whose entry is true (flattening order), else every tracked one.
    pub(super) which: Option<&'a [bool]>,
    pub(super) index: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradVisitor<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let index = self.index;
        self.index += 1;
        let taken = match self.which {
            Some(which) => which.get(index).copied().unwrap_or(false),
            None => tensor.is_require_grad(),
        };
        if !taken {
            return; // frozen (`Block::freeze`): no gradient, no place in a bucket
        }
        let n = tensor.shape().num_elements();
        let flat = match tensor.grad_remove(self.grads) {
            Some(grad) => grad.reshape([n]),
            None => Tensor::zeros([n], (&tensor.device(), tensor.dtype())),
        };
        self.parts.push(flat);
    }
}

pub(super) struct FreshLeafMapper;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeafMapper {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let fresh = if tensor.is_require_grad() {
            tensor.detach().require_grad()
        } else {
            tensor
        };
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Sets whether the parameters whose `which` entry is true are in autodiff: out of it
/// ([`Block::freeze`]: no backward computes their gradient) or back in as fresh leaves
/// ([`Block::track`]); the others, and those past `which`'s end, are left as they are.
pub(super) struct TrackedMapper<'a> {
    pub(super) which: &'a [bool],
    pub(super) tracked: bool,
    pub(super) index: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for TrackedMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let picked = self.which.get(self.index).copied().unwrap_or(false);
        self.index += 1;
        if !picked {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let tensor = match self.tracked {
            true => tensor.detach().require_grad(),
            false => tensor.detach().set_require_grad(false),
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Every parameter in one dtype, a leaf again where it required a gradient ([`Block::cast_params`]).
pub(super) struct CastMapper(pub(super) FloatDType);

impl<B: AutodiffBackend> ModuleMapper<B> for CastMapper {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let trains = tensor.is_require_grad();
        let cast = Tensor::from_inner(tensor.inner().cast(self.0)).set_require_grad(trains);
        Param::from_mapped_value(id, cast, mapper)
    }
}

pub(super) struct UntrackedMapper;

impl<B: AutodiffBackend> ModuleMapper<B> for UntrackedMapper {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // Not `detach()`: burn's detach keeps a leaf's `require_grad`, and ops on it would
        // record a graph that only a backward frees.
        Param::from_mapped_value(id, tensor.detach().set_require_grad(false), mapper)
    }
}

pub(super) struct LoadMapper<'a, B: Backend> {
    pub(super) flat: &'a [f32],
    /// `flat` already on the device (one write for the whole block).
    pub(super) whole: Option<Tensor<B, 1>>,
    pub(super) offset: usize,
    /// Load the frozen parameters (out of autodiff), else the trainable ones; the others keep
    /// their values.
    pub(super) frozen: bool,
}

impl<B: Backend> ModuleMapper<B> for LoadMapper<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // Without autodiff nothing is frozen (every parameter is loaded as trainable).
        let frozen = B::ad_enabled(&tensor.device()) && !tensor.is_require_grad();
        if frozen != self.frozen {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let shape = tensor.shape();
        let n = shape.num_elements();
        let range = self.offset..self.offset + n;
        self.offset += n;
        // In the module's dtype, whatever the master's (the compute copy of mixed precision),
        // rounded to nearest even.
        let dtype: DType = tensor.dtype();
        let device = tensor.device();
        let mut fresh = match &self.whole {
            Some(whole) => rounded(whole.clone().slice([range]).reshape(shape), dtype),
            None => upload_float::<B, D>(
                host_data(&self.flat[range], shape, dtype),
                &device,
                TransferKind::Parameter,
            ),
        };
        debug_assert_eq!(
            fresh.dtype(),
            dtype,
            "a loaded parameter keeps its module's dtype"
        );
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// f32 values as a tensor's data in `dtype` (f32, or bf16/f16 rounded to nearest even): a 16-bit
/// compute copy crosses to its device in its own bytes.
pub(super) fn host_data(values: &[f32], shape: burn::tensor::Shape, dtype: DType) -> TensorData {
    match dtype {
        DType::BF16 => {
            let rounded = values
                .iter()
                .map(|&x| half::bf16::from_bits(crate::typed_tensor::narrow_bf16(x)));
            TensorData::new(rounded.collect(), shape)
        }
        DType::F16 => TensorData::new(values.iter().map(|&x| half::f16::from_f32(x)).collect(), shape),
        _ => TensorData::new(values.to_vec(), shape),
    }
}

/// `t` in `dtype`, rounded to nearest even. burn's CPU backend casts f32 to bf16 through f64 with
/// `half`'s `bf16::from_f64`, which drops the f64's low 32 bits before deciding a tie (half
/// 2.7.1, `f64_to_bf16`), so an f32 just above a tie may round down; on it the values are
/// converted in host memory (where its tensors live) instead.
pub(super) fn rounded<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    let device = t.device();
    if t.dtype() == dtype || t.dtype() != DType::F32 || !B::name(&device).contains("flex") {
        return t.cast(dtype);
    }
    let shape = t.shape();
    let values = t.into_data().convert::<f32>();
    let values = values.as_slice::<f32>().expect("f32 values");
    Tensor::from_data(host_data(values, shape, dtype), (&device, dtype))
}
