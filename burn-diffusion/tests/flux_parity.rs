//! The FLUX.1 and FLUX.2 transformers against diffusers: fixtures made by
//! `tests/fixtures/make_fixtures.py` and `make_flux2_fixtures.py` (tiny random models, run by
//! diffusers 0.42.1), loaded from the diffusers folder, from the same weights in BFL layout,
//! and from a ComfyUI-style scaled-FP8 BFL file.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::FloatDType;
use burn_diffusion::LoadError;
use burn_diffusion::flux::{FluxCheckpoint, Layout, forward_file};
use burn_diffusion::flux2::Flux2Checkpoint;
use burn_quant::Checkpoint;

mod common;

use common::{BF16_TOLERANCE, F32_TOLERANCE, relative_error};

/// A family's `forward_file`: model, inputs, output, dtype, device.
type Forward = fn(&Path, &Path, &Path, FloatDType, &FlexDevice) -> Result<Vec<usize>, LoadError>;

/// A family's fixtures and its `forward_file`.
#[derive(Clone, Copy)]
struct Family {
    fixtures: &'static str,
    forward: Forward,
}

const FLUX1: Family = Family {
    fixtures: "flux",
    forward: forward_file::<Flex>,
};

const FLUX2: Family = Family {
    fixtures: "flux2",
    forward: burn_diffusion::flux2::forward_file::<Flex>,
};

impl Family {
    fn case(self, name: &str) -> PathBuf {
        common::fixture(self.fixtures).join(name)
    }
}

fn case(name: &str) -> PathBuf {
    FLUX1.case(name)
}

fn read(file: &Path, key: &str) -> Vec<f32> {
    common::read(file, key).0
}

/// Runs `model` on every input set of `case` through `forward_file`; returns the worst relative
/// error against the reference `key`.
fn worst_error(case_name: &str, model: &Path, shapes: usize, dtype: FloatDType, key: &str) -> f64 {
    family_error(FLUX1, case_name, model, shapes, dtype, key)
}

/// [`worst_error`] for `family`.
fn family_error(
    family: Family,
    case_name: &str,
    model: &Path,
    shapes: usize,
    dtype: FloatDType,
    key: &str,
) -> f64 {
    let case = |name: &str| family.case(name);
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    (0..shapes)
        .map(|k| {
            let inputs = case(case_name).join(format!("inputs_{k}.safetensors"));
            let output = dir.path().join(format!("output_{k}.safetensors"));
            let expected = read(
                &case(case_name).join(format!("output_{k}.safetensors")),
                key,
            );
            let shape = (family.forward)(model, &inputs, &output, dtype, &device).unwrap();
            assert_eq!(shape.iter().product::<usize>(), expected.len());
            let error = relative_error(&read(&output, "output"), &expected);
            println!(
                "{case_name} {} input {k} {dtype:?}: relative error {error:.2e}",
                model.display()
            );
            error
        })
        .fold(0.0, f64::max)
}

#[test]
fn diffusers_folders_match_diffusers_in_f32() {
    for name in ["guidance", "schnell"] {
        let model = case(name);
        assert_eq!(
            FluxCheckpoint::open(&model).unwrap().layout(),
            Layout::Diffusers
        );
        let error = worst_error(name, &model, 2, FloatDType::F32, "output");
        assert!(error <= F32_TOLERANCE, "{name}: relative error {error:.2e}");
    }
}

#[test]
fn bfl_files_match_diffusers_in_f32() {
    for name in ["guidance", "schnell"] {
        let model = case(name).join("flux1-bfl.safetensors");
        let checkpoint = FluxCheckpoint::open(&model).unwrap();
        assert_eq!(checkpoint.layout(), Layout::Bfl);
        let from_folder = FluxCheckpoint::open(&case(name)).unwrap();
        assert_eq!(
            checkpoint.config(),
            from_folder.config(),
            "{name}: inferred config"
        );
        let error = worst_error(name, &model, 2, FloatDType::F32, "output");
        assert!(error <= F32_TOLERANCE, "{name}: relative error {error:.2e}");
    }
}

