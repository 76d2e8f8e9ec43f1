//! Host ⇄ device transfers, counted. Every copy between host memory and a burn device that the
//! trainer makes goes through [`upload`] or [`download`], which add its bytes to the calling
//! thread's counters by what was moved ([`TransferKind`]). A device actor runs on one OS thread,
//! so [`take`] at the end of a step gives that actor's transfers of the step; the step report
//! sums them over actors.
//!
//! Counted on every backend, the CPU one included (its "device" memory is host memory, but the
//! copy into or out of a burn tensor is the same call that crosses PCIe on a GPU): the figures
//! say what a GPU run of the same plan moves. The optimizer path (gradients read off the device,
//! parameters written back) is what training state on the device removes; `gradients` and
//! `parameters` of a step show whether it did.

use std::cell::Cell;

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// What a transfer moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// Input batches and targets.
    Batch,
    /// Activations and activation gradients crossing to or from another pipeline stage.
    Activation,
    /// Parameter gradients (buckets).
    Gradient,
    /// Parameters (master weights into the modules, or out of them).
    Parameter,
    /// Single values: the loss, norms.
    Scalar,
}

/// Bytes moved each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Both {
    /// Host to device.
    pub to_device: u64,
    /// Device to host.
    pub to_host: u64,
}

impl Both {
    /// Both directions together.
    pub fn total(&self) -> u64 {
        self.to_device + self.to_host
    }

    fn add(&mut self, other: Both) {
        self.to_device += other.to_device;
        self.to_host += other.to_host;
    }
}

/// Host ⇄ device bytes by kind (of one actor's step, or summed over actors).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfers {
    /// Input batches and targets.
    pub batches: Both,
    /// Activations and their gradients to and from other stages.
    pub activations: Both,
    /// Parameter gradients.
    pub gradients: Both,
    /// Parameters.
    pub parameters: Both,
    /// Losses and norms.
    pub scalars: Both,
}

impl Transfers {
    fn slot(&mut self, kind: TransferKind) -> &mut Both {
        match kind {
            TransferKind::Batch => &mut self.batches,
            TransferKind::Activation => &mut self.activations,
            TransferKind::Gradient => &mut self.gradients,
            TransferKind::Parameter => &mut self.parameters,
            TransferKind::Scalar => &mut self.scalars,
        }
    }

    fn all(&self) -> [Both; 5] {
        [
            self.batches,
            self.activations,
            self.gradients,
            self.parameters,
            self.scalars,
        ]
    }

    /// Host to device, every kind.
    pub fn to_device(&self) -> u64 {
        self.all().iter().map(|b| b.to_device).sum()
    }

    /// Device to host, every kind.
    pub fn to_host(&self) -> u64 {
        self.all().iter().map(|b| b.to_host).sum()
    }

    /// The optimizer path's bytes, both ways: gradients and parameters.
    pub fn optimizer_path(&self) -> u64 {
        self.gradients.total() + self.parameters.total()
    }

    /// Adds `other` in.
    pub fn add(&mut self, other: &Transfers) {
        self.batches.add(other.batches);
        self.activations.add(other.activations);
        self.gradients.add(other.gradients);
        self.parameters.add(other.parameters);
        self.scalars.add(other.scalars);
    }
}

thread_local! {
    static COUNTS: Cell<Transfers> = Cell::new(Transfers::default());
}

fn record(kind: TransferKind, to_device: bool, bytes: usize) {
    COUNTS.with(|c| {
        let mut counts = c.get();
        let slot = counts.slot(kind);
        if to_device {
            slot.to_device += bytes as u64;
        } else {
            slot.to_host += bytes as u64;
        }
        c.set(counts);
    });
}

/// `data` as a tensor on `device`, its bytes counted host to device as `kind`.
pub fn upload<B: Backend, const D: usize, K: BasicOps<B>>(
    data: TensorData,
    device: &B::Device,
    kind: TransferKind,
) -> Tensor<B, D, K> {
    record(kind, true, data.bytes.len());
    Tensor::from_data(data, device)
}

/// [`upload`] of float data in its own dtype (a 16-bit compute copy stays 16-bit; `upload`
/// gives the device's default float dtype).
pub fn upload_float<B: Backend, const D: usize>(
    data: TensorData,
    device: &B::Device,
    kind: TransferKind,
) -> Tensor<B, D> {
    record(kind, true, data.bytes.len());
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

/// `tensor`'s values in host memory, their bytes counted device to host as `kind`.
pub fn download<B: Backend, const D: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D, K>,
    kind: TransferKind,
) -> TensorData {
    let data = tensor.into_data();
    record(kind, false, data.bytes.len());
    data
}

/// The calling thread's transfers since the last `take`, and zero from now on.
pub fn take() -> Transfers {
    COUNTS.with(|c| c.replace(Transfers::default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::backend::flex::FlexDevice;

    #[test]
    fn uploads_and_downloads_are_counted_by_kind_and_direction_per_thread() {
        take();
        let t: Tensor<Flex, 1> = upload(
            TensorData::new(vec![1.0f32; 10], [10]),
            &FlexDevice,
            TransferKind::Gradient,
        );
        let _ = download(t, TransferKind::Parameter);
        // Another thread's transfers are its own.
        std::thread::spawn(|| {
            let _: Tensor<Flex, 1> = upload(
                TensorData::new(vec![0i32; 3], [3]),
                &FlexDevice,
                TransferKind::Batch,
            );
            assert_eq!(take().batches.to_device, 12);
        })
        .join()
        .unwrap();
        let counts = take();
        assert_eq!(
            counts.gradients,
            Both {
                to_device: 40,
                to_host: 0
            }
        );
        assert_eq!(
            counts.parameters,
            Both {
                to_device: 0,
                to_host: 40
            }
        );
        assert_eq!(
            (counts.to_device(), counts.to_host(), counts.optimizer_path()),
            (40, 40, 80)
        );
        assert_eq!(counts.batches, Both::default());
        assert_eq!(take(), Transfers::default());
    }
}
