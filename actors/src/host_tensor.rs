//! Host tensors: f32 data in a shared buffer with a shape — what crosses the fabric.
//!
//! In-process, a send moves the `Arc`, never the bytes; `into_vec` gives the buffer back without a
//! copy when nobody else holds it. [`to_burn`] / [`into_burn`] and [`from_burn`] move a host
//! tensor onto a burn device and back (the trainer's activations and gradients).

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::transfer::{TransferKind, download, upload};

/// A dense f32 tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Row-major values, shared.
    pub data: Arc<Vec<f32>>,
}

impl HostTensor {
    /// A tensor owning `data` with `shape` (the product of `shape` must equal `data.len()`).
    ///
    /// # Panics
    /// When the shape does not match the data length.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> HostTensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} does not match {} values",
            data.len()
        );
        HostTensor {
            shape,
            data: Arc::new(data),
        }
    }

    /// A flat (1-D) tensor.
    pub fn flat(data: Vec<f32>) -> HostTensor {
        HostTensor {
            shape: vec![data.len()],
            data: Arc::new(data),
        }
    }

    /// A scalar as a 1-element tensor.
    pub fn scalar(value: f32) -> HostTensor {
        HostTensor::flat(vec![value])
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Bytes of payload.
    pub fn bytes(&self) -> u64 {
        4 * self.data.len() as u64
    }

    /// The values; a copy only when the buffer is shared.
    pub fn into_vec(self) -> Vec<f32> {
        Arc::try_unwrap(self.data).unwrap_or_else(|shared| shared.as_ref().clone())
    }
}

/// A host tensor as a burn tensor of rank `D` on `device`.
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn to_burn<B: Backend, const D: usize>(t: &HostTensor, device: &B::Device) -> Tensor<B, D> {
    into_burn(t.clone(), device)
}

/// [`to_burn`] for a tensor the caller gives up: its buffer is not copied when nobody else
/// holds it (a received activation, say). Counted as an activation transfer
/// ([`crate::transfer`]).
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn into_burn<B: Backend, const D: usize>(t: HostTensor, device: &B::Device) -> Tensor<B, D> {
    assert_eq!(
        t.shape.len(),
        D,
        "tensor of rank {} read as rank {D}",
        t.shape.len()
    );
    let shape = t.shape.clone();
    upload(
        TensorData::new(t.into_vec(), shape),
        device,
        TransferKind::Activation,
    )
}

/// A burn tensor back in host memory (counted as an activation transfer).
pub fn from_burn<B: Backend, const D: usize>(t: Tensor<B, D>) -> HostTensor {
    let shape = t.dims().to_vec();
    let data = download(t, TransferKind::Activation)
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data");
    HostTensor::new(shape, data)
}
