//! The decoders a host and the controller run on bytes from the network: a job's host part
//! (its parameters carry the host's plan; the runtime's actor port decodes them), the plan
//! alone and the step reports of a `RunPart` reply (all in the codec's bincode, behind a
//! 64 MiB limit), and the session's protobuf messages. Arbitrary bytes and
//! mutations of real encodings never panic, a value that decodes re-encodes to itself, and a
//! length prefix announcing a terabyte is refused before anything near it is allocated.

use std::sync::OnceLock;

use archipelago_actors::codec::{self, CodecError};
use archipelago_actors::executor::{InstructionTiming, StepMetrics, StepReport};
use archipelago_actors::fabric::DataPath;
use archipelago_actors::proto::{ControllerMessage, HostMessage};
use archipelago_controller::Controller;
use archipelago_controller::cli::{Cli, Command};
use archipelago_controller::cluster::host_part::PartParams;
use archipelago_dataflow::Plan;
use clap::Parser;
use proptest::prelude::*;
use prost::Message;

use super::peak_during;

/// The most a decode of a hostile input of a few KB may hold allocated at once. The codec's
/// limit on what length prefixes may claim follows the input's size (64 KiB for these), so what
/// is left is serde's cautious reservation of at most 1 MiB per list being filled.
const DECODE_BUDGET: usize = 4 << 20;

/// A real plan: a gpt at dp=2 × pp=2 with ZeRO-1, compiled as `archipelago plan` would.
fn plan() -> &'static (Plan, Vec<u8>) {
    static PLAN: OnceLock<(Plan, Vec<u8>)> = OnceLock::new();
    PLAN.get_or_init(|| {
        let cli = Cli::try_parse_from([
            "archipelago",
            "plan",
            "--model",
            "gpt:vocab=40,ctx=8,d=16,layers=2,heads=2",
            "--dp",
            "2",
            "--pp",
            "2",
            "--zero",
            "1",
            "--batch",
            "8",
        ])
        .unwrap();
        let Command::Plan(args) = cli.command else {
            unreachable!()
        };
        let program = args.train.job.program().unwrap();
        let plan = Controller::local(program.devices.clone()).plan(&program).unwrap();
        let bytes = codec::encode(&plan).unwrap();
        (plan, bytes)
    })
}

/// Step reports as a host sends them.
fn reports() -> &'static (Vec<StepReport>, Vec<u8>) {
    static REPORTS: OnceLock<(Vec<StepReport>, Vec<u8>)> = OnceLock::new();
    REPORTS.get_or_init(|| {
        let reports: Vec<StepReport> = (0..3)
            .map(|actor| StepReport {
                actor,
                step: 7,
                metrics: StepMetrics {
                    loss: Some(1.25),
                    model_state_bytes: 4096,
                    ..StepMetrics::default()
                },
                seconds: 0.01,
                began_unix_s: 1.7e9,
                timings: (0..5)
                    .map(|index| InstructionTiming {
                        index,
                        label: format!("Forward {{ chunk: {index} }}"),
                        start_s: index as f64 * 1e-3,
                        seconds: 1e-3,
                    })
                    .collect(),
                host_peak_rss_bytes: 1 << 30,
            })
            .collect();
        let bytes = codec::encode(&reports).unwrap();
        (reports, bytes)
    })
}

/// A host part's parameters carrying the plan, as the controller spawns it on a host.
fn part() -> Vec<u8> {
    codec::encode(&PartParams {
        job: "train-gpt".into(),
        launch: "train-gpt@0".into(),
        plan: plan().0.clone(),
        actors: vec![0, 1, 2, 3],
        peers: vec!["127.0.0.1:7000".into(); 4],
        patience: std::time::Duration::from_secs(30),
        restore: None,
        data_path: DataPath::Tcp,
    })
    .unwrap()
}

