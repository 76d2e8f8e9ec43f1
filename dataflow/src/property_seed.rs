//! The seed every property test of the workspace draws its cases from, one rule for all: under
//! CI (`CI` = `true` or `1`) a fixed seed, so that CI cannot flake; elsewhere a random one per
//! process, so that runs explore new cases. Either way the seed is printed (captured by the test
//! harness, shown when a test fails), and `ARCHIPELAGO_PROPTEST_SEED=N` (or proptest's own
//! `PROPTEST_RNG_SEED=N`) replays it.
//!
//! It only reads the environment: no dependency on proptest here. A test puts the seed into its
//! proptest configuration:
//!
//! ```ignore
//! let config = ProptestConfig {
//!     rng_seed: RngSeed::Fixed(archipelago_dataflow::property_seed::seed()),
//!     ..ProptestConfig::default()
//! };
//! ```

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// The seed under CI.
pub const CI_SEED: u64 = 0x4152_4348_4950_454c;

/// The variable that replays a seed (it wins over every other source).
pub const SEED_ENV: &str = "ARCHIPELAGO_PROPTEST_SEED";

/// What chose the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `ARCHIPELAGO_PROPTEST_SEED` or `PROPTEST_RNG_SEED`.
    Replayed,
    /// `CI` set to `true` or `1`: [`CI_SEED`].
    Ci,
    /// Drawn for this process.
    Random,
}

/// The seed of this process's property tests and what chose it, from `env` (a variable's value
/// by name; the process environment in [`seed`]); `random` draws one when nothing fixes it.
pub fn choose(env: impl Fn(&str) -> Option<String>, random: impl FnOnce() -> u64) -> (u64, Source) {
    for name in [SEED_ENV, "PROPTEST_RNG_SEED"] {
        if let Some(value) = env(name) {
            let seed = value
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}={value:?}: give the seed as an unsigned integer"));
            return (seed, Source::Replayed);
        }
    }
    match env("CI").as_deref().map(str::trim) {
        Some("true" | "1") => (CI_SEED, Source::Ci),
        _ => (random(), Source::Random),
    }
}

/// This process's seed (chosen once by [`choose`] from the environment), printed to stderr at
/// every call so that the output of whichever test fails names it.
pub fn seed() -> u64 {
    static SEED: OnceLock<(u64, Source)> = OnceLock::new();
    let (seed, source) = *SEED.get_or_init(|| {
        choose(
            |name| std::env::var(name).ok(),
            || {
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
        )
    });
    let why = match source {
        Source::Replayed => "replayed",
        Source::Ci => "fixed under CI",
        Source::Random => "random",
    };
    eprintln!("property tests: seed {seed} ({why}; replay with {SEED_ENV}={seed})");
    seed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn ci_fixes_the_seed_a_replay_wins_and_elsewhere_it_is_drawn() {
        assert_eq!(choose(env(&[("CI", "true")]), || 5), (CI_SEED, Source::Ci));
        assert_eq!(choose(env(&[("CI", "1")]), || 5), (CI_SEED, Source::Ci));
        assert_eq!(choose(env(&[("CI", "false")]), || 5), (5, Source::Random));
        assert_eq!(choose(env(&[]), || 5), (5, Source::Random));
        let replay = [("CI", "true"), (SEED_ENV, " 42 ")];
        assert_eq!(choose(env(&replay), || 5), (42, Source::Replayed));
        let theirs = [("PROPTEST_RNG_SEED", "7")];
        assert_eq!(choose(env(&theirs), || 5), (7, Source::Replayed));
    }

    #[test]
    #[should_panic(expected = "unsigned integer")]
    fn a_seed_that_is_not_a_number_is_refused() {
        choose(env(&[(SEED_ENV, "abc")]), || 5);
    }
}
