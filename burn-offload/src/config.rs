//! The engine's configuration: VRAM budget, ring, direct path, wire format, cost model.

use crate::error::OffloadError;

/// How a streamed weight's bytes are encoded in host memory and on the bus.
///
/// Whatever the wire format, the weight reaches the compute in its parameter's own dtype. Weights
/// smaller than [`OffloadConfig::direct_threshold`] always travel as [`WireFormat::Native`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// The parameter's own dtype (bf16 in production), byte for byte: results are bit-identical
    /// to a resident model.
    Native,
    /// bfloat16: half the bytes of an f32 parameter, decoded back to f32 on the device (the
    /// same as `Native` for a bf16 parameter).
    Bf16,
    /// FP8 E5M2 codes with one scale per block of 64 values (burn-quant), dequantized on the
    /// device: half the bytes of bf16, wide range, 2 mantissa bits.
    E5M2,
    /// FP8 E4M3 codes with one scale per block of 64 values, dequantized on the device: half
    /// the bytes of bf16, 3 mantissa bits.
    E4M3,
}

/// Configuration of the engine of one device.
///
/// The planner keeps weights resident while `vram_budget - activation_headroom` holds them
/// together with the ring (`ring_slots` slots as large as the largest streamed weight, leaving
/// out one more than `ring_slots` times the next smaller: that one is uploaded on its own at its
/// use); the rest stream. Which weights stay is chosen from the cost model (`link_bytes_per_second`,
/// `compute_flops_per_second`): those whose transfer the compute cannot hide come first.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadConfig {
    /// Device bytes the process may use: resident weights, the ring and the activation
    /// headroom. 0 streams every weight (the ring is then the only weight memory, and bounded
    /// by nothing).
    pub vram_budget: u64,
    /// Bytes of `vram_budget` reserved for what is not weights (activations, adapters,
    /// gradients, optimizer state, workspace), as a caller measured it
    /// ([`MemoryMeasurement`](crate::MemoryMeasurement)); the engine plans the weights within
    /// the rest. 0 reserves nothing: the budget then bounds the weights alone.
    pub activation_headroom: u64,
    /// Bytes of `vram_budget` beside the headroom that the planner leaves free of resident and
    /// kept weights, for what later steps may need beyond the measured headroom. It never makes
    /// the budget too small for the headroom: it only keeps fewer weights on the device.
    pub margin: u64,
    /// Device buffers in the ring (at least 2: one is read while the next is filled). Where
    /// the budget cannot hold them beside the activation headroom with every weight streamed,
    /// the engine keeps fewer, down to 2.
    pub ring_slots: usize,
    /// Weights whose wire payload is smaller than this many bytes are uploaded on demand into a
    /// buffer of their own instead of going through the ring.
    pub direct_threshold: u64,
    /// Encoding of streamed weights on the bus.
    pub wire: WireFormat,
    /// Host-to-device bandwidth the planner assumes (bytes per second).
    pub link_bytes_per_second: f64,
    /// Compute throughput the planner assumes for the linear ops (FLOP per second).
    pub compute_flops_per_second: f64,
    /// A streamed weight, or a compact resident one, used again at most this many uses later
    /// stays on the device decoded in between (a copy of its own, within the budget): a
    /// checkpointed block's recompute is followed by its backward, which uses the same weights
    /// in reverse. 0 keeps nothing.
    pub retain_window: usize,
    /// Every this many weight uses, the compute thread hands the free pages of its allocator
    /// back to the device's memory pool (0: never). The allocator keeps freed pages per size
    /// class, so what one part of a step freed waits unused while another part allocates other
    /// sizes; handed back, the memory serves any size.
    pub release_pages_every: u64,
    /// The loader thread decodes each prefetched weight sent in another format than its dtype
    /// (FP8, bfloat16 for f32) ahead of its use, on its own stream, so that the compute stream
    /// and thread run no decode; each ring slot then also holds its decoded weight until the
    /// slot is filled again. Off: the compute decodes at each use.
    pub decode_ahead: bool,
    /// Debug mode: overwrite a slot with NaN as soon as it may be reused, so that a read of a
    /// released weight shows up as NaN instead of silently reading another weight.
    pub poison_released_slots: bool,
}

