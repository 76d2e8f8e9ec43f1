//! The one codec for Rust-typed control data that crosses a process boundary: user actor
//! messages and replies, spawn parameters, tensor references. bincode 2 over serde, behind this
//! module only, so that it can be swapped (bincode 2.0.1 is unmaintained; 3.x is a tombstone).
//!
//! Input from the network is hostile: [`decode`] refuses a payload over [`MAX_MESSAGE_BYTES`]
//! before looking at it, and bincode's own limit bounds what a length prefix inside it may make
//! it allocate: that limit follows the input's size (16 times its size tier, up to the frame
//! limit), so a short message announcing a long string is refused before the string is
//! reserved. Tensor payloads never pass through here (they travel as raw
//! bytes behind a header on the fabric).
//!
//! ```
//! use archipelago_actors::codec;
//! let bytes = codec::encode(&("push", 3u64, vec![1.5f32, 2.0])).unwrap();
//! let back: (String, u64, Vec<f32>) = codec::decode(&bytes).unwrap();
//! assert_eq!(back, ("push".to_string(), 3, vec![1.5, 2.0]));
//! ```

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest encoded message accepted (64 MiB): bulk data belongs on the fabric as tensors.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The largest frame of the actor port: a message at the limit plus its envelope.
pub const MAX_FRAME_BYTES: usize = MAX_MESSAGE_BYTES + (64 << 10);

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// Why a value could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// The payload is larger than [`MAX_MESSAGE_BYTES`].
    #[error(
        "a message of {bytes} bytes is over the {MAX_MESSAGE_BYTES}-byte limit of control messages; send bulk data as a tensor (TensorRef) instead"
    )]
    TooLarge {
        /// Its size.
        bytes: usize,
    },
    /// The value could not be encoded.
    #[error("could not encode `{ty}`: {reason}")]
    Encode {
        /// The Rust type.
        ty: &'static str,
        /// bincode's reason.
        reason: String,
    },
    /// The bytes are not a valid `ty`.
    #[error("could not decode `{ty}` from {bytes} bytes: {reason}")]
    Decode {
        /// The Rust type expected.
        ty: &'static str,
        /// The payload's size.
        bytes: usize,
        /// bincode's reason.
        reason: String,
    },
    /// Bytes were left over after the value: the sender and receiver disagree on the type.
    #[error(
        "decoding `{ty}` left {left} of {bytes} bytes unread: sender and receiver were built with different message types"
    )]
    Trailing {
        /// The Rust type expected.
        ty: &'static str,
        /// The payload's size.
        bytes: usize,
        /// Bytes not consumed.
        left: usize,
    },
}

/// Encodes `value`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    // Most messages are small: one allocation instead of a few growing ones.
    let mut bytes = Vec::with_capacity(64);
    encode_into(value, &mut bytes, MAX_MESSAGE_BYTES)?;
    Ok(bytes)
}

/// Encodes a frame that wraps an already encoded message (allowed [`MAX_FRAME_BYTES`]).
pub fn encode_frame<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut bytes = Vec::with_capacity(64);
    encode_into(value, &mut bytes, MAX_FRAME_BYTES)?;
    Ok(bytes)
}

/// Appends the encoding of frame `value` to `out` (a writer's reused buffer); allowed
/// [`MAX_FRAME_BYTES`]. On an error `out` keeps what it held before.
pub fn encode_frame_into<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
    encode_into(value, out, MAX_FRAME_BYTES)
}

fn encode_into<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>, limit: usize) -> Result<(), CodecError> {
    let start = out.len();
    let written =
        bincode::serde::encode_into_std_write(value, out, config()).map_err(|e| CodecError::Encode {
            ty: std::any::type_name::<T>(),
            reason: e.to_string(),
        });
    let bytes = out.len() - start;
    if written.is_err() || bytes > limit {
        out.truncate(start);
    }
    written?;
    if bytes > limit {
        return Err(CodecError::TooLarge { bytes });
    }
    Ok(())
}

/// Decodes a frame (up to [`MAX_FRAME_BYTES`]) that must fill `bytes` exactly.
pub fn decode_frame<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { bytes: bytes.len() });
    }
    decode_unchecked(bytes)
}

/// Decodes a `T` that must fill `bytes` exactly, refusing oversized payloads first.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge { bytes: bytes.len() });
    }
    decode_unchecked(bytes)
}

fn decode_unchecked<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    // bincode counts against its limit the in-memory size of every value it decodes (a u64 is
    // 8 bytes, be its varint 1 byte long; a string its length), so a well-formed input claims at
    // most 16 times its own size (a u128). A limit of 16 times the input's size tier costs valid
    // input nothing and refuses a length prefix that announces more before allocating it: a
    // 2 KB message cannot make the decoder reserve 60 MiB.
    use bincode::config::standard;
    match bytes.len() {
        0..=4096 => decode_with(bytes, standard().with_limit::<65536>()),
        4097..=65536 => decode_with(bytes, standard().with_limit::<1048576>()),
        65537..=1048576 => decode_with(bytes, standard().with_limit::<16777216>()),
        _ => decode_with(bytes, config()),
    }
}