#[test]
fn scaled_fp8_file_matches_diffusers_on_the_dequantized_weights() {
    let model = case("fp8").join("flux1-bfl-fp8.safetensors");
    let error = worst_error("fp8", &model, 1, FloatDType::F32, "output");
    assert!(error <= F32_TOLERANCE, "relative error {error:.2e}");
}

#[test]
fn bf16_stays_close_to_diffusers_in_bf16() {
    for (name, model) in [
        ("guidance", case("guidance")),
        ("schnell", case("schnell").join("flux1-bfl.safetensors")),
    ] {
        let error = worst_error(name, &model, 2, FloatDType::BF16, "output_bf16");
        let against_f32 = worst_error(name, &model, 2, FloatDType::BF16, "output");
        println!("{name} bf16: {error:.2e} against diffusers bf16, {against_f32:.2e} against f32");
        assert!(
            error <= BF16_TOLERANCE,
            "{name}: relative error {error:.2e}"
        );
    }
}

/// Copies the BFL fixture with one key dropped, one renamed to an unknown name and one tensor
/// of the wrong shape.
fn broken_bfl(dir: &Path) -> PathBuf {
    let source = Checkpoint::open(&case("schnell").join("flux1-bfl.safetensors")).unwrap();
    let wrong_shape = vec![0u8; 4 * 7];
    let mut tensors = Vec::new();
    for t in source.tensors() {
        let (name, shape, data) = match t.name {
            "double_blocks.0.txt_mlp.2.bias" => continue,
            "single_blocks.1.linear2.weight" => {
                ("single_blocks.1.linear_2.weight", t.shape.to_vec(), t.data)
            }
            "txt_in.bias" => ("txt_in.bias", vec![7], wrong_shape.as_slice()),
            name => (name, t.shape.to_vec(), t.data),
        };
        tensors.push((
            name.to_string(),
            safetensors::tensor::TensorView::new(t.dtype, shape, data).unwrap(),
        ));
    }
    let file = dir.join("broken.safetensors");
    safetensors::serialize_to_file(tensors, None, &file).unwrap();
    file
}

#[test]
fn mismatched_checkpoint_reports_every_key_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = broken_bfl(dir.path());
    let error = FluxCheckpoint::open(&file)
        .unwrap()
        .load::<Flex>(&Default::default(), FloatDType::F32)
        .map(|_| ())
        .unwrap_err();
    let LoadError::Keys { report, .. } = &error else {
        panic!("expected a key report, got {error}");
    };
    assert_eq!(
        report.missing,
        [
            "double_blocks.0.txt_mlp.2.bias",
            "single_blocks.1.linear2.weight"
        ]
    );
    assert_eq!(report.unexpected, ["single_blocks.1.linear_2.weight"]);
    assert_eq!(report.mismatched.len(), 1);
    assert_eq!(report.mismatched[0].key, "txt_in.bias");
    assert_eq!(
        (
            report.mismatched[0].found.clone(),
            report.mismatched[0].expected.clone()
        ),
        (vec![7], vec![32])
    );
    let text = error.to_string();
    assert!(
        text.contains("broken.safetensors") && text.contains("`txt_in.bias` is [7], expected [32]"),
        "{text}"
    );
}

#[test]
fn bad_inputs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = Checkpoint::open(&case("schnell").join("inputs_0.safetensors")).unwrap();
    let tensors: Vec<_> = inputs
        .tensors()
        .filter(|t| t.name != "txt_ids")
        .map(|t| {
            (
                t.name.to_string(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.to_vec(), t.data).unwrap(),
            )
        })
        .collect();
    let file = dir.path().join("inputs.safetensors");
    safetensors::serialize_to_file(tensors, None, &file).unwrap();
    let output = dir.path().join("out.safetensors");
    let error = forward_file::<Flex>(
        &case("schnell"),
        &file,
        &output,
        FloatDType::F32,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("inputs.safetensors: input `txt_ids`: missing"),
        "{error}"
    );
    assert!(!output.exists());
}

