//! The engine's behaviour through the public API: schedule replay and divergence, the
//! planner's choices, the direct path, residency, and materialization outside the linear ops.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use std::sync::Arc;

use burn_offload::{
    Lookahead, MemoryPlan, Offload, OffloadConfig, OffloadError, OnDemand, PrefetchPolicy, Route,
    ScheduleOutcome, StepStats, WeightStream, WireFormat,
};
use common::{DIM, Path, Recompute, bits, data, net, train};

type A = Autodiff<Offload<Flex>>;

/// Every frozen matrix goes through two slots, and slots are filled with NaN as soon as they may
/// be reused: a read of a weight after its slot was reused would break the bit-identity checks.
fn ring_of_two() -> OffloadConfig {
    OffloadConfig::default()
        .with_ring_slots(2)
        .with_direct_threshold(0)
        .with_poisoning(true)
}

/// Trains the reference and the streamed network with the same paths; returns the streamed
/// steps' statistics after checking bit-identity.
fn compare(config: OffloadConfig, paths: &[Path]) -> Vec<StepStats> {
    compare_with::<Lookahead>(config, paths)
}

/// [`compare`] with the prefetch policy `P`.
fn compare_with<P: PrefetchPolicy>(config: OffloadConfig, paths: &[Path]) -> Vec<StepStats> {
    let device = Default::default();
    let path = |step: usize| paths[step];
    let (_, expected) = train(
        net::<Autodiff<Flex>>(DType::F32, &device),
        DType::F32,
        paths.len(),
        Recompute::Off,
        path,
        |_| {},
    );
    let stream = WeightStream::<Autodiff<Offload<Flex, P>>>::new(&device, config).unwrap();
    let model = stream
        .stream_frozen(net::<Autodiff<Offload<Flex, P>>>(DType::F32, &device))
        .unwrap();
    let mut stats = Vec::new();
    let (_, records) = train(
        model,
        DType::F32,
        paths.len(),
        Recompute::Off,
        path,
        |begin| {
            if begin {
                stream.begin_step();
            } else {
                stats.push(stream.end_step());
            }
        },
    );
    assert_eq!(records, expected);
    stats
}

#[test]
fn a_changed_order_falls_back_on_demand_then_replays_the_new_one() {
    use Path::{All, Skip};
    let stats = compare(ring_of_two(), &[All, All, Skip(1), Skip(1), All]);
    let outcomes: Vec<ScheduleOutcome> = stats.iter().map(|s| s.schedule).collect();
    // 16 uses with three blocks (9 forward, 7 backward), 10 with two (6 + 4); the order first
    // differs at the fourth use, where block 1's projection is no longer next.
    assert_eq!(
        outcomes,
        vec![
            ScheduleOutcome::Recorded { uses: 16 },
            ScheduleOutcome::Replayed { uses: 16 },
            ScheduleOutcome::Diverged { at: 3, uses: 10 },
            ScheduleOutcome::Replayed { uses: 10 },
            ScheduleOutcome::Diverged { at: 3, uses: 16 },
        ]
    );
    assert_eq!((stats[2].prefetched, stats[2].on_demand), (3, 7));
    // Replayed: the four backward uses find their weights kept since the forward.
    assert_eq!(
        (stats[3].prefetched, stats[3].on_demand, stats[3].kept),
        (6, 0, 4)
    );
    assert_eq!((stats[4].prefetched, stats[4].on_demand), (3, 13));
}

