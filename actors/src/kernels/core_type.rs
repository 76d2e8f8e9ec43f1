//! Which of OpenBLAS's kernel sets (its *core type*) a process runs: the rule, as pure functions.
//!
//! A `DYNAMIC_ARCH` OpenBLAS picks its kernels when it is loaded, from the CPU's model number.
//! A CPU newer than the build falls back to an old set: Debian's 0.3.21 takes an Intel Sapphire
//! Rapids (AVX-512, AMX; model name "Intel(R) Xeon(R) Processor") for a Prescott and runs SSE3
//! kernels there — 28 GFLOP/s at gpt-tiny's shapes where its SkylakeX kernels ran 137–145 and
//! its Haswell ones 75–78 (one thread, 2026-11-26), and gpt-tiny's step 1.77 s against 0.544 s.
//! `OPENBLAS_CORETYPE`, read by OpenBLAS's load-time constructor, forces a set.
//!
//! The rule ([`candidates`], tried in order by [`first_passing`]):
//! - `OPENBLAS_CORETYPE` set by the user: the library as it loads, nothing else (never
//!   overridden);
//! - otherwise, where OpenBLAS detected a core older than the CPU's features allow (its
//!   [`Level`] below theirs): the core of each level the features allow above the detected one,
//!   newest first, then the detected core, then the older levels' cores;
//! - otherwise (detection as new as the features, or a core name this rule does not know): the
//!   library as detected, then the older levels' cores.
//!
//! Each candidate is loaded and checked (it must report the core asked for and multiply as
//! Flex does); one that fails gives way to the next — older OpenBLAS builds computed wrong
//! products on some new CPUs, which is why the variable exists. The rule before (take whatever
//! loads: [`old_candidates`]) is kept as the unit tests' control.

use std::fmt;

/// The instruction-set level a core type's kernels use, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// SSE3 and older (Prescott, Core2, Nehalem, Atom, Opteron, …).
    Sse,
    /// AVX (Sandybridge, Bulldozer, Piledriver, Steamroller).
    Avx,
    /// AVX2 with FMA (Haswell, Zen, Excavator).
    Avx2,
    /// AVX-512 F/BW/VL/DQ/CD (SkylakeX, Cooperlake, SapphireRapids).
    Avx512,
}

impl Level {
    /// All levels, newest first.
    const NEWEST_FIRST: [Level; 4] = [Level::Avx512, Level::Avx2, Level::Avx, Level::Sse];

    /// The x86 features (as `is_x86_feature_detected!` names them) a CPU needs for this level.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Level::Avx512 => &["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"],
            Level::Avx2 => &["avx2", "fma"],
            Level::Avx => &["avx"],
            Level::Sse => &["sse3"],
        }
    }

    /// The core type to force for this level: the oldest name for its kernels, which every
    /// `DYNAMIC_ARCH` build since 0.2.20 knows (Cooperlake's f32 kernels are SkylakeX's). None
    /// for SSE: nothing older is worth forcing.
    pub fn core(self) -> Option<&'static str> {
        match self {
            Level::Avx512 => Some("SkylakeX"),
            Level::Avx2 => Some("Haswell"),
            Level::Avx => Some("Sandybridge"),
            Level::Sse => None,
        }
    }
}

/// The level of OpenBLAS's core type `name` (as `openblas_get_corename` prints it, any case);
/// None for a name this rule does not know (another architecture, a newer OpenBLAS's name):
/// such a detection is never overridden.
pub fn level_of(name: &str) -> Option<Level> {
    const NAMES: [(Level, &str); 4] = [
        (Level::Avx512, "skylakex cooperlake sapphirerapids"),
        (Level::Avx2, "haswell zen excavator"),
        (Level::Avx, "sandybridge bulldozer piledriver steamroller"),
        (
            Level::Sse,
            "katmai coppermine northwood prescott banias atom core2 penryn dunnington nehalem \
             athlon opteron opteron_sse3 barcelona nano bobcat",
        ),
    ];
    let name = name.trim().to_ascii_lowercase();
    NAMES
        .iter()
        .find(|(_, names)| names.split_whitespace().any(|n| n == name))
        .map(|(level, _)| *level)
}

/// The CPU features the rule looks at that this CPU has (names as `is_x86_feature_detected!`
/// spells them; it also checks that the OS saves the wide registers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    present: Vec<&'static str>,
}

impl CpuFeatures {
    /// This CPU's features (none on other architectures).
    pub fn of_this_cpu() -> CpuFeatures {
        #[cfg(target_arch = "x86_64")]
        let present = {
            let detected = |name: &str| match name {
                "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
                "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
                "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
                "avx512dq" => std::arch::is_x86_feature_detected!("avx512dq"),
                "avx512cd" => std::arch::is_x86_feature_detected!("avx512cd"),
                "avx2" => std::arch::is_x86_feature_detected!("avx2"),
                "fma" => std::arch::is_x86_feature_detected!("fma"),
                "avx" => std::arch::is_x86_feature_detected!("avx"),
                "sse3" => std::arch::is_x86_feature_detected!("sse3"),
                _ => false,
            };
            Self::known().filter(|name| detected(name)).collect()
        };
        #[cfg(not(target_arch = "x86_64"))]
        let present = Vec::new();
        CpuFeatures { present }
    }

