//! The shared-memory data path between host processes of one machine (the common multi-GPU
//! node: one host process per GPU or per socket): tensors cross through a ring in a `memfd`
//! both processes map, written by the sending actor's own thread (under the link's lock) and
//! read by a thread of the receiving host, instead of through loopback TCP. The frames are the
//! raw-TCP path's (the same encoder and decoder, hostile-input checks included); only the byte
//! stream under them changes.
//!
//! A ring is set up only on a raw-TCP connection that has passed the token check (and mutual TLS
//! where the cluster has it): the writer sends [`SHM_MAGIC`] instead of the TCP greeting, then
//! its machine id and process id; the reader answers with its Unix socket's name and a nonce if
//! both run under one kernel, or with the reason it will not (the connection then carries frames
//! as plain TCP). See [`handshake`] for the rest (`SO_PEERCRED`, `SCM_RIGHTS`).
//!
//! `--data-path shm` requires a ring to every peer host (an error names the host otherwise);
//! `auto` takes a ring where one can be had and raw TCP elsewhere; `tcp` never asks.

pub mod handshake;
mod ring;

pub use handshake::{Nonce, ShmListener, machine_id, open_ring};
pub use ring::{MAX_CAPACITY, RingReader, RingWriter, SharedRing};

use archipelago_dataflow::DType;

use crate::typed_tensor::{Payload, TypedTensor};
use std::io::{self, Read, Write};

/// The greeting of a raw-TCP connection that asks for a ring (the plain one is `ARCHTCP2`).
pub const SHM_MAGIC: &[u8; 8] = b"ARCHSHM2";
/// Data bytes of each ring (one per sending host and receiving host).
pub const RING_BYTES: usize = 16 << 20;
/// Longest machine id, socket name or refusal reason a peer may send.
const MAX_FIELD: u32 = 1024;

fn write_field(w: &mut (impl Write + ?Sized), bytes: &[u8]) -> io::Result<()> {
    w.write_all(&(bytes.len() as u32).to_le_bytes())?;
    w.write_all(bytes)
}

fn read_field(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_FIELD {
        return Err(io::Error::other(format!(
            "a handshake field of {len} bytes: over {MAX_FIELD}"
        )));
    }
    let mut field = vec![0u8; len as usize];
    r.read_exact(&mut field)?;
    Ok(field)
}

/// The next frame of a ring (the raw-TCP path's frame): the header through the buffered
/// reader, the values straight into the tensor's buffer (see [`RingReader::read_values`]).
/// `None` at a clean end.
pub(crate) fn read_ring_frame(r: &mut io::BufReader<RingReader>) -> io::Result<Option<super::tcp::Frame>> {
    let Some((from, to, tag, dtype, shape, len)) = super::tcp::read_header(r)? else {
        return Ok(None);
    };
    let payload = match dtype {
        DType::F32 => Payload::F32(RingReader::read_values(r, len)?),
        DType::I8 | DType::U8 => Payload::B1(RingReader::read_values(r, len)?),
        DType::BF16 | DType::F16 => Payload::B2(RingReader::read_values(r, len)?),
        DType::I32 => Payload::B4(RingReader::read_values(r, len)?),
        DType::I64 => Payload::B8(RingReader::read_values(r, len)?),
    };
    let tensor = TypedTensor::from_payload(dtype, shape, payload).map_err(io::Error::other)?;
    Ok(Some((from, to, tag, tensor)))
}

/// The writer's side, after [`SHM_MAGIC`] and the token: announces this machine and process,
/// reads the answer: `Ok(Ok((socket, nonce)))` to open the ring with, `Ok(Err(reason))` if the
/// reader declined (the connection is then a plain TCP one).
pub fn ask_for_ring(stream: &mut (impl Read + Write)) -> io::Result<Result<(String, Nonce), String>> {
    write_field(stream, machine_id().as_bytes())?;
    stream.write_all(&std::process::id().to_le_bytes())?;
    stream.flush()?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict)?;
    let field = String::from_utf8_lossy(&read_field(stream)?).into_owned();
    if verdict[0] != 1 {
        return Ok(Err(field));
    }
    let mut nonce = [0u8; handshake::NONCE_BYTES];
    stream.read_exact(&mut nonce)?;
    Ok(Ok((field, nonce)))
}

/// The reader's side of [`ask_for_ring`], on a connection whose token checked out: opens an
/// offer on `listener` when the writer runs under this kernel. Returns whether it did (the TCP
/// connection has then done its job; the ring arrives on the listener).
pub fn answer_ring_request(
    stream: &mut (impl Read + Write),
    listener: Option<&ShmListener>,
) -> io::Result<bool> {
    let machine = read_field(stream)?;
    let mut pid = [0u8; 4];
    stream.read_exact(&mut pid)?;
    let pid = u32::from_le_bytes(pid) as i32;
    let here = machine_id();
    let decline = |stream: &mut dyn Write, reason: &str| -> io::Result<bool> {
        stream.write_all(&[0])?;
        write_field(stream, reason.as_bytes())?;
        stream.flush()?;
        Ok(false)
    };
    let Some(listener) = listener else {
        return decline(stream, "this host serves no shared-memory socket");
    };
    if here.is_empty() || machine != here.as_bytes() {
        return decline(
            stream,
            "the hosts run on different machines (kernel boot ids differ)",
        );
    }
    let nonce = listener.offer(pid)?;
    stream.write_all(&[1])?;
    write_field(stream, listener.name().as_bytes())?;
    stream.write_all(&nonce)?;
    stream.flush()?;
    Ok(true)
}

#[cfg(test)]
mod fabric_tests;
