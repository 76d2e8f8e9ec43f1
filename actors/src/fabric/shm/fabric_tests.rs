//! The shared-memory data path as a fabric: two hosts of this machine (in this process; the
//! ring, socket and credential checks are the same as between processes) pass a ring of
//! messages through shared memory; strangers are refused on the way in.

use std::io::Cursor;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::fabric::tcp::tests::{intruder_delivers, two_hosts};
use crate::fabric::{DataPath, InProcessFabric, TcpFabric};
use crate::trust::Credentials;

/// The path of every route to an actor of the other host (two per host).
fn paths(fabrics: &[Arc<TcpFabric>]) -> Vec<DataPath> {
    fabrics
        .iter()
        .flat_map(|f| f.paths().into_iter().flatten())
        .collect()
}

/// Every dtype crosses the shared-memory ring bit for bit.
#[test]
fn every_dtype_round_trips_over_shared_memory() {
    let (_, fabrics) = two_hosts(&"secret".into(), DataPath::Shm);
    assert_eq!(paths(&fabrics), [DataPath::Shm; 4]);
    crate::fabric::testing::every_dtype_round_trips([fabrics[0].clone(), fabrics[1].clone()]);
}

/// Under `shm` and under `auto` (both hosts on this machine) every link is a ring and a ring of
/// messages across the hosts arrives whole; a peer with a wrong token gets no ring (`shm`
/// fails to connect) and delivers nothing (`auto` falls back to TCP, refused there too); the
/// right token delivers through a ring.
#[test]
fn over_shared_memory_messages_arrive_and_a_peer_without_the_token_is_refused() {
    for path in [DataPath::Shm, DataPath::Auto] {
        let (addrs, fabrics) = two_hosts(&"secret".into(), path);
        assert_eq!(paths(&fabrics), [DataPath::Shm; 4], "{path}");
        let [a, b] = [fabrics[0].clone(), fabrics[1].clone()];
        crate::fabric::testing::ring_exchange_across_two_hosts([a, b], 3_000_017, 1 << 18);
        assert!(
            !intruder_delivers(&addrs, &fabrics, &"wrong".into(), path),
            "{path}"
        );
        assert!(
            intruder_delivers(&addrs, &fabrics, &"secret".into(), path),
            "{path}"
        );
    }
    let (addrs, _fabrics) = two_hosts(&"secret".into(), DataPath::Tcp);
    let local = Arc::new(InProcessFabric::new(4, Duration::from_millis(300)));
    let error = TcpFabric::connect(&addrs, "elsewhere", local, &"wrong".into(), DataPath::Shm)
        .err()
        .expect("a peer with a wrong token got a ring");
    assert!(error.contains("no shared-memory ring"), "{error}");
}

/// Under mutual TLS the ring is set up inside the TLS connection: members exchange through
/// shared memory; a peer with a certificate the cluster CA did not sign gets nothing.
#[test]
fn over_mutual_tls_the_ring_is_handed_only_to_members() {
    let certs = crate::trust::testing::TestCerts::new();
    let (addrs, fabrics) = two_hosts(&certs.member("secret"), DataPath::Shm);
    assert_eq!(paths(&fabrics), [DataPath::Shm; 4]);
    let [a, b] = [fabrics[0].clone(), fabrics[1].clone()];
    crate::fabric::testing::ring_exchange_across_two_hosts([a, b], 1_000_003, 1 << 16);
    for (who, intruder) in [
        ("in clear", Credentials::new("secret")),
        ("with a foreign certificate", certs.foreign_certificate("secret")),
    ] {
        assert!(
            !intruder_delivers(&addrs, &fabrics, &intruder, DataPath::Shm),
            "a peer {who} delivered"
        );
    }
    assert!(intruder_delivers(
        &addrs,
        &fabrics,
        &certs.member("secret"),
        DataPath::Shm
    ));
}

