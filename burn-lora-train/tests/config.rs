//! Bad configurations give one error naming the field and what is allowed; environment
//! overrides reach nested keys.

use std::path::{Path, PathBuf};

use burn_lora_train::config::{ConfigError, OptimizerKind, TrainPlan, TrainYaml};

const GOOD: &str = "\
name: demo
network:
  type: lora
  linear: 16
  linear_alpha: 8
model:
  arch: flux1
  path: tiny
  quantize: e4m3
  offload:
    vram_budget_gb: 12
train:
  steps: 100
  optimizer: adamw
  lr_scheduler: cosine
  lr_warmup_steps: 10
datasets:
  - folder_path: images
    resolution: [512, 768]
save:
  format: peft
  dtype: float16
";

struct Case {
    dir: tempfile::TempDir,
    file: PathBuf,
}

fn case(yaml: &str) -> Case {
    let dir = tempfile::tempdir().unwrap();
    for folder in ["images", "tokenizer", "tokenizer_2"] {
        std::fs::create_dir(dir.path().join(folder)).unwrap();
    }
    let file = dir.path().join("train.yaml");
    std::fs::write(&file, yaml).unwrap();
    Case { dir, file }
}

fn load(file: &Path, env: &[(&str, &str)]) -> Result<TrainPlan, ConfigError> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let yaml = TrainYaml::load_with_env(file, env)?;
    TrainPlan::from_yaml(file, yaml)
}

