//! Shared pieces of the examples, so that tests can check exactly what the examples run: each
//! example's program is a module of [`programs`] on the runtime API, its binary a thin `main`.

pub mod programs;
