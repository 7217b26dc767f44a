//! File formats: alpha survives saving and loading (rank 1024, alpha 64), metadata, LoKr and
//! per-module overrides round-trip, atomic writes, and errors that name the key.

mod common;

use std::collections::HashMap;
use std::path::Path;

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::LinearConfig;
use burn::nn::conv::Conv2dConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData};
use burn_lora::{
    AdapterSet, LokrConfig, LoraConfig, LoraConv2d, LoraError, LoraLinear, LoraMetadata, LoraPlan,
    PeftAlpha, SaveOptions, StoredAdapter, export, load, load_adapters, save,
};
use common::rel_err;
use safetensors::SafeTensors;

type B = Flex;

#[derive(Module, Debug)]
struct One<B: Backend> {
    layer: LoraLinear<B>,
}

#[derive(Module, Debug)]
struct Two<B: Backend> {
    conv: LoraConv2d<B>,
    fc: LoraLinear<B>,
}

impl<B: burn_kernels::Kernels> Two<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([4, 6], [3, 3]).init(device).into(),
            fc: LinearConfig::new(6, 8).init(device).into(),
        }
    }

    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.fc.forward(self.conv.forward(x).permute([0, 2, 3, 1]))
    }
}

/// Gives every adapter weight deterministic non-zero values, through a file round trip of
/// the in-memory set.
fn randomize<M: Module<B>>(model: M) -> M {
    let fill = |t: &TensorData, k: f64| {
        let values: Vec<f64> = (0..t.num_elements())
            .map(|i| 0.2 * ((i as f64 + k) * 0.917).sin())
            .collect();
        TensorData::new(values, t.shape.clone()).convert_dtype(t.dtype)
    };
    let set = export(&model, Default::default());
    let mut out = AdapterSet::default();
    for (i, (name, adapter)) in set.iter().enumerate() {
        let k = 7.0 * i as f64;
        let adapter = match adapter {
            StoredAdapter::Lora { down, up, alpha } => StoredAdapter::Lora {
                down: fill(down, k),
                up: fill(up, k + 1.0),
                alpha: *alpha,
            },
            StoredAdapter::Lokr { w1, w2, alpha } => StoredAdapter::Lokr {
                w1: fill(w1, k),
                w2: match w2 {
                    burn_lora::LokrFactor::Full(w2) => burn_lora::LokrFactor::Full(fill(w2, k)),
                    burn_lora::LokrFactor::LowRank { a, b } => burn_lora::LokrFactor::LowRank {
                        a: fill(a, k + 2.0),
                        b: fill(b, k + 3.0),
                    },
                },
                alpha: *alpha,
            },
        };
        out.insert(name, adapter);
    }
    load_adapters(model, out).unwrap().0
}

fn raw(path: &Path) -> (Vec<u8>, HashMap<String, String>) {
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().unwrap_or_default();
    (bytes, metadata)
}

/// Lazy parameters initialise independently in each clone: materialise them first so clones
/// share the base weights.
fn materialized<M: Module<B>>(module: M) -> M {
    module.to_device(&Default::default())
}

fn base_layer() -> One<B> {
    materialized(One {
        layer: LinearConfig::new(16, 16).init(&Default::default()).into(),
    })
}

fn with_adapter(base: One<B>, rank: usize, alpha: f64) -> One<B> {
    let plan = LoraPlan::new(LoraConfig::new(rank).with_alpha(Some(alpha))).unwrap();
    plan.apply(base).0
}

