//! Tests of restarts across hosts, with two hosts served in this process over real TCP actor
//! ports (a host is lost when its port closes, as when its process dies): an actor spawned
//! with `restarts(1)` is re-placed on the other host — its pending call failed with the
//! host-lost error, calls sent while it is re-placed wait and keep their order, every clone of
//! its reference reaches the new incarnation — and the controls: `restarts(0)` ends it for
//! good, no host left ends it saying so, and a stop while it is re-placed wins.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::remote::Liveness;
use super::remote_tests::host;
use super::*;

/// A running total from its parameters; its constructor takes `build_ms` (the time a
/// re-placement takes, for the calls sent meanwhile to wait through).
struct Tally {
    total: i64,
}

impl Actor for Tally {
    type Params = (i64, u64);
    async fn new((start, build_ms): (i64, u64), _ctx: &Context<Self>) -> Result<Self, String> {
        tokio::time::sleep(Duration::from_millis(build_ms)).await;
        Ok(Tally { total: start })
    }
}

/// Adds to the total; replies with it and the host that runs the actor.
#[derive(Serialize, Deserialize)]
struct Add(i64);
impl Message for Add {
    type Reply = (i64, String);
}
impl Handler<Add> for Tally {
    async fn handle(&mut self, Add(n): Add, ctx: &Context<Self>) -> (i64, String) {
        self.total += n;
        (self.total, ctx.info().host.clone())
    }
}

#[derive(Serialize, Deserialize)]
struct Hold(u64);
impl Message for Hold {
    type Reply = ();
}
impl Handler<Hold> for Tally {
    async fn handle(&mut self, Hold(ms): Hold, _ctx: &Context<Self>) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Tally>()
        .handles::<Tally, Add>()
        .handles::<Tally, Hold>()
}

/// A driver over hosts of one CPU each, named `names`; their runtimes and ports are kept.
fn cluster(names: &[&str]) -> (Runtime, Vec<(Runtime, remote::ActorPort)>) {
    registry().install();
    let (mut hosts, mut slots) = (Vec::new(), Vec::new());
    for name in names {
        let (runtime, port, own) = host(name, 1, "restart-token");
        hosts.push((runtime, port));
        slots.extend(own);
    }
    let driver = Runtime::on_cluster("restart-test", slots, "restart-token", Liveness::default()).unwrap();
    (driver, hosts)
}

/// Fails a long call pending on `tally`'s host by closing its port; gives the call's error
/// and when the port closed.
fn lose_host_under(tally: &ActorRef<Tally>, port: &remote::ActorPort) -> (CallError, Instant) {
    let pending = tally.call(Hold(60_000));
    std::thread::sleep(Duration::from_millis(100));
    port.close();
    let lost_at = Instant::now();
    let error = pending.timeout(Duration::from_secs(5)).get().unwrap_err();
    (error, lost_at)
}

fn assert_names(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
}

/// Whether `actor` has ended within `within`.
fn ends_within(driver: &Runtime, actor: &ActorRef<Tally>, within: Duration) -> Option<ActorEnd> {
    let ended = actor.ended();
    driver.block_on(async { tokio::time::timeout(within, ended).await.ok() })
}

#[test]
fn an_actor_with_a_restart_is_re_placed_on_another_host_when_its_host_is_lost() {
    let (driver, hosts) = cluster(&["host-ra", "host-rb"]);
    let options = SpawnOptions::named("tally").restarts(1);
    let tally = driver.spawn_at::<Tally>(0, (10, 300), options).get().unwrap();
    let clone = tally.clone();
    assert_eq!(tally.call(Add(5)).get().unwrap(), (15, "host-ra".to_string()));

    let (error, lost_at) = lose_host_under(&tally, &hosts[0].1);
    let text = error.to_string();
    println!("the pending call failed with: {text}");
    assert_names(
        &text,
        &["host host-ra", "was lost", "\"tally\"", "Tally", "cpu:0"],
    );
    assert_names(&text, &["not retried", "re-placed on another host"]);
    // Sent while it is re-placed (its constructor takes 300 ms): they wait, in order.
    clone.cast(Add(100)).unwrap();
    let mut cancelled = clone.call(Add(1000));
    cancelled.cancel();
    let next = clone.call(Add(1)).timeout(Duration::from_secs(5)).get();
    let answered_after = lost_at.elapsed();
    println!("re-placed and answering on the other host {answered_after:?} after the host was lost");
    // The constructor ran again from the same parameters, on the other host.
    assert_eq!(next.unwrap(), (111, "host-rb".to_string()));
    assert!(answered_after < Duration::from_secs(5), "{answered_after:?}");
    assert!(matches!(cancelled.get(), Err(CallError::Cancelled { .. })));

    for reference in [&tally, &clone] {
        assert_eq!(
            (reference.info().host.as_str(), reference.info().name.as_str()),
            ("host-rb", "tally")
        );
        assert_eq!(reference.restarts(), 1);
        assert_eq!(reference.end(), None);
    }
    assert_eq!(tally.call(Add(1)).get().unwrap(), (112, "host-rb".to_string()));
    assert_eq!(ends_within(&driver, &tally, Duration::from_millis(200)), None);

    // No restart left: losing the second host ends it for good.
    let (error, _) = lose_host_under(&tally, &hosts[1].1);
    assert_names(&error.to_string(), &["host host-rb", "was lost"]);
    let end = ends_within(&driver, &clone, Duration::from_secs(5)).expect("ended");
    assert!(matches!(end, ActorEnd::Failed(_)), "{end:?}");
    assert_names(
        &tally.call(Add(1)).get().unwrap_err().to_string(),
        &["host host-rb", "was lost"],
    );
}

