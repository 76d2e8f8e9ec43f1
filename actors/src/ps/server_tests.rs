//! The server actor of `server.rs` under calls a correct client never makes: keys another server
//! owns, lengths that do not match, clocks out of turn, pushes without a granted pull, a
//! checkpoint between clocks — each refused with the reason, and the server still serves.

use archipelago_dataflow::DeviceSpec;

use super::clock::Consistency;
use super::ring::Ring;
use super::server::{Dump, PsServer, Pull, Pulled, Push, SaveCheckpoint, ServerFault, ServerParams, Stats};
use super::update::Sgd;
use crate::runtime::{ActorRef, Runtime};

fn server(runtime: &Runtime, ring: &Ring, consistency: Consistency) -> ActorRef<PsServer<Sgd>> {
    // The server's types, as a cluster needs them (strict registration mode checks them here).
    super::server::register_server::<Sgd>(crate::runtime::Registry::new()).install();
    let params = ServerParams {
        index: 0,
        workers: 2,
        width: 2,
        consistency,
        update: Sgd { lr: 1.0 },
        ring: ring.clone(),
        replicas: 1,
        first_clock: 0,
        resume: None,
        log_clocks: true,
        fault: ServerFault::None,
    };
    runtime
        .spawn::<PsServer<Sgd>>(DeviceSpec::Cpu(0), params)
        .get()
        .unwrap()
}

#[test]
fn a_server_refuses_what_a_correct_client_never_sends_and_sums_a_clock_once_complete() {
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let ring = Ring::new(0..2, 8).unwrap();
    let mine: Vec<u64> = (0..100).filter(|&k| ring.owner(k) == 0).take(2).collect();
    let theirs = (0..100).find(|&k| ring.owner(k) == 1).unwrap();
    let s = server(&runtime, &ring, Consistency::Sequential);
    let pull = |worker, clock, keys: Vec<u64>| {
        s.call(Pull {
            worker,
            clock,
            keys,
            list: Default::default(),
            epoch: 0,
            at_least: None,
        })
        .get()
        .unwrap()
    };
    let push = |worker, clock, keys: Vec<u64>, grads: Vec<f32>| {
        s.call(Push {
            worker,
            clock,
            keys,
            list: Default::default(),
            grads,
            part: 0,
            epoch: 0,
        })
        .get()
        .unwrap()
        .map(|_| ())
    };
    let e = pull(0, 0, vec![theirs]).unwrap_err();
    assert!(e.contains("the ring gives server 1"), "{e}");
    assert!(pull(2, 0, vec![]).unwrap_err().contains("2 workers"));
    assert!(pull(0, 3, vec![]).unwrap_err().contains("which is at clock 0"));
    let e = push(0, 0, mine.clone(), vec![1.0; 3]).unwrap_err();
    assert!(e.contains("3 values for 2 keys of width 2"), "{e}");

    // Clock 0: both workers push; the sum is applied once, when the second push arrives.
    assert!(matches!(
        pull(0, 0, mine.clone()).unwrap(),
        Pulled::Granted { applied: 0, .. }
    ));
    push(0, 0, mine.clone(), vec![1.0, 2.0, 3.0, 4.0]).unwrap();
    // Worker 0 may not start clock 1 before worker 1 finished clock 0, nor push it.
    assert!(matches!(pull(0, 1, vec![]).unwrap(), Pulled::Wait { slowest: 0 }));
    let e = push(0, 1, vec![], vec![]).unwrap_err();
    assert!(e.contains("pull before pushing"), "{e}");
    let e = s
        .call(SaveCheckpoint {
            dir: std::env::temp_dir(),
        })
        .get()
        .unwrap()
        .unwrap_err();
    assert!(e.contains("between clocks"), "{e}");
    push(1, 0, mine.clone(), vec![10.0, 20.0, 30.0, 40.0]).unwrap();
    let Pulled::Granted { applied, values } = pull(0, 1, mine.clone()).unwrap() else {
        panic!("granted once every worker pushed clock 0")
    };
    assert_eq!(applied, 1);
    assert_eq!(values, vec![-11.0, -22.0, -33.0, -44.0]);
    let dumped = s.call(Dump::default()).get().unwrap();
    let mut sorted = mine.clone();
    sorted.sort_unstable();
    assert_eq!(dumped.keys, sorted);
    let report = s.call(Stats).get().unwrap();
    assert_eq!(
        (
            report.figures.pushes,
            report.figures.applied,
            report.figures.refused
        ),
        (2, 1, 1)
    );
    assert_eq!(report.clocks, vec![1, 1]);
}

