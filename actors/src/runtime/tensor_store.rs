//! Tensor references with ownership: a tensor an actor [`put`](super::Context::put)s stays in
//! that actor's store (on its device); others get a [`TensorRef`]. Resolving a reference
//! ([`Context::fetch`](super::Context::fetch)) moves the bytes from the owner to the actor that
//! asks — inside a process that is the shared buffer itself, no copy; from another host, raw
//! bytes on the owner host's actor port, straight into the asker's buffer — and counts them on
//! the `(owner, consumer)` link; an actor (or the program) that merely passed the reference
//! along never touches them. Fetching to the program is explicit
//! ([`RuntimeHandle::fetch`](super::RuntimeHandle::fetch), counted on the link to [`DRIVER`]).
//!
//! Lifetime (after Ray's ownership protocol): the owner's store keeps a tensor while the owner's
//! own reference lives or any balance it keeps for the tensor is not zero. Balances are kept per
//! key, each changed only in the order of one connection: `Holder(p)` counts the copies process
//! `p` holds (it adds one when a copy arrives and takes it back when the copy is dropped, on its
//! own link to the owner); `InFlight(p, n)` is reference `n` in a message process `p` sent: the
//! sender adds it before the message leaves, the receiver takes it back after registering its
//! own copy. A change that overtakes another on a different connection leaves some key at ±1
//! for a while, never all of them at zero — so the tensor cannot be freed while a copy exists or
//! is on its way. When the owner ends, its tensors go with it and references fail with
//! [`TensorError::OwnerGone`]. Not covered: a reference in a message that is never delivered
//! (or serialized for something else than a message) keeps its tensor until the owner ends.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use archipelago_dataflow::ActorId;
use serde::{Deserialize, Serialize};

use super::remote::links::{self, OwnerLink};
use crate::fabric::{DRIVER, LinkBytes, OTHER_PROCESS};
use crate::typed_tensor::{DType, TypedTensor};

/// Identifies a tensor: its owner and a number unique on that owner's runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorId {
    /// The owning actor.
    pub owner: ActorId,
    /// The tensor's number on its owner's runtime.
    pub index: u64,
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor {} of actor {}", self.index, self.owner)
    }
}

/// Why a reference could not be resolved.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
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
}

/// One stored tensor and what keeps it.
struct Entry {
    tensor: TypedTensor,
    /// Whether the owner's own reference is alive.
    owned: bool,
    /// The balances that keep it, by key (zero balances are removed).
    balances: HashMap<BorrowKey, i64>,
}

/// What a borrow balance counts (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BorrowKey {
    /// The copies held by a process.
    Holder(u64),
    /// A reference on its way in a message: `(sending process, number)`.
    InFlight(u64, u64),
}

#[derive(Default)]
struct OwnerStore {
    tensors: HashMap<u64, Entry>,
    bytes: u64,
    /// `Some((owner label, reason))` once the owner ended.
    ended: Option<(String, String)>,
}

/// The stores of every actor of one runtime.
#[derive(Default)]
pub(crate) struct StoresInner {
    owners: Mutex<HashMap<ActorId, OwnerStore>>,
    next_index: AtomicU64,
    links: LinkBytes,
    /// `(host, actor-port address)` once the runtime serves an actor port: only then can its
    /// references cross processes.
    pub(crate) home: OnceLock<(String, String)>,
}

impl StoresInner {
    /// Changes what keeps `id`: the owner's reference gone (`owner_gone`) and balances changed;
    /// frees the tensor when nothing keeps it any more.
    pub(crate) fn adjust(&self, id: TensorId, owner_gone: bool, changes: &[(BorrowKey, i64)]) {
        let mut owners = self.owners.lock().expect("tensor stores");
        let Some(store) = owners.get_mut(&id.owner) else {
            return;
        };
        let Some(entry) = store.tensors.get_mut(&id.index) else {
            return;
        };
        entry.owned &= !owner_gone;
        for (key, delta) in changes {
            let balance = entry.balances.entry(*key).or_default();
            *balance += delta;
            if *balance == 0 {
                entry.balances.remove(key);
            }
        }
        if !entry.owned && entry.balances.is_empty() {
            let bytes = entry.tensor.byte_len() as u64;
            store.tensors.remove(&id.index);
            store.bytes -= bytes;
        }
    }

