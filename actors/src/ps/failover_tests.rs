//! A failover under sequential consistency, message by message on three in-process servers: a
//! clock is half pushed (one worker's every part, the other's part 0 only) when server 1 is
//! lost; the live servers freeze, hand over keys, version vectors and the pushes they keep for
//! the unfinished clock, commit the new ring, and the second worker pushes its clock again on
//! it. Every key then holds exactly the sum of both workers' gradients on both of its replicas —
//! and with the kept pushes not handed over (the control), the new replicas miss one worker's.

use archipelago_dataflow::DeviceSpec;

use super::clock::Consistency;
use super::failover::{Commit, Freeze, Install};
use super::ring::{Ring, ServerId};
use super::server::{Dump, PsServer, Push, Pushed, ServerFault, ServerParams};
use super::update::Sgd;
use crate::runtime::{ActorRef, Runtime};

const KEYS: u64 = 300;
/// Worker 0's gradient of every key, and worker 1's.
const GRADS: [f32; 2] = [1.0, 10.0];

fn servers(runtime: &Runtime, ring: &Ring, fault: ServerFault) -> Vec<ActorRef<PsServer<Sgd>>> {
    // The server's types, as a cluster needs them (strict registration mode checks them here).
    super::server::register_server::<Sgd>(crate::runtime::Registry::new()).install();
    (0..3)
        .map(|index| {
            let params = ServerParams {
                index,
                workers: 2,
                width: 1,
                consistency: Consistency::Sequential,
                update: Sgd { lr: 1.0 },
                ring: ring.clone(),
                replicas: 2,
                first_clock: 0,
                resume: None,
                log_clocks: false,
                fault,
            };
            runtime
                .spawn::<PsServer<Sgd>>(DeviceSpec::Cpu(index as u32), params)
                .get()
                .unwrap()
        })
        .collect()
}

/// Worker `worker`'s part `part` of clock 0 to server `to` on `ring` (of version `epoch`).
fn push(server: &ActorRef<PsServer<Sgd>>, ring: &Ring, to: ServerId, worker: usize, part: usize, epoch: u64) {
    let keys: Vec<u64> = (0..KEYS)
        .filter(|&k| ring.chain(k, 2).get(part) == Some(&to))
        .collect();
    let push = Push {
        worker,
        clock: 0,
        grads: vec![GRADS[worker]; keys.len()],
        keys,
        list: Default::default(),
        part,
        epoch,
    };
    assert_eq!(server.call(push).get().unwrap(), Ok(Pushed::Done));
}

/// Runs the scenario; every `(server, key, value)` held at the end on the live servers.
fn run(fault: ServerFault) -> Vec<(ServerId, u64, f32)> {
    let runtime = Runtime::local(DeviceSpec::cpus(3));
    let old = Ring::new(0..3, 4).unwrap();
    let s = servers(&runtime, &old, fault);
    for part in 0..2 {
        for (to, server) in s.iter().enumerate() {
            push(server, &old, to, 0, part, 0);
        }
    }
    for (to, server) in s.iter().enumerate() {
        push(server, &old, to, 1, 0, 0);
    }
    // Server 1 is lost before worker 1's part 1 reaches anyone.
    s[1].stop("lost (test)");
    let mut new = old.clone();
    new.remove(1).unwrap();
    let live: [ServerId; 2] = [0, 2];
    let handovers: Vec<_> = live
        .iter()
        .map(|&at| {
            let freeze = Freeze {
                ring: new.clone(),
                epoch: 1,
            };
            s[at].call(freeze).get().unwrap().unwrap()
        })
        .collect();
    for handover in handovers {
        for (to, entries) in handover.copies {
            s[to].call(Install { entries }).get().unwrap().unwrap();
        }
    }
    for &at in &live {
        let commit = Commit {
            ring: new.clone(),
            epoch: 1,
        };
        s[at].call(commit).get().unwrap();
    }
    // Worker 1 pushes its clock again, whole, on the new ring.
    for part in 0..2 {
        for &to in &live {
            push(&s[to], &new, to, 1, part, 1);
        }
    }
    let mut held = Vec::new();
    for &at in &live {
        let dump = s[at].call(Dump { replicas: true }).get().unwrap();
        held.extend(dump.keys.iter().zip(&dump.values).map(|(&k, &v)| (at, k, v)));
    }
    held
}

#[test]
fn a_clock_half_pushed_when_a_server_is_lost_is_applied_once_and_whole_on_every_replica() {
    let held = run(ServerFault::None);
    let mut copies = vec![0usize; KEYS as usize];
    let sum = -(GRADS[0] + GRADS[1]);
    for &(server, key, value) in &held {
        assert_eq!(value, sum, "key {key} on server {server}");
        copies[key as usize] += 1;
    }
    assert!(
        copies.iter().all(|&c| c == 2),
        "every key on 2 live servers: {copies:?}"
    );
    // Control: without the kept pushes handed over, a new replica misses worker 0's gradient.
    let broken = run(ServerFault::ForgetPendingOnHandover);
    let wrong: Vec<_> = broken.iter().filter(|(.., v)| *v != sum).collect();
    assert!(!wrong.is_empty(), "the comparison must catch lost kept pushes");
    assert!(wrong.iter().all(|(.., v)| *v == -GRADS[1]), "{wrong:?}");
}