#[test]
fn under_eventual_consistency_pulls_never_wait_and_pushes_apply_on_arrival() {
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let ring = Ring::new(0..1, 4).unwrap();
    let s = server(&runtime, &ring, Consistency::Eventual);
    for clock in 0..3 {
        let pulled = s
            .call(Pull {
                worker: 0,
                clock,
                keys: vec![5],
                list: Default::default(),
                epoch: 0,
                at_least: None,
            })
            .get()
            .unwrap()
            .unwrap();
        let Pulled::Granted { values, .. } = pulled else {
            panic!("never waits")
        };
        assert_eq!(values, vec![-(clock as f32), 0.0]);
        let push = Push {
            worker: 0,
            clock,
            keys: vec![5],
            list: Default::default(),
            grads: vec![1.0, 0.0],
            part: 0,
            epoch: 0,
        };
        s.call(push).get().unwrap().unwrap();
    }
    let report = s.call(Stats).get().unwrap();
    assert_eq!((report.figures.max_lead, report.figures.applied), (2, 0));
}

/// The range version vectors: a pull that asks for version 1 waits until both workers' clock-0
/// pushes reached the key's range; a push retried (as after a failover) is applied once, and
/// without the versions (a push of a clock not seen yet) it would have counted twice.
#[test]
fn a_pull_at_least_version_v_waits_for_every_worker_and_a_retried_push_applies_once() {
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let ring = Ring::new(0..1, 4).unwrap();
    let s = server(&runtime, &ring, Consistency::Eventual);
    // Worker 1 pulls (at its own clock: 0 until it pushes).
    let pull = |clock: u64, at_least: Option<u64>| {
        s.call(Pull {
            worker: 1,
            clock,
            keys: vec![5],
            list: Default::default(),
            epoch: 0,
            at_least,
        })
        .get()
        .unwrap()
        .unwrap()
    };
    let push = |worker: usize, clock: u64| {
        let push = Push {
            worker,
            clock,
            keys: vec![5],
            list: Default::default(),
            grads: vec![1.0, 0.0],
            part: 0,
            epoch: 0,
        };
        s.call(push).get().unwrap().unwrap();
    };
    assert!(
        matches!(pull(0, Some(1)), Pulled::Wait { .. }),
        "nobody pushed clock 0"
    );
    push(0, 0);
    assert!(
        matches!(pull(0, Some(1)), Pulled::Wait { .. }),
        "worker 1 has not pushed clock 0"
    );
    assert!(
        matches!(pull(0, None), Pulled::Granted { .. }),
        "eventual: never waits"
    );
    push(0, 0);
    push(1, 0);
    let Pulled::Granted { values, .. } = pull(1, Some(1)) else {
        panic!("both workers' clock 0 reached the range")
    };
    assert_eq!(values, vec![-2.0, 0.0], "worker 0's retried push counted once");
    let report = s.call(Stats).get().unwrap();
    let versions = &report.versions;
    assert!(
        !versions.is_empty() && versions.iter().all(|v| v.next == vec![1, 1]),
        "{versions:?}"
    );
    // Control: a push of a clock the range has not seen is applied.
    push(0, 1);
    let Pulled::Granted { values, .. } = pull(1, None) else {
        panic!()
    };
    assert_eq!(values, vec![-3.0, 0.0]);
}
