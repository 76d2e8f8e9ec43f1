//! How two processes of one machine agree on a ring, after the TCP connection between them has
//! been authenticated (token, and mutual TLS where on): the reading host answers the writer's
//! offer on that connection with the name of its Unix socket and a one-time nonce; the writer
//! connects to the socket, sends the nonce and the ring's `memfd` (`SCM_RIGHTS`); the reader
//! checks the nonce, and the peer's credentials as the kernel gives them (`SO_PEERCRED`: the same
//! user as this process, the process id the writer announced on the authenticated connection),
//! maps the ring and acknowledges. A socket name alone admits nobody: without a nonce handed out
//! on an authenticated connection, a connection is closed unread.
//!
//! The socket is in Linux's abstract namespace (no file to clean up; it disappears with the
//! process), so it is reachable from processes of the same network namespace only — others fall
//! back to TCP under `--data-path auto`.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use super::ring::{RingReader, RingWriter, SharedRing};

/// Bytes of a nonce.
pub const NONCE_BYTES: usize = 32;
/// How long an offer stays open for the writer's Unix connection.
const OFFER_LIFETIME: Duration = Duration::from_secs(30);
/// How long either side waits for the other during the handshake.
const HANDSHAKE_PATIENCE: Duration = Duration::from_secs(10);

/// This machine's identity for the "same machine?" question: the kernel's boot id (equal for
/// every process under one running kernel, whatever its container).
pub fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A one-time secret handed out on an authenticated connection.
pub type Nonce = [u8; NONCE_BYTES];

