//! A cluster for the tests: a controller served on 127.0.0.1 by this test process, and host
//! processes of an example's own binary (`ARCHIPELAGO_ROLE=host`), as `examples/multi_host.sh`
//! starts them; drivers connect to it with [`TestCluster::connect`] (or run as processes of the
//! same binary, given the controller's address and a file holding [`TOKEN`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use archipelago_controller::cluster::service::{ClusterConfig, serve_controller};
use archipelago_controller::prelude::*;
use archipelago_controller::runtime::{
    CONTROLLER_ENV, DEVICES_ENV, HOST_NAME_ENV, ISLAND_ENV, ROLE_ENV, TOKEN_FILE_ENV, connect,
};

/// The cluster token.
pub const TOKEN: &str = "cluster-secret";

/// A controller and its host processes; dropping it kills the hosts, then the controller.
pub struct TestCluster {
    /// The host processes, by name.
    pub hosts: Vec<(String, Child)>,
    /// The controller's address.
    pub addr: String,
    _controller: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

/// The binary of example `name` (cargo builds the examples beside the tests).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    profile_dir.join("examples").join(name)
}

impl TestCluster {
    /// A controller (hosts lost after 2 s of silence; a driver's request for more devices than
    /// registered refused after 6 s) and one host process of example `example` per name in
    /// `hosts`, each offering `devices` (e.g. `cpu:0,cpu:1`) on island `island-a`.
    pub fn start(example: &str, hosts: &[&str], devices: &str) -> TestCluster {
        let binary = example_binary(example);
        assert!(binary.exists(), "{} is built by `cargo test`", binary.display());
        TestCluster::start_binary(&binary, hosts, devices, &[])
    }

    /// [`TestCluster::start`] with hosts of any program's `binary`, each also given `env`.
    pub fn start_binary(binary: &Path, hosts: &[&str], devices: &str, env: &[(&str, &str)]) -> TestCluster {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, TOKEN).unwrap();
        let controller = tokio::runtime::Runtime::new().unwrap();
        let config = ClusterConfig {
            host_timeout: Duration::from_secs(2),
            wait_for_hosts: Duration::from_secs(6),
            dashboard: None,
        };
        let (addr, _registry) = controller
            .block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                serve_controller(listener, &TOKEN.into(), config)
            })
            .unwrap();
        let hosts = hosts
            .iter()
            .map(|name| {
                let child = Command::new(binary)
                    .envs(env.iter().copied())
                    .env(ROLE_ENV, "host")
                    .env(CONTROLLER_ENV, addr.to_string())
                    .env(TOKEN_FILE_ENV, &token_file)
                    .env(DEVICES_ENV, devices)
                    .env(HOST_NAME_ENV, name)
                    .env(ISLAND_ENV, "island-a")
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot start host {name} ({}): {e}", binary.display()));
                (name.to_string(), child)
            })
            .collect();
        TestCluster {
            hosts,
            addr: addr.to_string(),
            _controller: controller,
            _dir: dir,
        }
    }

    /// A driver's runtime on the cluster, once it offers `devices` devices.
    pub fn connect(&self, devices: usize) -> Runtime {
        connect(&self.addr, TOKEN, devices).unwrap()
    }

    /// SIGKILLs the host named `name`.
    pub fn kill(&mut self, name: &str) {
        let (_, child) = self.hosts.iter_mut().find(|(n, _)| n == name).unwrap();
        child.kill().unwrap();
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.hosts {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
