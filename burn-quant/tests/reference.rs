//! Bit-exactness against ml_dtypes (fixtures from tests/fixtures/make_fixtures.py).

use burn_quant::{FloatBytes, FloatDtype, Fp8Format, Fp8Tensor, Granularity};
use safetensors::SafeTensors;

const FIXTURE: &[u8] = include_bytes!("fixtures/fp8_reference.safetensors");

fn tensor<'a>(st: &'a SafeTensors<'a>, key: &str) -> &'a [u8] {
    st.tensor(key)
        .unwrap_or_else(|e| panic!("{key}: {e}"))
        .data()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn assert_codes(got: &[u8], expected: &[u8], inputs: impl Fn(usize) -> String, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    let wrong: Vec<String> = (0..got.len())
        .filter(|&i| got[i] != expected[i])
        .take(5)
        .map(|i| {
            format!(
                "{} -> {:#04x}, expected {:#04x}",
                inputs(i),
                got[i],
                expected[i]
            )
        })
        .collect();
    assert!(wrong.is_empty(), "{what}: {wrong:?}");
}

#[test]
fn f32_conversion_is_bit_exact() {
    let st = SafeTensors::deserialize(FIXTURE).unwrap();
    let input = f32s(tensor(&st, "f32_input"));
    for format in Fp8Format::ALL {
        let expected = tensor(&st, &format!("{format}_from_f32"));
        let got: Vec<u8> = input.iter().map(|&x| format.encode(x)).collect();
        assert_codes(&got, expected, |i| format!("{:e}", input[i]), format.name());
    }
}

#[test]
fn every_bf16_and_f16_value_converts_bit_exactly() {
    let st = SafeTensors::deserialize(FIXTURE).unwrap();
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
    for (dtype, name) in [(FloatDtype::BF16, "bf16"), (FloatDtype::F16, "f16")] {
        let src = FloatBytes::new(dtype, &all).unwrap();
        for format in Fp8Format::ALL {
            let q = Fp8Tensor::quantize(src, &[256, 256], format, Granularity::None);
            let expected = tensor(&st, &format!("{format}_from_{name}_all"));
            assert_codes(
                &q.data,
                expected,
                |i| format!("{name} bits {i:#06x}"),
                &format!("{format} from {name}"),
            );
        }
    }
}

#[test]
fn scaled_quantization_is_bit_exact() {
    let st = SafeTensors::deserialize(FIXTURE).unwrap();
    let view = st.tensor("scaled_input").unwrap();
    let input = f32s(view.data());
    for format in Fp8Format::ALL {
        for g in [Granularity::Tensor, Granularity::Row, Granularity::Block64] {
            let q = Fp8Tensor::quantize(FloatBytes::from_f32(&input), view.shape(), format, g);
            let scales = f32s(tensor(&st, &format!("{format}_{g}_scales")));
            assert_eq!(q.scales, scales, "{format} {g} scales");
            assert_codes(
                &q.data,
                tensor(&st, &format!("{format}_{g}_codes")),
                |i| format!("{:e}", input[i]),
                &format!("{format} {g}"),
            );
        }
    }
}