#[test]
fn steps_that_take_turns_between_two_orders_replay_both() {
    use Path::{All, Skip};
    // Skipping the first block changes the first weight used: a model run two ways (as two
    // experts taking turns), each replayed from its own recording.
    let stats = compare(ring_of_two(), &[All, Skip(0), Skip(0), All, Skip(0), All]);
    let outcomes: Vec<ScheduleOutcome> = stats.iter().map(|s| s.schedule).collect();
    assert_eq!(
        outcomes,
        vec![
            ScheduleOutcome::Recorded { uses: 16 },
            ScheduleOutcome::Recorded { uses: 10 },
            ScheduleOutcome::Replayed { uses: 10 },
            ScheduleOutcome::Replayed { uses: 16 },
            ScheduleOutcome::Replayed { uses: 10 },
            ScheduleOutcome::Replayed { uses: 16 },
        ]
    );
    for s in &stats[2..] {
        assert_eq!(s.on_demand, 0, "{s:?}");
        assert!(s.prefetched > 0, "{s:?}");
    }
}

#[test]
fn one_fence_frees_half_the_ring() {
    // A slot read by an op is reusable only after a fence; one fence frees every slot
    // released before it, and is taken once half the ring is released (or the loader asks).
    // Fetched on demand through eight slots: a fence for every four releases, and one at the
    // end of the step. Through two, one per release.
    let fences = |stats: &[StepStats], per_fence: u64| {
        for s in &stats[1..] {
            let releases = s.prefetched + s.on_demand;
            assert!(releases >= 8, "{s:?}");
            assert!(
                s.fences * per_fence >= releases && s.fences <= releases.div_ceil(per_fence) + 1,
                "{} fences for {releases} releases",
                s.fences
            );
        }
    };
    let paths = [Path::All; 4];
    fences(
        &compare_with::<OnDemand>(ring_of_two().with_ring_slots(8), &paths),
        4,
    );
    fences(&compare(ring_of_two(), &paths), 1);
}

#[test]
fn small_weights_take_the_direct_path() {
    let config = ring_of_two().with_direct_threshold(1 << 20);
    let stats = compare(config, &[Path::All; 2]);
    for s in &stats {
        assert_eq!((s.direct, s.prefetched, s.on_demand), (16, 0, 0));
        assert_eq!(s.ring_bytes, 0);
    }
}

#[test]
fn with_room_for_everything_weights_are_uploaded_once() {
    let frozen_bytes = 3 * 4 * (DIM * DIM + 2 * DIM * common::HIDDEN) as u64;
    let config = ring_of_two().with_vram_budget(frozen_bytes);
    let stats = compare(config, &[Path::All; 3]);
    // Resident from the start: each weight is uploaded at its first use and kept.
    assert_eq!(stats[0].bytes_uploaded, frozen_bytes);
    assert_eq!(stats[0].resident_hits, 16 - 9);
    for s in &stats[1..] {
        assert_eq!((s.resident_hits, s.bytes_uploaded), (16, 0));
        assert_eq!((s.resident_bytes, s.ring_bytes), (frozen_bytes, 0));
    }
}

/// Output and input gradient of a frozen 3x3 convolution (its weights from `seed`), as bits.
fn conv_step<B: burn::tensor::backend::AutodiffBackend>(
    conv: &burn::nn::conv::Conv2d<B>,
    device: &B::Device,
) -> (Vec<u32>, Vec<u32>) {
    let values = common::values(11, 2 * 3 * 8 * 8, 1.0);
    let x = Tensor::<B, 1>::from_floats(values.as_slice(), device)
        .reshape([2, 3, 8, 8])
        .require_grad();
    let y = conv.forward(x.clone());
    let grads = y.clone().powi_scalar(2).sum().backward();
    let dx = x.grad(&grads).unwrap();
    (bits(y.into_data()), bits(dx.into_data()))
}