    /// Features given by name (the tests' CPUs); names the rule does not look at are dropped.
    pub fn from_names(names: &[&str]) -> CpuFeatures {
        CpuFeatures {
            present: Self::known().filter(|known| names.contains(known)).collect(),
        }
    }

    fn known() -> impl Iterator<Item = &'static str> {
        Level::NEWEST_FIRST
            .into_iter()
            .flat_map(|l| l.features().iter().copied())
    }

    /// The newest level whose features (and every older level's) this CPU has.
    pub fn level(&self) -> Option<Level> {
        let has = |l: Level| l.features().iter().all(|f| self.present.contains(f));
        let mut best = None;
        for level in Level::NEWEST_FIRST.into_iter().rev() {
            if !has(level) {
                break;
            }
            best = Some(level);
        }
        best
    }

    /// The features behind [`CpuFeatures::level`], space-separated (what the description says).
    pub fn of_level(&self) -> String {
        self.level().map(|l| l.features().join(" ")).unwrap_or_default()
    }
}

/// One way of loading OpenBLAS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// With the environment as it is: OpenBLAS's own detection, or the user's
    /// `OPENBLAS_CORETYPE`.
    AsLoaded,
    /// With `OPENBLAS_CORETYPE` set to this core type for the load.
    Core(&'static str),
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Candidate::AsLoaded => f.write_str("as loaded"),
            Candidate::Core(core) => write!(f, "OPENBLAS_CORETYPE={core}"),
        }
    }
}

/// The candidates to try, in order (see the module's rule): `user_set` when the user's own
/// `OPENBLAS_CORETYPE` is in the environment, `detected` what OpenBLAS chose loading without it.
pub fn candidates(user_set: bool, detected: &str, features: &CpuFeatures) -> Vec<Candidate> {
    if user_set {
        return vec![Candidate::AsLoaded];
    }
    let Some(allowed) = features.level() else {
        return vec![Candidate::AsLoaded];
    };
    // An unknown name ranks above every level: tried first, never displaced.
    let detected = level_of(detected);
    let mut ranked: Vec<(Option<Level>, Candidate)> = vec![(detected, Candidate::AsLoaded)];
    for level in Level::NEWEST_FIRST.into_iter().filter(|l| *l <= allowed) {
        if let Some(core) = level.core().filter(|_| Some(level) != detected) {
            ranked.push((Some(level), Candidate::Core(core)));
        }
    }
    let rank = |l: &Option<Level>| l.map_or(usize::MAX, |l| l as usize);
    ranked.sort_by_key(|(level, _)| std::cmp::Reverse(rank(level)));
    ranked.into_iter().map(|(_, c)| c).collect()
}

/// The rule before issue 47, the tests' control: whatever loads, as it loads.
pub fn old_candidates(_user_set: bool, _detected: &str, _features: &CpuFeatures) -> Vec<Candidate> {
    vec![Candidate::AsLoaded]
}

/// What trying the candidates gave: the first that passed (with what loading it made), and
/// each one refused before it with the reason.
#[derive(Debug)]
pub struct Choice<L> {
    /// The candidate taken and its value; None when every one was refused.
    pub chosen: Option<(Candidate, L)>,
    /// The candidates refused, in order, with why.
    pub refused: Vec<(Candidate, String)>,
}

/// Tries `candidates` in order with `attempt` (load and check) and keeps the first that passes.
pub fn first_passing<L>(
    candidates: &[Candidate],
    mut attempt: impl FnMut(Candidate) -> Result<L, String>,
) -> Choice<L> {
    let mut refused = Vec::new();
    for &candidate in candidates {
        match attempt(candidate) {
            Ok(loaded) => {
                return Choice {
                    chosen: Some((candidate, loaded)),
                    refused,
                };
            }
            Err(why) => refused.push((candidate, why)),
        }
    }
    Choice {
        chosen: None,
        refused,
    }
}

