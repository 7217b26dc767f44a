//! Decisions, free of device code: the prefetch schedule and the residency plan.
//!
//! The engine asks [`Schedule`] what each weight use is (recorded, replayed, or fetched on demand
//! after the order changed), asks [`plan_step`] which weights stay resident and which uses keep
//! their weight on the device until its next use ([`Retention`]), and [`shortfall`] whether a
//! budget holds the activation headroom a caller measured ([`MemoryMeasurement`]); it executes
//! the answers with its ring, loader thread and fences. Nothing here imports Burn or touches a
//! device.

use std::collections::HashMap;

/// A weight, as the policy knows it: an opaque key.
pub type WeightKey = u64;

/// What the schedule says about one weight use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// No step is running: fetch on demand, record nothing.
    Unscheduled,
    /// The step is being recorded: fetch on demand.
    Record,
    /// The use matches position `index` of the recording the step replays, so the loader has
    /// fetched (or is fetching) its weight.
    Replay(usize),
    /// The step's first use is the first of another recording, which the step replays from
    /// here (this use is its position 0): what was prefetched for the other is dropped and
    /// prefetching starts over.
    Switched,
    /// The order diverged from the recording at this use or earlier in the step: fetch on
    /// demand for the rest of the step.
    Fallback,
}

/// How a step went, as far as the schedule is concerned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleOutcome {
    /// Uses outside `begin_step` / `end_step`.
    #[default]
    Unscheduled,
    /// The step's order was recorded; a later step that begins as it did replays it.
    Recorded {
        /// Weight uses in the step.
        uses: usize,
    },
    /// The step followed a recorded order to the end.
    Replayed {
        /// Weight uses in the step.
        uses: usize,
    },
    /// The order changed at use `at` (or the step ended there); the rest was fetched on demand
    /// and the step's own order replaces the recording it began as.
    Diverged {
        /// Index of the first use that differed.
        at: usize,
        /// Weight uses in the step.
        uses: usize,
    },
}

/// A step's weight uses in order, with the FLOP of each.
#[derive(Clone, Debug, Default)]
struct Recording {
    keys: Vec<WeightKey>,
    flops: Vec<f64>,
}

impl Recording {
    fn push(&mut self, key: WeightKey, flops: f64) {
        self.keys.push(key);
        self.flops.push(flops);
    }

    fn truncated(&self, len: usize) -> Self {
        Self {
            keys: self.keys[..len].to_vec(),
            flops: self.flops[..len].to_vec(),
        }
    }
}

#[derive(Debug, Default)]
enum StepState {
    #[default]
    Idle,
    Recording(Recording),
    Replaying(usize),
    Diverged {
        at: usize,
        seen: Recording,
    },
}

/// Records the order of weight uses in a step and replays it in later steps.
///
/// A model that runs in several ways (two experts that take turns, each with weights of its
/// own) has a recording for each: a step's first use picks the recording that begins with the
/// same weight. A step replays the recording of the step before it; when its first use begins
/// another, it switches to that one, and when it begins none, the step is recorded as one more
/// (beyond [`Schedule::RECORDINGS`] the least recently used is forgotten). Within a step, on the
/// first mismatch (another weight, more uses than recorded, or fewer when the step ends) the
/// rest of the step is fetched on demand and its complete order replaces the recording.
#[derive(Debug, Default)]
pub struct Schedule {
    recordings: Vec<Recording>,
    /// The step that last used each recording.
    last_used: Vec<u64>,
    /// The recording the running step replays, or the last step used.
    current: usize,
    steps: u64,
    state: StepState,
}

impl Schedule {
    /// Recordings kept at most.
    pub const RECORDINGS: usize = 4;

    /// A schedule with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a step (ending a step left open, if any): replays the last step's recording if
    /// there is one, records otherwise.
    pub fn begin_step(&mut self) {
        if !matches!(self.state, StepState::Idle) {
            self.end_step();
        }
        self.steps += 1;
        self.state = match self.recordings.is_empty() {
            true => StepState::Recording(Recording::default()),
            false => StepState::Replaying(0),
        };
    }

    /// Classifies the next use, of weight `key` with `flops` of compute.
    pub fn on_use(&mut self, key: WeightKey, flops: f64) -> Use {
        match &mut self.state {
            StepState::Idle => Use::Unscheduled,
            StepState::Recording(seen) => {
                seen.push(key, flops);
                Use::Record
            }
            StepState::Diverged { seen, .. } => {
                seen.push(key, flops);
                Use::Fallback
            }
            StepState::Replaying(pos) => {
                let at = *pos;
                let order = &self.recordings[self.current];
                if order.keys.get(at) == Some(&key) {
                    *pos += 1;
                    return Use::Replay(at);
                }
                if at == 0 {
                    let other = self
                        .recordings
                        .iter()
                        .position(|r| r.keys.first() == Some(&key));
                    if let Some(other) = other {
                        self.current = other;
                        self.state = StepState::Replaying(1);
                        return Use::Switched;
                    }
                    let mut seen = Recording::default();
                    seen.push(key, flops);
                    self.state = StepState::Recording(seen);
                    return Use::Record;
                }
                let mut seen = order.truncated(at);
                seen.push(key, flops);
                self.state = StepState::Diverged { at, seen };
                Use::Fallback
            }
        }
    }

    /// Ends the step and says how it went; a recorded step's order becomes one more recording,
    /// a diverged step's replaces the one it began as.
    pub fn end_step(&mut self) -> ScheduleOutcome {
        let steps = self.steps;
        match std::mem::take(&mut self.state) {
            StepState::Idle => ScheduleOutcome::Unscheduled,
            StepState::Recording(seen) => {
                let uses = seen.keys.len();
                if uses > 0 {
                    self.add(seen);
                }
                ScheduleOutcome::Recorded { uses }
            }
            StepState::Replaying(pos) => {
                self.last_used[self.current] = steps;
                let order = &mut self.recordings[self.current];
                if pos == order.keys.len() {
                    return ScheduleOutcome::Replayed { uses: pos };
                }
                // A step without uses leaves nothing to replay.
                match pos {
                    0 => self.remove(self.current),
                    _ => *order = order.truncated(pos),
                }
                ScheduleOutcome::Diverged { at: pos, uses: pos }
            }
            StepState::Diverged { at, seen } => {
                let uses = seen.keys.len();
                self.last_used[self.current] = steps;
                self.recordings[self.current] = seen;
                ScheduleOutcome::Diverged { at, uses }
            }
        }
    }