fn conv<B: Backend>(device: &B::Device) -> burn::nn::conv::Conv2d<B> {
    B::seed(device, 5);
    burn::nn::conv::Conv2dConfig::new([3, 8], [3, 3])
        .with_padding(burn::nn::PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init(device)
        .no_grad()
}

#[test]
fn a_convolutions_weight_streams_through_the_ring_both_ways() {
    let device = Default::default();
    let expected = conv_step(&conv::<Autodiff<Flex>>(&device), &device);
    let stream = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = stream.stream_frozen(conv::<A>(&device)).unwrap();
    let mut stats = Vec::new();
    for _ in 0..3 {
        stream.begin_step();
        assert_eq!(conv_step(&model, &device), expected);
        stats.push(stream.end_step());
    }
    // The forward and the input gradient each use the weight; nothing is materialized.
    assert_eq!(stats[0].schedule, ScheduleOutcome::Recorded { uses: 2 });
    for s in &stats {
        assert_eq!((s.weight_uses, s.materialized), (2, 0), "{s:?}");
    }
    for s in &stats[1..] {
        assert_eq!(s.schedule, ScheduleOutcome::Replayed { uses: 2 });
        assert_eq!(s.on_demand, 0, "{s:?}");
    }
}

#[test]
fn a_weight_met_outside_the_linear_ops_is_materialized() {
    let device = Default::default();
    let stream = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = stream.stream_frozen(net::<A>(DType::F32, &device)).unwrap();
    let original = bits(
        net::<Flex>(DType::F32, &device).blocks[0]
            .proj
            .weight
            .val()
            .into_data(),
    );

    stream.begin_step();
    let weight = model.blocks[0].proj.weight.val();
    let doubled = weight.clone() * 2.0;
    // Every slot of the ring is reused several times (poisoned in between).
    let x = Tensor::<A, 2>::from_data(data(7, [4, DIM], 1.0, DType::F32), &device);
    let _ = model.forward(x, Path::All).into_data();
    let stats = stream.end_step();

    assert_eq!(stats.materialized, 1);
    assert_eq!(stats.materialized_bytes, (DIM * DIM * 4) as u64);
    let halved = bits((doubled / 2.0).into_data());
    assert_eq!(halved, original);
    // Reading a streamed weight's values goes to host memory, not through the device.
    assert_eq!(bits(weight.into_data()), original);
}

/// Frozen layers applied to every token, and a modulation layer applied to one summary token:
/// its transfer is the one compute cannot hide.
#[derive(Module, Debug)]
struct Modulated<B: Backend> {
    layers: Vec<Linear<B>>,
    modulation: Linear<B>,
}

/// A DIM x DIM layer without bias, its weights drawn from `seed`.
fn square<B: Backend>(seed: u64, device: &B::Device) -> Linear<B> {
    Linear {
        weight: burn::module::Param::from_data(data(seed, [DIM, DIM], 0.25, DType::F32), device),
        bias: None,
    }
}

impl<B: Backend> Modulated<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..3).map(|seed| square(seed, device)).collect(),
            modulation: square(9, device),
        }
        .no_grad()
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let scale = self.modulation.forward(x.clone().mean_dim(0));
        self.layers
            .iter()
            .fold(x, |h, layer| layer.forward(h) * scale.clone())
    }
}

/// A token embedding four times the size of each of the two matrices after it, as a text
/// encoder's is.
#[derive(Module, Debug)]
struct Encoder<B: Backend> {
    embedding: Embedding<B>,
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Encoder<B> {
    const VOCAB: usize = 4 * DIM;

    fn new(device: &B::Device) -> Self {
        let matrix =
            |seed, rows| Param::from_data(data(seed, [rows, DIM], 0.25, DType::F32), device);
        Self {
            embedding: Embedding {
                weight: matrix(1, Self::VOCAB),
            },
            layers: (2..4)
                .map(|seed| Linear {
                    weight: matrix(seed, DIM),
                    bias: None,
                })
                .collect(),
        }
        .no_grad()
    }

    fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let x = self.embedding.forward(ids);
        self.layers.iter().fold(x, |h, layer| layer.forward(h))
    }
}

