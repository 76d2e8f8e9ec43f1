//! Tensors that stay with their owner, across hosts: a `Holder` actor keeps the tensors it
//! makes and hands out references; a holder on another host is given a reference and fetches
//! the bytes straight from the owner's host (the program in between never touches them); the
//! owner frees a tensor once every holder of a reference has dropped it. A holder can also be
//! handed a call still pending (its tensor comes from the owner when the call resolves), and
//! find another holder by name anywhere in the cluster.

use serde::{Deserialize, Serialize};

use archipelago_controller::prelude::*;

/// Keeps tensors and sums tensors it is handed references to.
pub struct Holder;

impl Actor for Holder {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Holder)
    }
}

/// One tensor of each dtype with its type's extreme values.
pub fn every_dtype() -> Vec<TypedTensor> {
    vec![
        TypedTensor::from_values(vec![4], &[f32::MIN, -0.0, f32::EPSILON, f32::MAX]),
        TypedTensor::from_values(vec![2], &[half::bf16::MIN, half::bf16::MAX]),
        TypedTensor::from_values(vec![1, 2], &[half::f16::MIN_POSITIVE, half::f16::MAX]),
        TypedTensor::from_values(vec![3], &[i8::MIN, 0, i8::MAX]),
        TypedTensor::from_values(vec![3], &[0u8, 128, 255]),
        TypedTensor::from_values(vec![2], &[i32::MIN, i32::MAX]),
        TypedTensor::from_values(vec![2, 1], &[i64::MIN, i64::MAX]),
    ]
}

/// Makes [`every_dtype`] and keeps it.
#[derive(Serialize, Deserialize)]
pub struct MakeEvery;
impl Message for MakeEvery {
    type Reply = Vec<TensorRef>;
}
impl Handler<MakeEvery> for Holder {
    async fn handle(&mut self, _: MakeEvery, ctx: &Context<Self>) -> Vec<TensorRef> {
        every_dtype().into_iter().map(|t| ctx.put(t)).collect()
    }
}

/// Makes the f32 ramp `0, 1, …, n−1` and keeps it.
#[derive(Serialize, Deserialize)]
pub struct MakeRamp(pub usize);
impl Message for MakeRamp {
    type Reply = TensorRef;
}
impl Handler<MakeRamp> for Holder {
    async fn handle(&mut self, MakeRamp(n): MakeRamp, ctx: &Context<Self>) -> TensorRef {
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ctx.put(TypedTensor::from_values(vec![n], &values))
    }
}

/// Fetches an f32 tensor from wherever it is and sums it.
#[derive(Serialize, Deserialize)]
pub struct SumOf(pub TensorRef);
impl Message for SumOf {
    type Reply = Result<f64, String>;
}
impl Handler<SumOf> for Holder {
    async fn handle(&mut self, SumOf(tensor): SumOf, ctx: &Context<Self>) -> Result<f64, String> {
        let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
        Ok(values.values::<f32>().iter().map(|v| *v as f64).sum())
    }
}

/// Sums the tensor of a call still pending elsewhere (a future passed across hosts: the reply
/// comes from the caller, the bytes from the tensor's owner).
#[derive(Serialize, Deserialize)]
pub struct SumOfCall(pub Call<TensorRef>);
impl Message for SumOfCall {
    type Reply = Result<f64, String>;
}
impl Handler<SumOfCall> for Holder {
    async fn handle(&mut self, SumOfCall(pending): SumOfCall, ctx: &Context<Self>) -> Result<f64, String> {
        let tensor = pending.await.map_err(|e| e.to_string())?;
        let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
        Ok(values.values::<f32>().iter().map(|v| *v as f64).sum())
    }
}

/// Finds the holder of this name anywhere in the cluster and asks it for its held bytes:
/// `(its host, its bytes)`.
#[derive(Serialize, Deserialize)]
pub struct AskByName(pub String);
impl Message for AskByName {
    type Reply = Result<(String, u64), String>;
}
impl Handler<AskByName> for Holder {
    async fn handle(
        &mut self,
        AskByName(name): AskByName,
        ctx: &Context<Self>,
    ) -> Result<(String, u64), String> {
        let found = ctx
            .runtime()
            .find::<Holder>(&name)
            .await
            .map_err(|e| e.to_string())?;
        let held = found.call(HeldBytes).await.map_err(|e| e.to_string())?;
        Ok((found.info().host.clone(), held))
    }
}

/// Bytes this holder keeps for live references.
#[derive(Serialize, Deserialize)]
pub struct HeldBytes;
impl Message for HeldBytes {
    type Reply = u64;
}
impl Handler<HeldBytes> for Holder {
    async fn handle(&mut self, _: HeldBytes, ctx: &Context<Self>) -> u64 {
        ctx.runtime().held_bytes(ctx.info().id)
    }
}

/// The types that cross processes.
pub fn registry() -> Registry {
    Registry::new()
        .actor::<Holder>()
        .handles::<Holder, MakeEvery>()
        .handles::<Holder, MakeRamp>()
        .handles::<Holder, SumOf>()
        .handles::<Holder, HeldBytes>()
        .handles::<Holder, SumOfCall>()
        .handles::<Holder, AskByName>()
}