    /// Adds `recording` as the current one, forgetting the least recently used beyond
    /// [`Schedule::RECORDINGS`].
    fn add(&mut self, recording: Recording) {
        if self.recordings.len() == Self::RECORDINGS {
            let oldest = (0..self.last_used.len())
                .min_by_key(|&i| self.last_used[i])
                .expect("a full schedule has recordings");
            self.remove(oldest);
        }
        self.recordings.push(recording);
        self.last_used.push(self.steps);
        self.current = self.recordings.len() - 1;
    }

    fn remove(&mut self, index: usize) {
        self.recordings.remove(index);
        self.last_used.remove(index);
        self.current = self.recordings.len().saturating_sub(1);
    }

    /// Every recorded order, whether or not a step is running.
    pub fn recorded(&self) -> impl Iterator<Item = &[WeightKey]> {
        self.recordings.iter().map(|r| r.keys.as_slice())
    }

    /// The position among [`Schedule::recorded`] of the order a step replays, while it does.
    pub fn replaying(&self) -> Option<usize> {
        matches!(self.state, StepState::Replaying(_)).then_some(self.current)
    }

    /// The recorded order, while a step replays it (the loader's work list).
    pub fn replay_order(&self) -> Option<&[WeightKey]> {
        self.replaying().map(|i| self.recordings[i].keys.as_slice())
    }

    /// The uses and FLOP of each weight over every recording: a step of each kind, summed.
    pub fn profile(&self) -> HashMap<WeightKey, (u64, f64)> {
        let mut profile = HashMap::new();
        for r in &self.recordings {
            for (key, flops) in r.keys.iter().zip(&r.flops) {
                let entry = profile.entry(*key).or_insert((0, 0.0));
                entry.0 += 1;
                entry.1 += flops;
            }
        }
        profile
    }

    /// Forgets the recordings and abandons the step in progress: the next step records again.
    pub fn reset(&mut self) {
        *self = Self {
            steps: self.steps,
            ..Self::default()
        };
    }
}

/// One weight as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightProfile {
    /// Bytes it occupies on the device decoded, in its compute dtype.
    pub device_bytes: u64,
    /// Bytes it occupies on the device kept in compact form and decoded at each use: its wire
    /// payload where the device decodes it (FP8 codes and scales), else `device_bytes`.
    pub compact_bytes: u64,
    /// Bytes one upload moves over the bus (the wire payload).
    pub wire_bytes: u64,
    /// Bytes it needs in a ring slot.
    pub slot_bytes: u64,
    /// Uses per step: each use of a streamed weight is one upload.
    pub uses: u64,
    /// Floating-point operations of those uses per step (the compute that can hide transfers).
    pub flops: f64,
}

impl WeightProfile {
    /// Whether the weight reaches the device in a compact form that each use decodes (FP8
    /// codes and scales), resident or streamed.
    pub fn decodes_at_use(&self) -> bool {
        self.compact_bytes < self.device_bytes
    }
}

/// What bounds the plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanLimits {
    /// Device bytes for resident weights, the ring and everything else on the device.
    pub vram_budget: u64,
    /// Bytes of the budget reserved for what is not weights (activations, adapters,
    /// gradients, optimizer state, workspace).
    pub activation_headroom: u64,
    /// Bytes of the budget beside the headroom that resident and kept weights leave free, for
    /// what later steps need beyond the measured headroom. Unlike the headroom, it never makes
    /// a budget too small ([`shortfall`]): it only holds fewer weights on the device.
    pub margin: u64,
    /// Slots in the ring.
    pub ring_slots: usize,
    /// Streamed weights with a smaller wire payload take the direct path.
    pub direct_threshold: u64,
    /// Assumed host-to-device bandwidth (bytes per second).
    pub link_bytes_per_second: f64,
    /// Assumed compute throughput (FLOP per second).
    pub compute_flops_per_second: f64,
}

/// Where a weight comes from when an op needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// Uploaded once and kept on the device, decoded.
    Resident,
    /// Uploaded once and kept on the device in compact form, decoded at each use.
    Compact,
    /// Streamed through the ring, prefetched when the schedule allows.
    Ring,
    /// Small: uploaded on demand into a buffer of its own.
    Direct,
}

impl Route {
    /// Whether the weight stays on the device, decoded or compact.
    pub fn is_resident(self) -> bool {
        matches!(self, Route::Resident | Route::Compact)
    }
}

/// The planner's decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// One route per weight, in the order given.
    pub routes: Vec<Route>,
    /// Bytes of the resident weights.
    pub resident_bytes: u64,
    /// Bytes of one ring slot (0 when nothing goes through the ring).
    pub slot_bytes: u64,
    /// Bytes of the whole ring.
    pub ring_bytes: u64,
}

/// Seconds of a weight's transfers per step that its own compute cannot cover.
fn exposed_seconds(w: &WeightProfile, limits: &PlanLimits) -> f64 {
    let transfer = (w.uses * w.wire_bytes) as f64 / limits.link_bytes_per_second;
    let compute = w.flops / limits.compute_flops_per_second;
    (transfer - compute).max(0.0)
}

/// Chooses, deterministically, which weights stay resident.
///
/// Weights are ranked by the transfer time they would expose per step for each byte of VRAM
/// they occupy (the least hideable first), then by the bytes they would move per step, then by
/// their index. Following that order, a weight becomes resident in its compact form
/// ([`WeightProfile::compact_bytes`]: decoding an FP8 weight at each use costs far less than
/// streaming it) if the resident weights, itself and the ring still needed for the weights
/// left streaming fit in `vram_budget - activation_headroom - margin`; at each rank, all remaining
/// weights become resident at once if they fit without a ring. What the budget leaves then
/// goes to decoding compact weights once, in the same order. Weights not used in a step are
/// never made resident. The others stream: through the ring, or by the direct path below
/// `direct_threshold`.
pub fn plan(weights: &[WeightProfile], limits: &PlanLimits) -> Plan {
    let available = limits
        .vram_budget
        .saturating_sub(limits.activation_headroom)
        .saturating_sub(limits.margin);
    let streamed_route = |w: &WeightProfile| {
        if w.wire_bytes < limits.direct_threshold {
            Route::Direct
        } else {
            Route::Ring
        }
    };
    let resident_route = |w: &WeightProfile| {
        if w.decodes_at_use() {
            Route::Compact
        } else {
            Route::Resident
        }
    };
    let mut routes: Vec<Route> = weights.iter().map(streamed_route).collect();
    let ring_bytes = |routes: &[Route]| {
        let slot = slot_bytes(weights, routes, limits.ring_slots);
        slot * limits.ring_slots as u64
    };

    let mut ranked: Vec<(usize, f64, u64)> = weights
        .iter()
        .enumerate()
        .filter(|(_, w)| w.uses > 0)
        .map(|(i, w)| {
            let per_byte = exposed_seconds(w, limits) / w.compact_bytes.max(1) as f64;
            (i, per_byte, w.uses * w.wire_bytes)
        })
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)));

    let mut resident_bytes = 0u64;
    for (rank, &(i, _, _)) in ranked.iter().enumerate() {
        // Taking every remaining candidate may fit where taking them one by one does not,
        // because the ring is no longer needed once nothing streams through it.
        let rest = &ranked[rank..];
        let mut all = routes.clone();
        rest.iter()
            .for_each(|&(j, _, _)| all[j] = resident_route(&weights[j]));
        let rest_bytes: u64 = rest.iter().map(|&(j, _, _)| weights[j].compact_bytes).sum();
        if resident_bytes + rest_bytes + ring_bytes(&all) <= available {
            routes = all;
            resident_bytes += rest_bytes;
            break;
        }
        let previous = routes[i];
        routes[i] = resident_route(&weights[i]);
        let needed = resident_bytes + weights[i].compact_bytes + ring_bytes(&routes);
        if needed <= available {
            resident_bytes += weights[i].compact_bytes;
        } else {
            routes[i] = previous;
        }
    }
    let ring = ring_bytes(&routes);
    for &(i, _, _) in &ranked {
        if routes[i] != Route::Compact {
            continue;
        }
        let w = &weights[i];
        let grown = resident_bytes + w.device_bytes - w.compact_bytes;
        if grown + ring <= available {
            routes[i] = Route::Resident;
            resident_bytes = grown;
        }
    }
    let slot_bytes = slot_bytes(weights, &routes, limits.ring_slots);
    for (route, weight) in routes.iter_mut().zip(weights) {
        if *route == Route::Ring && weight.slot_bytes > slot_bytes {
            *route = Route::Direct;
        }
    }
    Plan {
        ring_bytes: slot_bytes * limits.ring_slots as u64,
        routes,
        resident_bytes,
        slot_bytes,
    }
}