#[test]
fn the_ring_is_sized_for_the_matrices_not_an_outsized_embedding() {
    let device = Default::default();
    let ids = || {
        let ids: Vec<i64> = (0..8)
            .map(|i| (i * 13 % Encoder::<Flex>::VOCAB) as i64)
            .collect();
        TensorData::new(ids, [1, 8])
    };
    let expected = bits(
        Encoder::<Flex>::new(&device)
            .forward(Tensor::from_data(ids(), &device))
            .into_data(),
    );
    let stream = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = stream.stream_frozen(Encoder::<A>::new(&device)).unwrap();
    stream.begin_step();
    let out = model.forward(Tensor::from_data(ids(), &device));
    assert_eq!(bits(out.into_data()), expected);
    let stats = stream.end_step();
    let matrix_bytes = (DIM * DIM * size_of::<f32>()) as u64;
    assert_eq!(
        stats.ring_bytes,
        2 * matrix_bytes,
        "two slots of one matrix"
    );
    // The lookup is no linear op: the embedding is uploaded whole for it, outside the ring.
    assert_eq!((stats.materialized, stats.on_demand), (1, 2));
}

#[test]
fn the_planner_keeps_the_weight_whose_transfer_cannot_be_hidden() {
    use Route::{Resident as R, Ring as S};
    let weight_bytes = (DIM * DIM * 4) as u64;
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_data(data(7, [64, DIM], 1.0, DType::F32), &device);
    let expected = bits(
        Modulated::<Flex>::new(&device)
            .forward(x.clone())
            .into_data(),
    );
    // (budget in weights, routes before any step from sizes alone, routes after a step)
    let cases = [
        (0, vec![S, S, S, S], vec![S, S, S, S]),
        // One weight besides the two-slot ring: from sizes alone the first registered; after
        // a step, the modulation layer (one token: 64 times less compute for the same bytes).
        (3, vec![R, S, S, S], vec![S, S, S, R]),
        (4, vec![R, R, R, R], vec![R, R, R, R]),
    ];
    for (budget, before, after) in cases {
        let config = ring_of_two()
            .with_vram_budget(budget * weight_bytes)
            .with_rates(1e9, 1e12);
        let stream = WeightStream::<A>::new(&device, config).unwrap();
        let model = stream.stream_frozen(Modulated::<A>::new(&device)).unwrap();
        let routes = |stream: &WeightStream<A>| -> Vec<Route> {
            stream.routes().into_iter().map(|(_, r)| r).collect()
        };
        assert_eq!(routes(&stream), before, "budget {budget}");
        let names: Vec<String> = stream.routes().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.1.weight",
                "layers.2.weight",
                "modulation.weight"
            ]
        );
        for _ in 0..2 {
            stream.begin_step();
            let x = Tensor::<A, 2>::from_data(x.to_data(), &device);
            let out = model.forward(x);
            assert_eq!(bits(out.into_data()), expected, "budget {budget}");
            stream.end_step();
            assert_eq!(routes(&stream), after, "budget {budget}");
        }
    }
}

#[test]
fn a_larger_budget_moves_the_weights_in_at_once_and_drops_the_ring() {
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_data(data(7, [64, DIM], 1.0, DType::F32), &device);
    let expected = bits(
        Modulated::<Flex>::new(&device)
            .forward(x.clone())
            .into_data(),
    );
    let stream = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = stream.stream_frozen(Modulated::<A>::new(&device)).unwrap();
    let step = || {
        stream.begin_step();
        let out = model.forward(Tensor::<A, 2>::from_data(x.to_data(), &device));
        assert_eq!(bits(out.into_data()), expected);
        stream.end_step()
    };
    let streamed = step();
    assert_eq!((streamed.prefetched, streamed.ring_bytes), (0, 2 * 1024));
    stream
        .reconfigure(stream.config().with_vram_budget(1 << 30))
        .unwrap();
    // The new plan's resident copies are uploaded by the reconfiguration, not by a step.
    assert_eq!(stream.memory_plan().resident_bytes, 4 * 1024);
    for _ in 0..2 {
        let resident = step();
        assert_eq!((resident.resident_hits, resident.ring_bytes), (4, 0));
        assert_eq!(
            (resident.resident_bytes, resident.bytes_uploaded),
            (4 * 1024, 0)
        );
    }
}

