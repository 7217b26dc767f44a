//! What one step did (traffic, waits, memory), and how the budget is divided.

use crate::policy::ScheduleOutcome;

/// Statistics of one step (between `begin_step` and `end_step`), also logged through `tracing`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Steps ended so far on this device, this one included.
    pub step: u64,
    /// Whether the step recorded, replayed or diverged from the schedule.
    pub schedule: ScheduleOutcome,
    /// Weight uses by the intercepted linear ops.
    pub weight_uses: u64,
    /// Uses served by a slot the loader had filled ahead of time.
    pub prefetched: u64,
    /// Of the prefetched uses, those whose weight the loader had also decoded ahead of the op
    /// ([`StreamTarget::prepare`](crate::StreamTarget::prepare)).
    pub prepared: u64,
    /// Uses whose weight the compute thread fetched itself into a slot (recording step, order
    /// changed, or a policy without lookahead).
    pub on_demand: u64,
    /// Uses served by a copy kept on the device since the weight's previous use
    /// ([`OffloadConfig::retain_window`](crate::OffloadConfig::retain_window)).
    pub kept: u64,
    /// Uses of small weights uploaded by the direct path.
    pub direct: u64,
    /// Uses of resident weights.
    pub resident_hits: u64,
    /// Streamed weights met by an op other than the intercepted ones, and materialized.
    pub materialized: u64,
    /// Bytes uploaded for those materializations.
    pub materialized_bytes: u64,
    /// Bytes moved from host to device (ring, direct path, residency, materializations).
    pub bytes_uploaded: u64,
    /// Seconds spent uploading, on the loader thread and on the compute thread.
    pub upload_seconds: f64,
    /// Seconds the compute thread spent waiting for weights: for the loader to fill a slot,
    /// for a slot to be freed, and for its own uploads. On an asynchronous device (CUDA) this
    /// is host time: the device usually still has queued work then, so a host wait is not device
    /// idle time. The exposed transfer shows in the step time against a resident run.
    pub wait_seconds: f64,
    /// Fences the compute thread took to free released ring slots, each freeing every slot
    /// released before it.
    pub fences: u64,
    /// Seconds the compute thread spent taking those fences (on CUDA, a round trip to
    /// CubeCL's device thread each).
    pub fence_seconds: f64,
    /// Seconds spent reading the device memory in use (at both ends of the step, and at every
    /// weight use of a recording step, every 16th of a replayed one).
    pub memory_read_seconds: f64,
    /// Seconds the compute thread spent making the tensors that read ring slots (an FP8
    /// weight's decode is queued there, unless the loader [`prepared`](Self::prepared) it).
    pub view_seconds: f64,
    /// Seconds from `begin_step` to `end_step`.
    pub step_seconds: f64,
    /// Bytes of the weights kept resident.
    pub resident_bytes: u64,
    /// Bytes of the ring.
    pub ring_bytes: u64,
    /// Highest device memory in use seen during the step, where the backend reports it.
    pub peak_device_bytes: Option<u64>,
    /// Highest device memory in use during the step beyond the engine's own weight memory at
    /// that moment (resident copies, the ring, a weight being uploaded): what the step needed
    /// for everything else. Sampled with [`StepStats::peak_device_bytes`].
    pub peak_beyond_weights: Option<u64>,
    /// Highest memory the backend's allocator had handed out beyond the engine's weight memory,
    /// sampled with [`StepStats::peak_beyond_weights`] where the backend reports both (not with
    /// a probe): the live tensors, without the pages the allocator keeps in reserve.
    pub peak_handed_out_beyond_weights: Option<u64>,
    /// The bytes in the allocator's pages for the compute thread at the step's end
    /// ([`StreamTarget::memory_pooled`](crate::StreamTarget::memory_pooled)), weights included.
    pub pooled_bytes: Option<u64>,
}

/// How the VRAM budget is divided by the plan in force.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The budget (`OffloadConfig::vram_budget`).
    pub vram_budget: u64,
    /// The part reserved for what is not weights (`OffloadConfig::activation_headroom`).
    pub activation_headroom: u64,
    /// The part left free of weights beside the headroom (`OffloadConfig::margin`).
    pub margin: u64,
    /// Weights kept on the device.
    pub resident_weights: usize,
    /// Their bytes on the device.
    pub resident_bytes: u64,
    /// Weights streamed from host memory (through the ring or the direct path).
    pub streamed_weights: usize,
    /// Bytes of the ring the plan needs.
    pub ring_bytes: u64,
    /// The most bytes of streamed weights kept on the device between two uses at once.
    pub retained_bytes: u64,
}

impl StepStats {
    /// Upload bandwidth in GB/s: bytes uploaded over the time spent uploading them.
    pub fn upload_gbps(&self) -> f64 {
        if self.upload_seconds > 0.0 {
            self.bytes_uploaded as f64 / self.upload_seconds / 1e9
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_follow_the_counters() {
        let stats = StepStats {
            bytes_uploaded: 5_000_000_000,
            upload_seconds: 0.1,
            ..Default::default()
        };
        assert!((stats.upload_gbps() - 50.0).abs() < 1e-9);
        assert_eq!(StepStats::default().upload_gbps(), 0.0);
    }
}
