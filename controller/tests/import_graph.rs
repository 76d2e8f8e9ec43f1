//! The layering rules of the workspace, checked on the source: which module's code names which
//! other module (`use crate::…`, `use super::…`, `crate::…` paths in code, re-exports followed to
//! where the item lives).
//!
//! - In the controller, no module of the job's path (the `Controller` in `controller`, the
//!   training job in `train`, the cluster in `cluster`, the gangs) lies on an import cycle:
//!   lower modules never import higher ones.
//! - In the actors crate, the fabric imports nothing of the collectives, directly or through
//!   another module: collectives build on the fabric, never the other way.
//!
//! Each rule is checked on tiny synthetic crates too (negative controls: a cycle and a forbidden
//! path are found, comments and strings are not taken for imports). Run with `--nocapture` to
//! see the controller's graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "import_graph/source_scan.rs"]
mod source_scan;

use source_scan::{Named, names_in};

/// Module paths (`a::b`, `""` for the crate root) and what each one's code names.
#[derive(Default)]
struct ModuleGraph {
    edges: BTreeMap<String, BTreeSet<String>>,
}

impl ModuleGraph {
    /// The graph of the library crate whose sources are under `src` (`lib.rs` the root).
    fn of_crate(src: &Path) -> ModuleGraph {
        let mut files = Vec::new();
        collect_rs_files(src, &mut files);
        let mut renamed: BTreeMap<PathBuf, String> = BTreeMap::new();
        let mut sources = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).unwrap();
            let module = renamed.get(file).cloned().unwrap_or_else(|| module_of(src, file));
            if file.ends_with("main.rs") {
                continue; // the binary: a crate of its own
            }
            for (path, name) in path_attributes(&text) {
                let target = file.parent().unwrap().join(path);
                renamed.insert(target, join(&module, &name));
            }
            sources.push((file.clone(), text));
        }
        let sources: Vec<(String, String)> = sources
            .into_iter()
            .map(|(file, text)| {
                let module = renamed
                    .get(&file)
                    .cloned()
                    .unwrap_or_else(|| module_of(src, &file));
                (module, text)
            })
            .collect();
        ModuleGraph::from_sources(&sources)
    }

    /// The graph of modules given as `(module path, source)`.
    fn from_sources(sources: &[(String, String)]) -> ModuleGraph {
        let modules: BTreeSet<String> = sources.iter().map(|(m, _)| m.clone()).collect();
        let named: Vec<Named> = sources
            .iter()
            .flat_map(|(module, text)| names_in(module, text, &modules))
            .collect();
        let mut reexports: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for n in &named {
            if let Some(name) = &n.reexport {
                reexports.insert((n.from.clone(), name.clone()), n.path.clone());
            }
        }
        let mut graph = ModuleGraph::default();
        for module in &modules {
            graph.edges.entry(module.clone()).or_default();
        }
        for n in &named {
            let Some(target) = resolve(&n.path, &modules, &reexports, 0) else {
                continue;
            };
            if !target.is_empty() && target != n.from {
                graph.edges.get_mut(&n.from).unwrap().insert(target);
            }
        }
        graph
    }

    /// The import cycles: every strongly connected set of two or more modules.
    fn cycles(&self) -> Vec<Vec<String>> {
        let mut tarjan = Tarjan::default();
        for module in self.edges.keys() {
            if !tarjan.index.contains_key(module) {
                tarjan.visit(self, module);
            }
        }
        tarjan.components.into_iter().filter(|c| c.len() > 1).collect()
    }

    /// A chain of imports from `from` to a module under `to` (itself included), if there is one.
    fn path_to(&self, from: &str, to: &str) -> Option<Vec<String>> {
        let mut came_from: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([from.to_string()]);
        while let Some(at) = queue.pop_front() {
            if under(&at, to) {
                let mut chain = vec![at.clone()];
                while let Some(prev) = came_from.get(chain.last().unwrap()) {
                    chain.push(prev.clone());
                }
                chain.reverse();
                return Some(chain);
            }
            for next in self.edges.get(&at).into_iter().flatten() {
                if next != from && !came_from.contains_key(next) {
                    came_from.insert(next.clone(), at.clone());
                    queue.push_back(next.clone());
                }
            }
        }
        None
    }
}

/// Whether `module` is `scope` or inside it.
fn under(module: &str, scope: &str) -> bool {
    module == scope || module.starts_with(&format!("{scope}::"))
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}::{child}")
    }
}

fn collect_rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect_rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are `a::b`; `src/lib.rs` is the root.
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

/// `#[path = "file.rs"] mod name;` declarations: the file and the module name.
fn path_attributes(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    (lines.windows(2))
        .filter_map(|pair| {
            let path = pair[0].strip_prefix("#[path = \"")?.strip_suffix("\"]")?;
            let name = pair[1].strip_prefix("mod ")?.strip_suffix(';')?;
            Some((path.to_string(), name.to_string()))
        })
        .collect()
}

/// The module a path names (the longest prefix that is a module), following re-exports.
fn resolve(
    path: &[String],
    modules: &BTreeSet<String>,
    reexports: &BTreeMap<(String, String), Vec<String>>,
    depth: usize,
) -> Option<String> {
    let length = (0..=path.len())
        .rev()
        .find(|&i| modules.contains(&path[..i].join("::")))?;
    let module = path[..length].join("::");
    if let Some(next) = path.get(length)
        && let Some(source) = reexports.get(&(module.clone(), next.clone()))
        && depth < 8
    {
        let mut followed = source.clone();
        followed.extend_from_slice(&path[length + 1..]);
        return resolve(&followed, modules, reexports, depth + 1);
    }
    Some(module)
}

