//! The summary's communication sections: the collectives beside memcpy, the data paths between
//! processes (with PyTorch's gloo where `--peers` measured it), the runtime API's actor calls
//! beside the fabric's round trips, and the controller at scale.

use serde_json::Value;

use super::table::{MISSING, Table, at, fig, fig_unit, list, load, missing_section, num, plain, with_ratio};

const OPS: [&str; 3] = ["all_reduce", "reduce_scatter", "all_gather"];

/// The in-process collectives: a row per transport, a column per collective, each algbw with
/// its fraction of a memcpy of the same bytes measured beside it.
pub(super) fn collectives(out: &Value) -> Vec<String> {
    let Some(runs) = list(out, "collectives") else {
        return missing_section("collectives");
    };
    let mut transports: Vec<String> = Vec::new();
    for run in runs {
        let name = run["name"].as_str().unwrap_or_default();
        let transport = OPS.iter().find_map(|op| name.strip_prefix(&format!("{op}_")));
        if let Some(t) = transport.filter(|t| !transports.iter().any(|s| s == t)) {
            transports.push(t.to_string());
        }
    }
    let mib = plain(at(&runs[0], "/config/bytes").map(|b| b / 1048576.0));
    let title = format!("collectives, {mib} MiB, GB/s (of memcpy)");
    let mut table = Table::new(title, &["all_reduce", "reduce_scatter", "all_gather", "load"]);
    for transport in &transports {
        let mut cells: Vec<String> = OPS
            .iter()
            .map(|op| {
                let run = runs.iter().find(|r| r["name"] == format!("{op}_{transport}"));
                let figure = |key: &str| run.and_then(|r| r[key].as_f64());
                with_ratio(figure("algbw_gb_per_s"), figure("algbw_fraction_of_memcpy"))
            })
            .collect();
        let first = runs.iter().find(|r| {
            r["name"]
                .as_str()
                .is_some_and(|n| n.ends_with(transport.as_str()))
        });
        cells.push(first.map_or_else(|| MISSING.into(), load));
        table.row(transport.replace('_', " "), cells);
    }
    table.lines()
}

/// The full suite's data paths: in one process, and between two over gRPC, shared memory, raw
/// TCP in clear and under TLS; gloo's all-reduce beside them when `--peers` ran it.
pub(super) fn cross_process(out: &Value) -> Vec<String> {
    let Some(paths) = out.get("cross_process") else {
        return missing_section("data paths (cross_process)");
    };
    let rows = [
        ("in process (threads)", &paths["in_process"]),
        ("gRPC, 2 processes", &paths["grpc_2_processes"]),
        ("shared memory, 2 proc.", &paths["shm_2_processes"]),
        ("raw TCP, 2 processes", &paths["tcp_2_processes"]),
        ("TCP + TLS, 2 processes", &paths["tcp_tls_2_processes"]),
    ];
    let mut table = transports(&rows);
    let tls = at(paths, "/tcp_all_reduce_tls_over_plain");
    table.row("all_reduce TLS / plain", vec![fig(tls)]);
    gloo_rows(&mut table, &out["peers"]["gloo"], &paths["shm_2_processes"]);
    table.lines()
}

/// `--data-paths-only`: shared memory, raw TCP and gRPC between two processes.
pub(super) fn data_paths(out: &Value) -> Vec<String> {
    let Some(paths) = out.get("data_paths") else {
        return missing_section("data paths");
    };
    let rows = [
        ("shared memory, 2 proc.", &paths["shm_2_processes"]),
        ("raw TCP, 2 processes", &paths["tcp_2_processes"]),
        ("gRPC, 2 processes", &paths["grpc_2_processes"]),
    ];
    let mut table = transports(&rows);
    let ratio = |key: &str| fig(at(paths, &format!("/ratios/{key}")));
    let (all_reduce, moved) = (
        ratio("all_reduce_shm_over_tcp"),
        ratio("tensor_move_shm_over_tcp"),
    );
    table.row("shm / raw TCP", vec![all_reduce, moved]);
    gloo_rows(&mut table, &out["peers"]["gloo"], &paths["shm_2_processes"]);
    table.lines()
}

/// `--tls-only`: raw TCP between two processes in clear and under mutual TLS.
pub(super) fn tls(out: &Value) -> Vec<String> {
    let Some(tcp) = out.get("tcp_2_processes") else {
        return missing_section("raw TCP, clear and TLS");
    };
    let rows = [
        ("raw TCP, 2 processes", &tcp["plain"]),
        ("TCP + TLS, 2 processes", &tcp["tls"]),
    ];
    let mut table = transports(&rows);
    table.row(
        "all_reduce TLS / plain",
        vec![fig(at(tcp, "/all_reduce_tls_over_plain"))],
    );
    table.lines()
}

/// A row per data path: its all-reduce, a 64 MiB tensor moved (with its fraction of memcpy)
/// and its round trips.
fn transports(rows: &[(&str, &Value)]) -> Table {
    let heads = [
        "all_reduce GB/s",
        "move GB/s (of memcpy)",
        "sync µs",
        "1000 in flight/s",
        "1→8 actors/s",
        "load",
    ];
    let mut table = Table::new("data paths, 64 MiB", &heads);
    for (label, figures) in rows {
        let all_reduce = list(figures, "collectives")
            .and_then(|c| {
                c.iter()
                    .find(|r| r["name"].as_str().is_some_and(|n| n.starts_with("all_reduce")))
            })
            .and_then(|r| r["algbw_gb_per_s"].as_f64());
        let moved = with_ratio(
            at(figures, "/tensor_move/gb_per_s"),
            at(figures, "/tensor_move/fraction_of_memcpy"),
        );
        let trip = |key: &str| fig(at(figures, &format!("/round_trips/{key}")));
        let cells = vec![
            fig(all_reduce),
            moved,
            trip("sync_latency_us"),
            trip("in_flight_1000_per_s"),
            trip("one_caller_8_actors_in_flight_1000_per_s"),
            load(figures),
        ];
        table.row(*label, cells);
    }
    table
}

