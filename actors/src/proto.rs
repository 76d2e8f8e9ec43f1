//! The wire protocol, generated from `proto/archipelago.proto` by `build.rs` (tonic + prost,
//! compiled with protox): the controller's `Session` service and every host's `Fabric` service.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("archipelago.v1");
