//! The mechanism: one engine per device owns the ring, the loader thread, the resident copies
//! and the step statistics, and executes what the policy decides.
//!
//! A slot goes `Free -> Filling -> Ready -> InUse -> Released -> Fenced -> Free`. The loader thread
//! fills slots for the uses the replayed schedule announces, up to the prefetch depth ahead of the
//! compute, and with [`OffloadConfig::decode_ahead`] prepares each weight where the backend does
//! (CUDA decodes an FP8 payload on the loader's stream, off the compute's); the compute thread
//! takes a `Ready` slot, runs its op on the prepared weight or a view of the slot and releases it
//! (a prepared weight lives until the slot's next fill, after the fence that follows the op), or,
//! when the policy's [`Retention`] says the weight is used again soon, first copies it into a
//! tensor of its own that the next use takes without a transfer (a weight resident in compact form
//! keeps its decoded copy so, and is decoded once less). A fence after the ops that read released
//! slots is taken by the compute thread (fences follow the work of the thread that takes them) once
//! half the ring is released, or at once when the loader has found no slot to fill while fewer than
//! half the slots hold weights the compute has yet to read: one fence frees every slot released
//! before it. A loader that keeps up thus gets half the ring at a time, and the compute takes one
//! round trip to the device for every half ring of uses instead of one for each. A `Fenced` slot is
//! refilled (and, in the debug mode, poisoned first) only after its fence has passed, so no op ever
//! reads a slot that was reused. When the order of uses changes, the prefetched slots are dropped
//! (a generation counter invalidates fills in flight) and the compute thread fetches on demand for
//! the rest of the step.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use burn::tensor::ops::FloatTensor;

use crate::config::OffloadConfig;
use crate::policy::{
    self, PlanLimits, Retention, Route, Schedule, ScheduleOutcome, Shortfall, Use, WeightProfile,
    ring_slot_bytes,
};
use crate::stats::{MemoryPlan, StepStats};
use crate::target::{MemoryProbe, StreamTarget};
use crate::weight::HostWeight;

/// The streaming engine of one device: streamed weights keep it alive, and its loader thread
/// stops when it is dropped.
pub struct Engine<B: StreamTarget> {
    device: B::Device,
    shared: Arc<Shared<B>>,
}

struct Shared<B: StreamTarget> {
    state: Mutex<State<B>>,
    changed: Condvar,
}

enum Slot<F> {
    Free,
    /// Released after an op that read it, before a fence was taken after that op. `order`
    /// counts releases, so the oldest is reused first.
    Released {
        order: u64,
    },
    /// Released, and reusable once `fence` has passed.
    Fenced {
        fence: Arc<SharedFence<F>>,
        order: u64,
    },
    /// Being filled, for replay use `use_index` (the loader) or on demand (`None`).
    Filling {
        use_index: Option<usize>,
    },
    Ready {
        use_index: usize,
    },
    InUse,
}

/// One fence shared by the slots released before it: the first to wait for it waits, the
/// others find it passed.
struct SharedFence<F>(Mutex<Option<F>>);

impl<F> SharedFence<F> {
    /// Blocks until the fence has passed.
    fn wait<B: StreamTarget<Fence = F>>(&self) {
        let mut fence = self.0.lock().unwrap();
        if let Some(fence) = fence.take() {
            B::wait(fence);
        }
    }
}

struct Ring<B: StreamTarget> {
    memory: Arc<B::Ring>,
    slots: Vec<Slot<B::Fence>>,
    slot_bytes: usize,
    /// Per slot, the weight as the loader prepared it ([`StreamTarget::prepare`]): read by the
    /// op of the slot's use, and replaced only when the slot is filled again, after the fence
    /// that follows that op.
    prepared: Vec<Option<Prepared<B>>>,
    /// Device bytes a slot's prepared weight may take beside the slot.
    prepared_bytes: usize,
}

/// A weight the loader prepared, and its device bytes.
struct Prepared<B: StreamTarget> {
    tensor: FloatTensor<B>,
    bytes: usize,
}

impl<B: StreamTarget> Ring<B> {
    /// Device bytes the ring may take: its slots, and a prepared weight beside each.
    fn capacity(&self) -> u64 {
        (self.slots.len() * (self.slot_bytes + self.prepared_bytes)) as u64
    }

    /// Device bytes the ring holds now: its slots, and the prepared weights alive.
    fn held(&self) -> u64 {
        let prepared: usize = self.prepared.iter().flatten().map(|p| p.bytes).sum();
        (self.slots.len() * self.slot_bytes + prepared) as u64
    }
}

/// A slot claimed for filling: what must happen before the copy.
struct Claim<B: StreamTarget> {
    slot: usize,
    fence: Option<Arc<SharedFence<B::Fence>>>,
    memory: Arc<B::Ring>,
}