/// Tarjan's strongly connected components.
#[derive(Default)]
struct Tarjan {
    index: BTreeMap<String, usize>,
    low: BTreeMap<String, usize>,
    stack: Vec<String>,
    on_stack: BTreeSet<String>,
    components: Vec<Vec<String>>,
}

impl Tarjan {
    fn visit(&mut self, graph: &ModuleGraph, v: &str) {
        let n = self.index.len();
        self.index.insert(v.to_string(), n);
        self.low.insert(v.to_string(), n);
        self.stack.push(v.to_string());
        self.on_stack.insert(v.to_string());
        for w in graph.edges.get(v).into_iter().flatten() {
            if !self.index.contains_key(w) {
                self.visit(graph, w);
                let low = self.low[v].min(self.low[w]);
                self.low.insert(v.to_string(), low);
            } else if self.on_stack.contains(w) {
                let low = self.low[v].min(self.index[w]);
                self.low.insert(v.to_string(), low);
            }
        }
        if self.low[v] == self.index[v] {
            let mut component = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack.remove(&w);
                let done = w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            component.sort();
            self.components.push(component);
        }
    }
}

/// The sources of crate `name`: this checkout's, or under `ARCHIPELAGO_SOURCE_ROOT` when set
/// (another checkout, e.g. `git archive` of an older commit: how the checks are seen to fail on
/// a tree that breaks the rules).
fn crate_src(name: &str) -> PathBuf {
    let root = std::env::var_os("ARCHIPELAGO_SOURCE_ROOT")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."), PathBuf::from);
    root.join(name).join("src")
}

/// The controller's job path: the `Controller`, the training job, the cluster, the gangs.
const JOB_PATH: [&str; 5] = ["controller", "train", "cluster", "gang", "actor_gang"];

#[test]
fn no_module_of_the_job_path_lies_on_an_import_cycle() {
    let graph = ModuleGraph::of_crate(&crate_src("controller"));
    for (module, targets) in &graph.edges {
        if JOB_PATH.iter().any(|scope| under(module, scope)) && !targets.is_empty() {
            let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
            eprintln!("{module} -> {}", targets.join(", "));
        }
    }
    // The scan sees the imports at all: the remote gang drives the host parts.
    assert!(graph.edges["cluster::remote_gang"].contains("cluster::host_part"));
    let on_path: Vec<Vec<String>> = (graph.cycles().into_iter())
        .filter(|cycle| cycle.iter().any(|m| JOB_PATH.iter().any(|scope| under(m, scope))))
        .collect();
    assert!(
        on_path.is_empty(),
        "import cycles through the job path: {on_path:?}"
    );
}

#[test]
fn the_fabric_imports_nothing_of_the_collectives() {
    let graph = ModuleGraph::of_crate(&crate_src("actors"));
    assert!(
        graph.edges["collectives"].contains("fabric"),
        "the collectives build on the fabric"
    );
    for module in graph.edges.keys().filter(|m| under(m, "fabric")) {
        let chain = graph.path_to(module, "collectives");
        assert!(chain.is_none(), "the fabric reaches the collectives: {chain:?}");
    }
}

/// The negative controls: on tiny crates, a cycle (through a use group, `super`, a path in code
/// and a re-export) and a chain from the fabric to the collectives are found; paths in comments
/// and strings are not imports.
#[test]
fn the_checks_find_a_cycle_and_a_forbidden_chain_in_synthetic_crates() {
    let source = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(m, s)| (m.to_string(), s.to_string()))
            .collect()
    };
    let cyclic = ModuleGraph::from_sources(&source(&[
        ("", "mod a; mod b; mod c; pub use a::Thing;"),
        ("a", "use crate::{b::{self, B}, x};\npub struct Thing;"),
        ("b", "fn f() { super::c::g(); }"),
        (
            "c",
            "// use crate::a;\nfn g() { let s = \"crate::a::Thing\"; let _ = crate::Thing; }",
        ),
    ]));
    assert_eq!(
        cyclic.cycles(),
        vec![vec!["a".to_string(), "b".into(), "c".into()]]
    );
    let acyclic = ModuleGraph::from_sources(&source(&[
        ("", "mod a; mod b; mod c;"),
        ("a", "use crate::b::B;"),
        ("b", "fn f() { super::c::g(); }"),
        (
            "c",
            "// use crate::a;\nfn g() { let s = \"crate::a::Thing\"; let l: &'static str = r#\"crate::a\"#; }",
        ),
    ]));
    assert!(acyclic.cycles().is_empty(), "{:?}", acyclic.edges);
    let through_another = ModuleGraph::from_sources(&source(&[
        ("", "mod fabric; mod collectives; mod other;"),
        ("fabric", "mod inner { use crate::other::Z; }"),
        ("other", "pub fn z() { crate::collectives::all_reduce(); }"),
        ("collectives", "use crate::fabric::Fabric;"),
    ]));
    let chain = through_another.path_to("fabric", "collectives");
    assert_eq!(
        chain,
        Some(vec!["fabric".into(), "other".into(), "collectives".into()])
    );
    let layered = ModuleGraph::from_sources(&source(&[
        ("", "mod fabric; mod collectives; mod other;"),
        ("fabric", "use crate::other::Z; // crate::collectives\n"),
        ("other", "pub struct Z;"),
        ("collectives", "use crate::fabric::Fabric;"),
    ]));
    assert_eq!(layered.path_to("fabric", "collectives"), None);
    assert!(layered.path_to("collectives", "other").is_some());
}
