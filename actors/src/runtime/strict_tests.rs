//! Tests of strict registration mode: in one process, a spawn, a call or a compiled call that a
//! cluster would refuse for a missing registration fails with the cluster's own error; the same
//! program with the mode off runs (the control); `.compiled::<A, M, T>` registers the eager call.

use archipelago_dataflow::DeviceSpec;
use serde::{Deserialize, Serialize};

use super::compiled::Recorder;
use super::remote::Liveness;
use super::remote_tests::host;
use super::*;

struct Strictly;

impl Actor for Strictly {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Strictly)
    }
}

/// Registered with `.handles`.
#[derive(Serialize, Deserialize)]
struct Known(u64);
impl Message for Known {
    type Reply = u64;
}
impl Handler<Known> for Strictly {
    async fn handle(&mut self, Known(n): Known, _ctx: &Context<Self>) -> u64 {
        n + 1
    }
}

/// Serializable but never registered.
#[derive(Serialize, Deserialize)]
struct Unknown(u64);
impl Message for Unknown {
    type Reply = u64;
}
impl Handler<Unknown> for Strictly {
    async fn handle(&mut self, Unknown(n): Unknown, _ctx: &Context<Self>) -> u64 {
        n + 2
    }
}

/// Registered only through `.compiled`.
#[derive(Serialize, Deserialize)]
struct Doubled(u64);
impl Message for Doubled {
    type Reply = u64;
}
impl Handler<Doubled> for Strictly {
    async fn handle(&mut self, Doubled(n): Doubled, _ctx: &Context<Self>) -> u64 {
        2 * n
    }
}

/// An actor type never registered.
struct Stranger;
impl Actor for Stranger {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Stranger)
    }
}

fn install() {
    Registry::new()
        .actor::<Strictly>()
        .handles::<Strictly, Known>()
        .compiled::<Strictly, Doubled, u64>(Doubled)
        .install();
}

/// The reason a `NotRemote` error gives.
fn reason(error: &CallError) -> String {
    match error {
        CallError::NotRemote { reason, .. } => reason.clone(),
        other => panic!("not a registration error: {other}"),
    }
}

#[test]
fn strict_mode_fails_locally_with_the_clusters_error_and_off_it_runs() {
    install();
    let (_host, _port, slots) = host("host-s", 1, "secret");
    let cluster = Runtime::on_cluster("strict-test", slots, "secret", Liveness::default()).unwrap();
    let remote = cluster
        .spawn_at::<Strictly>(0, (), SpawnOptions::default())
        .get()
        .unwrap();
    let on_cluster = remote.call(Unknown(1)).get().unwrap_err();

    let runtime = Runtime::local(DeviceSpec::cpus(1));
    runtime.set_strict_registry(true);
    let local = runtime.spawn::<Strictly>(DeviceSpec::Cpu(0), ()).get().unwrap();
    assert_eq!(local.call(Known(1)).get().unwrap(), 2);
    let refused = local.call(Unknown(1)).get().unwrap_err();
    assert_eq!(
        reason(&refused),
        reason(&on_cluster),
        "the cluster's words, locally"
    );
    assert!(
        reason(&refused).contains(".handles::<Strictly, Unknown>()"),
        "{refused}"
    );
    assert!(local.cast(Unknown(1)).is_err(), "a cast is checked too");
    assert_eq!(
        local.call(Doubled(4)).get().unwrap(),
        8,
        ".compiled registers the eager call"
    );
    let stranger = runtime
        .spawn::<Stranger>(DeviceSpec::Cpu(0), ())
        .get()
        .unwrap_err();
    assert!(
        stranger.to_string().contains(".actor::<Stranger>()"),
        "{stranger}"
    );

    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let out = recorder.call(&local, &input, Known);
    let error = recorder
        .compile(&runtime, &out)
        .err()
        .expect("refused in strict mode");
    assert!(
        error.to_string().contains(".compiled::<A, M, T>(make)"),
        "{error}"
    );
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let out = recorder.call(&local, &input, Doubled);
    let program = recorder.compile(&runtime, &out).unwrap();
    assert_eq!(program.run(5).get().unwrap(), 10);

    // The control: the same program with the mode off runs in one process.
    let relaxed = Runtime::local(DeviceSpec::cpus(1));
    relaxed.set_strict_registry(false);
    let actor = relaxed.spawn::<Strictly>(DeviceSpec::Cpu(0), ()).get().unwrap();
    assert_eq!(actor.call(Unknown(1)).get().unwrap(), 3);
    assert!(relaxed.spawn::<Stranger>(DeviceSpec::Cpu(0), ()).get().is_ok());
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let out = recorder.call(&actor, &input, Known);
    assert_eq!(recorder.compile(&relaxed, &out).unwrap().run(1).get().unwrap(), 2);
}
