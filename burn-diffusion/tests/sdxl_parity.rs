//! The SDXL UNet against diffusers 0.42.1 (`UNet2DConditionModel`): fixtures made by
//! `tests/fixtures/make_sdxl_fixtures.py` from a tiny random model of SDXL's shape, saved as a
//! diffusers folder; gradient checkpointing with LoRA and LoCon adapters; the loader's report.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_diffusion::sdxl::{UNet2DCondition, UNetCheckpoint, UNetConfig, UNetInput, unet_modules};
use burn_diffusion::{BlockTape, Checkpointing, LoadError, ShapeMismatch};
use burn_lora::{LoraConfig, LoraPlan};
use burn_quant::{Checkpoint, FloatBytes, FloatDtype};
use safetensors::tensor::TensorView;

mod common;

type B = Flex;
type Ad = Autodiff<Flex>;

fn fixture(path: &str) -> PathBuf {
    common::fixture("sdxl").join(path)
}

/// The fixture model's configuration: SDXL's, at widths 8, 16, 16.
fn tiny() -> UNetConfig {
    UNetConfig {
        block_out_channels: vec![8, 16, 16],
        transformer_layers_per_block: vec![1, 1, 2],
        attention_head_dim: vec![1, 1, 2],
        cross_attention_dim: 16,
        addition_time_embed_dim: 8,
        projection_class_embeddings_input_dim: 16 + 6 * 8,
        norm_num_groups: 4,
        ..UNetConfig::sdxl()
    }
}

/// The inputs of an io file, in `dtype`.
fn input<Bk: Backend>(io: &Path, dtype: FloatDType) -> UNetInput<Bk> {
    fn tensor<Bk: Backend, const D: usize>(
        io: &Path,
        key: &str,
        dtype: FloatDType,
    ) -> Tensor<Bk, D> {
        let (values, shape) = common::read(io, key);
        let tensor: Tensor<Bk, D> =
            Tensor::from_data(TensorData::new(values, shape), &Default::default());
        tensor.cast(dtype)
    }
    UNetInput {
        sample: tensor(io, "sample", dtype),
        timestep: tensor(io, "timestep", FloatDType::F32),
        encoder_hidden_states: tensor(io, "encoder_hidden_states", dtype),
        text_embeds: tensor(io, "text_embeds", dtype),
        time_ids: tensor(io, "time_ids", FloatDType::F32),
    }
}

#[test]
fn diffusers_folder_matches_diffusers_in_f32() {
    let checkpoint = UNetCheckpoint::open(&common::fixture("sdxl")).unwrap();
    assert_eq!(checkpoint.config(), &tiny(), "config");
    let model = checkpoint
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap();
    for file in ["io.safetensors", "io_odd.safetensors"] {
        let io = fixture(file);
        let output = model.forward(input(&io, FloatDType::F32));
        common::assert_within(output.into_data(), &io, "output", common::F32_TOLERANCE);
    }
}

#[test]
fn runs_in_bf16_with_norms_in_f32() {
    let model = UNet2DCondition::<B>::load(&fixture("unet"), &Default::default(), FloatDType::BF16)
        .unwrap();
    let io = fixture("io.safetensors");
    let output = model.forward(input(&io, FloatDType::BF16));
    assert_eq!(output.dtype(), DType::BF16);
    common::assert_within(output.into_data(), &io, "output", common::BF16_TOLERANCE);
}

#[test]
fn placed_weights_are_the_projection_matrices() {
    let device = Default::default();
    let checkpoint = UNetCheckpoint::open(&fixture("unet")).unwrap();
    let mut placed = Vec::new();
    let mut place = |name: &str, data: TensorData| {
        placed.push((name.to_string(), data.shape.to_vec()));
        Ok(Tensor::<B, 2>::from_data(data, &device))
    };
    let model = checkpoint
        .load_with::<B>(&device, FloatDType::F32, &mut place)
        .unwrap();
    // Every rank-2 tensor of the checkpoint is a projection, handed over under its own name.
    let mut matrices: Vec<String> = checkpoint
        .names()
        .filter(|name| checkpoint.shape(name).is_some_and(|s| s.len() == 2))
        .map(str::to_string)
        .collect();
    matrices.sort();
    let mut names: Vec<String> = placed.iter().map(|(name, _)| name.clone()).collect();
    names.sort();
    assert_eq!(names, matrices);
    assert!(
        names.contains(
            &"down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj.weight".into()
        )
    );
    assert!(
        names.contains(&"mid_block.attentions.0.transformer_blocks.1.attn2.to_out.0.weight".into())
    );
    let (name, shape) = placed
        .iter()
        .find(|(name, _)| name == "add_embedding.linear_1.weight")
        .unwrap();
    assert_eq!(shape, &[64, 32], "{name}: Burn's [d_input, d_output]");
    let io = fixture("io.safetensors");
    let output = model.forward(input(&io, FloatDType::F32));
    common::assert_within(output.into_data(), &io, "output", common::F32_TOLERANCE);
}

