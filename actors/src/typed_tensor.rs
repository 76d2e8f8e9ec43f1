//! The one tensor type of host memory: a dtype, a shape and a buffer shared behind an `Arc` —
//! what the runtime's tensor references own and move, and what crosses the training fabric on
//! every data path (in-process, shared memory, raw TCP, gRPC). Every dtype (f32, bf16, f16, i8,
//! u8, i32, i64) is raw little-endian bytes on the wire; the values are read back as their Rust
//! type without a copy ([`TypedTensor::values`]) or widened to f32 ([`TypedTensor::to_f32`]).
//! An f32 tensor keeps its values in a `Vec<f32>`, so that a received activation or gradient
//! bucket becomes a burn tensor or a mutable slice without a copy
//! ([`TypedTensor::into_f32_vec`]); every other dtype in a vector of unsigned integers of its
//! element's size ([`Payload`]), so that each can be viewed in place at its alignment and a
//! receiver reads the bytes straight into it.
//!
//! ```
//! use archipelago_actors::typed_tensor::{DType, TypedTensor};
//! let t = TypedTensor::from_values(vec![2, 2], &[1i64, -2, 3, i64::MAX]);
//! assert_eq!(t.dtype(), DType::I64);
//! assert_eq!(t.values::<i64>()[3], i64::MAX);
//! assert_eq!(t.byte_len(), 32);
//! let g = TypedTensor::flat(vec![0.5f32, 1.5]);
//! assert_eq!((g.dtype(), g.f32s()), (DType::F32, &[0.5f32, 1.5][..]));
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

/// A tensor's elements in the vector its dtype is kept in: f32 values as themselves, any other
/// dtype as unsigned integers of its element's size (so the vector has the element's alignment).
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// f32.
    F32(Vec<f32>),
    /// i8, u8.
    B1(Vec<u8>),
    /// bf16, f16.
    B2(Vec<u16>),
    /// i32.
    B4(Vec<u32>),
    /// i64.
    B8(Vec<u64>),
}

/// Calls `$body` with `$v` bound to the vector inside a [`Payload`] (or [`Storage`]) `$p`.
macro_rules! each_payload {
    ($kind:ident, $p:expr, $v:ident => $body:expr) => {
        match $p {
            $kind::F32($v) => $body,
            $kind::B1($v) => $body,
            $kind::B2($v) => $body,
            $kind::B4($v) => $body,
            $kind::B8($v) => $body,
        }
    };
}

impl Payload {
    /// `elements` zeros of `dtype`, or `None` when the memory cannot be had.
    pub fn zeros(dtype: DType, elements: usize) -> Option<Payload> {
        Some(match dtype {
            DType::F32 => Payload::F32(try_zeroed(elements)?),
            DType::I8 | DType::U8 => Payload::B1(try_zeroed(elements)?),
            DType::BF16 | DType::F16 => Payload::B2(try_zeroed(elements)?),
            DType::I32 => Payload::B4(try_zeroed(elements)?),
            DType::I64 => Payload::B8(try_zeroed(elements)?),
        })
    }

    /// An empty payload of `dtype` (what a receiver grows as bytes arrive).
    pub fn empty(dtype: DType) -> Payload {
        Payload::zeros(dtype, 0).expect("an empty vector")
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        each_payload!(Payload, self, v => bytemuck::cast_slice(v.as_slice()))
    }

    /// Bytes held so far.
    pub fn byte_len(&self) -> usize {
        self.bytes().len()
    }

    /// Reserves room for `bytes` more bytes (fallibly).
    pub fn reserve_bytes(&mut self, bytes: usize) -> Result<(), String> {
        each_payload!(Payload, self, v => {
            let size = std::mem::size_of_val(&v.first().copied().unwrap_or_default());
            v.try_reserve_exact(bytes / size).map_err(|e| format!("cannot hold {bytes} bytes: {e}"))
        })
    }

    /// Appends `bytes` (whole elements).
    pub fn extend_from_bytes(&mut self, bytes: &[u8]) -> Result<(), String> {
        fn extend<T: Pod>(v: &mut Vec<T>, bytes: &[u8]) -> Result<(), String> {
            let size = std::mem::size_of::<T>();
            if !bytes.len().is_multiple_of(size) {
                return Err(format!(
                    "{} bytes are not whole {size}-byte elements",
                    bytes.len()
                ));
            }
            v.try_reserve(bytes.len() / size).map_err(|e| format!("{e}"))?;
            v.extend(bytes.chunks_exact(size).map(bytemuck::pod_read_unaligned::<T>));
            Ok(())
        }
        each_payload!(Payload, self, v => extend(v, bytes))
    }
}