/// A rank-1024, alpha-64 adapter has scale 1/16 before saving and after loading, in every
/// style; a loader that dropped alpha would see scale 1 and a 16x larger update.
#[test]
fn rank_1024_alpha_64_keeps_scale_one_sixteenth() {
    let base = base_layer();
    let model = randomize(with_adapter(base.clone(), 1024, 64.0));
    assert_eq!(model.layer.adapter().unwrap().scale(), 0.0625);
    let x = Tensor::<B, 2>::random([3, 16], Distribution::Default, &Default::default());
    let expected = model.layer.forward(x.clone()).into_data();
    let base_out = model.layer.base().forward(x.clone()).into_data();
    // The update is about 0.7 % of the output (the base weights and `x` are random, so it is
    // sometimes below 0.1 %); 1e-4 is far above rounding, and a 16x update would still show
    // against the 1e-5 tolerance below.
    assert!(
        rel_err(&expected, &base_out) > 1e-4,
        "the update is visible"
    );

    let set = export(&model, LoraMetadata::default());
    let dir = tempfile::tempdir().unwrap();
    let styles = [
        SaveOptions::kohya(),
        SaveOptions::peft(),
        SaveOptions {
            peft_alpha: PeftAlpha::Baked,
            ..SaveOptions::peft()
        },
        SaveOptions {
            peft_alpha: PeftAlpha::Baked,
            ..SaveOptions::for_format(burn_lora::Format::AiToolkit)
        },
    ];
    for (i, options) in styles.iter().enumerate() {
        let path = dir.path().join(format!("{i}.safetensors"));
        save(&set, &path, options).unwrap();
        let (bytes, metadata) = raw(&path);
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        match (options.format, options.peft_alpha) {
            (burn_lora::Format::Kohya, _) => {
                let alpha = tensors.tensor("lora_unet_layer.alpha").unwrap();
                assert_eq!(alpha.dtype(), safetensors::Dtype::F32);
                assert!(alpha.shape().is_empty());
                assert_eq!(alpha.data(), 64.0f32.to_le_bytes());
            }
            (_, PeftAlpha::Metadata) => {
                let config: serde_json::Value =
                    serde_json::from_str(&metadata["lora_adapter_metadata"]).unwrap();
                assert_eq!(config["transformer.lora_alpha"], 64.0);
                assert_eq!(config["transformer.r"], 1024);
            }
            (_, PeftAlpha::Baked) => {
                assert!(!metadata.contains_key("lora_adapter_metadata"));
                assert!(tensors.names().iter().all(|k| !k.ends_with(".alpha")));
                assert_eq!(metadata["ss_network_alpha"], "64");
            }
            (_, PeftAlpha::Tensors) => assert!(!metadata.contains_key("lora_adapter_metadata")),
        }
        assert_eq!(metadata["ss_network_dim"], "1024");

        let loaded = load(&path).unwrap();
        let stored = loaded.get("layer").unwrap();
        // Into a layer that already has a rank-1024 adapter (a resume), alpha comes from the file.
        let resumed = with_adapter(base.clone(), 1024, 1024.0);
        let (reloaded, _) = load_adapters(resumed, loaded.clone()).unwrap();
        let adapter = reloaded.layer.adapter().unwrap();
        if options.peft_alpha == PeftAlpha::Baked {
            // Baked: alpha = rank, the scale lives in lora_B.
            assert_eq!((stored.scale(), adapter.scale()), (1.0, 1.0));
        } else {
            assert_eq!((stored.scale(), adapter.scale()), (0.0625, 0.0625));
            assert_eq!(adapter.alpha(), 64.0);
        }
        let err = rel_err(&reloaded.layer.forward(x.clone()).into_data(), &expected);
        assert!(err <= 1e-5, "{options:?}: {err}");
    }
}