#[test]
fn without_restarts_an_actor_of_a_lost_host_ends_for_good() {
    let (driver, hosts) = cluster(&["host-rc", "host-rd"]);
    let tally = driver
        .spawn_at::<Tally>(0, (10, 0), SpawnOptions::named("once"))
        .get()
        .unwrap();
    let (error, _) = lose_host_under(&tally, &hosts[0].1);
    let text = error.to_string();
    assert_names(&text, &["host host-rc", "was lost", "\"once\""]);
    assert!(!text.contains("re-placed"), "{text}");
    let end = ends_within(&driver, &tally, Duration::from_secs(5)).expect("ended");
    assert!(matches!(end, ActorEnd::Failed(_)), "{end:?}");
    assert_names(
        &tally.call(Add(1)).get().unwrap_err().to_string(),
        &["host host-rc", "was lost"],
    );
    assert_eq!((tally.restarts(), tally.info().host.as_str()), (0, "host-rc"));
    assert!(
        hosts[1].0.actors().is_empty(),
        "nothing was spawned on the other host"
    );
}

#[test]
fn with_no_live_host_left_a_restartable_actor_ends_saying_so() {
    let (driver, hosts) = cluster(&["host-re"]);
    let options = SpawnOptions::named("alone").restarts(3);
    let tally = driver.spawn_at::<Tally>(0, (10, 0), options).get().unwrap();
    let (error, _) = lose_host_under(&tally, &hosts[0].1);
    assert_names(&error.to_string(), &["host host-re", "was lost"]);
    let end = ends_within(&driver, &tally, Duration::from_secs(5)).expect("ended");
    let ActorEnd::Failed(failure) = end else {
        panic!("{end:?}")
    };
    let text = failure.to_string();
    println!("the actor ended with: {text}");
    assert_names(
        &text,
        &[
            "host host-re",
            "\"alone\"",
            "Tally",
            "cpu:0",
            "could not be re-placed",
        ],
    );
    assert_names(
        &text,
        &["no live host has a CPU device", "start a host with a CPU device"],
    );
    let refused = tally.call(Add(1)).get().unwrap_err().to_string();
    assert_names(&refused, &["could not be re-placed"]);
}

#[test]
fn a_stop_while_the_actor_is_re_placed_ends_it_and_its_new_incarnation() {
    let (driver, hosts) = cluster(&["host-rf", "host-rg"]);
    let options = SpawnOptions::named("stopped").restarts(1);
    let tally = driver.spawn_at::<Tally>(0, (10, 400), options).get().unwrap();
    lose_host_under(&tally, &hosts[0].1);
    let waiting = tally.call(Add(1));
    tally.stop("no longer needed");
    let end = ends_within(&driver, &tally, Duration::from_secs(5)).expect("ended");
    assert_eq!(
        end,
        ActorEnd::Stopped {
            reason: "no longer needed".into()
        }
    );
    let error = waiting.get().unwrap_err();
    assert!(matches!(error, CallError::Stopped { .. }), "{error}");
    // The incarnation spawned meanwhile on the other host is stopped once it is up.
    let other = &hosts[1].0;
    let stopped = || {
        let stats = other.local_actor_stats();
        stats
            .iter()
            .any(|s| s.info.name == "stopped" && s.ended.is_some())
    };
    // Its end is recorded a moment before it leaves the host's list of actors: wait for both.
    let started = Instant::now();
    while !(stopped() && other.actors().is_empty()) && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(stopped(), "{:?}", other.local_actor_stats());
    assert!(other.actors().is_empty(), "{:?}", other.actors());
}
