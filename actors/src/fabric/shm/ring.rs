//! A byte ring in shared memory between two processes of one machine: one writer, one reader,
//! the bytes in a `memfd` both map, head and tail counters and two futex words in its first page.
//! The writer copies bytes in (`io::Write`), the reader copies them out (`io::Read`) while the
//! writer fills the next piece, so a large tensor crosses in about one memcpy's time when each
//! side has a core (Lamport's single-producer single-consumer queue, with futex sleeps in place
//! of spinning; the layout is that of io_uring's and LMAX's rings: counters that only grow, the
//! position being the counter modulo the capacity).
//!
//! This is the one module of the fabric with `unsafe` code (the counters and bytes live in memory
//! another process writes, which Rust's references cannot describe): each block says why it is
//! sound. The peer is authenticated before a ring is mapped (token, TLS where on, `SO_PEERCRED`),
//! but its counters are still checked on every use: a peer that writes garbage makes this side
//! fail with an error, never read or write outside the mapping.
#![allow(unsafe_code)]

use std::io::{self, BufRead, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use rustix::event::{PollFd, PollFlags};
use rustix::thread::futex;

/// Bytes before the data: the control block, one page.
const CONTROL_BYTES: usize = 4096;
/// Most bytes published at once: the reader starts copying a large tensor out after this much.
const PIECE: usize = 1 << 20;
/// Largest ring a peer may hand over (a guard against a hostile size).
pub const MAX_CAPACITY: usize = 1 << 30;
/// How long a side sleeps before it checks that its peer is still alive.
const LIVENESS_CHECK: Duration = Duration::from_millis(100);
/// Polls of the counters before a side sleeps (a small message's reply comes within them).
const SPINS: usize = 200;

/// A counter or futex word on its own cache line (the two sides write different lines).
#[repr(C, align(64))]
struct Line<T>(T);

/// The first page of the mapping.
#[repr(C)]
struct Control {
    /// Bytes the writer has published, ever.
    head: Line<AtomicU64>,
    /// Bytes the reader has consumed, ever.
    tail: Line<AtomicU64>,
    /// Bumped by the writer after publishing (the reader sleeps on it).
    published: Line<AtomicU32>,
    /// Bumped by the reader after consuming (the writer sleeps on it).
    consumed: Line<AtomicU32>,
    /// 1 while the reader sleeps (the writer wakes it only then).
    reader_sleeps: Line<AtomicU32>,
    /// 1 while the writer sleeps.
    writer_sleeps: Line<AtomicU32>,
    /// 1 once the writer has closed the ring cleanly (no byte follows).
    closed: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// Says why a side should stop waiting for its peer (the job was aborted), or `None`.
type GiveUp = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// A ring mapped into this process, and the socket that tells whether its peer is alive (the
/// peer holds the other end; it closes when the peer exits, however it exits).
pub struct SharedRing {
    map: MmapRaw,
    capacity: usize,
    peer: UnixStream,
    /// Asked while waiting: a peer that is alive but stopped (SIGSTOP, a stuck reader) never
    /// closes its socket, so a wait also ends when the job gives up.
    give_up: Option<GiveUp>,
}

impl SharedRing {
    /// A new zeroed ring of `capacity` data bytes in a fresh `memfd`; returns it and the
    /// descriptor to hand to the reader.
    pub fn create(capacity: usize, peer: UnixStream) -> io::Result<(SharedRing, OwnedFd)> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(io::Error::other(format!(
                "a ring of {capacity} bytes: it must be between 1 byte and {MAX_CAPACITY}"
            )));
        }
        let fd = rustix::fs::memfd_create("archipelago-ring", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, (CONTROL_BYTES + capacity) as u64)?;
        let ring = SharedRing::map(&fd, capacity, peer)?;
        Ok((ring, fd))
    }

    /// Maps the ring a peer handed over; its size comes from the descriptor and is checked.
    pub fn open(fd: OwnedFd, peer: UnixStream) -> io::Result<SharedRing> {
        let size = rustix::fs::fstat(&fd)?.st_size as u64;
        let capacity = (size as usize).saturating_sub(CONTROL_BYTES);
        if size <= CONTROL_BYTES as u64 || capacity > MAX_CAPACITY {
            return Err(io::Error::other(format!(
                "the peer's ring is {size} bytes: not a ring of this fabric"
            )));
        }
        SharedRing::map(&fd, capacity, peer)
    }

    fn map(fd: &OwnedFd, capacity: usize, peer: UnixStream) -> io::Result<SharedRing> {
        let map = MmapOptions::new()
            .len(CONTROL_BYTES + capacity)
            .populate()
            .map_raw(fd)?;
        Ok(SharedRing {
            map,
            capacity,
            peer,
            give_up: None,
        })
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping is page-aligned (more than `Control`'s 64) and at least
        // `CONTROL_BYTES` long (checked at `open`, made so at `create`); every field is an atomic,
        // valid for any bit pattern (a fresh memfd is zeros); the other process only touches these
        // words atomically; the reference lives no longer than `self`, which owns the mapping.
        unsafe { &*(self.map.as_mut_ptr() as *const Control) }
    }

    /// Data bytes the ring holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks the counters a peer may have scribbled on: `head - tail` within the capacity.
    fn in_flight(&self, head: u64, tail: u64) -> io::Result<usize> {
        match head.checked_sub(tail) {
            Some(n) if n <= self.capacity as u64 => Ok(n as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the ring's counters are corrupt (head {head}, tail {tail}): the peer broke the protocol"
                ),
            )),
        }
    }

    /// Where `len` bytes at ring position `at` lie: at most two pieces (the wrap), each
    /// `(offset in the data area, offset in the caller's buffer, length)`.
    fn pieces(&self, at: u64, len: usize) -> [(usize, usize, usize); 2] {
        let start = (at % self.capacity as u64) as usize;
        let first = len.min(self.capacity - start);
        [(start, 0, first), (0, first, len - first)]
    }

    /// The address of data byte `offset` (`offset < capacity`).
    fn data_at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < self.capacity);
        // SAFETY: `CONTROL_BYTES + offset` is inside the mapping (`offset < capacity`).
        unsafe { self.map.as_mut_ptr().add(CONTROL_BYTES + offset) }
    }

    /// Copies `bytes` into the ring at position `at` (`bytes.len() <= capacity`).
    fn copy_in(&self, at: u64, bytes: &[u8]) {
        for (ring_at, local_at, n) in self.pieces(at, bytes.len()) {
            if n > 0 {
                // SAFETY: `ring_at + n <= capacity` (the first piece stops at the end of the
                // data, the second starts at 0 and is shorter than the capacity minus the first),
                // so the target lies inside the mapping; the source is inside `bytes`; the two
                // never overlap (the mapping is not this process's heap or stack). Under the
                // protocol the free bytes belong to the writer alone until `head` moves past
                // them; a peer that breaks it can change their values, never their bounds.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr().add(local_at), self.data_at(ring_at), n)
                };
            }
        }
    }

    /// Copies `len` ring bytes from position `at` to `out` (`len <= capacity`).
    ///
    /// # Safety
    /// `out` must be valid for writes of `len` bytes and not overlap the mapping.
    unsafe fn copy_out(&self, at: u64, out: *mut u8, len: usize) {
        for (ring_at, local_at, n) in self.pieces(at, len) {
            if n > 0 {
                // SAFETY: as in `copy_in`, with the roles swapped (the published bytes belong to
                // the reader alone until `tail` moves past them); `out` is valid for `len`
                // bytes (the caller's promise) and `local_at + n <= len`.
                unsafe { std::ptr::copy_nonoverlapping(self.data_at(ring_at), out.add(local_at), n) };
            }
        }
    }

    /// Whether the peer's end of the socket is closed (the peer exited or dropped the ring).
    fn peer_gone(&self) -> bool {
        let mut fds = [PollFd::new(&self.peer, PollFlags::IN | PollFlags::HUP)];
        let zero = futex::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(0) => false,
            // Nothing is ever sent on it after the handshake: readable means end of stream.
            Ok(_) => true,
            Err(_) => true,
        }
    }

    /// Sleeps until `ready()` or the word `seq` moves, announcing the sleep in `sleeps`; after
    /// each [`LIVENESS_CHECK`] without news, fails if the peer is gone.
    fn wait(&self, seq: &AtomicU32, sleeps: &AtomicU32, ready: impl Fn() -> bool) -> io::Result<()> {
        for _ in 0..SPINS {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let timeout = futex::Timespec {
            tv_sec: 0,
            tv_nsec: LIVENESS_CHECK.as_nanos() as i64,
        };
        loop {
            let seen = seq.load(Ordering::SeqCst);
            sleeps.store(1, Ordering::SeqCst);
            if ready() {
                sleeps.store(0, Ordering::SeqCst);
                return Ok(());
            }
            let slept = futex::wait(seq, futex::Flags::empty(), seen, Some(&timeout));
            sleeps.store(0, Ordering::SeqCst);
            if ready() {
                return Ok(());
            }
            if matches!(slept, Err(rustix::io::Errno::TIMEDOUT)) && self.peer_gone() {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the process at the other end of the shared-memory ring is gone",
                ));
            }
            if let Some(reason) = self.give_up.as_ref().and_then(|give_up| give_up()) {
                return Err(io::Error::other(format!(
                    "stopped waiting for the ring's peer: {reason}"
                )));
            }
        }
    }

    /// Bumps `seq` and wakes the other side if it sleeps on it.
    fn notify(seq: &AtomicU32, sleeps: &AtomicU32) {
        seq.fetch_add(1, Ordering::SeqCst);
        if sleeps.load(Ordering::SeqCst) == 1 {
            let _ = futex::wake(seq, futex::Flags::empty(), 1);
        }
    }
}