#[test]
fn activation_headroom_comes_out_of_the_budget() {
    let weight_bytes = (DIM * DIM * 4) as u64;
    let device = Default::default();
    let config = ring_of_two()
        .with_vram_budget(3 * weight_bytes)
        .with_rates(1e9, 1e12);
    let stream = WeightStream::<A>::new(&device, config).unwrap();
    let model = stream.stream_frozen(Modulated::<A>::new(&device)).unwrap();
    stream.begin_step();
    let x = Tensor::<A, 2>::from_data(data(7, [64, DIM], 1.0, DType::F32), &device);
    let _ = model.forward(x).into_data();
    stream.end_step();
    assert_eq!(stream.routes()[3].1, Route::Resident);
    // What is left after the headroom holds the ring and nothing else.
    stream
        .reconfigure(stream.config().with_activation_headroom(weight_bytes))
        .unwrap();
    assert!(stream.routes().iter().all(|(_, r)| *r == Route::Ring));
}

#[test]
fn weights_that_fit_only_in_their_wire_format_stay_resident_in_it() {
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_data(data(7, [64, DIM], 1.0, DType::F32), &device);
    let wire = ring_of_two()
        .with_wire(WireFormat::Bf16)
        .with_rates(1e9, 1e12);
    let run = |config: OffloadConfig| {
        let stream = WeightStream::<A>::new(&device, config).unwrap();
        let model = stream.stream_frozen(Modulated::<A>::new(&device)).unwrap();
        let outputs: Vec<_> = (0..2)
            .map(|_| {
                stream.begin_step();
                let out = model.forward(Tensor::<A, 2>::from_data(x.to_data(), &device));
                let out = bits(out.into_data());
                stream.end_step();
                out
            })
            .collect();
        (outputs, stream.routes(), stream.memory_plan())
    };
    let (streamed, _, _) = run(wire.clone());
    // Four matrices: 4 x DIM² f32 decoded, half that in bfloat16. The budget holds the latter
    // and less than what decoding one of them adds.
    let decoded = (4 * DIM * DIM * 4) as u64;
    let (outputs, routes, plan) = run(wire.with_vram_budget(decoded / 2 + (DIM * DIM) as u64));
    assert!(
        routes.iter().all(|(_, r)| *r == Route::Compact),
        "{routes:?}"
    );
    assert_eq!(plan.resident_bytes, decoded / 2);
    // Cast at each use, the weights compute what the streamed bfloat16 payloads decode to.
    assert_eq!(outputs, streamed);
}

/// Frozen layers each applied twice in a row: every weight's two forward uses are adjacent, and
/// so are its two backward uses, as a checkpointed block's recompute and backward are.
#[derive(Module, Debug)]
struct Twice<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Twice<B> {
    const LAYERS: usize = 16;

    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..Self::LAYERS as u64)
                .map(|seed| square(seed, device))
                .collect(),
        }
        .no_grad()
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.layers
            .iter()
            .fold(x, |h, layer| layer.forward(layer.forward(h)))
    }
}