/// Where a tensor's bytes live, shared ([`Payload`] behind an `Arc`).
#[derive(Clone, PartialEq)]
enum Storage {
    F32(Arc<Vec<f32>>),
    B1(Arc<Vec<u8>>),
    B2(Arc<Vec<u16>>),
    B4(Arc<Vec<u32>>),
    B8(Arc<Vec<u64>>),
}

impl From<Payload> for Storage {
    fn from(p: Payload) -> Storage {
        match p {
            Payload::F32(v) => Storage::F32(Arc::new(v)),
            Payload::B1(v) => Storage::B1(Arc::new(v)),
            Payload::B2(v) => Storage::B2(Arc::new(v)),
            Payload::B4(v) => Storage::B4(Arc::new(v)),
            Payload::B8(v) => Storage::B8(Arc::new(v)),
        }
    }
}

/// Which storage holds `dtype` (the element's size class).
fn storage_fits(dtype: DType, payload: &Payload) -> bool {
    matches!(
        (dtype, payload),
        (DType::F32, Payload::F32(_))
            | (DType::I8 | DType::U8, Payload::B1(_))
            | (DType::BF16 | DType::F16, Payload::B2(_))
            | (DType::I32, Payload::B4(_))
            | (DType::I64, Payload::B8(_))
    )
}

/// A dense tensor of any [`DType`] in host memory; cloning shares the buffer.
#[derive(Clone, PartialEq)]
pub struct TypedTensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
    /// Bytes of payload.
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

/// The element count of `shape` and its bytes in `dtype`, unless either overflows.
fn sizes(dtype: DType, shape: &[usize]) -> Option<(usize, usize)> {
    let elements = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d))?;
    let bytes = elements.checked_mul(dtype.size())?;
    (bytes <= isize::MAX as usize / 2).then_some((elements, bytes))
}

/// A zero-filled vector of `len` elements, or `None` when the memory cannot be had.
fn try_zeroed<T: Clone + Default>(len: usize) -> Option<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, T::default());
    Some(v)
}