/// The writing end of a ring.
pub struct RingWriter(pub SharedRing);

impl RingWriter {
    /// Stops a write that waits for space as soon as `reason` says why (e.g. the job's
    /// mailboxes were aborted): a peer process that is alive but stopped never frees space.
    pub fn give_up_when(&mut self, reason: impl Fn() -> Option<String> + Send + Sync + 'static) {
        self.0.give_up = Some(Box::new(reason));
    }
}

impl Write for RingWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let ring = &self.0;
        let c = ring.control();
        let head = c.head.0.load(Ordering::Relaxed);
        let free = || -> io::Result<usize> {
            Ok(ring.capacity - ring.in_flight(head, c.tail.0.load(Ordering::Acquire))?)
        };
        if free()? == 0 {
            ring.wait(&c.consumed.0, &c.writer_sleeps.0, || !matches!(free(), Ok(0)))?;
        }
        let n = buf.len().min(free()?).min(PIECE);
        ring.copy_in(head, &buf[..n]);
        c.head.0.store(head + n as u64, Ordering::Release);
        SharedRing::notify(&c.published.0, &c.reader_sleeps.0);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for RingWriter {
    /// A clean end: the reader reads what is left, then the end of the stream.
    fn drop(&mut self) {
        let c = self.0.control();
        c.closed.0.store(1, Ordering::Release);
        SharedRing::notify(&c.published.0, &c.reader_sleeps.0);
    }
}