/// Files written by `burnlora quantize` (E4M3 or E5M2, scales per row or per block of 64):
/// every Linear weight of the loaded model equals burn-quant's dequantization of its FP8
/// tensor, transposed to Burn's layout, and no scale is left over as an unexpected key.
#[test]
fn burnlora_quantize_files_load_with_their_scales() {
    use burn_quant::{Fp8Format, Granularity, QuantizeOptions, quantize_checkpoint, read_fp8};

    let dir = tempfile::tempdir().unwrap();
    let source = case("guidance").join("flux1-bfl.safetensors");
    for (format, granularity) in [
        (Fp8Format::E4M3, Granularity::Block64),
        (Fp8Format::E5M2, Granularity::Row),
    ] {
        let file = dir
            .path()
            .join(format!("{format}-{granularity}.safetensors"));
        let options = QuantizeOptions {
            format,
            granularity,
            include: None,
            exclude: None,
        };
        quantize_checkpoint(&source, &file, &options).unwrap();
        let checkpoint = FluxCheckpoint::open(&file).unwrap();
        let model = checkpoint
            .load::<Flex>(&Default::default(), FloatDType::F32)
            .unwrap();
        let weights = flatten(&model);

        let files = Checkpoint::open(&file).unwrap();
        let mut checked = 0;
        for keys in burn_diffusion::flux::linear_keys(checkpoint.config()) {
            let (_, dims, loaded) = weights
                .iter()
                .find(|(p, _, _)| *p == format!("{}.weight", keys.module))
                .unwrap();
            let fp8 = read_fp8(&files, &format!("{}.weight", keys.bfl))
                .unwrap()
                .expect("stored as FP8");
            let expected = fp8.dequantize();
            let [d_input, d_output] = [dims[0], dims[1]];
            for i in 0..d_input {
                for o in 0..d_output {
                    assert_eq!(
                        loaded[i * d_output + o],
                        expected[o * d_input + i],
                        "{} [{i}, {o}]",
                        keys.module
                    );
                }
            }
            checked += 1;
        }
        assert_eq!(checked, 36, "{format} {granularity}");
    }
}

/// `load_with` hands every projection weight (and nothing else) to the placement, in Burn's
/// layout, and builds the same model as `load`; a placement error names the parameter.
#[test]
fn weight_matrices_can_be_placed_elsewhere() {
    use burn::tensor::{Tensor, TensorData};

    let device = Default::default();
    let checkpoint = FluxCheckpoint::open(&case("guidance")).unwrap();
    let plain = checkpoint.load::<Flex>(&device, FloatDType::F32).unwrap();
    let mut placed = Vec::new();
    let mut place = |name: &str, data: TensorData| {
        placed.push((name.to_string(), data.shape.to_vec()));
        Ok(Tensor::<Flex, 2>::from_data(data, &device))
    };
    let streamed = checkpoint
        .load_with::<Flex>(&device, FloatDType::F32, &mut place)
        .unwrap();
    let expected: Vec<String> = burn_diffusion::flux::linear_keys(checkpoint.config())
        .iter()
        .map(|k| format!("{}.weight", k.module))
        .collect();
    let mut names: Vec<String> = placed.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(names, expected_sorted);
    let (a, b) = (flatten(&plain), flatten(&streamed));
    assert_eq!(a.len(), b.len());
    for ((name, _, x), (_, _, y)) in a.iter().zip(&b) {
        assert_eq!(x, y, "{name}");
    }

    let mut refuse = |_: &str, _: TensorData| Err::<Tensor<Flex, 2>, _>("no room".into());
    let error = checkpoint
        .load_with::<Flex>(&device, FloatDType::F32, &mut refuse)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&expected[0]) && error.contains("no room"),
        "{error}"
    );
}

/// Every float parameter of `model`: its path, shape and f32 values.
fn flatten(model: &burn_diffusion::flux::Flux<Flex>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct All(Vec<String>, Vec<(String, Vec<usize>, Vec<f32>)>);
    impl ModuleVisitor<Flex> for All {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Flex, D>>) {
            let value = param.val();
            let dims = value.dims().to_vec();
            let values = value.into_data().convert::<f32>().to_vec().unwrap();
            self.1.push((self.0.join("."), dims, values));
        }
    }
    let mut all = All(Vec::new(), Vec::new());
    model.visit(&mut all);
    all.1
}