impl<B: StreamTarget> Claim<B> {
    /// Waits until no op reads the slot, and poisons it if `poison`.
    fn prepare(&self, poison: bool) {
        if let Some(fence) = &self.fence {
            fence.wait::<B>();
        }
        if poison {
            B::poison(&self.memory, self.slot).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

#[derive(Default)]
struct Counters {
    weight_uses: u64,
    prefetched: u64,
    prepared: u64,
    on_demand: u64,
    kept: u64,
    direct: u64,
    resident_hits: u64,
    materialized: u64,
    materialized_bytes: u64,
    bytes_uploaded: u64,
    upload: Duration,
    wait: Duration,
    fences: u64,
    fence_time: Duration,
    memory_reads: Duration,
    views: Duration,
    peak_device_bytes: Option<u64>,
    peak_beyond_weights: Option<u64>,
    peak_handed_out_beyond_weights: Option<u64>,
}

struct State<B: StreamTarget> {
    config: OffloadConfig,
    weights: BTreeMap<u64, Weak<HostWeight>>,
    routes: HashMap<u64, Route>,
    /// Resident copies, with their device bytes and their route (decoded or compact).
    resident: HashMap<u64, (FloatTensor<B>, u64, Route)>,
    /// Device bytes of the resident copies.
    resident_bytes: u64,
    /// Copies of streamed weights kept between two uses, with their device bytes.
    kept: HashMap<u64, (FloatTensor<B>, u64)>,
    /// Device bytes of the kept copies.
    kept_bytes: u64,
    /// For each recording of the schedule, which replayed uses keep their weight, and which
    /// find it kept.
    retentions: Vec<Retention>,
    /// How the last plan divides the budget.
    planned: MemoryPlan,
    /// Where device memory is read, in place of `B::memory_in_use`.
    probe: Option<Arc<dyn MemoryProbe>>,
    ring: Option<Ring<B>>,
    loader_started: bool,
    schedule: Schedule,
    /// How many uses ahead of the compute the loader may fill.
    depth: usize,
    /// The next replay use the loader considers.
    next_fill: usize,
    /// Replay uses the compute has started.
    consumed: usize,
    /// Bumped to invalidate prefetched slots and fills in flight.
    generation: u64,
    releases: u64,
    /// Set when a claim found no slot to fill while fewer than half the slots hold weights
    /// still to be read: the compute thread fences its next release at once (or, where slots
    /// are released already, at its next call).
    fence_wanted: bool,
    counters: Counters,
    step_started: Option<Instant>,
    steps: u64,
    /// Set when resident copies changed: the next step's start hands the allocator's free
    /// pages back to the device.
    cleanup_at_start: bool,
    shutdown: bool,
}

impl<B: StreamTarget> State<B> {
    fn route(&self, weight: &HostWeight) -> Route {
        let route = self.routes.get(&weight.id).copied().unwrap_or(Route::Ring);
        match (route, &self.ring) {
            // A weight larger than the slots: registered after the ring was sized, or left out
            // of its sizing.
            (Route::Ring, Some(ring)) if B::slot_bytes(weight) > ring.slot_bytes => Route::Direct,
            _ => route,
        }
    }

    /// Keeps `tensor`, the copy of weight `id` (`bytes` on the device), until its next use.
    fn keep_copy(&mut self, id: u64, tensor: FloatTensor<B>, bytes: u64) {
        if let Some((_, previous)) = self.kept.insert(id, (tensor, bytes)) {
            self.kept_bytes -= previous;
        }
        self.kept_bytes += bytes;
    }

    /// For replay use `index` of weight `id`: the copy kept since the weight's previous use, if
    /// any, still kept after this use where the retention says so.
    fn take_kept(&mut self, id: u64, index: usize) -> Option<FloatTensor<B>> {
        if self.retention().keeps(index) {
            return self.kept.get(&id).map(|(t, _)| t.clone());
        }
        let (tensor, bytes) = self.kept.remove(&id)?;
        self.kept_bytes -= bytes;
        Some(tensor)
    }

    /// For replay use `index`, the copy kept since the weight's previous use where the
    /// retention says it finds one, counted as a kept use.
    fn kept_use(&mut self, id: u64, index: usize, device: &B::Device) -> Option<FloatTensor<B>> {
        if !self.retention().is_kept(index) {
            return None;
        }
        let tensor = self.take_kept(id, index)?;
        self.counters.kept += 1;
        self.sample_use_memory(device, 0);
        Some(tensor)
    }

    /// The retention of the recording the step replays.
    fn retention(&self) -> &Retention {
        self.schedule
            .replaying()
            .and_then(|i| self.retentions.get(i))
            .unwrap_or(&KEEP_NOTHING)
    }

    /// Drops the copies kept between uses.
    fn drop_kept(&mut self) {
        self.kept.clear();
        self.kept_bytes = 0;
    }

    /// Cancels prefetching: fills in flight will be discarded, ready slots are freed.
    fn cancel_prefetch(&mut self) {
        self.generation += 1;
        if let Some(ring) = &mut self.ring {
            for slot in &mut ring.slots {
                if matches!(slot, Slot::Ready { .. }) {
                    *slot = Slot::Free;
                }
            }
        }
    }

    /// Takes a free slot, or else the oldest fenced one, for filling. When there is none,
    /// asks the compute thread for a fence.
    fn claim(&mut self, use_index: Option<usize>) -> Option<Claim<B>> {
        let ring = self.ring.as_ref()?;
        let index = ring
            .slots
            .iter()
            .position(|s| matches!(s, Slot::Free))
            .or_else(|| {
                ring.slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| match s {
                        Slot::Fenced { order, .. } => Some((i, *order)),
                        _ => None,
                    })
                    .min_by_key(|(_, order)| *order)
                    .map(|(i, _)| i)
            });
        let Some(index) = index else {
            // With half the ring still to be read, the compute's releases reach a fence's
            // batch before the loader runs dry.
            let ahead = ring
                .slots
                .iter()
                .filter(|s| matches!(s, Slot::Ready { .. } | Slot::Filling { use_index: Some(_) }))
                .count();
            if ahead < fence_batch(ring.slots.len()) {
                self.fence_wanted = true;
            }
            return None;
        };
        let ring = self.ring.as_mut()?;
        let fence = match std::mem::replace(&mut ring.slots[index], Slot::Filling { use_index }) {
            Slot::Fenced { fence, .. } => Some(fence),
            _ => None,
        };
        Some(Claim {
            slot: index,
            fence,
            memory: ring.memory.clone(),
        })
    }

    /// The loader's next job: the next replay use that goes through the ring, within the
    /// prefetch depth, with a slot to put it in.
    fn next_job(&mut self) -> Option<(Claim<B>, Arc<HostWeight>, usize, u64)> {
        self.ring.as_ref()?;
        loop {
            let order = self.schedule.replay_order()?;
            if self.next_fill >= order.len() || self.next_fill >= self.consumed + self.depth {
                return None;
            }
            let index = self.next_fill;
            let key = order[index];
            let weight = self.weights.get(&key).and_then(Weak::upgrade);
            match weight {
                // The compute takes the copy kept since the previous use.
                _ if self.retention().is_kept(index) => self.next_fill += 1,
                Some(weight) if self.route(&weight) == Route::Ring => {
                    let claim = self.claim(Some(index))?;
                    self.next_fill += 1;
                    return Some((claim, weight, index, self.generation));
                }
                // The compute takes resident and direct weights itself.
                _ => self.next_fill += 1,
            }
        }
    }

    fn slot_with(&self, pred: impl Fn(&Slot<B::Fence>) -> bool) -> Option<usize> {
        self.ring.as_ref()?.slots.iter().position(pred)
    }

    /// Slots released without a fence after them yet.
    fn released(&self) -> usize {
        self.ring.as_ref().map_or(0, |r| {
            r.slots
                .iter()
                .filter(|s| matches!(s, Slot::Released { .. }))
                .count()
        })
    }

    /// Device bytes the engine holds for weights now: resident copies, the ring, the copies
    /// kept between uses, and `uploading` (a weight uploaded into a tensor of its own, not yet
    /// counted elsewhere).
    fn weight_bytes(&self, uploading: u64) -> u64 {
        let ring = self.ring.as_ref().map_or(0, Ring::held);
        self.resident_bytes + ring + self.kept_bytes + uploading
    }

    /// Device memory in use now (from the probe, else the backend) and how much of it is
    /// beyond the engine's weights, where known.
    fn memory(&self, device: &B::Device, uploading: u64) -> Option<(u64, u64)> {
        let weights = self.weight_bytes(uploading);
        let in_use = match &self.probe {
            Some(probe) => probe.in_use(weights),
            None => B::memory_in_use(device),
        }?;
        Some((in_use, in_use.saturating_sub(weights)))
    }

    /// At a weight use: records the memory in use now in the step's peaks, at every use of a
    /// step that records the schedule and at every [`MEMORY_SAMPLE_EVERY`]th use of one that
    /// replays it. Within a step the device's count only grows (freed pages stay in the
    /// allocator's pools), so a later sample sees what a skipped one would have.
    fn sample_use_memory(&mut self, device: &B::Device, uploading: u64) {
        if self.schedule.replaying().is_none()
            || self
                .counters
                .weight_uses
                .is_multiple_of(MEMORY_SAMPLE_EVERY)
        {
            self.sample_memory(device, uploading);
        }
    }

    /// Records the memory in use now in the step's peaks.
    fn sample_memory(&mut self, device: &B::Device, uploading: u64) {
        let started = Instant::now();
        let memory = self.memory(device, uploading);
        let handed_out = match self.probe {
            Some(_) => None,
            None => B::memory_handed_out(device),
        };
        self.counters.memory_reads += started.elapsed();
        let weights = self.weight_bytes(uploading);
        let c = &mut self.counters;
        if let Some((in_use, beyond)) = memory {
            let peak = c.peak_device_bytes.get_or_insert(0);
            *peak = (*peak).max(in_use);
            let peak = c.peak_beyond_weights.get_or_insert(0);
            *peak = (*peak).max(beyond);
        }
        if let Some(handed_out) = handed_out {
            let peak = c.peak_handed_out_beyond_weights.get_or_insert(0);
            *peak = (*peak).max(handed_out.saturating_sub(weights));
        }
    }

    fn keep_resident(&mut self, id: u64, tensor: FloatTensor<B>, bytes: u64, route: Route) {
        if let Some((_, previous, _)) = self.resident.insert(id, (tensor, bytes, route)) {
            self.resident_bytes -= previous;
        }
        self.resident_bytes += bytes;
    }

    /// The live weights and what the planner knows of each: their uses over the recorded
    /// steps (one of each kind) or, before any step, sizes alone.
    fn profiles(&self) -> (Vec<Arc<HostWeight>>, Vec<WeightProfile>) {
        let live: Vec<Arc<HostWeight>> = self.weights.values().filter_map(Weak::upgrade).collect();
        let profile = self.schedule.profile();
        let profiled = !profile.is_empty();
        let profiles = live
            .iter()
            .map(|w| {
                let (uses, flops) = match profile.get(&w.id) {
                    Some(&p) => p,
                    None if profiled => (0, 0.0),
                    // Nothing measured yet: every weight counts as used once, without compute.
                    None => (1, 0.0),
                };
                WeightProfile {
                    device_bytes: w.device_bytes() as u64,
                    compact_bytes: B::compact_bytes(w) as u64,
                    wire_bytes: w.wire_bytes() as u64,
                    slot_bytes: (B::slot_bytes(w) + self.prepared_bytes(w)) as u64,
                    uses,
                    flops,
                }
            })
            .collect();
        (live, profiles)
    }

    /// Recomputes the routes ([`State::profiles`]) and the retention of each recorded order,
    /// and drops resident copies that are no longer wanted; returns their bytes.
    fn replan(&mut self) -> u64 {
        self.weights.retain(|_, w| w.strong_count() > 0);
        let (live, profiles) = self.profiles();
        let limits = plan_limits(&self.config);
        let index: HashMap<u64, usize> = live.iter().enumerate().map(|(i, w)| (w.id, i)).collect();
        let orders: Vec<Vec<Option<usize>>> = self
            .schedule
            .recorded()
            .map(|order| order.iter().map(|key| index.get(key).copied()).collect())
            .collect();
        let (plan, retentions) =
            policy::plan_step(&profiles, &orders, self.config.retain_window, &limits);
        let resident_weights = plan.routes.iter().filter(|r| r.is_resident()).count();
        self.planned = MemoryPlan {
            vram_budget: limits.vram_budget,
            activation_headroom: limits.activation_headroom,
            margin: limits.margin,
            resident_weights,
            resident_bytes: plan.resident_bytes,
            streamed_weights: live.len() - resident_weights,
            ring_bytes: plan.ring_bytes,
            retained_bytes: retentions.iter().map(|r| r.peak_bytes).max().unwrap_or(0),
        };
        self.retentions = retentions;
        self.routes = live.iter().map(|w| w.id).zip(plan.routes).collect();
        let routes = &self.routes;
        let mut dropped = 0;
        self.resident.retain(|id, (_, bytes, route)| {
            let keep = routes.get(id) == Some(route);
            if !keep {
                dropped += *bytes;
            }
            keep
        });
        self.resident_bytes -= dropped;
        self.drop_kept();
        tracing::debug!(
            weights = live.len(),
            resident_bytes = plan.resident_bytes,
            ring_bytes = plan.ring_bytes,
            retained_bytes = self.planned.retained_bytes,
            kept_uses = self
                .retentions
                .iter()
                .map(Retention::kept_uses)
                .sum::<usize>(),
            headroom = limits.activation_headroom,
            "offload plan"
        );
        dropped
    }

    /// Device bytes the loader's prepared form of `weight` takes beside its slot.
    fn prepared_bytes(&self, weight: &HostWeight) -> usize {
        if self.config.decode_ahead {
            B::prepared_bytes(weight)
        } else {
            0
        }
    }

    /// Slot size the current routes need ([`ring_slot_bytes`]), and the most a slot's
    /// prepared weight takes beside it.
    fn wanted_slot_bytes(&self) -> (usize, usize) {
        let streamed: Vec<Arc<HostWeight>> = self
            .weights
            .values()
            .filter_map(Weak::upgrade)
            .filter(|w| self.routes.get(&w.id).copied().unwrap_or(Route::Ring) == Route::Ring)
            .collect();
        let slot = ring_slot_bytes(
            streamed.iter().map(|w| B::slot_bytes(w) as u64),
            self.config.ring_slots,
        ) as usize;
        let prepared = streamed
            .iter()
            .filter(|w| B::slot_bytes(w) <= slot)
            .map(|w| self.prepared_bytes(w))
            .max()
            .unwrap_or(0);
        (slot, prepared)
    }
}

/// The retention of a step that replays nothing.
static KEEP_NOTHING: Retention = Retention::NONE;

/// While a step replays the schedule, the device memory in use is read at every this many
/// weight uses (a driver call each on CUDA).
const MEMORY_SAMPLE_EVERY: u64 = 16;

/// Resident copies of at least this many bytes are allocated in the allocator's persistent
/// memory ([`Engine::upload_resident`]). Smaller ones stay in the step's pools: the persistent
/// pool also takes every later allocation of a size it holds, and small sizes are common.
const PERSISTENT_BYTES: usize = 1 << 20;

/// The planner's limits for `config`.
fn plan_limits(config: &OffloadConfig) -> PlanLimits {
    PlanLimits {
        vram_budget: config.vram_budget,
        activation_headroom: config.activation_headroom,
        margin: config.margin,
        ring_slots: config.ring_slots,
        direct_threshold: config.direct_threshold,
        link_bytes_per_second: config.link_bytes_per_second,
        compute_flops_per_second: config.compute_flops_per_second,
    }
}

/// Hands the allocator's free pages back to the device, waits for the device, and returns the
/// freed memory to the system: until then the driver's count of used memory, which the engine
/// reads as the need beside the weights, still holds it (CUDA's pool keeps freed memory for
/// reuse, [`StreamTarget::trim_freed`]).
fn release_free_pages<B: StreamTarget>(device: &B::Device) {
    B::memory_cleanup(device);
    B::sync(device)
        .unwrap_or_else(|e| panic!("waiting for the device after freeing memory: {e:?}"));
    B::trim_freed(device);
}

/// Released slots that take a fence together: half the ring.
fn fence_batch(slots: usize) -> usize {
    (slots / 2).max(1)
}

/// Releases a slot when dropped, also when the op that read it panicked.
struct SlotLease<'a, B: StreamTarget> {
    engine: &'a Engine<B>,
    slot: usize,
}

impl<B: StreamTarget> Drop for SlotLease<'_, B> {
    fn drop(&mut self) {
        self.engine.release(self.slot);
    }
}