/// The reading end of a ring.
pub struct RingReader(pub SharedRing);

impl RingReader {
    /// Copies up to `max` published bytes to `out`, waiting for at least one; 0 at the end of a
    /// cleanly closed ring.
    ///
    /// # Safety
    /// `out` must be valid for writes of `max` bytes.
    unsafe fn fill(&mut self, out: *mut u8, max: usize) -> io::Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        let ring = &self.0;
        let c = ring.control();
        let tail = c.tail.0.load(Ordering::Relaxed);
        let ready = || -> io::Result<usize> { ring.in_flight(c.head.0.load(Ordering::Acquire), tail) };
        if ready()? == 0 {
            let closed = || c.closed.0.load(Ordering::Acquire) == 1;
            ring.wait(&c.published.0, &c.reader_sleeps.0, || {
                !matches!(ready(), Ok(0)) || closed()
            })?;
            if ready()? == 0 {
                return Ok(0); // closed, and everything read
            }
        }
        let n = max.min(ready()?);
        // SAFETY: `n <= max` bytes to `out` (the caller's promise); `n` is within the published
        // bytes, which are within the capacity (`in_flight` checked).
        unsafe { ring.copy_out(tail, out, n) };
        c.tail.0.store(tail + n as u64, Ordering::Release);
        SharedRing::notify(&c.consumed.0, &c.writer_sleeps.0);
        Ok(n)
    }

    /// Reads a tensor's `len` values into a fresh buffer written once (no zeroing first): first
    /// what the buffered reader `r` already took off the ring, then the ring itself. Up to
    /// 64 MiB is reserved at once and the buffer grows with the bytes that arrive (fallibly: an
    /// allocation that fails is an error), so announcing a huge tensor costs only what is sent.
    pub fn read_values<T: bytemuck::Pod>(
        r: &mut io::BufReader<RingReader>,
        len: usize,
    ) -> io::Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let bytes = len
            .checked_mul(size)
            .ok_or_else(|| io::Error::other(format!("{len} values overflow a buffer")))?;
        let mut values: Vec<T> = Vec::new();
        let mut written = 0;
        while written < bytes {
            if written == values.capacity() * size {
                let more = (len - values.len()).min(crate::fabric::assembly::EAGER_ELEMENTS * 4 / size);
                values
                    .try_reserve_exact(more)
                    .map_err(|e| io::Error::other(format!("cannot hold a tensor of {len} values: {e}")))?;
            }
            let room = (values.capacity() * size).min(bytes) - written;
            // SAFETY: `written < capacity * size`, so the address is inside the allocation.
            let out = unsafe { (values.as_mut_ptr() as *mut u8).add(written) };
            let buffered = r.buffer();
            let n = if buffered.is_empty() {
                // SAFETY: `out` has `room` writable bytes left in the allocation. The buffered
                // reader holds nothing, so reading the ring under it skips no byte.
                unsafe { r.get_mut().fill(out, room)? }
            } else {
                let n = buffered.len().min(room);
                // SAFETY: `n <= room` bytes into the allocation from the reader's buffer, this
                // process's memory that does not overlap a fresh allocation.
                unsafe { std::ptr::copy_nonoverlapping(buffered.as_ptr(), out, n) };
                r.consume(n);
                n
            };
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the ring closed in the middle of a tensor",
                ));
            }
            written += n;
            // SAFETY: bytes `0..written` are written, so `written / size` whole values are
            // initialised (any bit pattern is a `T`: `Pod`), within the capacity. A reallocation
            // happens only when `written` fills the capacity, a whole number of values.
            unsafe { values.set_len(written / size) };
        }
        Ok(values)
    }
}

