//! The Kubernetes manifests of `examples/k8s/` cannot drift from the binary: every container's
//! command line (with `$(VAR)` filled as the kubelet would) parses with the binary's own
//! argument parser; every container port is one its flags make it listen on; every probe is an
//! `archipelago health` call the parser accepts, on the port of the container's `--health` and a
//! path the endpoint serves; every Service port reaches a container port of the pods it
//! selects; hosts and clients dial a Service port that reaches the controller's `--listen`; the
//! token file and the TLS files lie in mounted Secrets. A broken copy of the manifests must fail the check.

use std::collections::BTreeMap;
use std::path::Path;

use clap::Parser;
use yaml_rust2::{Yaml, YamlLoader};

use archipelago_controller::cli::{Cli, Command};
use archipelago_controller::cluster::health::PATHS;

/// Values the kubelet would put in `$(VAR)` for a pod (fieldRef'd downward API values).
fn sample(var: &str) -> &'static str {
    match var {
        "POD_NAME" => "archipelago-host-0",
        "POD_IP" => "10.1.2.3",
        "NODE_NAME" => "node-a",
        "POD_NAMESPACE" => "default",
        _ => "",
    }
}

/// One container of a workload, as the check needs it.
struct Container {
    workload: String,
    labels: BTreeMap<String, String>,
    argv: Vec<String>,
    ports: Vec<i64>,
    probes: Vec<Vec<String>>,
    mounts: Vec<String>,
    env: Vec<String>,
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .map(|s| s.as_str().map(String::from).unwrap_or_else(|| format!("{s:?}")))
                .collect()
        })
        .unwrap_or_default()
}

fn expand(arg: &str, env: &[String]) -> Result<String, String> {
    let mut out = arg.to_string();
    while let Some(start) = out.find("$(") {
        let end = out[start..].find(')').ok_or(format!("unclosed $( in {arg}"))? + start;
        let var = out[start + 2..end].to_string();
        if !env.contains(&var) {
            return Err(format!("{arg}: $({var}) is not in the container's env"));
        }
        out.replace_range(start..=end, sample(&var));
    }
    Ok(out)
}

fn containers(docs: &[Yaml]) -> Vec<Container> {
    let mut all = Vec::new();
    for doc in docs {
        let pod = &doc["spec"]["template"];
        if pod.is_badvalue() {
            continue;
        }
        let labels = pod["metadata"]["labels"]
            .as_hash()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.as_str().unwrap().to_string(), v.as_str().unwrap().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        for c in pod["spec"]["containers"].as_vec().unwrap() {
            let env: Vec<String> = c["env"]
                .as_vec()
                .map(|e| {
                    e.iter()
                        .map(|v| v["name"].as_str().unwrap().to_string())
                        .collect()
                })
                .unwrap_or_default();
            let mut argv = strings(&c["command"]);
            argv.extend(strings(&c["args"]));
            let probes = ["readinessProbe", "livenessProbe", "startupProbe"]
                .iter()
                .filter(|p| !c[**p].is_badvalue())
                .map(|p| strings(&c[*p]["exec"]["command"]))
                .collect();
            all.push(Container {
                workload: doc["metadata"]["name"].as_str().unwrap().to_string(),
                labels: BTreeMap::clone(&labels),
                argv,
                ports: c["ports"]
                    .as_vec()
                    .map(|p| p.iter().filter_map(|p| p["containerPort"].as_i64()).collect())
                    .unwrap_or_default(),
                probes,
                mounts: c["volumeMounts"]
                    .as_vec()
                    .map(|m| {
                        m.iter()
                            .map(|m| m["mountPath"].as_str().unwrap().to_string())
                            .collect()
                    })
                    .unwrap_or_default(),
                env,
            });
        }
    }
    all
}

