//! Flex tensors multiplied by OpenBLAS: `[..batch, m, k] · [..batch, k, n]`, f32, read in place.
//!
//! An operand whose last two dimensions are row-major (rows `ld` apart) or the transpose of that
//! is handed to `cblas_sgemm` as it lies, with the transpose flag: the transposed views autodiff's
//! backward makes (`xᵀ · dy`, `dy · Wᵀ`) and attention's `k.swap_dims(2, 3)` cost no copy. Other
//! layouts (negative or zero strides) are copied to contiguous first. Batch dimensions may
//! broadcast (size 1 on one side); each matrix of the batch is one `sgemm` call, at the offset its
//! operand's strides give. Anything else (another dtype, a rank mismatch) answers `None`, and the
//! caller uses Flex's own matmul.

use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{DType, Shape};

use super::openblas::{OpenBlas, Operand};

/// `lhs · rhs` by OpenBLAS, or `None` where this path does not apply (the caller then uses Flex's).
pub fn matmul(blas: &OpenBlas, lhs: &FlexTensor, rhs: &FlexTensor) -> Option<FlexTensor> {
    if lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 {
        return None;
    }
    let dims = lhs.layout().num_dims();
    if dims < 2 || rhs.layout().num_dims() != dims {
        return None;
    }
    let (ls, rs) = (lhs.layout().shape(), rhs.layout().shape());
    let (m, k, n) = (ls[dims - 2], ls[dims - 1], rs[dims - 1]);
    if rs[dims - 2] != k {
        return None;
    }
    let mut batch = Vec::with_capacity(dims - 2);
    for i in 0..dims - 2 {
        let (a, b) = (ls[i], rs[i]);
        if a != b && a != 1 && b != 1 {
            return None;
        }
        batch.push(a.max(b));
    }
    let lhs_copy;
    let (lhs, a_op) = match operand(lhs.layout(), m, k) {
        Some(op) => (lhs, op),
        None => {
            lhs_copy = lhs.to_contiguous();
            (&lhs_copy, operand(lhs_copy.layout(), m, k)?)
        }
    };
    let rhs_copy;
    let (rhs, b_op) = match operand(rhs.layout(), k, n) {
        Some(op) => (rhs, op),
        None => {
            rhs_copy = rhs.to_contiguous();
            (&rhs_copy, operand(rhs_copy.layout(), k, n)?)
        }
    };
    let count: usize = batch.iter().product();
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    let (a_all, b_all) = (lhs.storage::<f32>(), rhs.storage::<f32>());
    // Product `i`'s operands: the batch index of `i` (row-major) placed by each side's strides.
    let mut index = vec![0usize; dims - 2];
    let values = blas
        .sgemm_batch((m, n, k), count, (a_op, b_op), |i| {
            if i > 0 {
                next_index(&mut index, &batch);
            }
            let a = a_all.get(batch_offset(lhs.layout(), &index)?..)?;
            let b = b_all.get(batch_offset(rhs.layout(), &index)?..)?;
            Some((a, b))
        })
        .ok()?;
    let layout = Layout::contiguous(Shape::from(out_shape));
    Some(FlexTensor::new(
        burn::tensor::Bytes::from_elems(values),
        layout,
        DType::F32,
    ))
}

/// A contiguous f32 tensor of zeros, made from an f32 buffer: `FlexTensor::empty` builds its
/// bytes from a `Vec<u8>` and then copies them into a 16-byte-aligned buffer (cubecl's `Bytes`
/// asks for it), a second pass over every output of every product (4 % of a gpt-tiny step).
pub(crate) fn zeroed(shape: Vec<usize>) -> FlexTensor {
    let values = vec![0.0f32; shape.iter().product()];
    let layout = Layout::contiguous(Shape::from(shape));
    FlexTensor::new(burn::tensor::Bytes::from_elems(values), layout, DType::F32)
}