#[test]
fn flux2_files_match_diffusers_in_f32() {
    for (name, shapes) in [("dev", 2), ("klein", 1)] {
        let folder = FLUX2.case(name);
        let bfl = folder.join("flux2-bfl.safetensors");
        let from_folder = Flux2Checkpoint::open(&folder).unwrap();
        let from_bfl = Flux2Checkpoint::open(&bfl).unwrap();
        assert_eq!(from_folder.layout(), Layout::Diffusers);
        assert_eq!(from_bfl.layout(), Layout::Bfl);
        assert_eq!(
            from_bfl.config(),
            from_folder.config(),
            "{name}: inferred config"
        );
        assert_eq!(from_folder.config().guidance_embed, name == "dev");
        for model in [folder, bfl] {
            let error = family_error(FLUX2, name, &model, shapes, FloatDType::F32, "output");
            assert!(error <= F32_TOLERANCE, "{name}: relative error {error:.2e}");
        }
    }
}

#[test]
fn flux2_scaled_fp8_file_matches_diffusers_on_the_dequantized_weights() {
    let model = FLUX2.case("fp8").join("flux2-bfl-fp8.safetensors");
    let error = family_error(FLUX2, "fp8", &model, 1, FloatDType::F32, "output");
    assert!(error <= F32_TOLERANCE, "relative error {error:.2e}");
}

#[test]
fn flux2_bf16_stays_close_to_diffusers_in_bf16() {
    for (name, shapes) in [("dev", 2), ("klein", 1)] {
        let model = FLUX2.case(name);
        let error = family_error(FLUX2, name, &model, shapes, FloatDType::BF16, "output_bf16");
        assert!(
            error <= BF16_TOLERANCE,
            "{name}: relative error {error:.2e}"
        );
    }
}

#[test]
fn flux2_refuses_a_flux1_file_and_guidance_it_has_no_embedding_for() {
    let error = Flux2Checkpoint::open(&case("guidance").join("flux1-bfl.safetensors"))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("not a FLUX.2 transformer")
            && error.contains("double_stream_modulation_img.lin.weight"),
        "{error}"
    );
    let dir = tempfile::tempdir().unwrap();
    let error = (FLUX2.forward)(
        &FLUX2.case("klein"),
        &FLUX2.case("dev").join("inputs_1.safetensors"),
        &dir.path().join("out.safetensors"),
        FloatDType::F32,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("encoder_hidden_states") || error.contains("guidance"),
        "{error}"
    );
}

#[test]
fn flux2_bad_keys_are_reported_at_once_with_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let source = Checkpoint::open(&FLUX2.case("klein").join("flux2-bfl.safetensors")).unwrap();
    let mut tensors = Vec::new();
    for t in source.tensors() {
        let name = match t.name {
            "double_stream_modulation_txt.lin.weight" => continue,
            "single_blocks.2.linear2.weight" => "single_blocks.2.linear_2.weight",
            name => name,
        };
        tensors.push((
            name.to_string(),
            safetensors::tensor::TensorView::new(t.dtype, t.shape.to_vec(), t.data).unwrap(),
        ));
    }
    let file = dir.path().join("broken-flux2.safetensors");
    safetensors::serialize_to_file(tensors, None, &file).unwrap();
    let error = Flux2Checkpoint::open(&file)
        .unwrap()
        .load::<Flex>(&Default::default(), FloatDType::F32)
        .map(|_| ())
        .unwrap_err();
    let LoadError::Keys { report, .. } = &error else {
        panic!("expected a key report, got {error}");
    };
    assert_eq!(
        report.missing,
        [
            "double_stream_modulation_txt.lin.weight",
            "single_blocks.2.linear2.weight"
        ]
    );
    assert_eq!(report.unexpected, ["single_blocks.2.linear_2.weight"]);
    assert!(
        error.to_string().contains("broken-flux2.safetensors"),
        "{error}"
    );
}
