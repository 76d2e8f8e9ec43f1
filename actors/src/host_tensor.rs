//! Host tensors and burn: [`to_burn`] / [`into_burn`] and [`from_burn`] move an f32 (or, under
//! mixed precision, a bf16 or f16) [`TypedTensor`] onto a burn device and back (the trainer's
//! activations and gradients).
//!
//! In-process, a send moves the tensor's `Arc`, never the bytes; [`into_burn`] takes the buffer
//! without a copy when nobody else holds it ([`TypedTensor::into_f32_vec`]).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::transfer::{TransferKind, download, upload_float};
use crate::typed_tensor::TypedTensor;
use archipelago_dataflow::DType;

/// A host tensor as a burn tensor of rank `D` on `device`.
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn to_burn<B: Backend, const D: usize>(t: &TypedTensor, device: &B::Device) -> Tensor<B, D> {
    into_burn(t.clone(), device)
}

/// [`to_burn`] for a tensor the caller gives up: its buffer is not copied when nobody else
/// holds it (a received activation, say). Counted as an activation transfer
/// ([`crate::transfer`]).
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn into_burn<B: Backend, const D: usize>(t: TypedTensor, device: &B::Device) -> Tensor<B, D> {
    assert_eq!(
        t.shape().len(),
        D,
        "tensor of rank {} read as rank {D}",
        t.shape().len()
    );
    let shape = t.shape().to_vec();
    let data = match t.dtype() {
        DType::BF16 => TensorData::from_bytes_vec(t.bytes().to_vec(), shape, burn::tensor::DType::BF16),
        DType::F16 => TensorData::from_bytes_vec(t.bytes().to_vec(), shape, burn::tensor::DType::F16),
        _ => TensorData::new(t.into_f32_vec(), shape),
    };
    upload_float(data, device, TransferKind::Activation)
}

/// A burn tensor back in host memory, in its dtype (f32, or the 16 bits of mixed precision;
/// counted as an activation transfer).
pub fn from_burn<B: Backend, const D: usize>(t: Tensor<B, D>) -> TypedTensor {
    let shape = t.dims().to_vec();
    let data = download(t, TransferKind::Activation);
    let sixteen = match data.dtype {
        burn::tensor::DType::BF16 => Some(DType::BF16),
        burn::tensor::DType::F16 => Some(DType::F16),
        _ => None,
    };
    match sixteen {
        Some(dtype) => {
            TypedTensor::from_bytes(dtype, shape, data.as_bytes()).expect("a 16-bit tensor's bytes")
        }
        None => TypedTensor::new(shape, data.convert::<f32>().into_vec::<f32>().expect("f32 data")),
    }
}
