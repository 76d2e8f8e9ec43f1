//! Tensor references with ownership: a tensor an actor [`put`](super::Context::put)s stays in
//! that actor's store (on its device); others get a [`TensorRef`]. Resolving a reference
//! ([`Context::fetch`](super::Context::fetch)) moves the bytes from the owner to the actor that
//! asks — inside a process that is the shared buffer itself, no copy — and counts them on the
//! `(owner, consumer)` link; the actor that merely passed the reference along never touches
//! them. Fetching to the program is explicit ([`RuntimeHandle::fetch`](super::RuntimeHandle::fetch),
//! counted on the link to [`DRIVER`]). When the last reference is dropped the owner frees the
//! tensor; when the owner ends, its tensors go with it and references fail with
//! [`TensorError::OwnerGone`].

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use archipelago_dataflow::ActorId;

use crate::fabric::{DRIVER, LinkBytes};
use crate::typed_tensor::{DType, TypedTensor};

/// Identifies a tensor: its owner and a number unique on that owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TensorId {
    /// The owning actor.
    pub owner: ActorId,
    /// The tensor's number on its owner.
    pub index: u64,
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor {} of actor {}", self.index, self.owner)
    }
}

/// Why a reference could not be resolved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    /// The owner ended, and its tensors with it.
    #[error(
        "{tensor} is gone: its owner {owner} ended ({reason}); keep the owner alive while references to its tensors are in use, or fetch the tensor before it ends"
    )]
    OwnerGone {
        /// The tensor.
        tensor: TensorId,
        /// The owner, named.
        owner: String,
        /// How it ended.
        reason: String,
    },
    /// The reference belongs to another runtime.
    #[error("{tensor} belongs to another runtime; pass references only between actors of one runtime")]
    ForeignRuntime {
        /// The tensor.
        tensor: TensorId,
    },
}

#[derive(Default)]
struct OwnerStore {
    tensors: HashMap<u64, TypedTensor>,
    bytes: u64,
    /// `Some((owner label, reason))` once the owner ended.
    ended: Option<(String, String)>,
}

#[derive(Default)]
struct StoresInner {
    owners: Mutex<HashMap<ActorId, OwnerStore>>,
    next_index: AtomicU64,
    links: LinkBytes,
}

/// The tensor stores of every actor of one runtime.
#[derive(Default)]
pub(crate) struct TensorStores {
    inner: Arc<StoresInner>,
}

impl TensorStores {
    /// Stores `tensor` on `owner` and returns the first reference to it.
    pub(crate) fn put(&self, owner: ActorId, tensor: TypedTensor) -> TensorRef {
        let index = self.inner.next_index.fetch_add(1, Ordering::Relaxed);
        let id = TensorId { owner, index };
        let meta = (tensor.dtype(), tensor.shape().to_vec(), tensor.byte_len() as u64);
        let mut owners = self.inner.owners.lock().expect("tensor stores");
        let store = owners.entry(owner).or_default();
        store.bytes += meta.2;
        store.tensors.insert(index, tensor);
        TensorRef {
            inner: Arc::new(RefInner {
                id,
                dtype: meta.0,
                shape: meta.1,
                bytes: meta.2,
                stores: Arc::downgrade(&self.inner),
            }),
        }
    }

    /// Resolves `tensor` for `consumer`, counting its bytes on the `(owner, consumer)` link.
    pub(crate) fn fetch(&self, tensor: &TensorRef, consumer: ActorId) -> Result<TypedTensor, TensorError> {
        let id = tensor.inner.id;
        if !std::ptr::eq(tensor.inner.stores.as_ptr(), Arc::as_ptr(&self.inner)) {
            return Err(TensorError::ForeignRuntime { tensor: id });
        }
        let owners = self.inner.owners.lock().expect("tensor stores");
        let store = owners.get(&id.owner);
        if let Some((owner, reason)) = store.and_then(|s| s.ended.clone()) {
            return Err(TensorError::OwnerGone {
                tensor: id,
                owner,
                reason,
            });
        }
        let found = store.and_then(|s| s.tensors.get(&id.index)).cloned();
        drop(owners);
        // A live reference keeps its tensor in the store: absence means the owner ended.
        let found = found.ok_or_else(|| TensorError::OwnerGone {
            tensor: id,
            owner: format!("actor {}", id.owner),
            reason: "its store no longer holds it".into(),
        })?;
        if consumer != id.owner {
            self.inner
                .links
                .record(id.owner, consumer, found.byte_len() as u64);
        }
        Ok(found)
    }

    /// Bytes of tensors `owner` holds for references still alive.
    pub(crate) fn held_bytes(&self, owner: ActorId) -> u64 {
        let owners = self.inner.owners.lock().expect("tensor stores");
        owners.get(&owner).map_or(0, |s| s.bytes)
    }

    /// Drops `owner`'s tensors; later fetches say it ended.
    pub(crate) fn owner_ended_with(&self, owner: ActorId, label: String, reason: String) {
        let mut owners = self.inner.owners.lock().expect("tensor stores");
        let store = owners.entry(owner).or_default();
        store.tensors.clear();
        store.bytes = 0;
        store.ended = Some((label, reason));
    }

    pub(crate) fn links(&self) -> &LinkBytes {
        &self.inner.links
    }
}

impl StoresInner {
    fn release(&self, id: TensorId, bytes: u64) {
        let mut owners = self.owners.lock().expect("tensor stores");
        if let Some(store) = owners.get_mut(&id.owner)
            && store.tensors.remove(&id.index).is_some()
        {
            store.bytes -= bytes;
        }
    }
}

struct RefInner {
    id: TensorId,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
    stores: Weak<StoresInner>,
}

impl Drop for RefInner {
    fn drop(&mut self) {
        if let Some(stores) = self.stores.upgrade() {
            stores.release(self.id, self.bytes);
        }
    }
}

/// A reference to a tensor held by another actor; clone it to share, pass it in messages.
/// The tensor is freed on its owner when the last clone is dropped.
#[derive(Clone)]
pub struct TensorRef {
    inner: Arc<RefInner>,
}

impl fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TensorRef({}, {} {:?})",
            self.inner.id, self.inner.dtype, self.inner.shape
        )
    }
}

impl TensorRef {
    /// Which tensor, on which owner.
    pub fn id(&self) -> TensorId {
        self.inner.id
    }

    /// Its dtype (known without fetching).
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// Its shape (known without fetching).
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.inner.bytes
    }
}

impl super::RuntimeHandle {
    /// Brings a tensor to the program (explicitly; counted on the link owner → [`DRIVER`]).
    pub fn fetch(&self, tensor: &TensorRef) -> Result<TypedTensor, TensorError> {
        self.inner().tensors.fetch(tensor, DRIVER)
    }

    /// Bytes `actor` holds in its store for live references.
    pub fn held_bytes(&self, actor: ActorId) -> u64 {
        self.inner().tensors.held_bytes(actor)
    }

    /// Tensor bytes moved per `(owner, consumer)` link by resolving references.
    pub fn link_bytes(&self) -> &LinkBytes {
        self.inner().tensors.links()
    }
}

impl<A: super::Actor> super::Context<A> {
    /// Keeps `tensor` on this actor and returns a reference for others.
    pub fn put(&self, tensor: TypedTensor) -> TensorRef {
        self.runtime().inner().tensors.put(self.info().id, tensor)
    }

    /// Brings the tensor behind `tensor` here from its owner (no copy within a process).
    pub fn fetch(&self, tensor: &TensorRef) -> Result<TypedTensor, TensorError> {
        self.runtime().inner().tensors.fetch(tensor, self.info().id)
    }
}
