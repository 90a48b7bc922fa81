//! What the shard process uses, sampled every few seconds and sent to the coordinator
//! (`ShardMsg::Stats`), which exports it: resident memory from `/proc/self/status`, and
//! on a GPU the device's utilization, memory, temperature and power through NVML.
//!
//! NVML is optional: without the library (no NVIDIA driver, a CPU host), or where a query
//! fails, the GPU figures are simply absent; it is said once in the log, never an error.

use std::time::Duration;

use tessera_comm::proto::{ShardMsg, ShardStats};
use tokio::sync::mpsc::UnboundedSender;

/// How often the stats are sent.
pub const STATS_EVERY: Duration = Duration::from_secs(5);

/// Samples this process's stats.
pub struct StatsSampler {
    #[cfg(feature = "cuda")]
    gpu: Option<nvml::Gpu>,
}

impl std::fmt::Debug for StatsSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(feature = "cuda")]
        let gpu = self.gpu.as_ref().map(|g| g.pci_bus_id.as_str());
        #[cfg(not(feature = "cuda"))]
        let gpu: Option<&str> = None;
        f.debug_struct("StatsSampler").field("gpu", &gpu).finish()
    }
}

impl StatsSampler {
    /// A sampler for a CPU shard.
    pub fn cpu() -> StatsSampler {
        StatsSampler {
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// A sampler for a shard on `device`, with NVML where it loads.
    #[cfg(feature = "cuda")]
    pub fn cuda(device: &tessera_kernels::cuda::CudaDevice) -> StatsSampler {
        StatsSampler {
            gpu: nvml::Gpu::open(device),
        }
    }

    pub fn sample(&self) -> ShardStats {
        ShardStats {
            rss_bytes: resident_bytes().unwrap_or(0),
            #[cfg(feature = "cuda")]
            gpu: self.gpu.as_ref().and_then(nvml::Gpu::sample),
            #[cfg(not(feature = "cuda"))]
            gpu: None,
        }
    }
}

/// Sends `sampler`'s stats into `events` every [`STATS_EVERY`] until the channel closes.
pub async fn report(sampler: StatsSampler, events: UnboundedSender<ShardMsg>) {
    let mut every = tokio::time::interval(STATS_EVERY);
    loop {
        every.tick().await;
        if events.send(ShardMsg::Stats(sampler.sample())).is_err() {
            return;
        }
    }
}

/// This process's resident memory: `VmRSS` of `/proc/self/status`.
fn resident_bytes() -> Option<u64> {
    resident_from_status(&std::fs::read_to_string("/proc/self/status").ok()?)
}

fn resident_from_status(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line["VmRSS:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib * 1024)
}

#[cfg(feature = "cuda")]
mod nvml {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
    use tessera_comm::proto::GpuStats;
    use tessera_kernels::cuda::CudaDevice;
    use tracing::{info, warn};

    /// NVML, and the PCI address of this shard's GPU.
    pub struct Gpu {
        nvml: Nvml,
        pub(super) pci_bus_id: String,
    }

    impl Gpu {
        pub fn open(device: &CudaDevice) -> Option<Gpu> {
            let Some(pci_bus_id) = device.pci_bus_id() else {
                info!("the GPU's PCI address is unknown: no GPU metrics");
                return None;
            };
            match Nvml::init() {
                Ok(nvml) => Some(Gpu { nvml, pci_bus_id }),
                Err(error) => {
                    info!(%error, "NVML is not available: no GPU metrics");
                    None
                }
            }
        }

        pub fn sample(&self) -> Option<GpuStats> {
            let read = || -> Result<GpuStats, nvml_wrapper::error::NvmlError> {
                let device = self.nvml.device_by_pci_bus_id(self.pci_bus_id.as_str())?;
                let memory = device.memory_info()?;
                Ok(GpuStats {
                    utilization: device.utilization_rates()?.gpu as f32 / 100.0,
                    memory_used_bytes: memory.used,
                    memory_total_bytes: memory.total,
                    temperature_celsius: device.temperature(TemperatureSensor::Gpu)? as f32,
                    power_watts: device.power_usage()? as f32 / 1000.0,
                })
            };
            read()
                .inspect_err(|error| warn!(%error, pci = %self.pci_bus_id, "reading NVML"))
                .ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_gives_the_resident_set_in_bytes() {
        let status = "Name:\ttessera-shard\nVmPeak:\t  900 kB\nVmRSS:\t   250 kB\nThreads:\t4\n";
        assert_eq!(resident_from_status(status), Some(250 * 1024));
        assert_eq!(resident_from_status("VmRSS:\t250 MB\n"), None);
        assert_eq!(resident_from_status("Name:\tx\n"), None);
    }

    #[test]
    fn a_cpu_sampler_reads_this_process_and_no_gpu() {
        let stats = StatsSampler::cpu().sample();
        assert!(stats.rss_bytes > 1 << 20, "{stats:?}");
        assert_eq!(stats.gpu, None);
    }
}