/// The reader declines a writer under another kernel (a different boot id) and says why; the
/// writer reads the reason and the connection goes on as plain TCP.
#[test]
fn a_writer_on_another_machine_is_declined_with_the_reason() {
    struct Wire(Cursor<Vec<u8>>, Vec<u8>);
    impl Read for Wire {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf)
        }
    }
    impl Write for Wire {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.1.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let listener = ShmListener::bind(|_, _| {}).unwrap();
    let mut request = Vec::new();
    write_field(&mut request, b"another-machine").unwrap();
    request.extend_from_slice(&1234u32.to_le_bytes());
    let mut wire = Wire(Cursor::new(request), Vec::new());
    assert!(!answer_ring_request(&mut wire, Some(&listener)).unwrap());
    // The writer's side of the same exchange reads the refusal.
    let mut answer = Wire(Cursor::new(wire.1), Vec::new());
    let reason = ask_for_ring(&mut answer).unwrap().unwrap_err();
    assert!(reason.contains("different machines"), "{reason}");
    // The negative control: this machine's id gets an offer.
    let mut request = Vec::new();
    write_field(&mut request, machine_id().as_bytes()).unwrap();
    request.extend_from_slice(&1234u32.to_le_bytes());
    let mut wire = Wire(Cursor::new(request), Vec::new());
    assert!(answer_ring_request(&mut wire, Some(&listener)).unwrap());
    let mut answer = Wire(Cursor::new(wire.1), Vec::new());
    let (socket, _) = ask_for_ring(&mut answer).unwrap().unwrap();
    assert_eq!(socket, listener.name());
}

/// `bytes` written into a fresh ring, which is then closed; the reader's side.
fn ring_holding(bytes: &[u8]) -> io::BufReader<RingReader> {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let (ring, fd) = SharedRing::create(1 << 16, a).unwrap();
    let reader = RingReader(SharedRing::open(fd, b).unwrap());
    let mut writer = RingWriter(ring);
    writer.write_all(bytes).unwrap();
    drop(writer);
    io::BufReader::with_capacity(1 << 10, reader)
}

/// A frame announcing a tensor far larger than what follows fails at the end of the ring, and
/// what it reserved is bounded (the announcement costs only what is sent); an honest frame
/// after a refused one is never reached, an honest one alone reads exactly.
#[test]
fn a_huge_announcement_through_a_ring_is_an_error_not_an_allocation() {
    let frame = |shape: &[u64], payload: &[u8]| {
        let mut out = Vec::new();
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&[0; 16]);
        out.extend_from_slice(&0u32.to_le_bytes()); // f32
        out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        shape.iter().for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
        out.extend_from_slice(payload);
        out
    };
    // 16 GiB announced (the decoder's limit), 4 KiB sent.
    let mut reader = ring_holding(&frame(&[1 << 32], &[0; 4096]));
    let error = read_ring_frame(&mut reader).unwrap_err();
    assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
    let values = [1.5f32, -2.0, 3.25];
    let honest: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut reader = ring_holding(&frame(&[3], &honest));
    let (_, _, _, tensor) = read_ring_frame(&mut reader).unwrap().unwrap();
    assert_eq!(tensor.f32s().to_vec(), values.to_vec());
    assert!(read_ring_frame(&mut reader).unwrap().is_none(), "the clean end");
}

proptest::proptest! {
    // The workspace's seed rule: fixed under CI, random (and printed) elsewhere.
    #![proptest_config(proptest::test_runner::Config {
        rng_seed: proptest::test_runner::RngSeed::Fixed(archipelago_dataflow::property_seed::seed()),
        ..proptest::test_runner::Config::default()
    })]
    /// Arbitrary bytes through a ring: the decoder returns frames, the end, or an error; never
    /// a panic.
    #[test]
    fn arbitrary_bytes_through_a_ring_never_panic_the_decoder(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let mut reader = ring_holding(&bytes);
        while let Ok(Some(_)) = read_ring_frame(&mut reader) {}
    }
}