/// Which uses of a recorded step keep their weight on the device until the weight's next use,
/// so that the next use needs no transfer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    keep: Vec<bool>,
    kept: Vec<bool>,
    /// The most bytes kept at once.
    pub peak_bytes: u64,
}

impl Retention {
    /// Keeps nothing.
    pub const NONE: Self = Self {
        keep: Vec::new(),
        kept: Vec::new(),
        peak_bytes: 0,
    };

    /// Whether use `index` keeps its weight until the weight's next use.
    pub fn keeps(&self, index: usize) -> bool {
        self.keep.get(index).copied().unwrap_or(false)
    }

    /// Whether use `index` finds its weight kept since the weight's previous use.
    pub fn is_kept(&self, index: usize) -> bool {
        self.kept.get(index).copied().unwrap_or(false)
    }

    /// Uses per step that find their weight kept: transfers saved.
    pub fn kept_uses(&self) -> usize {
        self.kept.iter().filter(|k| **k).count()
    }
}

/// Chooses the uses of `order` (each the index of its weight in `weights`, `None` for a
/// weight no longer live) after which a weight routed through the ring, or resident in compact
/// form, stays on the device decoded until its next use, at most `window` uses later, with at
/// most `limit` bytes (the weights' `device_bytes`) kept at once.
///
/// Candidates are taken shortest first (then by position), each if the bytes kept over its
/// span stay within `limit`. A checkpointed block's recompute runs just before its backward,
/// which uses the same weights in reverse: keeping them between the two saves one of the
/// three crossings of the bus per step (and one of the three decodings of a compact weight),
/// for the memory of one block's weights.
pub fn retention(
    order: &[Option<usize>],
    weights: &[WeightProfile],
    routes: &[Route],
    window: usize,
    limit: u64,
) -> Retention {
    let n = order.len();
    let mut next = vec![None; n];
    let mut seen: HashMap<usize, usize> = HashMap::new();
    for (i, w) in order.iter().enumerate().rev() {
        if let Some(w) = *w {
            next[i] = seen.insert(w, i);
        }
    }
    let mut spans: Vec<(usize, usize, u64)> = order
        .iter()
        .enumerate()
        .filter_map(|(i, w)| {
            let w = (*w)?;
            let j = next[i]?;
            let decoded_at_use = matches!(routes[w], Route::Ring | Route::Compact);
            (decoded_at_use && j - i <= window).then(|| (i, j, weights[w].device_bytes))
        })
        .collect();
    spans.sort_by_key(|&(i, j, _)| (j - i, i));
    let mut held = vec![0u64; n];
    let mut retention = Retention {
        keep: vec![false; n],
        kept: vec![false; n],
        peak_bytes: 0,
    };
    for (i, j, bytes) in spans {
        // Kept from use i up to use j, where it is consumed (or kept again for a later span).
        let most = held[i..j].iter().copied().max().unwrap_or(0);
        if most.saturating_add(bytes) <= limit {
            held[i..j].iter_mut().for_each(|h| *h += bytes);
            retention.keep[i] = true;
            retention.kept[j] = true;
        }
    }
    retention.peak_bytes = held.into_iter().max().unwrap_or(0);
    retention
}

/// [`plan`] for steps whose uses come in one of `orders` ([`retention`]'s, one per recording),
/// keeping weights between uses at most `window` apart: the retention takes what the budget
/// leaves beside the activation headroom and the ring of a plan that streams everything (with no
/// bound at budget 0), and the resident weights are planned in what it leaves. Retention comes
/// first: keeping one block's weights between its recompute and its backward saves a third of
/// every streamed weight's transfers, where the same bytes kept resident save the transfers of
/// those weights alone. Where [`plan`] without that reserve moves no more bytes over a step of
/// each order (a budget that holds nearly every weight) and decodes no more (what the reserve
/// would keep, it decodes once at load instead), that plan is taken. Steps of different orders
/// never run at once, so the retention needs the most any one order keeps.
pub fn plan_step(
    weights: &[WeightProfile],
    orders: &[Vec<Option<usize>>],
    window: usize,
    limits: &PlanLimits,
) -> (Plan, Vec<Retention>) {
    let streamed = streaming_everything(weights, limits);
    let limit = match limits.vram_budget {
        0 => u64::MAX,
        budget => budget
            .saturating_sub(limits.activation_headroom)
            .saturating_sub(limits.margin)
            .saturating_sub(streamed.ring_bytes),
    };
    let retained = |routes: &[Route], limit: u64| -> Vec<Retention> {
        orders
            .iter()
            .map(|order| retention(order, weights, routes, window, limit))
            .collect()
    };
    let peak = |retentions: &[Retention]| retentions.iter().map(|r| r.peak_bytes).max();
    let most = peak(&retained(&streamed.routes, limit)).unwrap_or(0);
    let plan = self::plan(
        weights,
        &PlanLimits {
            activation_headroom: limits.activation_headroom.saturating_add(most),
            ..*limits
        },
    );
    let retentions = retained(&plan.routes, most);
    let without = self::plan(weights, limits);
    let cost = |plan: &Plan, retentions: &[Retention]| -> (u64, u64) {
        orders
            .iter()
            .zip(retentions)
            .map(|(order, r)| step_cost(weights, order, plan, r))
            .fold((0, 0), |(m, d), (a, b)| (m + a, d + b))
    };
    let none = vec![Retention::default(); orders.len()];
    if cost(&without, &none) <= cost(&plan, &retentions) {
        return (without, none);
    }
    (plan, retentions)
}