impl<B: StreamTarget> Drop for Engine<B> {
    fn drop(&mut self) {
        self.lock().shutdown = true;
        self.shared.changed.notify_all();
    }
}

impl<B: StreamTarget> Engine<B> {
    /// An engine for `device` with `config` (validated by the caller) and no weights.
    pub fn new(device: B::Device, config: OffloadConfig) -> Self {
        Self {
            device,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    config,
                    weights: BTreeMap::new(),
                    routes: HashMap::new(),
                    resident: HashMap::new(),
                    resident_bytes: 0,
                    kept: HashMap::new(),
                    kept_bytes: 0,
                    retentions: Vec::new(),
                    planned: MemoryPlan::default(),
                    probe: None,
                    ring: None,
                    loader_started: false,
                    schedule: Schedule::new(),
                    depth: 0,
                    next_fill: 0,
                    consumed: 0,
                    generation: 0,
                    releases: 0,
                    fence_wanted: false,
                    counters: Counters::default(),
                    step_started: None,
                    steps: 0,
                    cleanup_at_start: false,
                    shutdown: false,
                }),
                changed: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.shared.state.lock().unwrap()
    }

    /// The device this engine serves.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Replaces the configuration (validated by the caller), with as many of its ring slots as
    /// its budget holds beside its activation headroom ([`policy::ring_depth`]), and replans;
    /// where even two slots do not fit ([`policy::shortfall`]), the configuration in force
    /// stays.
    pub fn configure(&self, config: OffloadConfig) -> Result<(), Shortfall> {
        let mut st = self.lock();
        st.weights.retain(|_, w| w.strong_count() > 0);
        let (_, profiles) = st.profiles();
        let ring_slots = policy::ring_depth(&profiles, &plan_limits(&config))?;
        let config = OffloadConfig {
            ring_slots,
            ..config
        };
        if config.ring_slots != st.config.ring_slots {
            st.schedule.reset();
        }
        st.config = config;
        let dropped = st.replan();
        drop(st);
        self.settle_residency(dropped);
        Ok(())
    }

    /// After a plan that ran steps, uploads the weights it made resident that are not yet (so
    /// that no step pays the uploads, their drains and their staging pages), and, when copies
    /// were dropped (`dropped` bytes) or uploaded, hands the allocator's free pages back to the
    /// device, now and again at the next step's start (pages of dropped copies that the step
    /// just ended still held are free by then), so that what a later step measures beside the
    /// weights does not count them.
    fn settle_residency(&self, dropped: u64) {
        let mut uploaded = false;
        let mut st = self.lock();
        if st.steps > 0 {
            let wanted: Vec<(Arc<HostWeight>, Route)> = st
                .weights
                .values()
                .filter_map(Weak::upgrade)
                .filter_map(|w| {
                    let route = *st.routes.get(&w.id)?;
                    (route.is_resident() && !st.resident.contains_key(&w.id)).then_some((w, route))
                })
                .collect();
            for (weight, route) in wanted {
                drop(st);
                self.upload_resident(&weight, route);
                st = self.lock();
                uploaded = true;
            }
        }
        if dropped > 0 || uploaded {
            st.cleanup_at_start = true;
            drop(st);
            release_free_pages::<B>(&self.device);
        }
    }

    /// Reads device memory from `probe` from now on, in place of the backend's report.
    pub fn set_probe(&self, probe: Arc<dyn MemoryProbe>) {
        self.lock().probe = Some(probe);
    }

    /// Device memory in use now beyond the engine's weights (resident copies and ring), where
    /// it can be read.
    pub fn memory_beyond_weights(&self) -> Option<u64> {
        self.lock()
            .memory(&self.device, 0)
            .map(|(_, beyond)| beyond)
    }

    /// Device memory handed out now by the backend's allocator (from the probe, else
    /// [`StreamTarget::memory_handed_out`]) beyond the engine's weights, where it can be read.
    pub fn handed_out_beyond_weights(&self) -> Option<u64> {
        let st = self.lock();
        let weights = st.weight_bytes(0);
        let handed_out = match &st.probe {
            Some(probe) => probe.in_use(weights),
            None => B::memory_handed_out(&self.device),
        }?;
        Some(handed_out.saturating_sub(weights))
    }

    /// How the plan in force divides the budget.
    pub fn memory_plan(&self) -> MemoryPlan {
        self.lock().planned.clone()
    }

    /// The configuration in force.
    pub fn config(&self) -> OffloadConfig {
        self.lock().config.clone()
    }

    /// Registers weights and replans.
    pub fn register(&self, weights: &[Arc<HostWeight>]) {
        let mut st = self.lock();
        for w in weights {
            st.weights.insert(w.id, Arc::downgrade(w));
        }
        let dropped = st.replan();
        drop(st);
        self.settle_residency(dropped);
    }

    /// The route of every live weight, by name, in registration order.
    pub fn routes(&self) -> Vec<(String, Route)> {
        let st = self.lock();
        st.weights
            .values()
            .filter_map(Weak::upgrade)
            .map(|w| (w.name.clone(), st.route(&w)))
            .collect()
    }

    /// Starts a step: the schedule replays (or records), the loader starts prefetching.
    pub fn begin_step(&self) {
        let mut st = self.lock();
        st.schedule.begin_step();
        st.cancel_prefetch();
        st.drop_kept();
        st.next_fill = 0;
        st.consumed = 0;
        st.counters = Counters::default();
        st.step_started = Some(Instant::now());
        if std::mem::take(&mut st.cleanup_at_start) {
            release_free_pages::<B>(&self.device);
        }
        st = self.resize_ring(st);
        st.sample_memory(&self.device, 0);
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Ends the step: replans after a recording, and returns (and logs) the step's statistics.
    pub fn end_step(&self) -> StepStats {
        let mut st = self.lock();
        if st.released() > 0 {
            // Frees the slots for the next step's first weights, which the loader may fill
            // while the host does other work.
            st = self.fence_released(st);
        }
        let schedule = st.schedule.end_step();
        // Only a recorded or diverged step changes the plan, and so what is resident.
        let replanned = matches!(
            schedule,
            ScheduleOutcome::Recorded { .. } | ScheduleOutcome::Diverged { .. }
        )
        .then(|| st.replan());
        st.cancel_prefetch();
        st.drop_kept();
        st.steps += 1;
        st.sample_memory(&self.device, 0);
        let c = std::mem::take(&mut st.counters);
        let stats = StepStats {
            step: st.steps,
            schedule,
            weight_uses: c.weight_uses,
            prefetched: c.prefetched,
            prepared: c.prepared,
            on_demand: c.on_demand,
            kept: c.kept,
            direct: c.direct,
            resident_hits: c.resident_hits,
            materialized: c.materialized,
            materialized_bytes: c.materialized_bytes,
            bytes_uploaded: c.bytes_uploaded,
            upload_seconds: c.upload.as_secs_f64(),
            wait_seconds: c.wait.as_secs_f64(),
            fences: c.fences,
            fence_seconds: c.fence_time.as_secs_f64(),
            memory_read_seconds: c.memory_reads.as_secs_f64(),
            view_seconds: c.views.as_secs_f64(),
            step_seconds: st
                .step_started
                .take()
                .map_or(0.0, |t| t.elapsed().as_secs_f64()),
            resident_bytes: st.resident_bytes,
            ring_bytes: st.ring.as_ref().map_or(0, Ring::capacity),
            peak_device_bytes: c.peak_device_bytes,
            peak_beyond_weights: c.peak_beyond_weights,
            peak_handed_out_beyond_weights: c.peak_handed_out_beyond_weights,
            pooled_bytes: B::memory_pooled(&self.device),
        };
        drop(st);
        tracing::info!(
            step = stats.step,
            schedule = ?stats.schedule,
            uses = stats.weight_uses,
            prefetched = stats.prefetched,
            prepared = stats.prepared,
            on_demand = stats.on_demand,
            kept = stats.kept,
            materialized = stats.materialized,
            uploaded_mb = stats.bytes_uploaded / 1_000_000,
            upload_gbps = stats.upload_gbps(),
            wait_s = stats.wait_seconds,
            fences = stats.fences,
            fence_s = stats.fence_seconds,
            memory_read_s = stats.memory_read_seconds,
            view_s = stats.view_seconds,
            resident_mb = stats.resident_bytes / 1_000_000,
            ring_mb = stats.ring_bytes / 1_000_000,
            peak_mb = stats.peak_device_bytes.map(|b| b / 1_000_000),
            beyond_weights_mb = stats.peak_beyond_weights.map(|b| b / 1_000_000),
            handed_out_beyond_mb = stats
                .peak_handed_out_beyond_weights
                .map(|b| b / 1_000_000),
            pooled_mb = stats.pooled_bytes.map(|b| b / 1_000_000),
            "offload step"
        );
        if let Some(dropped) = replanned {
            self.settle_residency(dropped);
        }
        stats
    }

    /// Builds, rebuilds or drops the ring to match the configuration and the routes, once no
    /// slot is being filled or read: slots larger than the plan's would hold device memory the
    /// plan gave to resident weights.
    fn resize_ring<'a>(&'a self, mut st: MutexGuard<'a, State<B>>) -> MutexGuard<'a, State<B>> {
        let (slot_bytes, prepared_bytes) = st.wanted_slot_bytes();
        let wanted = (st.config.ring_slots, slot_bytes, prepared_bytes);
        let current = st
            .ring
            .as_ref()
            .map(|r| (r.slots.len(), r.slot_bytes, r.prepared_bytes));
        let fits = match current {
            Some(current) => wanted.1 > 0 && current == wanted,
            None => wanted.1 == 0,
        };
        if fits {
            return st;
        }
        while st
            .slot_with(|s| matches!(s, Slot::Filling { .. } | Slot::InUse))
            .is_some()
        {
            st = self.shared.changed.wait(st).unwrap();
        }
        if st.ring.take().is_some() {
            // The old slots' pages go back to the device: slots of another size would not sit
            // in them, and a step would count them beside the weights as its own need. The
            // device is waited for before the loader prepares anything again, as the old
            // prepared weights may still be read.
            release_free_pages::<B>(&self.device);
        }
        if wanted.1 > 0 {
            let memory = B::new_ring(&self.device, wanted.0, wanted.1)
                .unwrap_or_else(|e| panic!("allocating the offload ring: {e}"));
            st.ring = Some(Ring {
                memory: Arc::new(memory),
                slots: (0..wanted.0).map(|_| Slot::Free).collect(),
                slot_bytes: wanted.1,
                prepared: (0..wanted.0).map(|_| None).collect(),
                prepared_bytes: wanted.2,
            });
            if !st.loader_started {
                st.loader_started = true;
                let shared = self.shared.clone();
                let device = self.device.clone();
                std::thread::Builder::new()
                    .name("offload-loader".into())
                    .spawn(move || loader::<B>(shared, device))
                    .expect("spawning the offload loader thread");
            }
        }
        st
    }

    /// Runs `op` on `weight`, fetched from wherever its route says; `flops` is the op's cost
    /// (for the planner) and `depth` gives how far ahead of the compute the loader may fill,
    /// for the configured number of slots.
    pub fn with_weight<R>(
        &self,
        weight: &Arc<HostWeight>,
        flops: f64,
        depth: fn(usize) -> usize,
        op: impl FnOnce(FloatTensor<B>) -> R,
    ) -> R {
        let mut st = self.lock();
        if st.fence_wanted && st.released() > 0 {
            st = self.fence_released(st);
        }
        let depth = depth(st.config.ring_slots);
        st.depth = depth;
        st.counters.weight_uses += 1;
        let every = st.config.release_pages_every;
        if every > 0 && st.counters.weight_uses.is_multiple_of(every) {
            B::memory_cleanup(&self.device);
        }
        let decision = match st.schedule.on_use(weight.id, flops) {
            Use::Fallback => {
                // The order left the recording: drop what was prefetched and kept (a no-op
                // after the first such use, as the loader has nothing left to replay).
                st.cancel_prefetch();
                st.drop_kept();
                Use::Fallback
            }
            Use::Switched => {
                // The step replays another recording from its first use: the loader starts
                // over on that one.
                st.cancel_prefetch();
                st.drop_kept();
                st.next_fill = 0;
                st.consumed = 0;
                Use::Replay(0)
            }
            decision => decision,
        };
        if st.ring.is_none() && st.route(weight) == Route::Ring {
            st = self.resize_ring(st);
        }
        match st.route(weight) {
            route @ (Route::Resident | Route::Compact) => {
                let replayed = match decision {
                    Use::Replay(index) if route == Route::Compact => Some(index),
                    _ => None,
                };
                if let Some(index) = replayed
                    && let Some(tensor) = st.kept_use(weight.id, index, &self.device)
                {
                    drop(st);
                    return op(tensor);
                }
                let keep = replayed.is_some_and(|i| st.retention().keeps(i));
                let stored = match st.resident.get(&weight.id) {
                    Some((t, _, _)) => {
                        let t = t.clone();
                        st.counters.resident_hits += 1;
                        st.sample_use_memory(&self.device, 0);
                        drop(st);
                        t
                    }
                    None => {
                        drop(st);
                        self.upload_resident(weight, route)
                    }
                };
                let view = self.resident_view(&stored, route, weight);
                if keep {
                    self.lock()
                        .keep_copy(weight.id, view.clone(), weight.device_bytes() as u64);
                }
                op(view)
            }
            Route::Direct => {
                st.counters.direct += 1;
                st.sample_use_memory(&self.device, 0);
                drop(st);
                op(self.upload(weight, false))
            }
            Route::Ring => {
                let replayed = match decision {
                    Use::Replay(index) => Some(index),
                    _ => None,
                };
                if let Some(index) = replayed
                    && let Some(tensor) = st.kept_use(weight.id, index, &self.device)
                {
                    st.consumed = index + 1;
                    drop(st);
                    self.shared.changed.notify_all();
                    return op(tensor);
                }
                let keep = replayed.is_some_and(|i| st.retention().keeps(i));
                let slot = match decision {
                    Use::Replay(index) if depth > 0 => self.take_prefetched(st, weight, index),
                    _ => self.fetch_on_demand(st, weight),
                };
                let Some(slot) = slot else {
                    return op(self.upload(weight, false));
                };
                let lease = SlotLease { engine: self, slot };
                let (view, prepared) = {
                    let mut st = self.lock();
                    let started = Instant::now();
                    let ring = st.ring.as_ref().expect("ring of a leased slot");
                    let prepared = ring.prepared[slot]
                        .as_ref()
                        .filter(|_| !keep)
                        .map(|p| p.tensor.clone());
                    let prepared_now = prepared.is_some();
                    let view = prepared
                        .unwrap_or_else(|| B::view(&ring.memory, slot, weight, &self.device));
                    st.counters.views += started.elapsed();
                    st.counters.prepared += u64::from(prepared_now);
                    (view, prepared_now)
                };
                // A view decoded into a tensor of its own frees its slot now, so that the fence
                // releasing it follows the decode rather than the op. A prepared weight is the
                // slot's until that fence, which then follows the op.
                let lease = (prepared || B::view_reads_slot(weight)).then_some(lease);
                if !keep {
                    let out = op(view);
                    drop(lease);
                    return out;
                }
                let tensor = B::keep(view, weight, &self.device)
                    .unwrap_or_else(|e| panic!("keeping `{}`: {e}", weight.name));
                drop(lease);
                let mut st = self.lock();
                st.keep_copy(weight.id, tensor.clone(), weight.device_bytes() as u64);
                st.sample_use_memory(&self.device, 0);
                drop(st);
                op(tensor)
            }
        }
    }

    /// Waits for the slot the loader fills for replay use `index`.
    fn take_prefetched<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B>>,
        weight: &Arc<HostWeight>,
        index: usize,
    ) -> Option<usize> {
        st.consumed = index;
        self.shared.changed.notify_all();
        let started = Instant::now();
        let slot = loop {
            if let Some(slot) =
                st.slot_with(|s| matches!(s, Slot::Ready { use_index } if *use_index == index))
            {
                break Some(slot);
            }
            let coming = st.next_fill <= index
                || st
                    .slot_with(|s| matches!(s, Slot::Filling { use_index: Some(i) } if *i == index))
                    .is_some();
            if !coming {
                break None;
            }
            if st.fence_wanted && st.released() > 0 {
                // The loader waits for this thread's fence to fill the slot awaited here.
                st = self.fence_released(st);
                continue;
            }
            st = self.shared.changed.wait(st).unwrap();
        };
        st.counters.wait += started.elapsed();
        st.consumed = index + 1;
        match slot {
            Some(slot) => {
                st.ring.as_mut().expect("ring").slots[slot] = Slot::InUse;
                st.counters.prefetched += 1;
                st.sample_use_memory(&self.device, 0);
                drop(st);
                self.shared.changed.notify_all();
                Some(slot)
            }
            None => self.fetch_on_demand(st, weight),
        }
    }

    /// Fills a slot on the compute thread; `None` when no slot can become free (every slot is
    /// held by an op in progress), in which case the caller uploads directly.
    fn fetch_on_demand<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B>>,
        weight: &Arc<HostWeight>,
    ) -> Option<usize> {
        let started = Instant::now();
        let claim = loop {
            if let Some(claim) = st.claim(None) {
                break claim;
            }
            if st.slot_with(|s| matches!(s, Slot::Ready { .. })).is_some() {
                // Prefetched for later uses that this fetch pre-empts.
                st.cancel_prefetch();
                continue;
            }
            if st.released() > 0 {
                st = self.fence_released(st);
                continue;
            }
            // Every slot is held by an op in progress: nothing will free one.
            st.slot_with(|s| matches!(s, Slot::Filling { .. }))?;
            st = self.shared.changed.wait(st).unwrap();
        };
        let poison = st.config.poison_released_slots;
        drop(st);
        claim.prepare(poison);
        let copy = Instant::now();
        B::fill(&claim.memory, claim.slot, weight)
            .unwrap_or_else(|e| panic!("uploading `{}`: {e}", weight.name));
        let mut st = self.lock();
        st.counters.upload += copy.elapsed();
        st.counters.wait += started.elapsed();
        st.counters.bytes_uploaded += weight.wire_bytes() as u64;
        st.counters.on_demand += 1;
        let ring = st.ring.as_mut().expect("ring");
        ring.slots[claim.slot] = Slot::InUse;
        // Its fence has passed: no op reads what the loader last prepared in it.
        ring.prepared[claim.slot] = None;
        st.sample_use_memory(&self.device, 0);
        Some(claim.slot)
    }

    /// Releases `slot` after the ops that read it were submitted; takes the fence that frees
    /// the released slots once half the ring waits for one, or the loader does.
    fn release(&self, slot: usize) {
        let mut st = self.lock();
        let order = st.releases;
        st.releases += 1;
        let ring = st.ring.as_mut().expect("ring of a leased slot");
        ring.slots[slot] = Slot::Released { order };
        let batch = fence_batch(ring.slots.len());
        if st.fence_wanted || st.released() >= batch {
            st = self.fence_released(st);
        }
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Takes one fence after the work this thread submitted so far, which frees every slot
    /// released before it (at once where the backend has nothing in flight).
    fn fence_released<'a>(&'a self, st: MutexGuard<'a, State<B>>) -> MutexGuard<'a, State<B>> {
        let released_before = st.releases;
        drop(st);
        let started = Instant::now();
        let fence = B::fence(&self.device).map(|f| Arc::new(SharedFence(Mutex::new(Some(f)))));
        let fenced = started.elapsed();
        let mut st = self.lock();
        st.fence_wanted = false;
        st.counters.fences += 1;
        st.counters.fence_time += fenced;
        let poison = st.config.poison_released_slots;
        if let Some(ring) = st.ring.as_mut() {
            for (index, slot) in ring.slots.iter_mut().enumerate() {
                let Slot::Released { order } = *slot else {
                    continue;
                };
                if order >= released_before {
                    continue;
                }
                *slot = match &fence {
                    Some(fence) => Slot::Fenced {
                        fence: fence.clone(),
                        order,
                    },
                    None => {
                        if poison {
                            B::poison(&ring.memory, index).unwrap_or_else(|e| panic!("{e}"));
                        }
                        Slot::Free
                    }
                };
            }
        }
        self.shared.changed.notify_all();
        st
    }

    /// The weight of the resident copy `stored` (of `route`), decoded where it is compact.
    fn resident_view(
        &self,
        stored: &FloatTensor<B>,
        route: Route,
        weight: &HostWeight,
    ) -> FloatTensor<B> {
        match route {
            Route::Compact => B::expand(stored, weight, &self.device),
            _ => stored.clone(),
        }
    }

    /// Uploads `weight` as the resident copy of `route` (decoded or compact) and keeps it. A
    /// copy of [`PERSISTENT_BYTES`] or more goes to the allocator's persistent memory, a buffer
    /// of its exact size, instead of a page of the step's pools: a free page there may be
    /// several times larger than the copy, and the activations that used it then take new ones.
    fn upload_resident(&self, weight: &HostWeight, route: Route) -> FloatTensor<B> {
        let compact = route == Route::Compact;
        let tensor = if weight.device_bytes() >= PERSISTENT_BYTES {
            B::memory_persistent_allocations(&self.device, weight, |weight| {
                self.upload(weight, compact)
            })
        } else {
            self.upload(weight, compact)
        };
        let bytes = if compact {
            B::compact_bytes(weight)
        } else {
            weight.device_bytes()
        };
        self.lock()
            .keep_resident(weight.id, tensor.clone(), bytes as u64, route);
        tensor
    }

    /// Uploads `weight` into a tensor of its own (compact or decoded), counting the bytes and
    /// the time.
    fn upload(&self, weight: &HostWeight, compact: bool) -> FloatTensor<B> {
        let started = Instant::now();
        let tensor = if compact {
            B::upload_compact(weight, &self.device)
        } else {
            B::upload(weight, &self.device)
        }
        .unwrap_or_else(|e| panic!("uploading `{}`: {e}", weight.name));
        let mut st = self.lock();
        let elapsed = started.elapsed();
        st.counters.upload += elapsed;
        st.counters.wait += elapsed;
        st.counters.bytes_uploaded += weight.wire_bytes() as u64;
        st.sample_use_memory(&self.device, weight.device_bytes() as u64);
        tensor
    }

    /// `weight` as a tensor of its own, for an op that does not stream (counted and logged).
    pub fn materialize(&self, weight: &HostWeight) -> FloatTensor<B> {
        let mut st = self.lock();
        st.counters.materialized += 1;
        if let Some((t, _, route)) = st.resident.get(&weight.id) {
            return self.resident_view(t, *route, weight);
        }
        st.counters.materialized_bytes += weight.wire_bytes() as u64;
        drop(st);
        tracing::debug!(weight = %weight.name, "materializing a streamed weight");
        self.upload(weight, false)
    }
}