/// Why the chosen candidate runs, for the description: `user` the user's `OPENBLAS_CORETYPE`
/// (if set), `detected` OpenBLAS's own choice, `refused` the candidates tried before it.
pub fn reason(
    chosen: Candidate,
    user: Option<&str>,
    detected: &str,
    features: &CpuFeatures,
    refused: &[(Candidate, String)],
) -> String {
    let mut why = match (chosen, user) {
        (Candidate::AsLoaded, Some(user)) => format!("OPENBLAS_CORETYPE={user}, the user's own"),
        (Candidate::AsLoaded, None) => "as OpenBLAS detected it".to_string(),
        (Candidate::Core(_), _) => format!(
            "core type set from the CPU's features: {}; OpenBLAS detected {detected}",
            features.of_level()
        ),
    };
    for (candidate, failure) in refused {
        why.push_str(&format!("; {candidate} refused: {failure}"));
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules compared: the one in force and the one before it.
    type Rule = fn(bool, &str, &CpuFeatures) -> Vec<Candidate>;

    /// One case: the CPU, the user's variable, OpenBLAS's detection, the candidates whose
    /// products are wrong, and the candidate a right rule takes (None: Flex).
    struct Case {
        name: &'static str,
        features: &'static [&'static str],
        user_set: bool,
        detected: &'static str,
        wrong: &'static [Candidate],
        want: Option<Candidate>,
    }

    const SAPPHIRE_RAPIDS: &[&str] = &[
        "sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
    ];
    const HASWELL: &[&str] = &["sse3", "avx", "avx2", "fma"];

    fn cases() -> Vec<Case> {
        use Candidate::{AsLoaded, Core};
        let case = |name, features, detected, wrong, want| Case {
            name,
            features,
            user_set: false,
            detected,
            wrong,
            want,
        };
        vec![
            case(
                "detected older than the features",
                SAPPHIRE_RAPIDS,
                "Prescott",
                &[],
                Some(Core("SkylakeX")),
            ),
            case(
                "the features' core fails its check",
                SAPPHIRE_RAPIDS,
                "Prescott",
                &[Core("SkylakeX")],
                Some(Core("Haswell")),
            ),
            case(
                "a Haswell detected as a Prescott",
                HASWELL,
                "Prescott",
                &[],
                Some(Core("Haswell")),
            ),
            case(
                "detection as new as the features",
                SAPPHIRE_RAPIDS,
                "Cooperlake",
                &[],
                Some(AsLoaded),
            ),
            case(
                "the detected core fails its check",
                SAPPHIRE_RAPIDS,
                "SkylakeX",
                &[AsLoaded],
                Some(Core("Haswell")),
            ),
            case("an old CPU", &["sse3"], "Prescott", &[], Some(AsLoaded)),
            case(
                "a name the rule does not know",
                SAPPHIRE_RAPIDS,
                "NeoverseN1",
                &[],
                Some(AsLoaded),
            ),
            case(
                "every candidate fails",
                SAPPHIRE_RAPIDS,
                "Prescott",
                &[Core("SkylakeX"), Core("Haswell"), Core("Sandybridge"), AsLoaded],
                None,
            ),
            Case {
                user_set: true,
                ..case(
                    "the user's OPENBLAS_CORETYPE",
                    SAPPHIRE_RAPIDS,
                    "Prescott",
                    &[],
                    Some(AsLoaded),
                )
            },
            Case {
                user_set: true,
                ..case(
                    "the user's core fails its check",
                    SAPPHIRE_RAPIDS,
                    "Prescott",
                    &[AsLoaded],
                    None,
                )
            },
        ]
    }

    /// The cases `rule` gets wrong, by name.
    fn failures(rule: Rule) -> Vec<&'static str> {
        cases()
            .into_iter()
            .filter(|case| {
                let features = CpuFeatures::from_names(case.features);
                let tried = rule(case.user_set, case.detected, &features);
                let choice = first_passing(&tried, |c| match case.wrong.contains(&c) {
                    true => Err("wrong products".to_string()),
                    false => Ok(()),
                });
                choice.chosen.map(|(c, ())| c) != case.want
            })
            .map(|case| case.name)
            .collect()
    }

    #[test]
    fn the_core_is_set_from_the_features_where_detection_is_older_and_a_failing_one_gives_way() {
        assert_eq!(failures(candidates), Vec::<&str>::new());
        // Control: the rule before (whatever loads, as it loads) fails the two cases the issue
        // is about, and so would a test of it.
        let old = failures(old_candidates);
        assert!(
            old.contains(&"detected older than the features")
                && old.contains(&"the features' core fails its check")
                && old.contains(&"the detected core fails its check"),
            "{old:?}"
        );
    }

    #[test]
    fn levels_of_names_and_features() {
        assert_eq!(level_of("Prescott"), Some(Level::Sse));
        assert_eq!(level_of("SKYLAKEX"), Some(Level::Avx512));
        assert_eq!(level_of("Zen"), Some(Level::Avx2));
        assert_eq!(level_of("NeoverseN1"), None);
        assert_eq!(
            CpuFeatures::from_names(SAPPHIRE_RAPIDS).level(),
            Some(Level::Avx512)
        );
        // AVX-512 without AVX2 is not a level (levels build on each other).
        let gap = CpuFeatures::from_names(&[
            "sse3", "avx", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
        ]);
        assert_eq!(gap.level(), Some(Level::Avx));
        assert_eq!(CpuFeatures::from_names(&[]).level(), None);
        let why = reason(
            Candidate::Core("SkylakeX"),
            None,
            "Prescott",
            &CpuFeatures::from_names(SAPPHIRE_RAPIDS),
            &[],
        );
        assert_eq!(
            why,
            "core type set from the CPU's features: avx512f avx512bw avx512vl avx512dq avx512cd; \
             OpenBLAS detected Prescott"
        );
    }
}
