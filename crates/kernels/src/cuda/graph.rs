//! CUDA graphs: the launches of a closure on an [`Ops`]'s stream, captured once and
//! replayed with one launch.

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::CudaError;
use super::ops::Ops;

/// A captured sequence of launches, replayed on the stream it was captured from.
pub struct Graph {
    graph: CudaGraph,
    /// Kernels in the graph (cuBLAS calls counted one each).
    kernels: u64,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("kernels", &self.kernels)
            .finish()
    }
}

impl Graph {
    pub fn kernels(&self) -> u64 {
        self.kernels
    }
}

impl Ops<'_> {
    /// Waits for everything enqueued on this stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream()
            .synchronize()
            .map_err(|e| self.device_error("synchronizing", e))
    }

    /// Captures the launches `body` makes on this stream into a graph. `body` must only
    /// launch (no allocation, no copy to or from the host, no synchronization); the
    /// capture is ended whatever `body` returns, so the stream stays usable.
    pub fn capture<R, E: From<CudaError>>(
        &self,
        body: impl FnOnce() -> Result<R, E>,
    ) -> Result<(Graph, R), E> {
        let before = self.launches();
        self.stream()
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| self.device_error("beginning a capture", e))?;
        let out = body();
        let ended = self
            .stream()
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| self.device_error("ending a capture", e));
        let out = out?;
        let graph = ended?.ok_or(CudaError::Shape {
            what: "captured launches",
            expected: 1,
            actual: 0,
        })?;
        graph
            .upload()
            .map_err(|e| self.device_error("uploading a graph", e))?;
        let kernels = self.launches() - before;
        Ok((Graph { graph, kernels }, out))
    }

    /// Replays `graph` on this stream (one launch).
    pub fn launch_graph(&self, graph: &Graph) -> Result<(), CudaError> {
        self.count_launch();
        graph
            .graph
            .launch()
            .map_err(|e| self.device_error("launching a graph", e))
    }
}