impl Read for RingReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        unsafe { self.fill(buf.as_mut_ptr(), buf.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(capacity: usize) -> (RingWriter, RingReader) {
        let (a, b) = UnixStream::pair().unwrap();
        let (ring, fd) = SharedRing::create(capacity, a).unwrap();
        let reader = SharedRing::open(fd, b).unwrap();
        (RingWriter(ring), RingReader(reader))
    }

    /// Bytes far beyond the capacity, in writes of odd sizes that wrap the ring at every
    /// position, arrive in order; the end of the stream follows the writer's drop.
    #[test]
    fn bytes_cross_in_order_through_a_small_ring_and_end_cleanly() {
        let (mut writer, mut reader) = pair(4099);
        let sent: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 % 251) as u8).collect();
        let to_send = sent.clone();
        let writing = std::thread::spawn(move || {
            for piece in to_send.chunks(1237) {
                writer.write_all(piece).unwrap();
            }
        });
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        writing.join().unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "bytes changed or reordered");
    }

    /// A writer whose peer process is gone (its socket end closed, no clean close) stops with an
    /// error instead of waiting forever for space; so does a reader waiting for bytes.
    #[test]
    fn a_side_whose_peer_is_gone_fails_instead_of_hanging() {
        let (mut writer, reader) = pair(1024);
        let RingReader(ring) = reader;
        drop(ring.peer); // the reader's process "exits": its socket end closes, the map stays
        let error = writer.write_all(&[1u8; 4096]).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe, "{error}");
        let (a, b) = UnixStream::pair().unwrap();
        let (ring, fd) = SharedRing::create(1024, a).unwrap();
        let mut reader = RingReader(SharedRing::open(fd, b).unwrap());
        drop(ring); // the writer's process "exits" without closing the ring
        let error = reader.read(&mut [0u8; 16]).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe, "{error}");
    }

    /// A writer whose peer is alive but never reads (a stopped process) waits for space until
    /// it is told to give up, then fails naming why.
    #[test]
    fn a_writer_waiting_on_a_stopped_peer_gives_up_when_the_job_does() {
        let (mut writer, _reader) = pair(1024);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        writer.give_up_when(move || {
            flag.load(Ordering::SeqCst)
                .then(|| "the job was aborted".to_string())
        });
        let writing = std::thread::spawn(move || writer.write_all(&[7u8; 4096]));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!writing.is_finished(), "the write did not wait for space");
        stop.store(true, Ordering::SeqCst);
        let error = writing.join().unwrap().unwrap_err().to_string();
        assert!(error.contains("the job was aborted"), "{error}");
    }

    /// Counters a peer corrupted are refused before any byte moves.
    #[test]
    fn corrupt_counters_are_an_error_not_an_out_of_bounds_copy() {
        let (writer, mut reader) = pair(1024);
        writer.0.control().head.0.store(1 << 40, Ordering::Release);
        let error = reader.read(&mut [0u8; 16]).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        let error = match SharedRing::open(
            rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap(),
            UnixStream::pair().unwrap().0,
        ) {
            Ok(_) => panic!("an empty memfd was taken for a ring"),
            Err(e) => e.to_string(),
        };
        assert!(error.contains("not a ring"), "{error}");
    }
}
