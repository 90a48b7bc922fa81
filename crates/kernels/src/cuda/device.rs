//! A CUDA device opened for a shard: its context, and every kernel compiled for its
//! compute capability and loaded.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::CudaError;
use super::compile::PtxCache;
use super::source::FAMILIES;

/// One GPU with the kernels loaded.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    name: String,
    capability: (i32, i32),
    total_memory: usize,
    multiprocessors: usize,
    functions: HashMap<&'static str, CudaFunction>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("capability", &self.capability)
            .field("total_memory", &self.total_memory)
            .field("multiprocessors", &self.multiprocessors)
            .field("kernels", &self.functions.len())
            .finish()
    }
}

/// Whether libcuda (the driver) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl CudaDevice {
    /// Opens device `ordinal` and loads every kernel family, compiled (or read from
    /// `cache`) for its compute capability. Fails with [`CudaError::NoDriver`] or
    /// [`CudaError::NoNvrtc`] where the libraries are missing.
    pub fn open(ordinal: usize, cache: &PtxCache) -> Result<CudaDevice, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let failed = |message: String| CudaError::Device { ordinal, message };
        let ctx = CudaContext::new(ordinal).map_err(|e| failed(e.to_string()))?;
        // SAFETY: Tessera runs each model's work on one stream of its own (kernels, cuBLAS,
        // copies and NCCL alike), and no buffer is shared between streams, so cudarc's
        // cross-stream events are not needed; without them a stream can be captured into
        // a CUDA graph (a capture may not wait on events recorded outside it).
        unsafe { ctx.disable_event_tracking() };
        let capability = ctx
            .compute_capability()
            .map_err(|e| failed(e.to_string()))?;
        let name = ctx.name().map_err(|e| failed(e.to_string()))?;
        let total_memory = ctx.total_mem().map_err(|e| failed(e.to_string()))?;
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| failed(format!("querying the multiprocessor count: {e}")))?;
        let arch = format!("compute_{}{}", capability.0, capability.1);
        let mut functions = HashMap::new();
        for family in FAMILIES {
            let ptx = cache.get_or_compile(family, &arch)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| failed(format!("loading {}: {e}", family.file)))?;
            for entry in family.entries {
                let function = module
                    .load_function(entry)
                    .map_err(|e| failed(format!("{entry}: {e}")))?;
                functions.insert(*entry, function);
            }
        }
        Ok(CudaDevice {
            ordinal,
            ctx,
            name,
            capability,
            total_memory,
            multiprocessors: usize::try_from(multiprocessors).unwrap_or(1).max(1),
            functions,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's product name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) compute capability.
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    pub fn total_memory(&self) -> usize {
        self.total_memory
    }

    /// Streaming multiprocessors (what the grouped attention kernel's split aims to fill).
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// Bytes of device memory free now (all processes on the device count).
    pub fn free_memory(&self) -> Result<usize, CudaError> {
        self.ctx
            .mem_get_info()
            .map(|(free, _total)| free)
            .map_err(|e| CudaError::Device {
                ordinal: self.ordinal,
                message: format!("querying free memory: {e}"),
            })
    }

    /// Peak memory bandwidth in bytes per second, from the memory clock and bus width the
    /// driver reports (double data rate); `None` where it reports neither.
    pub fn peak_bandwidth(&self) -> Option<f64> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let clock_khz = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
            .ok()?;
        let bus_bits = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
            .ok()?;
        (clock_khz > 0 && bus_bits > 0)
            .then(|| 2.0 * f64::from(clock_khz) * 1e3 * f64::from(bus_bits) / 8.0)
    }

    /// The device's PCI address, `domain:bus:device.0` in hex (as NVML names devices,
    /// whatever `CUDA_VISIBLE_DEVICES` renumbers); `None` where the driver reports none.
    pub fn pci_bus_id(&self) -> Option<String> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let get = |a| self.ctx.attribute(a).ok();
        let domain = get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
        let bus = get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
        let device = get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
        Some(format!("{domain:08x}:{bus:02x}:{device:02x}.0"))
    }

    /// Kernel `entry` of one of the families.
    pub fn function(&self, entry: &str) -> Option<&CudaFunction> {
        self.functions.get(entry)
    }
}
