//! `archipelago devices`: what this host can offer — its CPU cores and memory, its GPUs (with a
//! `cuda` build) and their memory — as the device specs `--devices` takes.

use serde::Serialize;

use archipelago_actors::gpus::{self, Gpu};

/// Flags of `devices`.
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The devices of this host.
#[derive(Debug, Clone, Serialize)]
pub struct HostDevices {
    /// CPU cores this process may use (one `cpu:N` device each).
    pub cpu_cores: usize,
    /// The CPU's model name, where `/proc/cpuinfo` tells it.
    pub cpu_model: String,
    /// Host memory in bytes (`MemTotal`), 0 where unknown.
    pub memory_bytes: u64,
    /// The GPUs the CUDA driver sees.
    pub gpus: Vec<Gpu>,
    /// Why there are no GPUs to offer, when there are none.
    pub gpus_unavailable: Option<String>,
    /// Every device spec this host can run.
    pub specs: Vec<String>,
}

impl HostDevices {
    /// Looks at this host.
    pub fn probe() -> HostDevices {
        let cpu_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(String::new, |(_, v)| v.trim().to_string());
        let (gpus, gpus_unavailable) = match gpus::list() {
            Ok(gpus) if gpus.is_empty() => (gpus, Some("the NVIDIA driver sees no GPU".to_string())),
            Ok(gpus) => (gpus, None),
            Err(why) => (Vec::new(), Some(why)),
        };
        let specs = (0..cpu_cores)
            .map(|n| format!("cpu:{n}"))
            .chain(gpus.iter().map(|g| format!("cuda:{}", g.index)))
            .collect();
        HostDevices {
            cpu_cores,
            cpu_model,
            memory_bytes: crate::process_stats::mem_total_bytes(),
            gpus,
            gpus_unavailable,
            specs,
        }
    }

    /// The human-readable listing.
    pub fn table(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut out = format!(
            "cpu:0..cpu:{}  {} core(s){}  host memory {:.1} GiB\n",
            self.cpu_cores.saturating_sub(1),
            self.cpu_cores,
            if self.cpu_model.is_empty() {
                String::new()
            } else {
                format!(" of {}", self.cpu_model)
            },
            gib(self.memory_bytes)
        );
        for g in &self.gpus {
            out.push_str(&format!(
                "cuda:{}  {}  {:.1} GiB\n",
                g.index,
                g.name,
                gib(g.memory_bytes)
            ));
        }
        if let Some(why) = &self.gpus_unavailable {
            out.push_str(&format!("no GPUs: {why}\n"));
        }
        out
    }
}

/// Runs `archipelago devices`.
pub fn devices(args: &DevicesArgs) -> anyhow::Result<()> {
    let found = HostDevices::probe();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&found)?);
    } else {
        print!("{}", found.table());
    }
    Ok(())
}
