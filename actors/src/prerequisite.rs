//! One rule for "must this test run here", for every test that needs something from outside the
//! workspace (root, a Debian package, a shared library):
//!
//! - under CI ([`CI_ENV`] set to `true` or `1`) nothing skips: a missing prerequisite fails the
//!   test with a message naming it and how to get it;
//! - elsewhere the test is skipped: it says so on stderr (`skipped <test>: <why>; <fix>`) and
//!   appends that line to the file [`SKIP_LOG_ENV`] names, which `scripts/test.sh` sets and lists
//!   at its end.
//!
//! It also starts a test's child processes without an entry point of their own that would count
//! as a test: [`child_of_this_test`] runs the calling test again in a child with a role, and the
//! test, asking [`child_role`] first, plays that role there and returns.
//!
//! For the tests of every crate (the actors' unit tests, the controller's and the integration
//! tests), hence public but hidden; it uses only std, so nothing test-only enters the library.

use std::fmt::Display;
use std::io::Write as _;
use std::path::Path;
use std::process::Command;

/// The variable that marks a CI run: `true` or `1` (what GitHub Actions, GitLab CI and most
/// others set).
pub const CI_ENV: &str = "CI";
/// The file a skipped test appends its line to (`scripts/test.sh` sets it).
pub const SKIP_LOG_ENV: &str = "ARCHIPELAGO_SKIP_LOG";
/// Set in a child process started by [`child_of_this_test`]: the role it plays.
pub const CHILD_ROLE_ENV: &str = "ARCHIPELAGO_TEST_CHILD_ROLE";

/// Whether this is a CI run, where every test must run.
pub fn under_ci() -> bool {
    std::env::var(CI_ENV).is_ok_and(|v| v == "true" || v == "1")
}

/// The running test's name: libtest runs each test on a thread named after it.
pub fn current_test() -> Option<String> {
    std::thread::current()
        .name()
        .filter(|name| *name != "main")
        .map(str::to_string)
}

/// `found`'s value where the prerequisite is there; where it is not (`Err(why)`), the rule:
/// under CI the test fails naming `why` and `fix` (what to install or do), elsewhere it is
/// skipped (see [`missing`]) and the answer is `None`.
#[track_caller]
pub fn require<T, E: Display>(found: Result<T, E>, fix: &str) -> Option<T> {
    match found {
        Ok(value) => Some(value),
        Err(why) => {
            missing(&why.to_string(), fix);
            None
        }
    }
}

/// The rule for a prerequisite that is missing (`why`; `fix` says what to install or do): under
/// CI a panic with both (at the caller's line); elsewhere the skip line on stderr and in the
/// skip log. The caller returns from the test after it.
#[track_caller]
pub fn missing(why: &str, fix: &str) {
    let test = current_test().unwrap_or_else(|| "a test".to_string());
    let log = std::env::var_os(SKIP_LOG_ENV);
    let log = log
        .as_deref()
        .map(Path::new)
        .filter(|p| !p.as_os_str().is_empty());
    if let Err(failure) = decide(&test, why, fix, under_ci(), log) {
        panic!("{failure}");
    }
}

/// The rule as a function of its inputs: `Err(message)` to fail with under CI; otherwise the
/// skip line, printed on stderr and appended to `log`.
fn decide(test: &str, why: &str, fix: &str, ci: bool, log: Option<&Path>) -> Result<(), String> {
    if ci {
        return Err(format!(
            "{test}: under CI ({CI_ENV} is true or 1) this test must run, but {why}; {fix}"
        ));
    }
    let line = format!("skipped {test}: {why}; {fix}");
    eprintln!("{line}");
    if let Some(log) = log
        && let Err(e) = append_line(log, &line)
    {
        eprintln!("could not append to {SKIP_LOG_ENV}={}: {e}", log.display());
    }
    Ok(())
}

/// One line appended with one write, so that tests skipping at once do not interleave.
fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    file.write_all(format!("{line}\n").as_bytes())
}

/// Where `program` is on `PATH` (an executable file), or why not — the check for a command a
/// Debian package brings.
pub fn on_path(program: &str) -> Result<std::path::PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|file| {
            std::fs::metadata(file).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| format!("`{program}` is not on PATH"))
}

/// This test binary started again to run only the calling test (`--exact`, on one thread, its
/// output not captured), with [`CHILD_ROLE_ENV`] set to `role`. The test asks [`child_role`]
/// first: in the child it plays the role and returns. Call it from the test's own thread.
pub fn child_of_this_test(role: &str) -> Command {
    let test = current_test()
        .expect("child_of_this_test is called from the test's own thread (libtest names it after the test)");
    let exe = std::env::current_exe().expect("the path of this test binary");
    let mut command = Command::new(exe);
    command
        .args(["--exact", &test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ROLE_ENV, role)
        .env_remove(SKIP_LOG_ENV);
    command
}

/// The role of this process where [`child_of_this_test`] started it; `None` in the test itself.
pub fn child_role() -> Option<String> {
    std::env::var(CHILD_ROLE_ENV).ok().filter(|role| !role.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_ci_a_missing_prerequisite_fails_naming_it_and_the_fix() {
        let failure = decide("t", "libfoo missing", "apt-get install libfoo", true, None).unwrap_err();
        assert!(
            failure.contains("t: under CI")
                && failure.contains("libfoo missing")
                && failure.contains("apt-get install libfoo"),
            "{failure}"
        );
    }

    #[test]
    fn elsewhere_a_missing_prerequisite_skips_with_one_line_in_the_log() {
        let log = std::env::temp_dir().join(format!("archipelago-skip-log-{}", std::process::id()));
        let _ = std::fs::remove_file(&log);
        decide("a", "no root", "run as root", false, Some(&log)).unwrap();
        decide("b", "no bar", "apt-get install bar", false, Some(&log)).unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_file(&log).unwrap();
        assert_eq!(
            text,
            "skipped a: no root; run as root\nskipped b: no bar; apt-get install bar\n"
        );
    }

    #[test]
    fn a_program_is_found_on_path_or_named_as_missing() {
        assert!(on_path("sh").is_ok_and(|p| p.ends_with("sh")));
        let missing = on_path("no-such-program-archipelago").unwrap_err();
        assert!(missing.contains("no-such-program-archipelago"), "{missing}");
    }

    #[test]
    fn the_test_name_is_the_thread_name_libtest_gives() {
        assert_eq!(
            current_test().as_deref(),
            Some("prerequisite::tests::the_test_name_is_the_thread_name_libtest_gives")
        );
    }
}
