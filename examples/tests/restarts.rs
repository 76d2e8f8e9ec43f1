//! Restarts across hosts on real processes: a controller in this test process, two host
//! processes of the `actors_cluster` example's binary (`support/cluster.rs`) and a driver here.
//! A host is SIGKILLed under a shard spawned with `restarts(1)`: its pending call fails naming
//! the host, and the shard answers its next call from the other host within 5 s, built again
//! by its constructor; a shard without restarts on the same host ends for good (the control).
//! The host binary is the example cargo builds beside the tests (`cargo test -p
//! archipelago-examples`, or `cargo build -p archipelago-examples --example actors_cluster`).

mod support {
    // This binary uses the cluster helpers only in part.
    #[allow(dead_code)]
    pub mod cluster;
}

use std::time::{Duration, Instant};

use archipelago_controller::prelude::*;
use archipelago_examples::programs::sharded_store::{Busy, Put, Shard, Summary, registry};

use support::cluster::TestCluster;

#[test]
fn a_sigkilled_hosts_actor_with_a_restart_answers_from_the_other_host_within_5_s() {
    let mut hosts = TestCluster::start("actors_cluster", &["h1", "h2"], "cpu:0");
    registry().install();
    let cluster = hosts.connect(2);
    let options = SpawnOptions::named("restartable").restarts(1);
    let shard = cluster.spawn_at::<Shard>(0, (0, 1), options).get().unwrap();
    let victim = shard.info().host.clone();
    let survivor = if victim == "h1" { "h2" } else { "h1" };
    let once = cluster
        .spawn_at::<Shard>(0, (0, 1), SpawnOptions::named("once"))
        .get()
        .unwrap();
    shard.call(Put(7, 1.5)).get().unwrap();
    assert_eq!(shard.call(Summary).get().unwrap().1, 1);

    let pending = shard.call(Busy(60_000));
    std::thread::sleep(Duration::from_millis(200));
    hosts.kill(&victim);
    let killed = Instant::now();
    let error = pending.get().unwrap_err().to_string();
    println!("the pending call failed after {:?}: {error}", killed.elapsed());
    for part in [
        &format!("host {victim}"),
        "was lost",
        "\"restartable\"",
        "Shard",
        "cpu:0",
    ] {
        assert!(error.contains(part), "`{part}` missing from: {error}");
    }
    assert!(error.contains("re-placed on another host"), "{error}");

    let (sum, keys, host, device) = shard.call(Summary).timeout(Duration::from_secs(5)).get().unwrap();
    let answered = killed.elapsed();
    println!("re-placed on {host} {device}, answering {answered:?} after the SIGKILL");
    assert!(answered < Duration::from_secs(5), "{answered:?}");
    // Built again by its constructor: the value put before the loss went with the lost host.
    assert_eq!((sum, keys, host.as_str()), (0.0, 0, survivor));
    assert_eq!((shard.restarts(), shard.info().host.as_str()), (1, survivor));
    assert_eq!(shard.end(), None);

    // The control: without restarts, the shard of the lost host ends for good.
    let end = once.ended().get();
    assert!(matches!(end, ActorEnd::Failed(_)), "{end:?}");
    let refused = once.call(Summary).get().unwrap_err().to_string();
    assert!(
        refused.contains(&format!("host {victim}")) && refused.contains("was lost"),
        "{refused}"
    );
}