    /// The tensor `id` for `consumer` (counted on the link unless it is the owner).
    pub(crate) fn lookup(&self, id: TensorId, consumer: ActorId) -> Result<TypedTensor, TensorError> {
        let owners = self.owners.lock().expect("tensor stores");
        let store = owners.get(&id.owner);
        if let Some((owner, reason)) = store.and_then(|s| s.ended.clone()) {
            return Err(TensorError::OwnerGone {
                tensor: id,
                owner,
                reason,
            });
        }
        let found = store
            .and_then(|s| s.tensors.get(&id.index))
            .map(|e| e.tensor.clone());
        drop(owners);
        // A live reference keeps its tensor: absence means it went with its owner.
        let found = found.ok_or_else(|| TensorError::OwnerGone {
            tensor: id,
            owner: format!("actor {}", id.owner),
            reason: "its store no longer holds it".into(),
        })?;
        if consumer != id.owner {
            self.links.record(id.owner, consumer, found.byte_len() as u64);
        }
        Ok(found)
    }
}

/// The tensor stores of every actor of one runtime.
#[derive(Default)]
pub(crate) struct TensorStores {
    pub(crate) inner: Arc<StoresInner>,
}

impl TensorStores {
    /// Stores `tensor` on `owner` and returns the owner's reference to it.
    pub(crate) fn put(&self, owner: ActorId, tensor: TypedTensor) -> TensorRef {
        let index = self.inner.next_index.fetch_add(1, Ordering::Relaxed);
        let id = TensorId { owner, index };
        let meta = Meta {
            id,
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            bytes: tensor.byte_len() as u64,
        };
        let mut owners = self.inner.owners.lock().expect("tensor stores");
        let store = owners.entry(owner).or_default();
        store.bytes += meta.bytes;
        let entry = Entry {
            tensor,
            owned: true,
            balances: HashMap::new(),
        };
        store.tensors.insert(index, entry);
        TensorRef {
            inner: Arc::new(RefInner {
                meta,
                holder: Holder::Owner(Arc::downgrade(&self.inner)),
            }),
        }
    }

    /// Resolves `tensor` for `consumer`, from this runtime's stores or the owner's host.
    pub(crate) async fn fetch(
        &self,
        tensor: &TensorRef,
        consumer: ActorId,
    ) -> Result<TypedTensor, TensorError> {
        let id = tensor.inner.meta.id;
        match &tensor.inner.holder {
            Holder::Owner(stores) | Holder::HomeBorrow(stores) => {
                if std::ptr::eq(stores.as_ptr(), Arc::as_ptr(&self.inner)) {
                    return self.inner.lookup(id, consumer);
                }
                // The owner is another runtime of this process: its buffer, no copy, counted
                // by the owner as served to another runtime and here as received.
                let owner = stores.upgrade().ok_or_else(|| TensorError::OwnerGone {
                    tensor: id,
                    owner: format!("actor {}", id.owner),
                    reason: "its runtime shut down".into(),
                })?;
                let found = owner.lookup(id, OTHER_PROCESS)?;
                self.inner
                    .links
                    .record(id.owner, consumer, found.byte_len() as u64);
                Ok(found)
            }
            Holder::Remote(link) => {
                let fetched = link.fetch(&tensor.inner.meta).await?;
                self.inner
                    .links
                    .record(id.owner, consumer, fetched.byte_len() as u64);
                Ok(fetched)
            }
        }
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

/// What a reference knows without fetching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Meta {
    pub(crate) id: TensorId,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: u64,
}

/// Who holds a reference, and so what dropping it returns.
enum Holder {
    /// The owner's own reference, in the owner's runtime.
    Owner(Weak<StoresInner>),
    /// A borrow that came back to the owner's runtime.
    HomeBorrow(Weak<StoresInner>),
    /// A borrow in another process.
    Remote(Arc<OwnerLink>),
}

struct RefInner {
    meta: Meta,
    holder: Holder,
}

impl Drop for RefInner {
    fn drop(&mut self) {
        match &self.holder {
            Holder::Owner(stores) => {
                if let Some(stores) = stores.upgrade() {
                    stores.adjust(self.meta.id, true, &[]);
                }
            }
            Holder::HomeBorrow(stores) => {
                if let Some(stores) = stores.upgrade() {
                    stores.adjust(
                        self.meta.id,
                        false,
                        &[(BorrowKey::Holder(links::process_id()), -1)],
                    );
                }
            }
            Holder::Remote(link) => {
                link.change(self.meta.id, vec![(BorrowKey::Holder(links::process_id()), -1)])
            }
        }
    }
}

/// A reference to a tensor held by an actor; clone it to share, pass it in messages (to
/// actors of other hosts too). The tensor is freed on its owner when every reference is gone.
#[derive(Clone)]
pub struct TensorRef {
    inner: Arc<RefInner>,
}

impl fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.inner.meta;
        write!(f, "TensorRef({}, {} {:?})", m.id, m.dtype, m.shape)
    }
}