#[test]
fn a_compact_weight_keeps_its_decoded_copy_until_its_next_use() {
    let device = Default::default();
    let x = data(7, [8, DIM], 1.0, DType::F32);
    let wire = ring_of_two()
        .with_wire(WireFormat::Bf16)
        .with_rates(1e9, 1e12)
        .with_retain_window(1);
    // The output and the input's gradient of three steps, with each step's statistics.
    let run = |config: OffloadConfig| {
        let stream = WeightStream::<A>::new(&device, config).unwrap();
        let model = stream.stream_frozen(Twice::<A>::new(&device)).unwrap();
        let (mut records, mut stats) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            stream.begin_step();
            let x = Tensor::<A, 2>::from_data(x.clone(), &device).require_grad();
            let out = model.forward(x.clone());
            let grads = out.clone().sum().backward();
            let grad = x.grad(&grads).unwrap();
            records.push((bits(out.into_data()), bits(grad.into_data())));
            stats.push(stream.end_step());
        }
        (records, stats, stream.routes(), stream.memory_plan())
    };
    let (streamed, _, _, _) = run(wire.clone());
    // Every matrix in bfloat16 (half its f32 bytes), and one matrix decoded: kept between two
    // adjacent uses (the last layer's too: its second forward use and first backward use), it
    // saves 33 decodings a step, where decoding two matrices at load would save 8.
    let matrix = (DIM * DIM * 4) as u64;
    let budget = Twice::<A>::LAYERS as u64 * matrix / 2 + matrix;
    let (records, stats, routes, plan) = run(wire.with_vram_budget(budget));
    assert!(
        routes.iter().all(|(_, r)| *r == Route::Compact),
        "{routes:?}"
    );
    assert_eq!(plan.retained_bytes, matrix);
    let replayed = &stats[2];
    assert_eq!(replayed.weight_uses, 64);
    assert_eq!((replayed.kept, replayed.resident_hits), (33, 31));
    // The kept copies are what each use would decode.
    assert_eq!(records, streamed);
}

#[test]
fn a_probe_measures_what_a_step_needs_beyond_the_weights_and_the_budget_then_holds_it() {
    use Route::{Resident as R, Ring as S};
    let w = (DIM * DIM * 4) as u64;
    // A device on which 5000 bytes are in use besides the engine's weights.
    let beyond = 5000;
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_data(data(7, [64, DIM], 1.0, DType::F32), &device);
    let expected = bits(
        Modulated::<Flex>::new(&device)
            .forward(x.clone())
            .into_data(),
    );
    let config = ring_of_two().with_rates(1e9, 1e12);
    let stream = WeightStream::<A>::new(&device, config.clone())
        .unwrap()
        .with_memory_probe(Arc::new(move |weights| Some(weights + beyond)));
    let model = stream.stream_frozen(Modulated::<A>::new(&device)).unwrap();
    let step = || {
        stream.begin_step();
        let out = model.forward(Tensor::<A, 2>::from_data(x.to_data(), &device));
        assert_eq!(bits(out.into_data()), expected);
        stream.end_step()
    };
    assert_eq!(stream.memory_beyond_weights(), Some(beyond));
    // Budget 0: every weight streams through two slots of one weight each.
    let streamed = step();
    assert_eq!(streamed.peak_beyond_weights, Some(beyond));
    assert_eq!(streamed.peak_device_bytes, Some(2 * w + beyond));

    // The headroom and the ring of everything streamed need 2 w + 5000.
    let short = config
        .clone()
        .with_vram_budget(2 * w + beyond - 1)
        .with_activation_headroom(beyond);
    let err = stream.reconfigure(short).unwrap_err();
    assert!(
        matches!(err, OffloadError::BudgetTooSmall { needed, ring, .. }
            if needed == 2 * w + beyond && ring == 2 * w),
        "{err}"
    );
    assert_eq!(
        stream.config(),
        config,
        "a refused configuration changes nothing"
    );

    // One weight more: the one whose transfer cannot hide stays.
    let budget = 3 * w + beyond;
    stream
        .reconfigure(
            config
                .with_vram_budget(budget)
                .with_activation_headroom(beyond),
        )
        .unwrap();
    let routes: Vec<Route> = stream.routes().into_iter().map(|(_, r)| r).collect();
    assert_eq!(routes, vec![S, S, S, R]);
    assert_eq!(
        stream.memory_plan(),
        MemoryPlan {
            vram_budget: budget,
            activation_headroom: beyond,
            margin: 0,
            resident_weights: 1,
            resident_bytes: w,
            streamed_weights: 3,
            ring_bytes: 2 * w,
            retained_bytes: 0,
        }
    );
    for _ in 0..2 {
        let stats = step();
        assert_eq!(stats.peak_beyond_weights, Some(beyond));
        assert_eq!(stats.peak_device_bytes, Some(budget));
        assert_eq!((stats.resident_bytes, stats.ring_bytes), (w, 2 * w));
    }

    // A ring of four slots where the budget holds three beside the headroom: it keeps three,
    // and every weight streams through them.
    let budget = 3 * w + beyond;
    stream
        .reconfigure(
            ring_of_two()
                .with_rates(1e9, 1e12)
                .with_ring_slots(4)
                .with_vram_budget(budget)
                .with_activation_headroom(beyond),
        )
        .unwrap();
    assert_eq!(stream.config().ring_slots, 3);
    assert_eq!(
        (
            stream.memory_plan().resident_weights,
            stream.memory_plan().ring_bytes
        ),
        (0, 3 * w)
    );
    for _ in 0..2 {
        let stats = step();
        assert_eq!(stats.peak_device_bytes, Some(budget));
        assert_eq!((stats.resident_bytes, stats.ring_bytes), (0, 3 * w));
    }
}