/// Every decoder of this family on `bytes`; panics only if a decoder does, or if a decode
/// holds more than [`DECODE_BUDGET`] at once.
fn decode_all(bytes: &[u8]) {
    let checks: [(&str, &dyn Fn()); 5] = [
        ("plan", &|| {
            if let Ok(plan) = codec::decode::<Plan>(bytes) {
                // What decodes encodes, and that encoding is a fixed point.
                let once = codec::encode(&plan).unwrap();
                let twice = codec::encode(&codec::decode::<Plan>(&once).unwrap()).unwrap();
                assert_eq!(once, twice, "a decoded plan does not round-trip");
            }
        }),
        ("step reports", &|| {
            if let Ok(reports) = codec::decode::<Vec<StepReport>>(bytes) {
                let again: Vec<StepReport> = codec::decode(&codec::encode(&reports).unwrap()).unwrap();
                assert_eq!(again.len(), reports.len());
            }
        }),
        ("host part", &|| {
            if let Ok(part) = codec::decode::<PartParams>(bytes) {
                let again: PartParams = codec::decode(&codec::encode(&part).unwrap()).unwrap();
                assert_eq!(again.actors, part.actors);
            }
        }),
        ("controller message", &|| drop(ControllerMessage::decode(bytes))),
        ("host message", &|| drop(HostMessage::decode(bytes))),
    ];
    for (what, check) in checks {
        let ((), peak) = peak_during(check);
        assert!(
            peak <= DECODE_BUDGET,
            "decoding {} bytes as a {what} held {peak} bytes at once",
            bytes.len()
        );
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite the byte at (index mod len).
    Set(usize, u8),
    /// Flip one bit.
    Flip(usize, u8),
    /// Insert bytes (e.g. a varint announcing a huge length).
    Insert(usize, Vec<u8>),
    /// Overwrite bytes from (index mod len) on (e.g. a length prefix).
    Replace(usize, Vec<u8>),
    /// Remove a run of bytes.
    Remove(usize, usize),
    /// Keep only a prefix.
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Lengths past the codec's 64 MiB limit, and lengths under it but far past the input.
    let huge = (20u32..63).prop_map(|shift| {
        // bincode's varint for a u64: 0xFD then 8 little-endian bytes.
        let mut v = vec![0xFD];
        v.extend_from_slice(&(1u64 << shift).to_le_bytes());
        v
    });
    prop_oneof![
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..12)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        3 => (any::<usize>(), huge.clone()).prop_map(|(i, v)| Mutation::Insert(i, v)),
        3 => (any::<usize>(), huge).prop_map(|(i, v)| Mutation::Replace(i, v)),
        1 => (any::<usize>(), 1usize..64).prop_map(|(i, n)| Mutation::Remove(i, n)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for m in mutations {
        let len = out.len().max(1);
        match m {
            Mutation::Set(i, b) => {
                if let Some(x) = out.get_mut(i % len) {
                    *x = *b;
                }
            }
            Mutation::Flip(i, bit) => {
                if let Some(x) = out.get_mut(i % len) {
                    *x ^= 1 << bit;
                }
            }
            Mutation::Insert(i, v) => {
                let at = i % (out.len() + 1);
                out.splice(at..at, v.iter().copied());
            }
            Mutation::Replace(i, v) => {
                let at = i % len;
                for (x, b) in out.iter_mut().skip(at).zip(v) {
                    *x = *b;
                }
            }
            Mutation::Remove(i, n) => {
                let at = i % len;
                let end = (at + n).min(out.len());
                out.drain(at.min(end)..end);
            }
            Mutation::Truncate(i) => out.truncate(i % len),
        }
    }
    out
}

proptest! {
    // The workspace's seed rule: fixed under CI, random (and printed) elsewhere.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(archipelago_dataflow::property_seed::seed()),
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_bytes_never_panic_the_plan_report_and_session_decoders(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048)
    ) {
        decode_all(&bytes);
    }

    #[test]
    fn mutated_plans_never_panic_and_stay_bounded(mutations in proptest::collection::vec(mutation(), 1..6)) {
        decode_all(&mutate(&plan().1, &mutations));
    }

    #[test]
    fn mutated_step_reports_never_panic_and_stay_bounded(mutations in proptest::collection::vec(mutation(), 1..6)) {
        decode_all(&mutate(&reports().1, &mutations));
    }

    #[test]
    fn mutated_host_parts_never_panic_and_stay_bounded(mutations in proptest::collection::vec(mutation(), 1..6)) {
        decode_all(&mutate(&part(), &mutations));
    }
}

/// `bytes` with its leading varint (a length) replaced by one announcing `len`.
fn announcing(len: u64, rest: &[u8]) -> Vec<u8> {
    let mut v = vec![0xFD];
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(rest);
    v
}

#[test]
fn real_encodings_decode_to_themselves() {
    let (original, bytes) = plan();
    let back: Plan = codec::decode(bytes).unwrap();
    assert_eq!(back.to_json(), original.to_json());
    let (reports, bytes) = reports();
    assert_eq!(&codec::decode::<Vec<StepReport>>(bytes).unwrap(), reports);
    let part: PartParams = codec::decode(&part()).unwrap();
    assert_eq!(codec::encode(&part.plan).unwrap(), plan().1);
}

#[test]
fn a_terabyte_announced_is_refused_before_allocation() {
    const TIB: u64 = 1 << 40;
    // The plan's first field is the model's name: its length is the first varint.
    let (_, plan_bytes) = plan();
    assert_eq!(plan_bytes[0] as usize, plan().0.program.model.name.len());
    let hostile_plan = announcing(TIB, &plan_bytes[1..]);
    let (result, peak) = peak_during(|| codec::decode::<Plan>(&hostile_plan));
    assert!(matches!(result, Err(CodecError::Decode { .. })), "{result:?}");
    assert!(peak < 1 << 20, "refusing a 1 TiB name held {peak} bytes");

    // A step-report list announcing 2^40 entries: serde reserves at most 1 MiB for a list of
    // announced length (its "cautious" size hint), then the input ends; nothing near 2^40.
    let (_, report_bytes) = reports();
    let hostile_reports = announcing(TIB, &report_bytes[1..]);
    let (result, peak) = peak_during(|| codec::decode::<Vec<StepReport>>(&hostile_reports));
    assert!(result.is_err());
    assert!(peak < 2 << 20, "refusing 2^40 step reports held {peak} bytes");

    // A host part whose job name (its first field) announces 1 TiB.
    let part_bytes = part();
    assert_eq!(part_bytes[0] as usize, "train-gpt".len());
    let hostile_part = announcing(TIB, &part_bytes[1..]);
    let (result, peak) = peak_during(|| codec::decode::<PartParams>(&hostile_part));
    assert!(result.is_err());
    assert!(peak < 1 << 20, "refusing a 1 TiB job name held {peak} bytes");

    // Negative control: an honest message of 8 MiB is decoded, and the meter sees its size.
    let big = codec::encode(&vec![7u8; 8 << 20]).unwrap();
    let (result, peak) = peak_during(|| codec::decode::<Vec<u8>>(&big));
    assert_eq!(result.unwrap().len(), 8 << 20);
    assert!(peak >= 8 << 20, "the meter missed an 8 MiB decode ({peak})");
}

#[test]
fn a_length_past_the_input_is_refused_before_allocation() {
    // A plan of about 2 KB whose model name announces 60 MiB, under the codec's 64 MiB limit:
    // the limit that applies follows the input's size, so the string is never reserved.
    let (_, plan_bytes) = plan();
    let hostile = announcing(60 << 20, &plan_bytes[1..]);
    let (result, peak) = peak_during(|| codec::decode::<Plan>(&hostile));
    assert!(matches!(result, Err(CodecError::Decode { .. })), "{result:?}");
    eprintln!(
        "a {}-byte plan announcing a 60 MiB name held {peak} bytes while refused",
        hostile.len()
    );
    assert!(peak < 64 << 10, "held {peak} bytes");
    // A 60 KiB message whose string announces 2 MiB: past what a message of its size may
    // claim (1 MiB: 16 times its 64 KiB tier), refused before the string is reserved. (A list
    // of announced length gets serde's cautious reservation of at most 1 MiB instead.)
    let mut big = vec![0xFC]; // a u32 varint
    big.extend_from_slice(&(2u32 << 20).to_le_bytes());
    big.extend_from_slice(&[b'a'; 60 << 10]);
    let (result, peak) = peak_during(|| codec::decode::<String>(&big));
    assert!(result.is_err());
    assert!(peak < 1 << 20, "held {peak} bytes");
}