/// Every tensor of the fixture's weights, with `edit` applied to the list, written as the
/// weights of a copy of the unet folder in `dir`.
fn edited_copy(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) -> PathBuf {
    let source = fixture("unet");
    let files = Checkpoint::open(&source).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = files
        .tensors()
        .map(|t| {
            let dtype = FloatDtype::from_safetensors(t.dtype).unwrap();
            let values = FloatBytes::new(dtype, t.data).unwrap().to_f32_vec();
            (t.name.to_string(), t.shape.to_vec(), values)
        })
        .collect();
    edit(&mut tensors);
    let folder = dir.join("unet");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(source.join("config.json"), folder.join("config.json")).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap();
            (name.as_str(), view)
        })
        .collect();
    let file = folder.join("diffusion_pytorch_model.safetensors");
    safetensors::serialize_to_file(views, None, &file).unwrap();
    folder
}

#[test]
fn every_missing_unexpected_and_misshaped_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let renamed = "mid_block.attentions.0.proj_in.weight";
    let reshaped = "up_blocks.0.resnets.2.conv_shortcut.bias";
    let folder = edited_copy(dir.path(), |tensors| {
        for (name, shape, values) in tensors.iter_mut() {
            if name == renamed {
                *name = "mid_block.attentions.0.proj_inn.weight".into();
            } else if name == reshaped {
                shape[0] -= 1;
                values.pop();
            }
        }
    });
    let error =
        UNet2DCondition::<B>::load(&folder, &Default::default(), FloatDType::F32).unwrap_err();
    let text = error.to_string();
    let LoadError::Keys { file, report } = error else {
        panic!("expected a key report, got {text}");
    };
    assert_eq!(file, folder.join("diffusion_pytorch_model.safetensors"));
    assert_eq!(report.missing, [renamed]);
    assert_eq!(
        report.unexpected,
        ["mid_block.attentions.0.proj_inn.weight"]
    );
    assert_eq!(
        report.mismatched,
        [ShapeMismatch {
            key: reshaped.into(),
            expected: vec![16],
            found: vec![15],
        }]
    );
    assert!(
        text.contains(&format!("`{renamed}`")) && text.contains(reshaped),
        "{text}"
    );
}

/// The fixture's weights under their original (SGM) names, renamed by the table that
/// `sdxl_single_file.rs` checks against diffusers' converter, with another component's tensor
/// beside them, as in `sd_xl_base_1.0.safetensors`.
#[test]
fn an_sgm_single_file_loads_through_the_key_table() {
    let dir = tempfile::tempdir().unwrap();
    let sgm: HashMap<String, String> = unet_modules(&tiny().layout())
        .iter()
        .flat_map(|module| module.param_keys().collect::<Vec<_>>())
        .map(|(sgm, diffusers)| (diffusers, sgm))
        .collect();
    let folder = edited_copy(dir.path(), |tensors| {
        for (name, _, _) in tensors.iter_mut() {
            *name = format!("model.diffusion_model.{}", sgm[name.as_str()]);
        }
        tensors.push((
            "first_stage_model.encoder.conv_in.bias".into(),
            vec![1],
            vec![0.0],
        ));
    });
    let file = folder.join("diffusion_pytorch_model.safetensors");
    let checkpoint = UNetCheckpoint::open_sgm(&file, tiny()).unwrap();
    let model = checkpoint
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap();
    let io = fixture("io.safetensors");
    let output = model.forward(input(&io, FloatDType::F32));
    common::assert_within(output.into_data(), &io, "output", common::F32_TOLERANCE);

    // A file of another shape is refused with the keys that do not fit.
    let error = UNetCheckpoint::open(&file)
        .unwrap()
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap_err();
    assert!(matches!(error, LoadError::Keys { .. }), "{error}");
}