#[test]
fn without_a_probe_the_cpu_reports_no_memory() {
    let device = Default::default();
    let stream = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = stream.stream_frozen(net::<A>(DType::F32, &device)).unwrap();
    assert_eq!(stream.memory_beyond_weights(), None);
    stream.begin_step();
    let x = Tensor::<A, 2>::from_data(data(7, [4, DIM], 1.0, DType::F32), &device);
    let _ = model.forward(x, Path::All).into_data();
    let stats = stream.end_step();
    assert_eq!(
        (stats.peak_device_bytes, stats.peak_beyond_weights),
        (None, None)
    );
}

#[test]
fn bad_configuration_and_bad_weights_are_refused_with_names() {
    let device = Default::default();
    let err = WeightStream::<A>::new(&device, OffloadConfig::default().with_ring_slots(1))
        .err()
        .unwrap();
    assert!(matches!(err, OffloadError::RingTooSmall { found: 1 }));

    let stream = WeightStream::<A>::new(&device, OffloadConfig::default()).unwrap();
    let values = TensorData::new(vec![1.0f32; 6], [2, 3]);
    let err = stream
        .streamed_tensor::<3>("head.weight", values.clone())
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "`head.weight` has shape [2, 3], not a tensor of rank 3"
    );
    let short = TensorData::from_bytes_vec(vec![0u8; 20], [2, 3], DType::F32);
    let err = stream
        .streamed_tensor::<2>("head.weight", short)
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "`head.weight` has 20 bytes, its shape [2, 3] and dtype F32 need 24"
    );
    let ok = stream
        .streamed_tensor::<2>("head.weight", values.clone())
        .unwrap();
    assert_eq!(ok.into_data(), values);
}

#[test]
fn a_second_stream_adopts_the_streamed_weights_and_streams_them_itself() {
    let device = Default::default();
    let first = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let model = first.stream_frozen(net::<A>(DType::F32, &device)).unwrap();
    let second = WeightStream::<A>::new(&device, ring_of_two()).unwrap();
    let adopted = second.adopt(model.clone());
    assert_eq!(second.routes(), first.routes());
    assert!(!second.routes().is_empty());

    let x = Tensor::<A, 2>::from_data(data(7, [4, DIM], 1.0, DType::F32), &device);
    let forward = |stream: &WeightStream<A>, model: &common::Net<A>| {
        stream.begin_step();
        let out = bits(model.forward(x.clone(), Path::All).into_data());
        (out, stream.end_step())
    };
    let (expected, _) = forward(&first, &model);
    let (out, stats) = forward(&second, &adopted);
    assert_eq!(out, expected);
    assert!(stats.bytes_uploaded > 0, "the second stream uploads them");
    // The adapters stay trainable, with the same ids.
    let (a, b) = (&adopted.blocks[0].fc1.a, &model.blocks[0].fc1.a);
    assert!(a.val().is_require_grad() && b.val().is_require_grad());
    assert_eq!(a.id, b.id);
}