/// PyTorch's gloo all-reduce (when `--peers` ran it) and shared memory's over it.
fn gloo_rows(table: &mut Table, gloo: &Value, shm: &Value) {
    if gloo.is_null() {
        return;
    }
    if let Some(error) = gloo["error"].as_str() {
        table.row(format!("PyTorch gloo: {}", clip(error, 60)), vec![MISSING.into()]);
        return;
    }
    let theirs = super::super::peers::gloo_gb_per_s(gloo, "all_reduce");
    table.row("PyTorch gloo, 2 processes", vec![fig(theirs)]);
    let ours = list(shm, "collectives")
        .and_then(|c| c.iter().find(|r| r["name"] == "all_reduce_shm_2_processes"))
        .and_then(|r| r["algbw_gb_per_s"].as_f64());
    let ratio = ours.zip(theirs).map(|(o, t)| o / t);
    table.row("all_reduce shm / gloo", vec![fig(ratio)]);
}

/// The runtime API's actor calls, each beside (in brackets) its ratio to the fabric's round
/// trips of the same run.
pub(super) fn actor_api(out: &Value) -> Vec<String> {
    let Some(api) = out.get("actor_api") else {
        return missing_section("actor calls (actor_api)");
    };
    let heads = [
        "sync calls/s",
        "1000 in flight/s",
        "1→8 actors/s",
        "64 MiB arg GB/s",
        "chain µs",
        "load",
    ];
    let mut table = Table::new("actor calls (× the fabric's)", &heads);
    for (label, figures) in [
        ("in process", &api["in_process"]),
        ("2 processes, TCP", &api["two_processes"]),
    ] {
        let call = |key: &str, ratio: &str| {
            with_ratio(
                at(figures, &format!("/{key}")),
                at(figures, &format!("/ratio_to_fabric/{ratio}")),
            )
        };
        let chain = |key: &str| fig(at(figures, &format!("/compiled_chain/{key}_us_per_iteration")));
        let cells = vec![
            call("sync_calls_per_s", "sync"),
            call("in_flight_1000_calls_per_s", "in_flight_1000"),
            call("one_caller_8_actors_in_flight_1000_calls_per_s", "one_caller_8"),
            fig(at(figures, "/tensor_64mib_argument_gb_per_s")),
            format!("{} → {}", chain("classic_calls"), chain("compiled")),
            load(figures),
        ];
        table.row(label, cells);
    }
    table.lines()
}

/// The controller at scale: compiling a 4096-device plan, one step dispatched to 1024 (and
/// 4096) actors, and a hang's time to its report.
pub(super) fn scale(out: &Value) -> Vec<String> {
    let Some(scale) = out.get("controller_at_scale").or_else(|| out.get("scale")) else {
        return missing_section("controller at scale");
    };
    let mut table = Table::new("controller at scale", &["time", "rate", "load"]);
    let plan = &scale["plan"];
    let rate = fig_unit(at(plan, "/instructions_per_s"), "instructions/s");
    table.row(
        "compile a 4096-device plan",
        vec![fig_unit(at(plan, "/median_s"), "s"), rate, load(plan)],
    );
    let tp = &plan["tensor_parallel"];
    if tp.is_object() {
        let ratio =
            at(tp, "/over_dp_pp").map_or(MISSING.to_string(), |r| format!("{r:.2}× dp × pp (aim ≤ 3×)"));
        table.row(
            "  the same at tp=8 × pp=16 × dp=32",
            vec![fig_unit(at(tp, "/median_s"), "s"), ratio, load(plan)],
        );
    }
    for key in ["dispatch", "dispatch_working", "dispatch_4096"] {
        match scale.get(key) {
            Some(step) => dispatch_row(&mut table, key, step),
            None if key == "dispatch" => table.row("one step dispatched", vec![MISSING.into()]),
            None => {}
        }
    }
    // The full suite times a hang's report; `--scale-only` does not.
    match scale["hang_report"]["hangs"].as_object() {
        Some(hangs) => {
            let aim = plain(at(&scale["hang_report"], "/aim_s"));
            for (name, hang) in hangs {
                let time = fig_unit(at(hang, "/job_to_report_s"), "s");
                table.row(format!("hang ({name}) to report, aim {aim} s"), vec![time]);
            }
        }
        None if out.get("controller_at_scale").is_some() => {
            table.row("hang to report", vec![MISSING.into()]);
        }
        None => {}
    }
    table.lines()
}

/// A row for one step dispatched to `step`'s actors.
fn dispatch_row(table: &mut Table, key: &str, step: &Value) {
    let actors = at(step, "/config/actors").map_or_else(|| "?".into(), num);
    let kind = if key == "dispatch_working" {
        "working"
    } else {
        "no-op"
    };
    let time = fig_unit(at(step, "/median_step_s"), "s");
    let rate = fig_unit(at(step, "/steps_per_s"), "steps/s");
    table.row(
        format!("one step, {actors} {kind} actors"),
        vec![time, rate, load(step)],
    );
}

/// `text` cut to `chars` characters.
pub(super) fn clip(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}
