//! The README against `--help`: every `--flag` the README names is a flag of some `archipelago`
//! subcommand (or of cargo, listed below), and every default it states for a flag — "`--flag`
//! … (default X)" or "`--flag X` (the default)" — is the default clap has for it. A README that
//! drifts from the code fails here, naming the flag and both values.

use std::collections::{BTreeMap, BTreeSet};

use clap::CommandFactory;

use archipelago_controller::cli::Cli;

/// Flags the README names that belong to other programs (cargo, the test harness, chromium,
/// kubectl, Python scripts, the examples' own arguments).
const OTHERS: &[&str] = &[
    "fixture",
    "nodes",
    "release",
    "workspace",
    "features",
    "example",
    "bin",
    "test",
    "nocapture",
    "package",
    "lib",
    "all-targets",
    "no-deps",
    "check",
    "ignored",
    "test-threads",
    "headless",
    "export-model",
    "check-export",
    "system",
    "hosts",
    "kernels-only",
    "manifest-path",
    "locked",
];

/// Every long flag of every subcommand (hidden ones too), with its defaults: flag → defaults
/// (one per subcommand that has it and gives one).
fn flags() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![Cli::command()];
    while let Some(mut command) = stack.pop() {
        command.build();
        for arg in command.get_arguments() {
            if let Some(long) = arg.get_long() {
                let defaults = out.entry(long.to_string()).or_default();
                if let Some(d) = arg.get_default_values().first() {
                    defaults.insert(d.to_string_lossy().to_string());
                }
            }
        }
        stack.extend(command.get_subcommands().cloned());
    }
    out
}

/// The README's text.
fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README.md")
}

/// `--name` occurrences: (name, the text after it on its line).
fn mentions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut rest = line;
        while let Some(at) = rest.find("--") {
            let after = &rest[at + 2..];
            let before = rest[..at].chars().last();
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let starts_word = before.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '-');
            if starts_word && name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                out.push((
                    name.trim_end_matches('-').to_string(),
                    after[name.len()..].to_string(),
                ));
            }
            rest = &after[name.len()..];
        }
    }
    out
}

/// A default stated right after a flag: "… (default X)" within the clause, or "`--flag X` (the
/// default)".
fn stated_default(after: &str) -> Option<String> {
    let clause: String = after.chars().take(70).collect();
    // The clause ends at a sentence's or a list's end, or where another flag is named.
    let clause = clause
        .split(". ")
        .next()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("");
    let clause = clause.split("--").next().unwrap_or("");
    if let Some(at) = clause.find("(default ") {
        let value: String = clause[at + "(default ".len()..]
            .chars()
            .take_while(|c| !matches!(c, ')' | ',' | ' ' | '`'))
            .collect();
        return Some(value);
    }
    let value = after.strip_prefix(' ')?;
    let (value, rest) = value.split_once('`')?;
    (rest.trim_start().starts_with("(the default)") && !value.contains(' ')).then(|| value.to_string())
}

/// What `text` gets wrong against `--help`: flags no subcommand has, stated defaults that are
/// no subcommand's default for that flag; and how many stated defaults were checked.
fn check(text: &str) -> (BTreeSet<String>, Vec<String>, usize) {
    let flags = flags();
    let mut unknown = BTreeSet::new();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (name, after) in mentions(text) {
        if OTHERS.contains(&name.as_str()) {
            continue;
        }
        let Some(defaults) = flags.get(&name) else {
            unknown.insert(name);
            continue;
        };
        if let Some(value) = stated_default(&after) {
            checked += 1;
            // A flag several subcommands share may have a default per subcommand; the README's
            // mention does not say which, so any of them passes.
            let same = defaults.iter().any(|d| {
                d == &value || matches!((d.parse::<f64>(), value.parse::<f64>()), (Ok(a), Ok(b)) if a == b)
            });
            if !same {
                wrong.push(format!(
                    "--{name}: the README says {value}, --help says {defaults:?}"
                ));
            }
        }
    }
    (unknown, wrong, checked)
}

#[test]
fn every_flag_the_readme_names_exists_and_its_stated_defaults_are_the_codes() {
    let (unknown, wrong, checked) = check(&readme());
    assert!(
        unknown.is_empty(),
        "the README names flags no subcommand has: {unknown:?}"
    );
    assert!(
        wrong.is_empty(),
        "the README's defaults disagree with --help:\n{}",
        wrong.join("\n")
    );
    assert!(
        checked >= 5,
        "only {checked} stated defaults found: the scan is broken"
    );
}

#[test]
fn the_check_catches_a_wrong_default_and_an_unknown_flag() {
    // Negative control: the verdict itself must be able to fail.
    let text = "`--patience-s` (default 60) and `--no-such-flag`, `--state auto` (the default), \
                `--host-timeout-s` (default 5).";
    let (unknown, wrong, checked) = check(text);
    assert_eq!(checked, 3, "{wrong:?}");
    assert_eq!(unknown, BTreeSet::from(["no-such-flag".to_string()]));
    assert_eq!(wrong.len(), 1, "{wrong:?}");
    assert!(
        wrong[0].starts_with("--patience-s: the README says 60"),
        "{wrong:?}"
    );
}