/// Replaces the line starting with `old` (trimmed) in the good config.
fn with_line(old: &str, new: &str) -> String {
    let mut found = false;
    let text = GOOD
        .lines()
        .map(|line| {
            if line.trim_start().starts_with(old) {
                found = true;
                let indent = &line[..line.len() - line.trim_start().len()];
                format!("{indent}{new}")
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(found, "no line starts with {old}");
    text
}

/// The single problem of `yaml`: (field, message).
fn problem(yaml: &str) -> (String, String) {
    let c = case(yaml);
    let err = load(&c.file, &[]).unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    let text = err.to_string();
    assert!(text.starts_with(&c.file.display().to_string()), "{text}");
    let p = &err.problems[0];
    assert!(text.contains(&format!("`{}`", p.field)), "{text}");
    (p.field.clone(), p.message.clone())
}

#[test]
fn the_good_file_validates_with_typed_values() {
    let c = case(GOOD);
    let plan = load(&c.file, &[]).unwrap();
    assert_eq!(plan.train.optimizer, OptimizerKind::AdamW);
    assert_eq!(plan.model.wire, Some(burn_quant::Fp8Format::E4M3));
    assert_eq!(plan.model.vram_budget_bytes, Some(12_000_000_000));
    assert_eq!(plan.save.format, burn_lora::Format::Peft);
    assert_eq!(plan.save.dtype, burn::tensor::DType::F16);
    assert_eq!(plan.datasets[0].folder, c.dir.path().join("images"));
    assert_eq!(plan.datasets[0].resolutions, vec![512, 768]);
    assert_eq!(plan.output_dir, c.dir.path().join("output"));
}

#[test]
fn unknown_keys_are_named_with_their_section() {
    let (field, message) = problem(&with_line("optimizer:", "optimiser: adamw"));
    assert_eq!(field, "train.optimiser");
    assert!(message.contains("unknown field `optimiser`"), "{message}");
    assert!(
        message.contains("optimizer"),
        "lists the known keys: {message}"
    );

    let (field, _) = problem(&format!("{GOOD}trigger_word: sks\n"));
    assert_eq!(field, "trigger_word");

    let (field, _) = problem(&with_line("vram_budget_gb:", "vram_budget: 12"));
    assert_eq!(field, "model.offload.vram_budget");
}

#[test]
fn wrong_types_name_the_key() {
    let (field, message) = problem(&with_line("steps:", "steps: many"));
    assert_eq!(field, "train.steps");
    assert!(message.contains("many"), "{message}");

    let (field, message) = problem(&with_line("resolution:", "resolution: [512, big]"));
    assert_eq!(field, "datasets[0].resolution");
    assert!(message.contains("resolution"), "{message}");
}

#[test]
fn a_missing_section_is_named() {
    let yaml = GOOD.replace(
        "network:\n  type: lora\n  linear: 16\n  linear_alpha: 8\n",
        "",
    );
    let (field, message) = problem(&yaml);
    assert_eq!(field, "network");
    assert!(message.contains("missing"), "{message}");
}

#[test]
fn impossible_values_say_what_is_allowed() {
    let cases = [
        (("linear:", "linear: 0"), "network.linear", "at least 1"),
        (
            ("- folder_path:", "- folder_path: no/such/folder"),
            "datasets[0].folder_path",
            "is not a folder",
        ),
        (
            ("resolution:", "resolution: [512, 500]"),
            "datasets[0].resolution",
            "multiples of 16",
        ),
        (
            ("optimizer:", "optimizer: sgd"),
            "train.optimizer",
            "expected one of: adamw, adamw8bit",
        ),
        (
            ("quantize:", "quantize: true"),
            "model.quantize",
            "expected one of: none, e5m2, e4m3",
        ),
        (
            ("lr_warmup_steps:", "lr_warmup_steps: 500"),
            "train.lr_warmup_steps",
            "at most train.steps (100)",
        ),
        (("type: lora", "type: loha"), "network.type", "lora, lokr"),
        (
            ("dtype: float16", "dtype: int8"),
            "save.dtype",
            "expected one of: bf16",
        ),
        (
            ("path: tiny", "path: missing.safetensors"),
            "model.path",
            "does not exist",
        ),
        (
            ("linear_alpha:", "linear_alpha: -1"),
            "network.linear_alpha",
            "> 0",
        ),
    ];
    for ((old, new), field, allowed) in cases {
        let (got, message) = problem(&with_line(old, new));
        assert_eq!(got, field, "{new}");
        assert!(message.contains(allowed), "{new}: {message}");
    }
}

#[test]
fn decoding_ahead_is_off_unless_asked_for() {
    let c = case(GOOD);
    assert!(!load(&c.file, &[]).unwrap().model.decode_ahead);
    let env = [("BURNLORA_MODEL__OFFLOAD__DECODE_AHEAD", "true")];
    assert!(load(&c.file, &env).unwrap().model.decode_ahead);
    let (field, _) = problem(&with_line(
        "vram_budget_gb:",
        "vram_budget_gb: 12\n    decode_ahead: often",
    ));
    assert_eq!(field, "model.offload.decode_ahead");
}

#[test]
fn a_budget_of_0_streams_everything_and_a_negative_one_is_refused() {
    let c = case(&with_line("vram_budget_gb:", "vram_budget_gb: 0"));
    let plan = load(&c.file, &[]).unwrap();
    assert_eq!(plan.model.vram_budget_bytes, Some(0));
    let plan = load(
        &c.file,
        &[("BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB", "0.0")],
    )
    .unwrap();
    assert_eq!(plan.model.vram_budget_bytes, Some(0));

    for bad in ["-1", "-0.5"] {
        let (field, message) = problem(&with_line(
            "vram_budget_gb:",
            &format!("vram_budget_gb: {bad}"),
        ));
        assert_eq!(field, "model.offload.vram_budget_gb", "{bad}");
        assert!(message.contains("finite number ≥ 0"), "{bad}: {message}");
    }
    let c = case(GOOD);
    for bad in ["-2", "NaN", "inf"] {
        let err = load(&c.file, &[("BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB", bad)]).unwrap_err();
        assert_eq!(err.problems.len(), 1, "{bad}: {err}");
        assert_eq!(
            err.problems[0].field, "model.offload.vram_budget_gb",
            "{bad}: {err}"
        );
        assert!(
            err.problems[0].message.contains("finite number ≥ 0"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn invalid_patterns_are_named_by_index() {
    let yaml = with_line(
        "linear_alpha:",
        "linear_alpha: 8\n  include: [attn, \"(unclosed\"]",
    );
    let (field, message) = problem(&yaml);
    assert_eq!(field, "network.include[1]");
    assert!(message.contains("regular expression"), "{message}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let yaml = with_line("linear:", "linear: 0").replace("steps: 100", "steps: 0");
    let c = case(&yaml);
    let err = load(&c.file, &[]).unwrap_err();
    assert!(
        err.concerns("network.linear") && err.concerns("train.steps"),
        "{err}"
    );
}

#[test]
fn environment_overrides_reach_nested_keys() {
    let c = case(GOOD);
    let plan = load(
        &c.file,
        &[
            ("BURNLORA_TRAIN__STEPS", "10"),
            ("BURNLORA_TRAIN__LR_WARMUP_STEPS", "2"),
            ("BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB", "20.5"),
            ("burnlora_save__format", "kohya"),
            ("BURNLORA_NAME", "other"),
            // Not configuration keys: ignored.
            ("BURNLORA_LOG", "debug"),
            ("PATH", "/usr/bin"),
        ],
    )
    .unwrap();
    assert_eq!(plan.train.steps, 10);
    assert_eq!(plan.train.lr_warmup_steps, 2);
    assert_eq!(plan.model.vram_budget_bytes, Some(20_500_000_000));
    assert_eq!(plan.save.format, burn_lora::Format::Kohya);
    assert_eq!(plan.name, "other");
}

#[test]
fn bad_environment_overrides_are_named_too() {
    let c = case(GOOD);
    let err = load(&c.file, &[("BURNLORA_TRAIN__STPES", "10")]).unwrap_err();
    assert!(err.concerns("train.stpes"), "{err}");
    let err = load(&c.file, &[("BURNLORA_TRAIN__STEPS", "ten")]).unwrap_err();
    assert!(err.concerns("train.steps"), "{err}");
}

#[test]
fn a_missing_file_is_an_error_naming_it() {
    let err = TrainYaml::load_with_env(Path::new("/no/such/train.yaml"), []).unwrap_err();
    assert!(err.to_string().contains("/no/such/train.yaml"), "{err}");
}

/// The shipped recipes: the benchmark configurations validate as they are; the FLUX.1-dev,
/// SDXL and Wan recipes fail only on the two paths a user fills in (the model and the dataset).
#[test]
fn the_example_configurations_validate() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let bench = load(&examples.join("flux/bench.yaml"), &[]).unwrap();
    assert_eq!(
        bench.model.source,
        burn_lora_train::config::ModelSource::Random("flux1-dev".into())
    );
    assert!(bench.model.tokenizers.ends_with("tiny"));
    assert_eq!(bench.datasets[0].resolutions, [1024]);
    // Its three modes (resident, bf16 and e5m2 streamed) share one encoding of the dataset.
    assert!(bench.datasets[0].cache_to_disk);

    let error = load(&examples.join("flux/config.yaml"), &[]).unwrap_err();
    let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, ["model.path", "datasets[0].folder_path"], "{error}");

    let bench = load(&examples.join("sdxl/bench.yaml"), &[]).unwrap();
    assert_eq!(
        bench.model.source,
        burn_lora_train::config::ModelSource::Random("sdxl".into())
    );
    assert!(bench.model.tokenizers.ends_with("tiny/sdxl"));
    for recipe in [
        "sdxl/config.yaml",
        "wan/config.yaml",
        "wan/config_1.3b.yaml",
        "wan/config_a14b.yaml",
    ] {
        let error = load(&examples.join(recipe), &[]).unwrap_err();
        let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            ["model.path", "datasets[0].folder_path"],
            "{recipe}: {error}"
        );
    }
}

/// A transformer file as `model.path` needs the other components; a built-in model takes none.
#[test]
fn component_files_are_checked() {
    let c = case(&GOOD.replace("path: tiny", "path: flux1-dev.safetensors"));
    std::fs::write(c.dir.path().join("flux1-dev.safetensors"), b"").unwrap();
    let error = load(&c.file, &[]).unwrap_err();
    let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(
        fields,
        ["model.vae", "model.text_encoder", "model.text_encoder_2"],
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("required when model.path is a single file")
    );

    let (field, message) =
        problem(&GOOD.replace("path: tiny", "path: tiny\n  vae: ae.safetensors"));
    assert_eq!(field, "model.vae");
    assert!(
        message.contains("only with a model folder or file"),
        "{message}"
    );
}

#[test]
fn the_gradients_follow_the_optimizer_state_unless_told() {
    use burn_lora_train::config::{GradientPlacement, OptimizerState};
    let c = case(GOOD);
    let placement = |env: &[(&str, &str)]| {
        let plan = load(&c.file, env).unwrap();
        (plan.train.optimizer_state, plan.train.gradients)
    };
    assert_eq!(
        placement(&[]),
        (OptimizerState::Device, GradientPlacement::Device)
    );
    assert_eq!(
        placement(&[("BURNLORA_TRAIN__OPTIMIZER_STATE", "host")]),
        (OptimizerState::Host, GradientPlacement::Host)
    );
    assert_eq!(
        placement(&[
            ("BURNLORA_TRAIN__OPTIMIZER_STATE", "host"),
            ("BURNLORA_TRAIN__GRADIENTS", "device"),
        ]),
        (OptimizerState::Host, GradientPlacement::Device)
    );
    let err = load(&c.file, &[("BURNLORA_TRAIN__GRADIENTS", "host")]).unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    assert_eq!(err.problems[0].field, "train.gradients");
    assert!(
        err.problems[0].message.contains("optimizer_state: host"),
        "{err}"
    );
}

#[test]
fn several_devices_are_read_and_their_limits_named() {
    let c = case(GOOD);
    assert_eq!(load(&c.file, &[]).unwrap().train.devices, 1);
    let two = load(&c.file, &[("BURNLORA_TRAIN__DEVICES", "2")]).unwrap();
    assert_eq!(two.train.devices, 2);
    assert_ne!(
        two.resume_fingerprint(),
        load(&c.file, &[]).unwrap().resume_fingerprint(),
        "the global batch changes with the devices"
    );
    let err = load(&c.file, &[("BURNLORA_TRAIN__DEVICES", "0")]).unwrap_err();
    assert_eq!(err.problems[0].field, "train.devices", "{err}");
    let err = load(
        &c.file,
        &[
            ("BURNLORA_TRAIN__DEVICES", "2"),
            ("BURNLORA_TRAIN__OPTIMIZER_STATE", "host"),
        ],
    )
    .unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    assert_eq!(err.problems[0].field, "train.gradients");
    assert!(err.problems[0].message.contains("train.devices"), "{err}");
}
