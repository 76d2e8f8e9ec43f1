//! The CPU backend's device memory is host memory: there the device state's tensors are plain
//! buffers the optimizer's flat loops (`optim`) can update in place — no tensor ops, no copy to
//! another buffer, nothing counted as a transfer (it measured 3–10× faster than a tensor-op
//! optimizer on burn's `Flex`). Other backends (CUDA) keep the tensor-op update.
//!
//! A burn tensor of backend `B` is a `Flex` tensor exactly when `B`'s float primitive is
//! [`FlexTensor`]; [`into_cpu`] and [`from_cpu`] move between the two by a checked downcast.

use std::any::{Any, TypeId};

use burn::backend::flex::FlexTensor;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

/// Whether `B`'s tensors live in host memory as [`FlexTensor`]s.
pub(super) fn is_cpu<B: Backend>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<FlexTensor>()
}

/// The CPU tensor under `tensor` (`None` on another backend).
pub(super) fn into_cpu<B: Backend>(tensor: Tensor<B, 1>) -> Option<FlexTensor> {
    let primitive: Box<dyn Any> = Box::new(tensor.into_primitive().tensor());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// `tensor` as a tensor of backend `B`.
///
/// # Panics
/// When `B` is not the CPU backend (see [`is_cpu`]).
pub(super) fn from_cpu<B: Backend>(tensor: FlexTensor) -> Tensor<B, 1> {
    let primitive: Box<dyn Any> = Box::new(tensor);
    let primitive = primitive
        .downcast::<B::FloatTensorPrimitive>()
        .expect("a CPU tensor given to another backend");
    Tensor::from_primitive(TensorPrimitive::Float(*primitive))
}

/// The values of a contiguous 1-d f32 tensor, in place (copied first only when another tensor
/// shares the buffer: burn's copy-on-write).
pub(super) fn values_mut(tensor: &mut FlexTensor) -> Result<&mut [f32], String> {
    let len = tensor.layout().num_elements();
    if tensor.layout().contiguous_offsets() != Some((0, len)) {
        return Err("a device-state tensor is not one contiguous buffer".into());
    }
    Ok(&mut tensor.storage_mut::<f32>()[..len])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::backend::flex::FlexDevice;
    use burn::tensor::TensorData;

    #[test]
    fn a_cpu_tensor_is_updated_in_place_and_comes_back() {
        assert!(is_cpu::<Flex>());
        let t = Tensor::<Flex, 1>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]), &FlexDevice);
        let mut cpu = into_cpu(t).expect("a Flex tensor");
        values_mut(&mut cpu).unwrap().iter_mut().for_each(|x| *x *= 2.0);
        let back = from_cpu::<Flex>(cpu);
        assert_eq!(back.into_data().to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    }
}