/// How OpenBLAS reads a `rows × cols` matrix with these last two strides, if it can: row-major
/// (`cols` contiguous, rows `ld ≥ cols` apart) or transposed (`rows` contiguous, columns `ld ≥
/// rows` apart). A dimension of size 1 places no constraint on its stride; an empty matrix none.
fn operand(layout: &Layout, rows: usize, cols: usize) -> Option<Operand> {
    let strides = layout.strides();
    let (rs, cs) = (strides[strides.len() - 2], strides[strides.len() - 1]);
    if rows == 0 || cols == 0 {
        return Some(Operand {
            transposed: false,
            ld: cols.max(1),
        });
    }
    let at_least = |stride: isize, len: usize| stride >= len.max(1) as isize;
    if (cols <= 1 || cs == 1) && (rows <= 1 || at_least(rs, cols)) {
        let ld = if rows <= 1 { cols.max(1) } else { rs as usize };
        return Some(Operand {
            transposed: false,
            ld,
        });
    }
    if (rows <= 1 || rs == 1) && (cols <= 1 || at_least(cs, rows)) {
        let ld = if cols <= 1 { rows.max(1) } else { cs as usize };
        return Some(Operand { transposed: true, ld });
    }
    None
}

/// Where the matrix at batch `index` starts in the operand's storage (a broadcast dimension of
/// size 1 stays at 0); `None` if a stride points before the buffer.
fn batch_offset(layout: &Layout, index: &[usize]) -> Option<usize> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let mut offset = layout.start_offset() as isize;
    for (dim, &i) in index.iter().enumerate() {
        if shape[dim] != 1 {
            offset += i as isize * strides[dim];
        }
    }
    usize::try_from(offset).ok()
}

/// The next batch index in row-major order.
fn next_index(index: &mut [usize], batch: &[usize]) {
    for dim in (0..index.len()).rev() {
        index[dim] += 1;
        if index[dim] < batch[dim] {
            return;
        }
        index[dim] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_openblas_reads_in_place() {
        let read = |shape: Vec<usize>, strides: Vec<isize>| {
            let (rows, cols) = (shape[0], shape[1]);
            operand(&Layout::new(Shape::from(shape), strides, 0), rows, cols).map(|o| (o.transposed, o.ld))
        };
        // Row-major, padded rows, and the transpose of a row-major matrix.
        assert_eq!(read(vec![2, 3], vec![3, 1]), Some((false, 3)));
        assert_eq!(read(vec![2, 3], vec![5, 1]), Some((false, 5)));
        assert_eq!(read(vec![2, 3], vec![1, 2]), Some((true, 2)));
        // A single row or column: its other stride does not matter.
        assert_eq!(read(vec![1, 3], vec![0, 1]), Some((false, 3)));
        assert_eq!(read(vec![3, 1], vec![1, 0]), Some((false, 1)));
        // Broadcast (stride 0), flipped (negative) and overlapping rows need a copy.
        assert_eq!(read(vec![2, 3], vec![0, 1]), None);
        assert_eq!(read(vec![2, 3], vec![-3, 1]), None);
        assert_eq!(read(vec![2, 3], vec![2, 1]), None);
    }

    #[test]
    fn batch_indices_walk_in_row_major_order_and_broadcast_dims_stay_put() {
        let mut index = vec![0, 0];
        let mut seen = vec![index.clone()];
        for _ in 0..5 {
            next_index(&mut index, &[2, 3]);
            seen.push(index.clone());
        }
        assert_eq!(
            seen,
            vec![
                vec![0, 0],
                vec![0, 1],
                vec![0, 2],
                vec![1, 0],
                vec![1, 1],
                vec![1, 2]
            ]
        );
        let layout = Layout::new(Shape::from(vec![1, 3, 4, 4]), vec![48, 16, 4, 1], 7);
        assert_eq!(batch_offset(&layout, &[1, 2]), Some(7 + 2 * 16));
    }
}