#[test]
fn metadata_records_rank_alpha_type_model_and_step() {
    let model = with_adapter(base_layer(), 8, 4.0);
    let metadata = LoraMetadata {
        base_model: Some("flux1-dev".into()),
        step: Some(1200),
        extra: [("ss_output_name".to_string(), "style".to_string())].into(),
    };
    let set = export(&model, metadata.clone());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    save(&set, &path, &SaveOptions::kohya()).unwrap();
    let (_, raw_metadata) = raw(&path);
    let expected = [
        ("format", "pt"),
        ("ss_network_module", "networks.lora"),
        ("ss_network_args", r#"{"algo":"lora"}"#),
        ("ss_network_dim", "8"),
        ("ss_network_alpha", "4"),
        ("ss_sd_model_name", "flux1-dev"),
        ("ss_steps", "1200"),
        ("ss_output_name", "style"),
    ];
    for (key, value) in expected {
        assert_eq!(
            raw_metadata.get(key).map(String::as_str),
            Some(value),
            "{key}"
        );
    }
    let loaded = load(&path).unwrap();
    assert_eq!(loaded.metadata.base_model.as_deref(), Some("flux1-dev"));
    assert_eq!(loaded.metadata.step, Some(1200));
}

/// LoKr (full and low-rank second factor, on a conv and a linear) and LoRA with per-module
/// ranks and alphas: export → save → load gives the same forward in every style.
#[test]
fn lokr_and_overridden_lora_round_trip() {
    let device = Default::default();
    let x = Tensor::<B, 4>::random([2, 4, 6, 5], Distribution::Default, &device);
    let plans = [
        LoraPlan::new(
            LokrConfig::new(2)
                .with_decompose_w2(true)
                .with_alpha(Some(1.0)),
        )
        .unwrap()
        .with_override("fc", None, Some(3.0))
        .unwrap(),
        LoraPlan::new(LokrConfig::new(4).with_factor(Some(2))).unwrap(),
        LoraPlan::new(LoraConfig::new(4).with_alpha(Some(2.0)))
            .unwrap()
            .with_override("conv", Some(3), Some(9.0))
            .unwrap(),
    ];
    let dir = tempfile::tempdir().unwrap();
    for plan in plans {
        let base = materialized(Two::<B>::new(&device));
        let (model, report) = plan.apply(base.clone());
        assert_eq!(report.count(), 2);
        let model = randomize(model);
        let expected = model.forward(x.clone()).into_data();
        let set = export(&model, LoraMetadata::default());
        for options in [SaveOptions::kohya(), SaveOptions::peft()] {
            let path = dir.path().join("r.safetensors");
            save(&set, &path, &options).unwrap();
            let loaded = load(&path).unwrap();
            assert_eq!(
                loaded.get("conv").unwrap(),
                set.get("conv").unwrap(),
                "{options:?}"
            );
            let (reloaded, report) = load_adapters(base.clone(), loaded).unwrap();
            assert!(report.is_complete(), "{report}");
            let err = rel_err(&reloaded.forward(x.clone()).into_data(), &expected);
            assert!(err <= 1e-6, "{options:?}: {err}");
        }
    }
}

#[test]
fn saving_replaces_the_file_atomically() {
    let model = with_adapter(base_layer(), 2, 2.0);
    let set = export(&model, LoraMetadata::default());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lora.safetensors");
    std::fs::write(&path, b"old contents").unwrap();
    save(&set, &path, &SaveOptions::kohya()).unwrap();
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["lora.safetensors"]);
    assert_eq!(load(&path).unwrap().len(), 1);

    let missing = dir.path().join("no/such/dir/lora.safetensors");
    let err = save(&set, &missing, &SaveOptions::kohya()).unwrap_err();
    assert!(
        matches!(err, LoraError::Io { ref file, .. } if file == &missing),
        "{err}"
    );
}

fn write_raw(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
                .collect();
            (k.to_string(), bytes, shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(k, b, s)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (k.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn loading_checks_shapes_ranks_and_names() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let fresh = base_layer;

    // Input dimension 15 against a 16-input layer.
    write_raw(
        &path,
        &[
            ("lora_unet_layer.lora_down.weight", vec![4, 15]),
            ("lora_unet_layer.lora_up.weight", vec![16, 4]),
        ],
    );
    let err = load_adapters(fresh(), load(&path).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`lora_unet_layer.lora_down.weight` is [4, 15], expected [4, 16]"
    );

    // Rank 4 in the file, rank 8 already attached.
    write_raw(
        &path,
        &[
            ("transformer.layer.lora_A.weight", vec![4, 16]),
            ("transformer.layer.lora_B.weight", vec![16, 4]),
            ("transformer.other.lora_A.weight", vec![4, 16]),
            ("transformer.other.lora_B.weight", vec![16, 4]),
            ("text_encoder.mlp.fc1.lora_A.weight", vec![4, 16]),
        ],
    );
    let err = load_adapters(with_adapter(fresh(), 8, 8.0), load(&path).unwrap()).unwrap_err();
    assert!(matches!(err, LoraError::Rank { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("`transformer.layer.lora_A.weight`"), "{text}");
    assert!(
        text.contains("LoRA rank 4") && text.contains("LoRA rank 8"),
        "{text}"
    );

    // Into a fresh layer it loads; the extra module is reported, the foreign key too.
    let (_, report) = load_adapters(fresh(), load(&path).unwrap()).unwrap();
    assert_eq!(report.loaded, ["layer"]);
    assert_eq!(report.unmatched, ["other"]);
    assert_eq!(report.unrecognized, ["text_encoder.mlp.fc1.lora_A.weight"]);
    assert!(!report.is_complete());

    // A down matrix without its up matrix.
    write_raw(&path, &[("lora_unet_layer.lora_down.weight", vec![4, 16])]);
    let err = load(&path).unwrap_err().to_string();
    assert!(
        err.contains("`lora_unet_layer.lora_down.weight` has no `.lora_up.weight`"),
        "{err}"
    );
}
