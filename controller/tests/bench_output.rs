//! What `bench` prints when it succeeds: a short summary on stdout (the JSON only in `--json
//! FILE`), and no ERROR — the runtime-API section ends its host process in order, which once
//! logged `host bench-host … was lost` on every successful run.

use std::process::Command;

#[test]
fn a_successful_bench_prints_a_summary_and_no_error() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .args(["bench", "--actor-api-only", "--quick", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    for text in [&stdout, &stderr] {
        assert!(
            !text.contains("ERROR") && !text.contains("was lost"),
            "{stdout}{stderr}"
        );
    }
    let lines = stdout.lines().count();
    assert!((3..=60).contains(&lines), "{lines} lines:\n{stdout}");
    assert!(!stdout.trim_start().starts_with('{'), "JSON on stdout:\n{stdout}");
    let figures: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(figures["suite"], "actor_api");
    assert!(
        stdout.contains(&json.display().to_string()),
        "the summary names its JSON file:\n{stdout}"
    );
}