/// Values in `[-scale, scale)` of `shape` from a fixed sequence starting at `start`: the same
/// in every run, whatever other tests do with the backend's random generator.
fn fixed_values<const D: usize>(
    shape: burn::tensor::Shape,
    start: usize,
    scale: f32,
) -> Tensor<Ad, D> {
    let values: Vec<f32> = (start..start + shape.num_elements())
        .map(|i| scale * (2.0 * ((i as f32 * 0.618_034).fract()) - 1.0))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// Gives every adapter parameter (the only trainable ones) fixed non-zero values, so that
/// every adapter's gradient is non-zero.
fn randomize_adapters(model: UNet2DCondition<Ad>) -> UNet2DCondition<Ad> {
    struct Randomize(usize);
    impl ModuleMapper<Ad> for Randomize {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<Ad, D>>,
        ) -> Param<Tensor<Ad, D>> {
            if !param.val().is_require_grad() {
                return param;
            }
            param.map(|t| {
                let shape = t.shape();
                self.0 += shape.num_elements();
                fixed_values(shape, self.0, 0.1).require_grad()
            })
        }
    }
    model.map(&mut Randomize(0))
}

/// Loss and the gradient of every trainable parameter, by path, after one step.
fn grads(
    model: &UNet2DCondition<Ad>,
    checkpointing: Checkpointing,
) -> (f32, Vec<(String, Vec<f32>)>) {
    let io = fixture("io.safetensors");
    let input = input::<Ad>(&io, FloatDType::F32);
    let target = fixed_values::<4>(input.sample.shape(), 9, 1.0);
    let mut tape = BlockTape::new(checkpointing);
    let loss = (model.forward_with(input, &mut tape) - target)
        .powi_scalar(2)
        .mean();
    let value = loss.to_data().to_vec::<f32>().unwrap()[0];
    let grads = GradientsParams::from_grads(tape.backward(&loss, model), model);
    struct Collect<'a>(&'a GradientsParams, Vec<String>, Vec<(String, Vec<f32>)>);
    impl ModuleVisitor<Ad> for Collect<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.1.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
            if !param.val().is_require_grad() {
                return;
            }
            let path = self.1.join(".");
            let grad = self
                .0
                .get::<Flex, D>(param.id)
                .unwrap_or_else(|| panic!("no gradient for {path}"));
            self.2.push((path, grad.into_data().to_vec().unwrap()));
        }
    }
    let mut collect = Collect(&grads, Vec::new(), Vec::new());
    model.visit(&mut collect);
    (value, collect.2)
}

#[test]
fn checkpointed_lora_gradients_equal_plain_backprop() {
    let model = UNet2DCondition::<Ad>::load(&fixture("unet"), &Default::default(), FloatDType::F32)
        .unwrap()
        .no_grad();
    let plan = LoraPlan::new(LoraConfig::new(2)).unwrap();
    let (model, report) = plan.apply(model);
    let model = randomize_adapters(model);
    let _separate = burn_kernels::KernelOptions::separate_ops().install();
    let (plain_loss, plain) = grads(&model, Checkpointing::Off);
    let (loss, checkpointed) = grads(&model, Checkpointing::Blocks);

    assert_eq!(loss, plain_loss);
    // A down and an up factor per adapted layer: every projection and convolution.
    assert_eq!(plain.len(), 2 * report.count());
    assert!(
        plain
            .iter()
            .any(|(path, _)| path.starts_with("time_embedding.linear_1."))
    );
    assert!(plain.iter().any(|(path, _)| path.starts_with("conv_in.")));
    assert_eq!(plain.len(), checkpointed.len());
    for ((path, expected), (other, actual)) in plain.iter().zip(&checkpointed) {
        assert_eq!(path, other);
        let norm = expected
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let diff = expected
            .iter()
            .zip(actual)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(norm > 0.0, "{path}: zero gradient");
        assert!(
            diff <= 1e-5 * norm,
            "{path}: relative difference {:.2e}",
            diff / norm
        );
    }
}