impl TypedTensor {
    /// An f32 tensor owning `data` with `shape`.
    ///
    /// # Panics
    /// When the shape does not match the data length.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> TypedTensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} does not match {} values",
            data.len()
        );
        TypedTensor {
            dtype: DType::F32,
            len: 4 * data.len(),
            shape,
            storage: Storage::F32(Arc::new(data)),
        }
    }

    /// A flat (1-D) f32 tensor.
    pub fn flat(data: Vec<f32>) -> TypedTensor {
        TypedTensor::new(vec![data.len()], data)
    }

    /// An f32 scalar as a 1-element tensor.
    pub fn scalar(value: f32) -> TypedTensor {
        TypedTensor::flat(vec![value])
    }

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
        let refused = |shape: Vec<usize>| ShapeMismatch {
            dtype,
            shape,
            bytes: 0,
            expected: usize::MAX,
        };
        let Some((elements, _)) = sizes(dtype, &shape) else {
            return Err(refused(shape));
        };
        match Payload::zeros(dtype, elements) {
            Some(payload) => TypedTensor::from_payload(dtype, shape, payload),
            None => Err(refused(shape)),
        }
    }

    /// A tensor of `dtype` and `shape` over a received `payload` (no copy).
    pub fn from_payload(
        dtype: DType,
        shape: Vec<usize>,
        payload: Payload,
    ) -> Result<TypedTensor, ShapeMismatch> {
        let bytes = payload.byte_len();
        let expected = sizes(dtype, &shape).map_or(usize::MAX, |(_, b)| b);
        if bytes != expected || !storage_fits(dtype, &payload) {
            return Err(ShapeMismatch {
                dtype,
                shape,
                bytes,
                expected,
            });
        }
        Ok(TypedTensor {
            dtype,
            shape,
            storage: payload.into(),
            len: bytes,
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

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of payload.
    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        each_payload!(Storage, &self.storage, v => bytemuck::cast_slice(v.as_slice()))
    }

    /// The payload's bytes to fill (copies the buffer first when it is shared).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        each_payload!(Storage, &mut self.storage, v => bytemuck::cast_slice_mut(Arc::make_mut(v).as_mut_slice()))
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

    /// The elements as their Rust type, to change in place (copies the buffer first when it is
    /// shared).
    ///
    /// # Panics
    /// When `T` is not this tensor's element type.
    pub fn values_mut<T: Element>(&mut self) -> &mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "writing a {} tensor as {}",
            self.dtype,
            T::DTYPE
        );
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// The values of an f32 tensor, in place (the training fabric's activations, gradients and
    /// parameters).
    ///
    /// # Panics
    /// When it is not an f32 tensor.
    pub fn f32s(&self) -> &[f32] {
        self.values::<f32>()
    }

    /// The values of an f32 tensor; a copy only when the buffer is shared.
    ///
    /// # Panics
    /// When it is not an f32 tensor.
    pub fn into_f32_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::F32(values) => Arc::try_unwrap(values).unwrap_or_else(|shared| shared.as_ref().clone()),
            _ => panic!("reading a {} tensor as f32", self.dtype),
        }
    }

    /// The buffer of an f32 tensor that nobody else holds, or the tensor back (shared, or not
    /// f32): how a collective's pool takes received chunks back for reuse.
    pub fn try_into_f32_vec(self) -> Result<Vec<f32>, TypedTensor> {
        match self.storage {
            Storage::F32(values) => Arc::try_unwrap(values).map_err(|values| TypedTensor {
                storage: Storage::F32(values),
                ..self
            }),
            _ => Err(self),
        }
    }

    /// This float tensor in another float dtype (f32 ⇄ bf16/f16, rounded to nearest even when
    /// narrowing, in one pass over the values): how a collective carries an f32 buffer in 16 bits
    /// (mixed precision). Itself, buffer untouched, when already in `dtype`; the tensor back when
    /// either dtype is not a float type.
    pub fn cast_float(self, dtype: DType) -> Result<TypedTensor, TypedTensor> {
        use half::slice::HalfFloatSliceExt;
        if self.dtype == dtype {
            return Ok(self);
        }
        if !self.dtype.is_float() || !dtype.is_float() {
            return Err(self);
        }
        let shape = self.shape.clone();
        if dtype == DType::F32 {
            return Ok(TypedTensor::new(shape, self.to_f32()));
        }
        let wide;
        let values = match self.dtype {
            DType::F32 => self.values::<f32>(),
            _ => {
                wide = self.to_f32();
                &wide
            }
        };
        let bits: Vec<u16> = match dtype {
            DType::BF16 => values.iter().map(|&x| narrow_bf16(x)).collect(),
            _ => {
                let mut narrow = vec![half::f16::ZERO; values.len()];
                narrow.convert_from_f32_slice(values);
                narrow.into_iter().map(half::f16::to_bits).collect()
            }
        };
        Ok(TypedTensor::from_payload(dtype, shape, Payload::B2(bits)).expect("the same element count"))
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
}

/// f32 rounded to bf16's bits, to nearest even, NaN kept quiet: `half`'s `bf16::from_f32` in
/// branch-free arithmetic the compiler vectorises. The workspace's one f32 → bf16 rounding: the
/// kernels', the collectives' 16-bit edges ([`TypedTensor::cast_float`]) and the modules' loads.
#[inline(always)]
pub(crate) fn narrow_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let nan = (bits & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { (bits >> 16) | 0x40 } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 → bf16/f16 rounds as `half` does and widens back exactly; the same dtype hands the
    /// buffer on without a copy; integers are refused.
    #[test]
    fn float_casts_round_once_and_keep_a_same_dtype_buffer() {
        let values = [1.0f32, -2.5e-3, 3.333_333_3, 65_504.0, 1.000_000_1];
        let t = TypedTensor::new(vec![5], values.to_vec());
        let before = t.f32s().as_ptr();
        let same = t.cast_float(DType::F32).unwrap();
        assert_eq!(same.f32s().as_ptr(), before, "no copy for the same dtype");
        for dtype in [DType::BF16, DType::F16] {
            let narrow = same.clone().cast_float(dtype).unwrap();
            let expected: Vec<f32> = values
                .iter()
                .map(|&x| match dtype {
                    DType::BF16 => half::bf16::from_f32(x).to_f32(),
                    _ => half::f16::from_f32(x).to_f32(),
                })
                .collect();
            assert_eq!(narrow.dtype(), dtype);
            assert_eq!(
                narrow.cast_float(DType::F32).unwrap().f32s(),
                &expected[..],
                "{dtype}"
            );
        }
        assert!(
            TypedTensor::from_values(vec![1], &[3i32])
                .cast_float(DType::F32)
                .is_err()
        );
    }

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
