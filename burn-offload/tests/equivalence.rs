//! Training with every frozen weight streamed through a ring of two slots gives bit-identical
//! outputs, gradients and adapter weights to the same model computed resident.

mod common;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_offload::{
    Offload, OffloadBackend, OffloadConfig, OnDemand, Route, ScheduleOutcome, StepStats,
    WeightStream, WireFormat,
};
use burn_quant::{FloatBytes, FloatDtype, Fp8Format, Fp8Tensor, Granularity};
use common::{Path, Recompute, StepRecord, net, train};

const STEPS: usize = 3;

/// Every frozen matrix goes through two slots, and slots are filled with NaN as soon as they may
/// be reused: a read of a weight after its slot was reused would break the bit-identity checks.
fn ring_of_two() -> OffloadConfig {
    OffloadConfig::default()
        .with_ring_slots(2)
        .with_direct_threshold(0)
        .with_poisoning(true)
}

fn reference<A: AutodiffBackend<Device = burn::backend::flex::FlexDevice>>(
    dtype: DType,
    recompute: Recompute,
) -> Vec<StepRecord> {
    let device = Default::default();
    train(
        net::<A>(dtype, &device),
        dtype,
        STEPS,
        recompute,
        |_| Path::All,
        |_| {},
    )
    .1
}

fn streamed<A>(
    dtype: DType,
    recompute: Recompute,
    config: OffloadConfig,
) -> (Vec<StepRecord>, Vec<StepStats>)
where
    A: AutodiffBackend<Device = burn::backend::flex::FlexDevice> + OffloadBackend,
{
    let device = Default::default();
    let stream = WeightStream::<A>::new(&device, config).unwrap();
    let model = stream.stream_frozen(net::<A>(dtype, &device)).unwrap();
    assert!(stream.routes().iter().all(|(_, r)| *r == Route::Ring));
    let mut stats = Vec::new();
    let (_, records) = train(
        model,
        dtype,
        STEPS,
        recompute,
        |_| Path::All,
        |begin| {
            if begin {
                stream.begin_step();
            } else {
                stats.push(stream.end_step());
            }
        },
    );
    (records, stats)
}

/// Weight uses per step: 9 frozen linears forward; 7 in backward (in the first block, the
/// projection and the first MLP layer's base see only the input data, which needs no
/// gradient); with block recomputation, 9 more forward uses, and every block's input requires a
/// gradient.
fn uses(recompute: Recompute) -> usize {
    match recompute {
        Recompute::Off => 9 + 7,
        Recompute::Blocks => 9 + 9 + 9,
    }
}

/// Frozen matrices of the network: each crosses the bus once per replayed step, as every later
/// use comes within the default retain window and finds it kept.
const WEIGHTS: usize = 9;

fn check_schedule(stats: &[StepStats], recompute: Recompute) {
    let n = uses(recompute);
    assert_eq!(stats[0].schedule, ScheduleOutcome::Recorded { uses: n });
    assert_eq!(stats[0].on_demand, n as u64);
    for s in &stats[1..] {
        assert_eq!(s.schedule, ScheduleOutcome::Replayed { uses: n });
        assert_eq!(
            (s.prefetched, s.kept, s.on_demand),
            (WEIGHTS as u64, (n - WEIGHTS) as u64, 0)
        );
        assert_eq!(s.materialized, 0, "a streamed weight left the linear ops");
    }
}

#[test]
fn a_narrower_retain_window_keeps_fewer_uses_with_the_same_results() {
    let expected = reference::<Autodiff<Flex>>(DType::F32, Recompute::Blocks);
    // (window, kept per replayed step): 5 holds each block's recompute -> backward (spans of
    // 1, 3 and 5 uses) and the last block's forward -> recompute (3); 0 keeps nothing.
    for (window, kept) in [(5, 12), (0, 0)] {
        let config = ring_of_two().with_retain_window(window);
        let (records, stats) =
            streamed::<Autodiff<Offload<Flex>>>(DType::F32, Recompute::Blocks, config);
        assert_eq!(records, expected, "window {window}");
        let n = uses(Recompute::Blocks) as u64;
        for s in &stats[1..] {
            assert_eq!((s.prefetched, s.kept), (n - kept, kept), "window {window}");
            assert_eq!(s.on_demand, 0);
        }
    }
}

#[test]
fn f32_streamed_equals_resident_without_checkpointing() {
    for recompute in [Recompute::Off, Recompute::Blocks] {
        let expected = reference::<Autodiff<Flex>>(DType::F32, recompute);
        let (records, stats) =
            streamed::<Autodiff<Offload<Flex>>>(DType::F32, recompute, ring_of_two());
        assert_eq!(records, expected, "{recompute:?}");
        check_schedule(&stats, recompute);
    }
}