impl Default for OffloadConfig {
    /// Budget 0 (everything streams), 3 slots, a 1 MiB direct threshold, native wire format,
    /// a retain window of 32 uses (a block of up to 16 streamed weights between its recompute
    /// and its backward), free pages handed back every 8 weight uses, decoding at each use, and
    /// the rates measured on an H200: 55 GB/s pinned upload, 200 TFLOP/s for Burn's bf16
    /// matmul.
    fn default() -> Self {
        Self {
            vram_budget: 0,
            activation_headroom: 0,
            margin: 0,
            ring_slots: 3,
            direct_threshold: 1 << 20,
            wire: WireFormat::Native,
            link_bytes_per_second: 55e9,
            compute_flops_per_second: 200e12,
            retain_window: 32,
            release_pages_every: 8,
            decode_ahead: false,
            poison_released_slots: false,
        }
    }
}

impl OffloadConfig {
    /// Sets [`OffloadConfig::vram_budget`].
    pub fn with_vram_budget(mut self, bytes: u64) -> Self {
        self.vram_budget = bytes;
        self
    }

    /// Sets [`OffloadConfig::activation_headroom`].
    pub fn with_activation_headroom(mut self, bytes: u64) -> Self {
        self.activation_headroom = bytes;
        self
    }

    /// Sets [`OffloadConfig::margin`].
    pub fn with_margin(mut self, bytes: u64) -> Self {
        self.margin = bytes;
        self
    }

    /// Sets [`OffloadConfig::ring_slots`].
    pub fn with_ring_slots(mut self, slots: usize) -> Self {
        self.ring_slots = slots;
        self
    }

    /// Sets [`OffloadConfig::direct_threshold`].
    pub fn with_direct_threshold(mut self, bytes: u64) -> Self {
        self.direct_threshold = bytes;
        self
    }

    /// Sets [`OffloadConfig::wire`].
    pub fn with_wire(mut self, wire: WireFormat) -> Self {
        self.wire = wire;
        self
    }

    /// Sets [`OffloadConfig::link_bytes_per_second`] and
    /// [`OffloadConfig::compute_flops_per_second`].
    pub fn with_rates(mut self, link_bytes_per_second: f64, compute_flops_per_second: f64) -> Self {
        self.link_bytes_per_second = link_bytes_per_second;
        self.compute_flops_per_second = compute_flops_per_second;
        self
    }

    /// Sets [`OffloadConfig::retain_window`].
    pub fn with_retain_window(mut self, uses: usize) -> Self {
        self.retain_window = uses;
        self
    }

    /// Sets [`OffloadConfig::release_pages_every`].
    pub fn with_release_pages_every(mut self, uses: u64) -> Self {
        self.release_pages_every = uses;
        self
    }

    /// Sets [`OffloadConfig::decode_ahead`].
    pub fn with_decode_ahead(mut self, decode_ahead: bool) -> Self {
        self.decode_ahead = decode_ahead;
        self
    }

    /// Sets [`OffloadConfig::poison_released_slots`].
    pub fn with_poisoning(mut self, poison: bool) -> Self {
        self.poison_released_slots = poison;
        self
    }

    /// Checks the values, naming the first one at fault.
    pub fn validate(&self) -> Result<(), OffloadError> {
        if self.ring_slots < 2 {
            return Err(OffloadError::RingTooSmall {
                found: self.ring_slots,
            });
        }
        for (name, found) in [
            ("link_bytes_per_second", self.link_bytes_per_second),
            ("compute_flops_per_second", self.compute_flops_per_second),
        ] {
            if !(found.is_finite() && found > 0.0) {
                return Err(OffloadError::InvalidRate { name, found });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field_at_fault() {
        assert!(OffloadConfig::default().validate().is_ok());
        let err = OffloadConfig::default()
            .with_ring_slots(1)
            .validate()
            .unwrap_err();
        assert!(matches!(err, OffloadError::RingTooSmall { found: 1 }));
        let err = OffloadConfig::default()
            .with_rates(0.0, 1e12)
            .validate()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "link_bytes_per_second is 0, expected a positive finite number"
        );
        let err = OffloadConfig::default()
            .with_rates(1e9, f64::NAN)
            .validate()
            .unwrap_err();
        assert!(matches!(
            err,
            OffloadError::InvalidRate {
                name: "compute_flops_per_second",
                ..
            }
        ));
    }
}