impl TensorRef {
    /// Which tensor, on which owner.
    pub fn id(&self) -> TensorId {
        self.inner.meta.id
    }

    /// Its dtype (known without fetching).
    pub fn dtype(&self) -> DType {
        self.inner.meta.dtype
    }

    /// Its shape (known without fetching).
    pub fn shape(&self) -> &[usize] {
        &self.inner.meta.shape
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.inner.meta.bytes
    }
}

/// A reference on the wire: the tensor, the actor port of its owner's host, and the in-flight
/// balance the sender added for it.
#[derive(Serialize, Deserialize)]
struct WireRef {
    meta: Meta,
    owner_host: String,
    owner_addr: String,
    in_flight: BorrowKey,
}

impl Serialize for TensorRef {
    /// Adds a borrow for the receiving process (before the message leaves).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let meta = self.inner.meta.clone();
        if super::dry_run::is_dry_run() {
            let placeholder = WireRef {
                meta,
                owner_host: String::new(),
                owner_addr: String::new(),
                in_flight: BorrowKey::InFlight(0, 0),
            };
            return placeholder.serialize(serializer);
        }
        let wire = match &self.inner.holder {
            Holder::Owner(stores) | Holder::HomeBorrow(stores) => {
                let stores = stores.upgrade().ok_or_else(|| {
                    serde::ser::Error::custom(format!("{}: its runtime has shut down", meta.id))
                })?;
                let Some((host, addr)) = stores.home.get().cloned() else {
                    return Err(serde::ser::Error::custom(format!(
                        "a reference to {} cannot leave its process: its runtime serves no actor port (tensors cross processes from hosts)",
                        meta.id
                    )));
                };
                let in_flight = links::next_in_flight();
                stores.adjust(meta.id, false, &[(in_flight, 1)]);
                WireRef {
                    meta,
                    owner_host: host,
                    owner_addr: addr,
                    in_flight,
                }
            }
            Holder::Remote(link) => {
                let in_flight = links::next_in_flight();
                link.change(meta.id, vec![(in_flight, 1)]);
                WireRef {
                    meta,
                    owner_host: link.host().to_string(),
                    owner_addr: link.addr().to_string(),
                    in_flight,
                }
            }
        };
        wire.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for TensorRef {
    /// Registers this process's copy, then takes back the sender's in-flight balance.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<TensorRef, D::Error> {
        let wire = WireRef::deserialize(deserializer)?;
        let changes = vec![(BorrowKey::Holder(links::process_id()), 1), (wire.in_flight, -1)];
        let holder = match links::home(&wire.owner_addr).and_then(|w| w.upgrade().map(|s| (w, s))) {
            Some((weak, stores)) => {
                stores.adjust(wire.meta.id, false, &changes);
                Holder::HomeBorrow(weak)
            }
            None => {
                let link = links::owner_link(&wire.owner_host, &wire.owner_addr)
                    .map_err(serde::de::Error::custom)?;
                link.change(wire.meta.id, changes);
                Holder::Remote(link)
            }
        };
        Ok(TensorRef {
            inner: Arc::new(RefInner {
                meta: wire.meta,
                holder,
            }),
        })
    }
}

impl super::RuntimeHandle {
    /// Brings a tensor to the program (explicitly; counted on the link owner → [`DRIVER`]).
    pub fn fetch(&self, tensor: &TensorRef) -> super::Pending<Result<TypedTensor, TensorError>> {
        let (runtime, tensor) = (self.clone(), tensor.clone());
        let driver = self.driver().clone();
        super::Pending::new(
            async move { runtime.inner().tensors.fetch(&tensor, DRIVER).await },
            driver,
        )
    }

    /// Keeps `tensor` in the program's own store (owner [`DRIVER`]) and returns a reference to
    /// pass to actors (of other hosts too, once this runtime serves an actor port).
    pub fn put(&self, tensor: TypedTensor) -> TensorRef {
        self.inner().tensors.put(DRIVER, tensor)
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
    pub async fn fetch(&self, tensor: &TensorRef) -> Result<TypedTensor, TensorError> {
        self.runtime().inner().tensors.fetch(tensor, self.info().id).await
    }
}