fn port_of(addr: &str) -> Option<i64> {
    addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// The check: `Ok` when the manifests agree with the binary, the first disagreement otherwise.
fn check(docs: &[Yaml]) -> Result<(), String> {
    let services: Vec<(String, BTreeMap<String, String>, Vec<i64>)> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some("Service"))
        .map(|d| {
            let selector = d["spec"]["selector"]
                .as_hash()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.as_str().unwrap().to_string(), v.as_str().unwrap().to_string()))
                .collect();
            let ports = d["spec"]["ports"]
                .as_vec()
                .unwrap()
                .iter()
                .map(|p| p["targetPort"].as_i64().or(p["port"].as_i64()).unwrap())
                .collect();
            (
                d["metadata"]["name"].as_str().unwrap().to_string(),
                selector,
                ports,
            )
        })
        .collect();
    let all = containers(docs);
    let selects = |selector: &BTreeMap<String, String>, c: &Container| {
        selector.iter().all(|(k, v)| c.labels.get(k) == Some(v))
    };
    let mut parsed = Vec::new();
    for c in &all {
        let argv: Vec<String> = c
            .argv
            .iter()
            .map(|a| expand(a, &c.env))
            .collect::<Result<_, _>>()?;
        let cli = Cli::try_parse_from(&argv)
            .map_err(|e| format!("{}: {argv:?} does not parse: {e}", c.workload))?;
        parsed.push((c, cli));
    }
    // The controller's --listen port, for the Services that reach it.
    let mut controller_ports = Vec::new();
    for (c, cli) in &parsed {
        let c: &Container = c;
        let tls = match &cli.command {
            Command::Controller(a) => Some(&a.tls),
            Command::Host(a) => Some(&a.tls),
            Command::Train(a) => Some(&a.tls),
            _ => None,
        };
        for file in tls
            .iter()
            .flat_map(|t| [&t.tls_cert, &t.tls_key, &t.tls_ca])
            .flatten()
        {
            if !c.mounts.iter().any(|m| file.starts_with(m)) {
                return Err(format!(
                    "{}: the TLS file {} is in no mounted volume",
                    c.workload,
                    file.display()
                ));
            }
        }
        let (listening, token_file, health): (Vec<i64>, Option<&Path>, Option<i64>) = match &cli.command {
            Command::Controller(a) => {
                let port =
                    port_of(&a.listen).ok_or(format!("{}: --listen {} has no port", c.workload, a.listen))?;
                controller_ports.push((c, port));
                let health = a.health.as_deref().and_then(port_of);
                (vec![port], Some(a.token_file.as_path()), health)
            }
            Command::Host(a) => (
                port_of(&a.fabric_listen).into_iter().collect(),
                Some(a.token_file.as_path()),
                None,
            ),
            Command::Train(a) => (Vec::new(), a.token_file.as_deref(), None),
            other => return Err(format!("{}: unexpected subcommand {other:?}", c.workload)),
        };
        for port in &c.ports {
            if !listening.contains(port) {
                return Err(format!(
                    "{}: containerPort {port} is none the flags listen on ({listening:?})",
                    c.workload
                ));
            }
        }
        if let Some(file) = token_file
            && !c.mounts.iter().any(|m| file.starts_with(m))
        {
            return Err(format!(
                "{}: the token file {} is in no mounted volume",
                c.workload,
                file.display()
            ));
        }
        for probe in &c.probes {
            let parsed =
                Cli::try_parse_from(probe).map_err(|e| format!("{}: probe {probe:?}: {e}", c.workload))?;
            let Command::Health(h) = parsed.command else {
                return Err(format!(
                    "{}: probe {probe:?} is not `archipelago health`",
                    c.workload
                ));
            };
            let rest = h.url.strip_prefix("http://127.0.0.1:").ok_or(format!(
                "{}: probe URL {} is not the pod's loopback",
                c.workload, h.url
            ))?;
            let (port, path) = rest.split_once('/').unwrap_or((rest, ""));
            if Some(port.parse::<i64>().unwrap_or(-1)) != health {
                return Err(format!(
                    "{}: probe port {port} is not --health's ({health:?})",
                    c.workload
                ));
            }
            if !PATHS.contains(&format!("/{path}").as_str()) {
                return Err(format!(
                    "{}: probe path /{path} is not served ({PATHS:?})",
                    c.workload
                ));
            }
        }
    }
    for (name, selector, ports) in &services {
        for port in ports {
            if !all.iter().any(|c| selects(selector, c) && c.ports.contains(port)) {
                return Err(format!(
                    "Service {name}: port {port} reaches no container port of the pods it selects"
                ));
            }
        }
    }
    // Hosts and clients dial `SERVICE:PORT` of a Service that reaches the controller's --listen.
    for (c, cli) in &parsed {
        let dialled = match &cli.command {
            Command::Host(a) => Some(a.controller.clone()),
            Command::Train(a) => a.controller.clone(),
            _ => None,
        };
        if let Some(addr) = dialled {
            let (service, port) = addr
                .rsplit_once(':')
                .ok_or(format!("{}: --controller {addr} has no port", c.workload))?;
            let port: i64 = port
                .parse()
                .map_err(|_| format!("{}: --controller {addr}", c.workload))?;
            let reaches = services.iter().any(|(name, selector, ports)| {
                name == service
                    && ports.contains(&port)
                    && controller_ports
                        .iter()
                        .any(|(ctl, p)| selects(selector, ctl) && *p == port)
            });
            if !reaches {
                return Err(format!(
                    "{}: --controller {addr} reaches no controller",
                    c.workload
                ));
            }
        }
    }
    Ok(())
}

fn manifests() -> Vec<Yaml> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/k8s");
    let mut docs = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "manifests in {}: {files:?}", dir.display());
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        docs.extend(YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display())));
    }
    docs
}

#[test]
fn the_kubernetes_manifests_agree_with_the_binary() {
    let docs = manifests();
    check(&docs).unwrap();
    let workloads = containers(&docs).len();
    assert_eq!(workloads, 3, "controller, hosts and the training job");
}

/// Negative controls: each drift the check exists for is caught.
#[test]
fn a_drifted_manifest_fails_the_check() {
    let text: String = ["controller.yaml", "hosts.yaml", "train-job.yaml"]
        .iter()
        .map(|f| {
            std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../examples/k8s")
                    .join(f),
            )
            .unwrap()
                + "\n---\n"
        })
        .collect();
    for (from, to, what) in [
        ("127.0.0.1:7071/readyz", "127.0.0.1:7071/ready", "a probe path"),
        ("- 127.0.0.1:7071\n", "- 127.0.0.1:7079\n", "the health port"),
        ("- --fabric-listen", "- --fabric-port", "an unknown flag"),
        (
            "- archipelago-controller:7070",
            "- archipelago-control:7070",
            "the controller's Service",
        ),
        ("containerPort: 7072", "containerPort: 7073", "a container port"),
        (".$(POD_NAMESPACE)", ".$(MY_NAMESPACE)", "an unset variable"),
        (
            "- /etc/archipelago/tls/ca.pem",
            "- /etc/other/ca.pem",
            "a TLS file outside the Secret",
        ),
    ] {
        assert!(text.contains(from), "{what}: `{from}` not in the manifests");
        let broken = YamlLoader::load_from_str(&text.replacen(from, to, 1)).unwrap();
        assert!(check(&broken).is_err(), "{what} drifted and the check passed");
    }
}