#[test]
fn f32_streamed_equals_resident_with_balanced_checkpointing() {
    for recompute in [Recompute::Off, Recompute::Blocks] {
        let expected = reference::<Autodiff<Flex, BalancedCheckpointing>>(DType::F32, recompute);
        let (records, stats) = streamed::<Autodiff<Offload<Flex>, BalancedCheckpointing>>(
            DType::F32,
            recompute,
            ring_of_two(),
        );
        assert_eq!(records, expected, "{recompute:?}");
        check_schedule(&stats, recompute);
    }
}

#[test]
fn bf16_streamed_equals_resident() {
    let expected = reference::<Autodiff<Flex>>(DType::BF16, Recompute::Blocks);
    let (records, stats) =
        streamed::<Autodiff<Offload<Flex>>>(DType::BF16, Recompute::Blocks, ring_of_two());
    assert_eq!(records, expected);
    check_schedule(&stats, Recompute::Blocks);
}

#[test]
fn without_lookahead_every_use_is_fetched_on_demand() {
    let expected = reference::<Autodiff<Flex>>(DType::F32, Recompute::Blocks);
    let (records, stats) =
        streamed::<Autodiff<Offload<Flex, OnDemand>>>(DType::F32, Recompute::Blocks, ring_of_two());
    assert_eq!(records, expected);
    let n = uses(Recompute::Blocks) as u64;
    assert_eq!((stats[0].prefetched, stats[0].on_demand), (0, n));
    for s in &stats[1..] {
        assert_eq!((s.prefetched, s.kept), (0, n - WEIGHTS as u64));
        assert_eq!(s.on_demand, WEIGHTS as u64);
    }
}

/// The reference for an FP8 wire format: the same network whose frozen matrices hold the values
/// burn-quant's CPU quantizer and decoder give.
fn fp8_reference(format: Fp8Format) -> Vec<StepRecord> {
    type A = Autodiff<Flex>;
    let device = Default::default();
    let mut model = net::<A>(DType::F32, &device);
    for block in &mut model.blocks {
        for linear in [&mut block.proj, &mut block.fc1.base, &mut block.fc2.base] {
            let weight = linear.weight.val();
            let shape = weight.dims().to_vec();
            let data = weight.into_data();
            let q = Fp8Tensor::quantize(
                FloatBytes::new(FloatDtype::F32, &data.bytes).unwrap(),
                &shape,
                format,
                Granularity::Block64,
            );
            let decoded =
                Tensor::<A, 2>::from_data(TensorData::new(q.dequantize(), shape), &device);
            linear.weight = Param::from_tensor(decoded).set_require_grad(false);
        }
    }
    train(
        model,
        DType::F32,
        STEPS,
        Recompute::Off,
        |_| Path::All,
        |_| {},
    )
    .1
}

#[test]
fn fp8_wire_formats_equal_the_cpu_dequantized_model() {
    for (wire, format) in [
        (WireFormat::E4M3, Fp8Format::E4M3),
        (WireFormat::E5M2, Fp8Format::E5M2),
    ] {
        let (records, _) = streamed::<Autodiff<Offload<Flex>>>(
            DType::F32,
            Recompute::Off,
            ring_of_two().with_wire(wire),
        );
        assert_eq!(records, fp8_reference(format), "{wire:?}");
        // And they are not the resident f32 model.
        assert_ne!(
            records,
            reference::<Autodiff<Flex>>(DType::F32, Recompute::Off)
        );
    }
}

#[test]
fn fp8_weights_decoded_ahead_by_the_loader_train_the_same() {
    let expected = fp8_reference(Fp8Format::E5M2);
    for (decode_ahead, retain_window) in [(false, 32), (true, 0), (true, 32)] {
        let config = ring_of_two()
            .with_wire(WireFormat::E5M2)
            .with_retain_window(retain_window)
            .with_decode_ahead(decode_ahead);
        let (records, stats) =
            streamed::<Autodiff<Offload<Flex>>>(DType::F32, Recompute::Off, config);
        let case = format!("decode_ahead {decode_ahead}, retain_window {retain_window}");
        assert_eq!(records, expected, "{case}");
        // The recording step fetches on demand. In the replayed ones the loader decodes every
        // prefetched weight, but for the first use of a weight kept for its second: the compute
        // decodes that one into the copy it keeps.
        assert_eq!(stats[0].prepared, 0, "{case}");
        for s in &stats[1..] {
            let prepared = if decode_ahead {
                s.prefetched - s.kept
            } else {
                0
            };
            assert_eq!(s.prepared, prepared, "{case}: {s:?}");
            assert_eq!(s.prepared > 0, decode_ahead, "{case}");
        }
    }
    // A weight in its own dtype has nothing to decode.
    let (_, stats) = streamed::<Autodiff<Offload<Flex>>>(
        DType::F32,
        Recompute::Off,
        ring_of_two().with_decode_ahead(true),
    );
    assert!(stats.iter().all(|s| s.prepared == 0));
}