/// The loader thread: fills slots for the replayed schedule, ahead of the compute, and
/// prepares their weights where the backend does ([`StreamTarget::prepare`]).
fn loader<B: StreamTarget>(shared: Arc<Shared<B>>, device: B::Device) {
    let mut st = shared.state.lock().unwrap();
    loop {
        if st.shutdown {
            return;
        }
        let Some((claim, weight, use_index, generation)) = st.next_job() else {
            st = shared.changed.wait(st).unwrap();
            continue;
        };
        let poison = st.config.poison_released_slots;
        // A weight kept for a later use is copied from its view by the compute thread.
        let prepare = st.config.decode_ahead && !st.retention().keeps(use_index);
        // What was last prepared in the slot goes once the slot's fence has passed, before the
        // next weight is prepared.
        let stale = st.ring.as_mut().and_then(|r| r.prepared[claim.slot].take());
        drop(st);
        claim.prepare(poison);
        drop(stale);
        let started = Instant::now();
        B::fill(&claim.memory, claim.slot, &weight)
            .unwrap_or_else(|e| panic!("uploading `{}`: {e}", weight.name));
        let elapsed = started.elapsed();
        let prepared = if prepare {
            B::prepare(&claim.memory, claim.slot, &weight, &device)
                .unwrap_or_else(|e| panic!("preparing `{}`: {e}", weight.name))
                .map(|tensor| Prepared {
                    tensor,
                    bytes: B::prepared_bytes(&weight),
                })
        } else {
            None
        };
        st = shared.state.lock().unwrap();
        st.counters.upload += elapsed;
        st.counters.bytes_uploaded += weight.wire_bytes() as u64;
        let current = st.generation == generation;
        if let Some(ring) = st
            .ring
            .as_mut()
            .filter(|r| Arc::ptr_eq(&r.memory, &claim.memory))
        {
            ring.slots[claim.slot] = if current {
                Slot::Ready { use_index }
            } else {
                Slot::Free
            };
            ring.prepared[claim.slot] = prepared;
        }
        shared.changed.notify_all();
    }
}