fn fresh_nonce() -> io::Result<Nonce> {
    let mut nonce = [0u8; NONCE_BYTES];
    let mut filled = 0;
    while filled < NONCE_BYTES {
        filled += rustix::rand::getrandom(&mut nonce[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(nonce)
}

/// An offer waiting for its writer: who may take it, until when.
struct Offer {
    pid: i32,
    until: Instant,
}

/// The reading side's Unix socket and its open offers.
#[derive(Clone)]
pub struct ShmListener {
    name: String,
    offers: Arc<Mutex<HashMap<Nonce, Offer>>>,
}

impl ShmListener {
    /// Binds a fresh abstract socket; every ring accepted on it is handed to `serve` (on a
    /// thread of its own) with a description of the peer.
    pub fn bind(serve: impl Fn(RingReader, String) + Send + Sync + 'static) -> io::Result<ShmListener> {
        let name = format!(
            "archipelago-shm-{}-{}",
            std::process::id(),
            fresh_nonce()?[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        let offers: Arc<Mutex<HashMap<Nonce, Offer>>> = Arc::default();
        let (pending, serve) = (offers.clone(), Arc::new(serve));
        std::thread::Builder::new()
            .name("shm-listener".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let (pending, serve) = (pending.clone(), serve.clone());
                    let _ = std::thread::Builder::new()
                        .name("shm-fabric-reader".into())
                        .spawn(move || match accept(stream, &pending) {
                            Ok((ring, peer)) => serve(ring, peer),
                            Err(e) => tracing::warn!("refused a shared-memory ring: {e}"),
                        });
                }
            })?;
        Ok(ShmListener { name, offers })
    }

    /// The socket's abstract name (what the writer connects to).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Opens an offer for the process `pid` (announced on an authenticated connection); returns
    /// the nonce its Unix connection must bring.
    pub fn offer(&self, pid: i32) -> io::Result<Nonce> {
        let nonce = fresh_nonce()?;
        let mut offers = self.offers.lock().expect("offers");
        offers.retain(|_, o| o.until > Instant::now());
        offers.insert(
            nonce,
            Offer {
                pid,
                until: Instant::now() + OFFER_LIFETIME,
            },
        );
        Ok(nonce)
    }
}

/// Checks one Unix connection (nonce, credentials), receives its ring, acknowledges.
fn accept(stream: UnixStream, offers: &Mutex<HashMap<Nonce, Offer>>) -> io::Result<(RingReader, String)> {
    stream.set_read_timeout(Some(HANDSHAKE_PATIENCE))?;
    let credentials = rustix::net::sockopt::socket_peercred(&stream)?;
    let (pid, uid) = (credentials.pid.as_raw_nonzero().get(), credentials.uid.as_raw());
    let mut nonce = [0u8; NONCE_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        &stream,
        &mut [IoSliceMut::new(&mut nonce)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    let peer = format!("process {pid} (uid {uid})");
    let offer = (got.bytes == NONCE_BYTES)
        .then(|| offers.lock().expect("offers").remove(&nonce))
        .flatten()
        .filter(|o| o.until > Instant::now())
        .ok_or_else(|| io::Error::other(format!("{peer} brought no nonce of an open offer")))?;
    if uid != rustix::process::getuid().as_raw() {
        return Err(io::Error::other(format!(
            "{peer} runs as another user than this process (uid {})",
            rustix::process::getuid().as_raw()
        )));
    }
    if pid != offer.pid {
        return Err(io::Error::other(format!(
            "{peer} is not the process {} that asked for the ring on the authenticated connection",
            offer.pid
        )));
    }
    let [fd] = <[_; 1]>::try_from(fds)
        .map_err(|fds| io::Error::other(format!("{peer} sent {} descriptors, not one ring", fds.len())))?;
    let ring = SharedRing::open(fd, stream.try_clone()?)?;
    (&stream).write_all(&[1])?;
    stream.set_read_timeout(None)?;
    Ok((RingReader(ring), peer))
}

/// The writing side: connects to the reader's socket `name`, hands over a new ring of
/// `capacity` bytes with `nonce`, and waits for the acknowledgement.
pub fn open_ring(name: &str, nonce: &Nonce, capacity: usize) -> io::Result<RingWriter> {
    let stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    stream.set_read_timeout(Some(HANDSHAKE_PATIENCE))?;
    let (ring, fd) = SharedRing::create(capacity, stream.try_clone()?)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [std::os::fd::AsFd::as_fd(&fd)];
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let sent = rustix::net::sendmsg(&stream, &[IoSlice::new(nonce)], &mut control, SendFlags::empty())?;
    if sent != NONCE_BYTES {
        return Err(io::Error::other("the nonce did not leave in one message"));
    }
    let mut ack = [0u8; 1];
    (&stream)
        .read_exact(&mut ack)
        .map_err(|e| io::Error::other(format!("the reader refused the ring: {e}")))?;
    stream.set_read_timeout(None)?;
    Ok(RingWriter(ring))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    fn listener() -> (ShmListener, std::sync::mpsc::Receiver<(RingReader, String)>) {
        let (tx, rx) = channel();
        let tx = Mutex::new(tx);
        let listener =
            ShmListener::bind(move |ring, peer| tx.lock().unwrap().send((ring, peer)).unwrap()).unwrap();
        (listener, rx)
    }

    /// With the nonce of an offer made for this process, the ring is accepted and carries
    /// bytes; a made-up nonce, a nonce used twice, and an offer made for another process id
    /// (what `SO_PEERCRED` reports must match) are refused: the writer sees no acknowledgement.
    #[test]
    fn a_ring_is_accepted_only_with_a_fresh_nonce_from_the_announced_process() {
        let (listener, accepted) = listener();
        let me = std::process::id() as i32;
        let nonce = listener.offer(me).unwrap();
        let mut writer = open_ring(listener.name(), &nonce, 1 << 16).unwrap();
        let (mut reader, peer) = accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(peer.contains(&me.to_string()), "{peer}");
        writer.write_all(b"hello").unwrap();
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        for (what, nonce) in [
            ("a made-up nonce", [7u8; NONCE_BYTES]),
            ("a nonce already used", nonce),
            ("an offer for another process", listener.offer(me + 1).unwrap()),
        ] {
            let refused = open_ring(listener.name(), &nonce, 1 << 16);
            assert!(refused.is_err(), "a ring with {what} was accepted");
        }
        assert!(accepted.try_recv().is_err(), "a refused ring reached the fabric");
    }
}