/// Decodes `bytes` whole under `config`, borrowing strings and byte buffers from `bytes` where
/// `T` can (owned types allocate as usual).
fn decode_with<'a, T: serde::Deserialize<'a>>(
    bytes: &'a [u8],
    config: impl bincode::config::Config,
) -> Result<T, CodecError> {
    let ty = std::any::type_name::<T>();
    let (value, used) =
        bincode::serde::borrow_decode_from_slice(bytes, config).map_err(|e| CodecError::Decode {
            ty,
            bytes: bytes.len(),
            reason: e.to_string(),
        })?;
    if used != bytes.len() {
        return Err(CodecError::Trailing {
            ty,
            bytes: bytes.len(),
            left: bytes.len() - used,
        });
    }
    Ok(value)
}

/// Decodes a frame body that must fill `bytes` exactly, borrowing its strings and byte
/// buffers from `bytes` instead of allocating them (the actor port's calls and replies), with
/// the same bounds as [`decode`].
pub fn decode_frame_borrowed<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { bytes: bytes.len() });
    }
    decode_unchecked(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    enum Msg {
        Push { key: u64, values: Vec<f32> },
        Pull(u64),
    }

    #[test]
    fn round_trips_and_refuses_hostile_input() {
        let msg = Msg::Push {
            key: 7,
            values: vec![1.0, -2.5],
        };
        let bytes = encode(&msg).unwrap();
        assert_eq!(decode::<Msg>(&bytes).unwrap(), msg);
        assert_eq!(
            decode::<Msg>(&encode(&Msg::Pull(3)).unwrap()).unwrap(),
            Msg::Pull(3)
        );
        // A length prefix claiming 2^60 elements must not allocate: the limit refuses it.
        let mut hostile = encode(&Msg::Pull(0)).unwrap();
        hostile[0] = 0; // variant Push
        hostile.truncate(1);
        hostile.push(1); // key
        hostile.push(0xff); // u64 varint marker
        hostile.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(matches!(decode::<Msg>(&hostile), Err(CodecError::Decode { .. })));
        // A byte buffer announcing more than the input holds is refused (before allocating),
        // at every size tier; one that fits decodes.
        for len in [10usize, 5000, 70_000, 2 << 20, 20 << 20] {
            let fits = encode(&vec![1u8; len]).unwrap();
            assert_eq!(decode::<Vec<u8>>(&fits).unwrap().len(), len);
            let mut short = fits.clone();
            short.truncate(fits.len() - 1);
            assert!(matches!(
                decode::<Vec<u8>>(&short),
                Err(CodecError::Decode { .. })
            ));
        }
        let too_big = vec![0u8; MAX_MESSAGE_BYTES + 1];
        assert!(matches!(
            decode::<Msg>(&too_big),
            Err(CodecError::TooLarge { .. })
        ));
        let mut trailing = encode(&Msg::Pull(1)).unwrap();
        trailing.push(0);
        let err = decode::<Msg>(&trailing).unwrap_err();
        assert!(err.to_string().contains("different message types"), "{err}");
    }

    /// Compiled plans (enums far larger in memory than on the wire: a `Vec<Instruction>`) of
    /// every size tier decode: the size-tied limit must not refuse what the controller sends.
    #[test]
    fn compiled_plans_of_every_size_tier_round_trip() {
        use archipelago_dataflow::passes::schedule::Schedule;
        use archipelago_dataflow::{ModelSpec, ParallelPlan, Program, compile};
        let mut sizes = Vec::new();
        for (dp, pp, m) in [
            (1, 1, 1),
            (2, 2, 4),
            (4, 4, 16),
            (8, 4, 32),
            (16, 8, 64),
            (32, 8, 64),
            // A plan keeps one stream per pipeline device (the stream classes), so the streams
            // grow with pp × micro-batches, the placement with the actors.
            (8, 16, 1024),
            (64, 16, 128),
        ] {
            let program = Program::new(ModelSpec::parse("mlp:in=8,hidden=8,layers=16,out=2").unwrap())
                .with_plan(ParallelPlan {
                    dp,
                    pp,
                    microbatches: m,
                    batch: dp * m,
                    schedule: Schedule::OneFOneB,
                    bucket_bytes: 64,
                    ..ParallelPlan::default()
                });
            let plan = compile(&program).unwrap();
            let bytes = encode(&plan).unwrap();
            sizes.push(bytes.len());
            let back: archipelago_dataflow::Plan =
                decode(&bytes).unwrap_or_else(|e| panic!("{} bytes: {e}", bytes.len()));
            assert_eq!(back, plan);
        }
        assert!(
            sizes.iter().any(|&n| n > 65536) && sizes.iter().any(|&n| n > 1 << 20),
            "{sizes:?}"
        );
    }
}
