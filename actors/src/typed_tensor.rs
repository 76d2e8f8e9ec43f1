//! Typed host tensors: a dtype, a shape and an 8-byte-aligned byte buffer shared behind an
//! `Arc` — what the runtime's tensor references own and move. Every dtype the fabric carries
//! (f32, bf16, f16, i8, u8, i32, i64) is raw little-endian bytes; the values are read back as
//! their Rust type without a copy ([`TypedTensor::values`]) or widened to f32
//! ([`TypedTensor::to_f32`], how 16-bit sums accumulate).
//!
//! ```
//! use archipelago_actors::typed_tensor::{DType, TypedTensor};
//! let t = TypedTensor::from_values(vec![2, 2], &[1i64, -2, 3, i64::MAX]);
//! assert_eq!(t.dtype(), DType::I64);
//! assert_eq!(t.values::<i64>()[3], i64::MAX);
//! assert_eq!(t.byte_len(), 32);
//! ```

use std::fmt;
use std::sync::Arc;

use bytemuck::Pod;

/// The workspace's one element type (the plan's parameters use the same).
pub use archipelago_dataflow::DType;

/// Rust types that are the elements of a dtype.
pub trait Element: Pod {
    /// Its dtype.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for i8 {
    const DTYPE: DType = DType::I8;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

/// Why bytes do not make a tensor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{bytes} bytes are not a {dtype} tensor of shape {shape:?} ({expected} bytes)")]
pub struct ShapeMismatch {
    /// The dtype.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<usize>,
    /// Bytes given.
    pub bytes: usize,
    /// Bytes the shape needs.
    pub expected: usize,
}

/// A dense tensor of any [`DType`] in host memory; cloning shares the buffer.
#[derive(Clone, PartialEq)]
pub struct TypedTensor {
    dtype: DType,
    shape: Vec<usize>,
    /// Whole 8-byte words, so that every element type can be viewed in place.
    words: Arc<Vec<u64>>,
    len: usize,
}

impl fmt::Debug for TypedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TypedTensor({} {:?}, {} bytes)",
            self.dtype, self.shape, self.len
        )
    }
}

impl TypedTensor {
    /// A tensor of `dtype` and `shape` from its little-endian bytes.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<TypedTensor, ShapeMismatch> {
        let mut tensor = TypedTensor::zeros(dtype, shape)?;
        if bytes.len() != tensor.len {
            return Err(ShapeMismatch {
                dtype,
                expected: tensor.len,
                shape: tensor.shape,
                bytes: bytes.len(),
            });
        }
        tensor.bytes_mut().copy_from_slice(bytes);
        Ok(tensor)
    }

    /// A zero-filled tensor (the buffer a receiver allocates before the bytes arrive). A shape
    /// whose size overflows, or memory that cannot be had, is an error, not an abort.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<TypedTensor, ShapeMismatch> {
        let elements = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
        let len = elements.and_then(|e| e.checked_mul(dtype.size()));
        let refused = |shape: Vec<usize>| ShapeMismatch {
            dtype,
            shape,
            bytes: 0,
            expected: usize::MAX,
        };
        let Some(len) = len.filter(|l| *l <= isize::MAX as usize / 2) else {
            return Err(refused(shape));
        };
        let mut words: Vec<u64> = Vec::new();
        if words.try_reserve_exact(len.div_ceil(8)).is_err() {
            return Err(refused(shape));
        }
        words.resize(len.div_ceil(8), 0);
        Ok(TypedTensor {
            dtype,
            shape,
            words: Arc::new(words),
            len,
        })
    }

    /// A tensor holding `values` with `shape`.
    ///
    /// # Panics
    /// When the shape's element count is not `values.len()`.
    pub fn from_values<T: Element>(shape: Vec<usize>, values: &[T]) -> TypedTensor {
        TypedTensor::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(values))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// Bytes of payload.
    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    /// The payload's bytes to fill (copies the buffer first when it is shared).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut::<u64, u8>(Arc::make_mut(&mut self.words).as_mut_slice())[..len]
    }

    /// The elements as their Rust type, in place.
    ///
    /// # Panics
    /// When `T` is not this tensor's element type.
    pub fn values<T: Element>(&self) -> &[T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "reading a {} tensor as {}",
            self.dtype,
            T::DTYPE
        );
        bytemuck::cast_slice(self.bytes())
    }

    /// The elements widened to f32 (integers converted, 16-bit floats expanded).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self.values::<f32>().to_vec(),
            DType::BF16 => self.values::<half::bf16>().iter().map(|v| v.to_f32()).collect(),
            DType::F16 => self.values::<half::f16>().iter().map(|v| v.to_f32()).collect(),
            DType::I8 => self.values::<i8>().iter().map(|v| *v as f32).collect(),
            DType::U8 => self.values::<u8>().iter().map(|v| *v as f32).collect(),
            DType::I32 => self.values::<i32>().iter().map(|v| *v as f32).collect(),
            DType::I64 => self.values::<i64>().iter().map(|v| *v as f32).collect(),
        }
    }

    /// Whether `self` and `other` share one buffer (no copy was made between them).
    pub fn shares_buffer_with(&self, other: &TypedTensor) -> bool {
        Arc::ptr_eq(&self.words, &other.words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_its_bytes() {
        let tensors = [
            TypedTensor::from_values(vec![3], &[1.5f32, -0.0, f32::MAX]),
            TypedTensor::from_values(vec![2], &[half::bf16::from_f32(3.0), half::bf16::from_f32(-1.25)]),
            TypedTensor::from_values(vec![2], &[half::f16::from_f32(0.5), half::f16::from_f32(-7.0)]),
            TypedTensor::from_values(vec![3], &[-128i8, 0, 127]),
            TypedTensor::from_values(vec![1, 3], &[0u8, 1, 255]),
            TypedTensor::from_values(vec![2], &[i32::MIN, 7]),
            TypedTensor::from_values(vec![1], &[i64::MIN]),
        ];
        for t in &tensors {
            let back = TypedTensor::from_bytes(t.dtype(), t.shape().to_vec(), t.bytes()).unwrap();
            assert_eq!(&back, t);
            assert_eq!(DType::from_code(t.dtype().code()), Some(t.dtype()));
        }
        assert_eq!(tensors[1].to_f32(), vec![3.0, -1.25]);
        assert_eq!(tensors[4].to_f32(), vec![0.0, 1.0, 255.0]);
        assert!(TypedTensor::from_bytes(DType::I32, vec![2], &[0; 7]).is_err());
        assert!(TypedTensor::zeros(DType::I64, vec![usize::MAX, 2]).is_err());
        assert_eq!(DType::from_code(7), None);
    }
}