/// What a step of `order` costs with `plan` and `retention`: the bytes it moves over the bus
/// (every use of a streamed weight) and the decoded bytes it writes (every use of a weight that
/// reaches the device compact: resident so, or streamed in FP8), but for the uses that find
/// their weight kept since its previous use.
fn step_cost(
    weights: &[WeightProfile],
    order: &[Option<usize>],
    plan: &Plan,
    retention: &Retention,
) -> (u64, u64) {
    let uses = order
        .iter()
        .enumerate()
        .filter(|&(i, _)| !retention.is_kept(i))
        .filter_map(|(_, w)| *w);
    uses.fold((0, 0), |(moved, decoded), w| {
        let weight = &weights[w];
        let (sent, decodes) = match plan.routes[w] {
            Route::Resident => (0, false),
            Route::Compact => (0, true),
            Route::Ring | Route::Direct => (weight.wire_bytes, weight.decodes_at_use()),
        };
        let written = if decodes { weight.device_bytes } else { 0 };
        (moved + sent, decoded + written)
    })
}

/// The plan that streams every weight (budget 0): the least device memory any plan takes for
/// the weights.
fn streaming_everything(weights: &[WeightProfile], limits: &PlanLimits) -> Plan {
    plan(
        weights,
        &PlanLimits {
            vram_budget: 0,
            activation_headroom: 0,
            ..*limits
        },
    )
}

/// Device memory beyond the weights (resident copies and ring), as measured over a run's first
/// step: the adapters, the other parameters, activations, gradients, optimizer state and
/// workspace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryMeasurement {
    /// Handed out beyond the weights before the step (parameters that stay on the device,
    /// cached inputs, an optimizer state restored from a checkpoint), read as `after` is.
    pub before: u64,
    /// The highest in use beyond the weights during the step's passes (forward, checkpoint
    /// recompute, backward), the allocator's kept pages included where the device counts them.
    pub peak: u64,
    /// Handed out beyond the weights after the step, its optimizer update included.
    pub after: u64,
    /// In use beyond the weights after the optimizer update, read as `peak` is: the state the
    /// update created, its transients' pages that the allocator keeps, and everything before.
    pub settled: u64,
}

impl MemoryMeasurement {
    /// The headroom later steps need: the larger of the peak plus what the step left on the
    /// device that its passes ran without (the optimizer state the first update creates,
    /// `after - before` floored at 0), and the memory in use once the update settled, which
    /// already holds that state.
    pub fn headroom(&self) -> u64 {
        self.peak
            .saturating_add(self.after.saturating_sub(self.before))
            .max(self.settled)
    }
}

/// A budget too small for its headroom: even a plan that streams every weight needs the
/// headroom and a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The budget.
    pub budget: u64,
    /// The activation headroom asked for.
    pub headroom: u64,
    /// Bytes of the ring when every weight streams (the smallest plan).
    pub ring: u64,
}

impl Shortfall {
    /// The smallest budget that holds the headroom: the headroom and the ring.
    pub fn needed(&self) -> u64 {
        self.headroom.saturating_add(self.ring)
    }
}

/// Whether `limits.vram_budget` holds `limits.activation_headroom` beside the ring of a plan
/// that streams every weight, the least device memory any plan takes for them. A headroom of 0
/// reserves nothing and is never short: the budget then bounds the weights alone (and a budget
/// of 0 streams them all).
pub fn shortfall(weights: &[WeightProfile], limits: &PlanLimits) -> Option<Shortfall> {
    if limits.activation_headroom == 0 {
        return None;
    }
    let streamed = streaming_everything(weights, limits);
    let short = Shortfall {
        budget: limits.vram_budget,
        headroom: limits.activation_headroom,
        ring: streamed.ring_bytes,
    };
    (short.needed() > limits.vram_budget).then_some(short)
}

/// The most ring slots, from `limits.ring_slots` down to 2, beside which `limits.vram_budget`
/// holds `limits.activation_headroom` with every weight streamed ([`shortfall`]): the budget
/// bounds the run, the ring's depth only speeds it up. The shortfall of the two-slot ring where
/// even that does not fit.
pub fn ring_depth(weights: &[WeightProfile], limits: &PlanLimits) -> Result<usize, Shortfall> {
    let mut slots = limits.ring_slots;
    loop {
        let with_slots = PlanLimits {
            ring_slots: slots,
            ..*limits
        };
        match shortfall(weights, &with_slots) {
            None => return Ok(slots),
            Some(short) if slots <= 2 => return Err(short),
            Some(_) => slots -= 1,
        }
    }
}

fn slot_bytes(weights: &[WeightProfile], routes: &[Route], slots: usize) -> u64 {
    ring_slot_bytes(
        weights
            .iter()
            .zip(routes)
            .filter(|(_, r)| **r == Route::Ring)
            .map(|(w, _)| w.slot_bytes),
        slots,
    )
}

