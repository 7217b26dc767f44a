//! `burnlora quantize` and `burnlora inspect`, run as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_quant::{FloatBytes, FloatDtype, Fp8Format, Fp8Tensor, Granularity};
use safetensors::{Dtype, SafeTensors};

fn burnlora(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_burnlora"))
        .args(args)
        .output()
        .expect("runs")
}

fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/model.safetensors")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn quantizes_the_tiny_model_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("q.safetensors");
    let out = burnlora(&[
        "quantize",
        "--format",
        "e5m2",
        "--scale",
        "none",
        "--exclude",
        "^txt_in",
        tiny_model().to_str().unwrap(),
        output.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));

    let input_bytes = std::fs::read(tiny_model()).unwrap();
    let input = SafeTensors::deserialize(&input_bytes).unwrap();
    let output_bytes = std::fs::read(&output).unwrap();
    let quantized = SafeTensors::deserialize(&output_bytes).unwrap();
    assert_eq!(
        quantized.len(),
        input.len(),
        "no scale keys with --scale none"
    );
    let mut fp8 = 0;
    for (name, view) in input.tensors() {
        let got = quantized.tensor(&name).unwrap();
        assert_eq!(got.shape(), view.shape(), "{name}");
        let quantize = view.shape().len() >= 2 && !name.starts_with("txt_in");
        if quantize {
            fp8 += 1;
            assert_eq!(got.dtype(), Dtype::F8_E5M2, "{name}");
            let src = FloatBytes::new(
                FloatDtype::from_safetensors(view.dtype()).unwrap(),
                view.data(),
            )
            .unwrap();
            let expected: Vec<u8> = src
                .to_f32_vec()
                .iter()
                .map(|&x| Fp8Format::E5M2.encode(x))
                .collect();
            assert_eq!(got.data(), &expected[..], "{name}");
        } else {
            assert_eq!(got.dtype(), view.dtype(), "{name}");
            assert_eq!(got.data(), view.data(), "{name}");
        }
    }
    assert!(fp8 > 10);
    let (_, header) = SafeTensors::read_metadata(&output_bytes).unwrap();
    let metadata = header.metadata().clone().unwrap();
    assert_eq!(metadata["fp8_format"], "e5m2");
    assert_eq!(metadata["fp8_scale"], "none");
    assert_eq!(metadata["model"], "tiny FLUX-shaped example");
}

#[test]
fn block_scales_are_stored_beside_each_weight() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("q.safetensors");
    let out = burnlora(&[
        "quantize",
        tiny_model().to_str().unwrap(),
        output.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bytes = std::fs::read(&output).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let weight = st.tensor("single_blocks.0.linear2.weight").unwrap();
    assert_eq!(weight.dtype(), Dtype::F8_E4M3);
    let scales = st.tensor("single_blocks.0.linear2.scale_weight").unwrap();
    assert_eq!(scales.dtype(), Dtype::F32);
    let [rows, cols] = weight.shape() else {
        panic!()
    };
    assert_eq!(scales.shape(), &[*rows, cols.div_ceil(64)]);

    let ckpt = burn_quant::Checkpoint::open(&output).unwrap();
    let q = burn_quant::read_fp8(&ckpt, "single_blocks.0.linear2.weight")
        .unwrap()
        .unwrap();
    assert_eq!(q.spec.granularity, Granularity::Block64);
    let original = burn_quant::Checkpoint::open(&tiny_model()).unwrap();
    let t = original.get("single_blocks.0.linear2.weight").unwrap();
    let expected = Fp8Tensor::quantize(
        FloatBytes::new(FloatDtype::BF16, t.data).unwrap(),
        t.shape,
        Fp8Format::E4M3,
        Granularity::Block64,
    );
    assert_eq!(q, expected);

    let listing = burnlora(&["inspect", output.to_str().unwrap()]);
    assert!(listing.status.success());
    let text = String::from_utf8_lossy(&listing.stdout);
    assert!(
        text.contains("single_blocks.0.linear2.scale_weight"),
        "{text}"
    );
    assert!(text.contains("F8_E4M3"), "{text}");
    assert!(text.contains("metadata fp8_scale = block64"), "{text}");
}

#[test]
fn bad_input_is_named_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("q.safetensors");
    let out_str = output.to_str().unwrap();

    let missing = dir.path().join("missing.safetensors");
    let out = burnlora(&["quantize", missing.to_str().unwrap(), out_str]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("missing.safetensors"),
        "{}",
        stderr(&out)
    );

    let corrupt = dir.path().join("corrupt.safetensors");
    std::fs::write(
        &corrupt,
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": nonsense}",
    )
    .unwrap();
    let out = burnlora(&["quantize", corrupt.to_str().unwrap(), out_str]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("corrupt.safetensors"),
        "{}",
        stderr(&out)
    );

    let out = burnlora(&[
        "quantize",
        "--format",
        "e3m4",
        tiny_model().to_str().unwrap(),
        out_str,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("e3m4"), "{}", stderr(&out));

    let ints = dir.path().join("ints.safetensors");
    let data: Vec<u8> = (0..16u8).collect();
    let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![2, 2], &data).unwrap();
    safetensors::serialize_to_file([("steps", view)], None, &ints).unwrap();
    let out = burnlora(&[
        "quantize",
        "--include",
        "steps",
        ints.to_str().unwrap(),
        out_str,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("`steps`"), "{}", stderr(&out));

    assert!(!output.exists());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
