//! Device specifications: `cpu:N` (a core's worth of work) or `cuda:N`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// One compute device on a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceSpec {
    /// A CPU core's worth of work, run by one actor thread.
    Cpu(u32),
    /// An NVIDIA GPU by ordinal.
    Cuda(u32),
}

impl DeviceSpec {
    /// `n` CPU devices `cpu:0 .. cpu:n-1`.
    pub fn cpus(n: usize) -> Vec<DeviceSpec> {
        (0..n as u32).map(DeviceSpec::Cpu).collect()
    }

    /// The GPU ordinal of `cuda:N`; None for a CPU device.
    pub fn cuda_ordinal(self) -> Option<u32> {
        match self {
            DeviceSpec::Cuda(n) => Some(n),
            DeviceSpec::Cpu(_) => None,
        }
    }

    /// Parses a comma-separated list such as `cpu:0,cpu:1`.
    pub fn parse_list(s: &str) -> Result<Vec<DeviceSpec>, PlanError> {
        s.split(',').map(|d| d.trim().parse()).collect()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu(n) => write!(f, "cpu:{n}"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || PlanError::BadDevice(s.to_string());
        let (kind, index) = s.split_once(':').ok_or_else(bad)?;
        let index: u32 = index.parse().map_err(|_| bad())?;
        match kind {
            "cpu" => Ok(DeviceSpec::Cpu(index)),
            "cuda" => Ok(DeviceSpec::Cuda(index)),
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let list = DeviceSpec::parse_list("cpu:0, cuda:3").unwrap();
        assert_eq!(list, vec![DeviceSpec::Cpu(0), DeviceSpec::Cuda(3)]);
        assert_eq!(list[1].to_string(), "cuda:3");
        assert!("gpu:1".parse::<DeviceSpec>().is_err());
        assert!("cpu:x".parse::<DeviceSpec>().is_err());
    }
}