/// Bytes of each of `slots` ring slots for weights needing `sizes` bytes of slot each: the
/// largest size, leaving out (again and again) a largest weight more than `slots` times the
/// next smaller one, such as a text encoder's token embedding among its matrices. A ring sized
/// for such a weight would cost about `slots - 1` times more device memory than uploading it on
/// its own at its use, which is what happens to a weight larger than the slots (the direct
/// path).
pub(crate) fn ring_slot_bytes(sizes: impl IntoIterator<Item = u64>, slots: usize) -> u64 {
    let mut sizes: Vec<u64> = sizes.into_iter().collect();
    sizes.sort_unstable();
    while let [.., next, largest] = sizes[..]
        && largest > next.saturating_mul(slots as u64)
    {
        sizes.pop();
    }
    sizes.last().copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(schedule: &mut Schedule, keys: &[WeightKey]) -> (Vec<Use>, ScheduleOutcome) {
        schedule.begin_step();
        let uses = keys.iter().map(|&k| schedule.on_use(k, 1.0)).collect();
        (uses, schedule.end_step())
    }

    #[test]
    fn uses_outside_a_step_are_unscheduled() {
        let mut s = Schedule::new();
        assert_eq!(s.on_use(1, 0.0), Use::Unscheduled);
        assert_eq!(s.end_step(), ScheduleOutcome::Unscheduled);
        assert_eq!(s.replay_order(), None);
    }

    #[test]
    fn first_step_records_and_later_steps_replay() {
        let mut s = Schedule::new();
        let order = [3, 1, 4, 1, 5];
        let (uses, outcome) = replay(&mut s, &order);
        assert_eq!(uses, vec![Use::Record; 5]);
        assert_eq!(outcome, ScheduleOutcome::Recorded { uses: 5 });
        for _ in 0..2 {
            s.begin_step();
            assert_eq!(s.replay_order(), Some(&order[..]));
            let uses: Vec<Use> = order.iter().map(|&k| s.on_use(k, 1.0)).collect();
            assert_eq!(uses, (0..5).map(Use::Replay).collect::<Vec<_>>());
            assert_eq!(s.end_step(), ScheduleOutcome::Replayed { uses: 5 });
        }
    }

    #[test]
    fn divergence_falls_back_and_rerecords() {
        // (recorded, next step, expected uses, expected outcome)
        type Case = (Vec<WeightKey>, Vec<WeightKey>, Vec<Use>, ScheduleOutcome);
        let r = Use::Replay;
        let f = Use::Fallback;
        let cases: Vec<Case> = vec![
            // another weight in the middle
            (
                vec![1, 2, 3, 4],
                vec![1, 2, 9, 4],
                vec![r(0), r(1), f, f],
                ScheduleOutcome::Diverged { at: 2, uses: 4 },
            ),
            // more uses than recorded (a larger input, an extra branch)
            (
                vec![1, 2],
                vec![1, 2, 3],
                vec![r(0), r(1), f],
                ScheduleOutcome::Diverged { at: 2, uses: 3 },
            ),
            // fewer uses: noticed when the step ends
            (
                vec![1, 2, 3],
                vec![1, 2],
                vec![r(0), r(1)],
                ScheduleOutcome::Diverged { at: 2, uses: 2 },
            ),
        ];
        for (recorded, next, expected_uses, expected_outcome) in cases {
            let mut s = Schedule::new();
            replay(&mut s, &recorded);
            let (uses, outcome) = replay(&mut s, &next);
            assert_eq!(uses, expected_uses, "{recorded:?} then {next:?}");
            assert_eq!(outcome, expected_outcome, "{recorded:?} then {next:?}");
            // The diverged step's order is the new recording.
            let (uses, outcome) = replay(&mut s, &next);
            assert_eq!(uses, (0..next.len()).map(Use::Replay).collect::<Vec<_>>());
            assert_eq!(outcome, ScheduleOutcome::Replayed { uses: next.len() });
        }
    }

    #[test]
    fn an_open_step_is_closed_by_the_next_begin() {
        let mut s = Schedule::new();
        s.begin_step();
        s.on_use(7, 0.0);
        s.begin_step();
        assert_eq!(s.on_use(7, 0.0), Use::Replay(0));
        s.reset();
        s.begin_step();
        assert_eq!(s.on_use(7, 0.0), Use::Record);
    }

    #[test]
    fn steps_that_begin_differently_each_replay_a_recording_of_their_own() {
        let mut s = Schedule::new();
        let (a, b) = ([1, 2, 3], [7, 8, 3]);
        replay(&mut s, &a);
        // The first use begins no recording: the step is recorded beside the other.
        let (uses, outcome) = replay(&mut s, &b);
        assert_eq!(uses, vec![Use::Record; 3]);
        assert_eq!(outcome, ScheduleOutcome::Recorded { uses: 3 });
        // A step replays the last step's recording, and switches at its first use.
        let replayed = (0..3).map(Use::Replay).collect::<Vec<_>>();
        for (keys, first) in [(a, Use::Switched), (a, Use::Replay(0)), (b, Use::Switched)] {
            s.begin_step();
            assert_eq!(s.on_use(keys[0], 1.0), first);
            assert_eq!(s.replay_order(), Some(&keys[..]));
            let rest: Vec<Use> = keys[1..].iter().map(|&k| s.on_use(k, 1.0)).collect();
            assert_eq!(rest, replayed[1..]);
            assert_eq!(s.end_step(), ScheduleOutcome::Replayed { uses: 3 });
        }
        // Weight 3 is used by a step of each kind.
        let profile = s.profile();
        assert_eq!(
            (profile[&3], profile[&1], profile.len()),
            ((2, 2.0), (1, 1.0), 5)
        );
        // A divergence within a step replaces only the recording it began as.
        replay(&mut s, &[7, 9]);
        assert_eq!(
            replay(&mut s, &[7, 9]).1,
            ScheduleOutcome::Replayed { uses: 2 }
        );
        assert_eq!(replay(&mut s, &a).1, ScheduleOutcome::Replayed { uses: 3 });
        // Beyond the limit the least recently used recording is forgotten.
        for first in 20..20 + Schedule::RECORDINGS as u64 - 1 {
            replay(&mut s, &[first]);
        }
        assert_eq!(s.recorded().count(), Schedule::RECORDINGS);
        assert!(s.recorded().all(|order| order[0] != 7));
        assert_eq!(replay(&mut s, &a).1, ScheduleOutcome::Replayed { uses: 3 });
    }

    fn weight(bytes: u64, uses: u64, flops: f64) -> WeightProfile {
        WeightProfile {
            device_bytes: bytes,
            compact_bytes: bytes,
            wire_bytes: bytes,
            slot_bytes: bytes,
            uses,
            flops,
        }
    }

    /// `weight` sent and kept compact in half its decoded size, as an FP8 weight of bf16.
    fn fp8(bytes: u64, uses: u64, flops: f64) -> WeightProfile {
        WeightProfile {
            device_bytes: 2 * bytes,
            ..weight(bytes, uses, flops)
        }
    }

    fn limits(budget: u64) -> PlanLimits {
        PlanLimits {
            vram_budget: budget,
            activation_headroom: 0,
            margin: 0,
            ring_slots: 2,
            direct_threshold: 10,
            // 100 bytes take 1 s; 100 FLOP take 1 s.
            link_bytes_per_second: 100.0,
            compute_flops_per_second: 100.0,
        }
    }

    /// Four 100-byte weights used 3 times per step (forward, recompute, backward); weight 2 has
    /// no compute to hide behind (a modulation-like matrix applied to one token), weight 0
    /// hides its transfers completely (400 FLOP take longer than 3 x 100 bytes).
    fn four_weights() -> Vec<WeightProfile> {
        vec![
            weight(100, 3, 400.0),
            weight(100, 3, 100.0),
            weight(100, 3, 0.0),
            weight(100, 3, 200.0),
        ]
    }

    #[test]
    fn planner_table() {
        use Route::{Compact as C, Direct as D, Resident as R, Ring as S};
        let four = four_weights();
        let four_fp8: Vec<WeightProfile> = four
            .iter()
            .map(|w| fp8(w.wire_bytes, w.uses, w.flops))
            .collect();
        let mut five = four.clone();
        five.push(weight(100, 3, 50.0));
        // (name, weights, limits, expected routes, resident bytes, ring bytes)
        type Case = (
            &'static str,
            Vec<WeightProfile>,
            PlanLimits,
            Vec<Route>,
            u64,
            u64,
        );
        let cases: Vec<Case> = vec![
            (
                "budget 0 streams all",
                four.clone(),
                limits(0),
                vec![S, S, S, S],
                0,
                200,
            ),
            (
                "everything fits",
                four.clone(),
                limits(400),
                vec![R, R, R, R],
                400,
                0,
            ),
            // 399 bytes: the ring (2 x 100) leaves room for one weight: the least hideable.
            (
                "one fits",
                four.clone(),
                limits(399),
                vec![S, S, R, S],
                100,
                200,
            ),
            ("two fit", five, limits(400), vec![S, S, R, S, R], 200, 200),
            // Decoded (200 bytes) none would fit beside the ring; compact, one does.
            (
                "FP8 weights stay compact where decoded ones would not fit",
                four_fp8.clone(),
                limits(399),
                vec![S, S, C, S],
                100,
                200,
            ),
            // All four fit compact (400); the 200 bytes left decode the two least hideable.
            (
                "what compact weights leave decodes the least hideable",
                four_fp8.clone(),
                limits(600),
                vec![C, R, R, C],
                600,
                0,
            ),
            (
                "FP8 weights that all fit decoded stay decoded",
                four_fp8,
                limits(800),
                vec![R, R, R, R],
                800,
                0,
            ),
            (
                "headroom is taken first",
                four.clone(),
                PlanLimits {
                    activation_headroom: 101,
                    ..limits(500)
                },
                vec![S, S, R, S],
                100,
                200,
            ),
            (
                "unused weights never become resident",
                vec![weight(100, 0, 0.0), weight(100, 1, 0.0)],
                limits(1000),
                vec![S, R],
                100,
                200,
            ),
            (
                "small weights take the direct path",
                vec![weight(5, 1, 0.0), weight(100, 1, 0.0)],
                limits(0),
                vec![D, S],
                0,
                200,
            ),
            (
                "the ring shrinks when the largest weight becomes resident",
                vec![
                    weight(300, 1, 0.0),
                    weight(100, 1, 0.0),
                    weight(100, 1, 0.0),
                    weight(100, 1, 0.0),
                ],
                limits(550),
                vec![R, S, S, S],
                300,
                200,
            ),
            (
                "an outsized weight takes the direct path",
                vec![
                    weight(1000, 1, 0.0),
                    weight(100, 1, 0.0),
                    weight(100, 1, 0.0),
                ],
                limits(0),
                vec![D, S, S],
                0,
                200,
            ),
            (
                "several weights of the largest size are not outsized",
                vec![
                    weight(300, 1, 0.0),
                    weight(300, 1, 0.0),
                    weight(100, 1, 0.0),
                ],
                limits(0),
                vec![S, S, S],
                0,
                600,
            ),
        ];
        for (name, weights, limits, routes, resident, ring) in cases {
            let plan = plan(&weights, &limits);
            assert_eq!(plan.routes, routes, "{name}");
            assert_eq!(plan.resident_bytes, resident, "{name}");
            assert_eq!(plan.ring_bytes, ring, "{name}");
        }
    }

    #[test]
    fn the_ring_is_sized_without_outsized_weights() {
        // (sizes, slots, slot bytes): umT5-XXL's 2.1 GB embedding among its 84 MB and 34 MB
        // matrices; T5-XXL's 263 MB embedding is within four slots of its 84 MB matrices.
        let cases: [(&[u64], usize, u64); 7] = [
            (&[34, 2100, 84, 34], 4, 84),
            (&[263, 84, 34], 4, 263),
            (&[1000, 300, 100], 2, 100),
            (&[300, 300, 100], 2, 300),
            (&[201, 100], 2, 100),
            (&[200, 100], 2, 200),
            (&[5], 4, 5),
        ];
        for (sizes, slots, slot) in cases {
            assert_eq!(
                ring_slot_bytes(sizes.iter().copied(), slots),
                slot,
                "{sizes:?}"
            );
        }
        assert_eq!(ring_slot_bytes([], 4), 0);
    }

    #[test]
    fn the_headroom_is_the_peak_plus_what_the_first_update_left() {
        // (before, peak, after, settled, headroom): a fresh run's first update creates the
        // optimizer state (2 bytes here), which later passes hold on top of the peak; a resumed
        // run had it before the step already; memory freed by the step lowers nothing. An
        // update whose own memory (state and transients: 11) passes the peak with its state
        // (12) is counted once, not with its state added again.
        let cases = [
            ((1, 10, 3, 0), 12),
            ((3, 12, 3, 0), 12),
            ((5, 10, 2, 0), 10),
            ((0, 0, 0, 0), 0),
            ((0, u64::MAX, 1, 0), u64::MAX),
            ((1, 10, 3, 11), 12),
            ((1, 10, 3, 15), 15),
            ((0, 5, 0, u64::MAX), u64::MAX),
        ];
        for ((before, peak, after, settled), headroom) in cases {
            let measured = MemoryMeasurement {
                before,
                peak,
                after,
                settled,
            };
            assert_eq!(measured.headroom(), headroom, "{measured:?}");
        }
    }

    /// `blocks` checkpointed blocks of two weights each (block k: weights 2k, 2k + 1): the
    /// forward, then per block from the last, its recompute and its backward in reverse.
    fn checkpointed(blocks: usize) -> Vec<Option<usize>> {
        let mut order: Vec<usize> = (0..2 * blocks).collect();
        for k in (0..blocks).rev() {
            order.extend([2 * k, 2 * k + 1, 2 * k + 1, 2 * k]);
        }
        order.into_iter().map(Some).collect()
    }

    /// [`plan_step`] for steps of one order, window 3.
    fn plan_one(
        weights: &[WeightProfile],
        order: &[Option<usize>],
        limits: &PlanLimits,
    ) -> (Plan, Retention) {
        let (plan, mut retentions) = plan_step(weights, &[order.to_vec()], 3, limits);
        assert_eq!(retentions.len(), 1);
        (plan, retentions.remove(0))
    }

    #[test]
    fn steps_of_two_orders_keep_what_either_keeps_but_never_both_at_once() {
        // Two experts of four 100-byte weights each, checkpointed in two blocks, taking turns.
        let eight = vec![weight(100, 3, 0.0); 8];
        let first = checkpointed(2);
        let second: Vec<Option<usize>> = first.iter().map(|w| w.map(|w| w + 4)).collect();
        let orders = [first.clone(), second.clone()];
        let (p, r) = plan_step(&eight, &orders, 3, &limits(400));
        // A ring of two slots and one block kept fill the budget: 200 bytes kept, not 400.
        assert_eq!((p.ring_bytes, p.resident_bytes), (200, 0));
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].peak_bytes, r[1].peak_bytes), (200, 200));
        let (expected_keeps, expected_kept) = kept_uses(&r[0], first.len());
        assert!(!expected_kept.is_empty());
        assert_eq!(
            kept_uses(&r[1], second.len()),
            (expected_keeps, expected_kept)
        );
        // At 1000 bytes, what streaming would save beside the ring is resident instead.
        let (p, r) = plan_step(&eight, &orders, 3, &limits(1000));
        assert!(p.resident_bytes + p.ring_bytes + r[0].peak_bytes.max(r[1].peak_bytes) <= 1000);
        assert!(p.resident_bytes > 0);
    }

    fn kept_uses(r: &Retention, n: usize) -> (Vec<usize>, Vec<usize>) {
        let keeps = (0..n).filter(|&i| r.keeps(i)).collect();
        let kept = (0..n).filter(|&i| r.is_kept(i)).collect();
        (keeps, kept)
    }

    #[test]
    fn retention_keeps_the_shortest_spans_within_the_window_and_the_limit() {
        // a b c d | c d d c | a b b a
        let order = checkpointed(2);
        let weights = vec![weight(100, 3, 0.0); 4];
        let ring = vec![Route::Ring; 4];
        // (window, limit, uses that keep, uses that find their weight kept, peak)
        type Case = (usize, u64, Vec<usize>, Vec<usize>, u64);
        let cases: Vec<Case> = vec![
            // Every span up to 3 uses long: recompute -> backward of both blocks, and the last
            // block's forward -> recompute; the first block's forward -> recompute (8) is not.
            (
                3,
                u64::MAX,
                vec![2, 3, 4, 5, 8, 9],
                vec![4, 5, 6, 7, 10, 11],
                200,
            ),
            // One weight at a time: the two spans of one use, then c's 2-use span.
            (3, 100, vec![2, 5, 9], vec![4, 6, 10], 100),
            (1, u64::MAX, vec![5, 9], vec![6, 10], 100),
            (3, 99, vec![], vec![], 0),
            (0, u64::MAX, vec![], vec![], 0),
        ];
        for (window, limit, keeps, kept, peak) in cases {
            let r = retention(&order, &weights, &ring, window, limit);
            assert_eq!(
                kept_uses(&r, order.len()),
                (keeps, kept.clone()),
                "{window} {limit}"
            );
            assert_eq!(r.peak_bytes, peak, "{window} {limit}");
            assert_eq!(r.kept_uses(), kept.len());
        }
        // Resident weights and weights no longer live are not kept; compact ones are.
        let routes = vec![Route::Ring, Route::Ring, Route::Resident, Route::Direct];
        let mut order = checkpointed(2);
        order[9] = None;
        let r = retention(&order, &weights, &routes, 3, u64::MAX);
        assert_eq!(kept_uses(&r, order.len()), (vec![8], vec![11]));
        let routes = vec![Route::Ring, Route::Ring, Route::Compact, Route::Direct];
        let r = retention(&order, &weights, &routes, 3, u64::MAX);
        assert_eq!(kept_uses(&r, order.len()), (vec![2, 4, 8], vec![4, 7, 11]));
    }

    #[test]
    fn a_step_plan_keeps_retention_resident_weights_ring_and_headroom_within_the_budget() {
        let order = checkpointed(4);
        let eight = vec![weight(100, 3, 0.0); 8];
        for headroom in [0, 100] {
            for budget in (300..=1000).step_by(50) {
                let limits = PlanLimits {
                    activation_headroom: headroom,
                    ..limits(budget)
                };
                let (p, r) = plan_one(&eight, &order, &limits);
                let used = p.resident_bytes + p.ring_bytes + r.peak_bytes + headroom;
                assert!(used <= budget, "budget {budget}, headroom {headroom}");
                // Never more than the plan without retention.
                let (without, _) = step_cost(
                    &eight,
                    &order,
                    &plan(&eight, &limits),
                    &Retention::default(),
                );
                assert!(step_cost(&eight, &order, &p, &r).0 <= without);
                for (i, w) in order.iter().enumerate() {
                    if r.keeps(i) || r.is_kept(i) {
                        assert!(matches!(p.routes[w.unwrap()], Route::Ring | Route::Compact));
                    }
                }
            }
        }
        // 400 bytes: keeping one block (200) beside the ring (200) saves a transfer of each
        // block's two weights and of the last block's forward: 14 of 24 uses cross, where two
        // resident weights would leave 18.
        let (p, r) = plan_one(&eight, &order, &limits(400));
        assert_eq!((p.resident_bytes, r.peak_bytes), (0, 200));
        assert_eq!(step_cost(&eight, &order, &p, &r).0, 1400);
        let without = plan(&eight, &limits(400));
        assert_eq!(
            step_cost(&eight, &order, &without, &Retention::default()).0,
            1800
        );
        // 800 bytes hold every weight without a ring: nothing to keep.
        let (p, r) = plan_one(&eight, &order, &limits(800));
        assert_eq!((p.resident_bytes, p.ring_bytes, r.peak_bytes), (800, 0, 0));
        // Budget 0 streams every weight and keeps every span in the window.
        let (p, r) = plan_one(&eight, &order, &limits(0));
        assert_eq!(
            (p.resident_bytes, r.kept_uses(), r.peak_bytes),
            (0, 10, 200)
        );
    }

    #[test]
    fn compact_weights_are_kept_decoded_where_that_saves_more_decoding_than_residency() {
        // FP8 weights of 100 bytes (200 decoded), window 1: each block's second weight may be
        // kept decoded from its recompute to its backward, 200 bytes at a time. The budget holds
        // every weight compact and 200 bytes more: one block's kept weight, or two weights
        // decoded once at load (each saving its three decodings).
        let decodings = |blocks: usize| {
            let order = checkpointed(blocks);
            let weights = vec![fp8(100, 3, 0.0); 2 * blocks];
            let budget = 100 * 2 * blocks as u64 + 200;
            let (p, r) = plan_step(&weights, std::slice::from_ref(&order), 1, &limits(budget));
            let compact = p.routes.iter().filter(|r| **r == Route::Compact).count();
            let (_, decoded) = step_cost(&weights, &order, &p, &r[0]);
            (compact, r[0].kept_uses(), r[0].peak_bytes, decoded / 200)
        };
        // Sixteen blocks: keeping saves 16 decodings a step, residency 6.
        assert_eq!(decodings(16), (32, 16, 200, 96 - 16));
        // Two blocks: keeping saves 2, residency 6.
        assert_eq!(decodings(2), (2, 0, 0, 6));
    }

    #[test]
    fn the_margin_holds_fewer_weights_and_never_refuses_a_budget() {
        let four = vec![weight(100, 3, 0.0); 4];
        let with = |headroom, margin| PlanLimits {
            activation_headroom: headroom,
            margin,
            ..limits(500)
        };
        // 400 bytes beside the headroom hold all four; 300 hold one beside a ring of two slots.
        assert_eq!(plan(&four, &with(100, 0)).resident_bytes, 400);
        assert_eq!(plan(&four, &with(100, 100)).resident_bytes, 100);
        // The headroom and the ring of everything streamed fill the budget: no weight stays
        // resident and nothing is kept, and the margin does not make the budget short.
        let order = checkpointed(2);
        let (p, r) = plan_one(&four, &order, &with(300, 100));
        assert_eq!((p.resident_bytes, p.ring_bytes, r.peak_bytes), (0, 200, 0));
        assert_eq!(shortfall(&four, &with(300, 100)), None);
        // Eight weights in four blocks at 400 bytes: one block kept beside the ring, or one
        // weight beside a margin of 100.
        let eight = vec![weight(100, 3, 0.0); 8];
        let order = checkpointed(4);
        let kept = |margin| {
            let limits = PlanLimits {
                margin,
                ..limits(400)
            };
            let (p, r) = plan_one(&eight, &order, &limits);
            (p.resident_bytes, r.peak_bytes)
        };
        assert_eq!(kept(0), (0, 200));
        assert_eq!(kept(100), (0, 100));
    }

    #[test]
    fn a_budget_short_of_its_headroom_and_the_least_ring_says_how_much_it_needs() {
        let four = vec![weight(100, 3, 0.0); 4];
        let with = |budget, headroom| PlanLimits {
            activation_headroom: headroom,
            ..limits(budget)
        };
        // Streaming all four needs a ring of 2 x 100 bytes beside the headroom.
        assert_eq!(
            shortfall(&four, &with(499, 300)),
            Some(Shortfall {
                budget: 499,
                headroom: 300,
                ring: 200
            })
        );
        assert_eq!(shortfall(&four, &with(499, 300)).unwrap().needed(), 500);
        assert_eq!(shortfall(&four, &with(500, 300)), None);
        // The headroom alone is too much, whatever streams.
        assert_eq!(
            shortfall(&four, &with(250, 300)).map(|s| s.needed()),
            Some(500)
        );
        // No headroom reserves nothing: budget 0 streams everything and is never short.
        assert_eq!(shortfall(&four, &with(0, 0)), None);
        // Weights small enough for the direct path need no ring.
        let small = vec![weight(5, 1, 0.0); 3];
        assert_eq!(shortfall(&small, &with(40, 40)), None);
        assert_eq!(
            shortfall(&small, &with(39, 40)).map(|s| s.needed()),
            Some(40)
        );
    }

    #[test]
    fn a_ring_too_deep_for_the_budget_gives_up_slots_down_to_two() {
        let four = vec![weight(100, 3, 0.0); 4];
        let with = |budget| PlanLimits {
            activation_headroom: 300,
            ring_slots: 4,
            ..limits(budget)
        };
        assert_eq!(ring_depth(&four, &with(700)), Ok(4));
        assert_eq!(ring_depth(&four, &with(699)), Ok(3));
        assert_eq!(ring_depth(&four, &with(600)), Ok(3));
        assert_eq!(ring_depth(&four, &with(500)), Ok(2));
        assert_eq!(
            ring_depth(&four, &with(499)),
            Err(Shortfall {
                budget: 499,
                headroom: 300,
                ring: 200
            })
        );
        // Without a headroom the budget bounds the weights alone: the ring keeps its slots.
        let bare = PlanLimits {
            activation_headroom: 0,
            ..with(100)
        };
        assert_eq!(ring_depth(&four, &bare), Ok(4));
    }

    #[test]
    fn a_plan_within_a_measured_headroom_stays_within_the_budget() {
        // Whatever the budget and the measured headroom, a plan the budget can hold keeps
        // resident weights + ring + headroom within it, and one more byte of budget never makes
        // fewer weights resident.
        let four = four_weights();
        for headroom in [1, 150, 299, 300] {
            let mut resident = 0;
            for budget in (0..=800).step_by(25) {
                let limits = PlanLimits {
                    activation_headroom: headroom,
                    ..limits(budget)
                };
                let p = plan(&four, &limits);
                match shortfall(&four, &limits) {
                    Some(short) => {
                        assert_eq!(short.needed(), headroom + 200);
                        assert!(short.needed() > budget);
                    }
                    None => {
                        let used = p.resident_bytes + p.ring_bytes + headroom;
                        assert!(used <= budget, "budget {budget}, headroom {headroom}");
                        assert!(p.resident_bytes >= resident, "budget {budget}");
                        resident = p.resident_bytes;
                    }
                }
            }
            // 400 bytes of weights: the largest budget keeps them all, without a ring.
            assert_eq!(resident, 400, "headroom {headroom}");
        }
        // The measurement decides: a first step that peaked at 150 bytes beyond the weights
        // and whose update left 50 (the optimizer state) leaves 600 - 200 for the weights:
        // all four, once the ring is no longer needed.
        let measured = MemoryMeasurement {
            before: 20,
            peak: 150,
            after: 70,
            settled: 120,
        };
        let limits = PlanLimits {
            activation_headroom: measured.headroom(),
            ..limits(600)
        };
        assert_eq!(plan(&four, &limits).resident_bytes, 400);
        // With 599 the ring is back and only one weight fits beside it: the least hideable.
        let limits = PlanLimits {
            vram_budget: 599,
            ..limits
        };
        use Route::{Resident as R, Ring as S};
        assert_eq!(plan(&four, &limits).routes, vec![S, S, R, S]);
    }

    #[test]
    fn ties_go_to_the_larger_transfer_then_the_lower_index() {
        // All expose 0.01 s per byte; weights 1-3 move 200 bytes per step, weight 0 only 100.
        let weights = vec![
            weight(100, 1, 0.0),
            weight(200, 1, 0.0),
            weight(200, 1, 0.0),
            weight(200, 1, 0.0),
        ];
        let plan = plan(&weights, &limits(600));
        use Route::{Resident as R, Ring as S};
        assert_eq!(plan.routes, vec![S, R, S, S]);
    }
}
