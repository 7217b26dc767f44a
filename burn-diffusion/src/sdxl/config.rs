//! SDXL UNet hyperparameters: the SDXL base 1.0 preset and diffusers' `unet/config.json`
//! (`UNet2DConditionModel`), limited to what SDXL uses.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/unets/unet_2d_condition.py (UNet2DConditionModel.__init__, _check_config)

use std::path::Path;

use burn::config::Config;
use serde_json::{Map, Value};

use super::UNetLayout;
use crate::error::LoadError;
use crate::vae::check_group_norm;
use crate::weights::read_json;

/// diffusers' name of a level without attention.
pub(crate) const DOWN_BLOCK: &str = "DownBlock2D";
/// diffusers' name of a level with attention.
pub(crate) const CROSS_ATTN_DOWN_BLOCK: &str = "CrossAttnDownBlock2D";
/// diffusers' name of a decoder level without attention.
pub(crate) const UP_BLOCK: &str = "UpBlock2D";
/// diffusers' name of a decoder level with attention.
pub(crate) const CROSS_ATTN_UP_BLOCK: &str = "CrossAttnUpBlock2D";

/// The shape of an SDXL-style UNet (diffusers' `UNet2DConditionModel` with the `text_time`
/// addition embedding, linear projections in the transformers and a cross-attention middle
/// block). Field names and meanings follow diffusers' `config.json`; per-level lists are
/// indexed by down block (finest first), and up block `i` uses the entry of down block
/// `levels - 1 - i`.
#[derive(Config, Debug, PartialEq)]
pub struct UNetConfig {
    /// Latent channels in.
    #[config(default = 4)]
    pub in_channels: usize,
    /// Channels predicted.
    #[config(default = 4)]
    pub out_channels: usize,
    /// Channels of each resolution level, finest first; each level but the last halves the
    /// resolution on the way down and doubles it on the way up.
    pub block_out_channels: Vec<usize>,
    /// Residual blocks per down block (the up blocks have one more).
    #[config(default = 2)]
    pub layers_per_block: usize,
    /// Transformer blocks in each attention layer of each level (the middle block uses the last
    /// level's); ignored for levels without attention.
    pub transformer_layers_per_block: Vec<usize>,
    /// Attention heads of each level. diffusers' name: the field counts heads, not their width
    /// (`UNet2DConditionModel` reads it as `num_attention_heads`); SDXL's `[5, 10, 20]` gives
    /// heads of width 64.
    pub attention_head_dim: Vec<usize>,
    /// Width of a text token (SDXL: 2048, CLIP-L's 768 beside OpenCLIP-bigG's 1280).
    pub cross_attention_dim: usize,
    /// Width of the sinusoidal embedding of each size-and-crop conditioning value (`time_ids`).
    pub addition_time_embed_dim: usize,
    /// Input width of the addition embedding: the pooled text width plus
    /// `time_ids · addition_time_embed_dim` (SDXL: 1280 + 6 · 256).
    pub projection_class_embeddings_input_dim: usize,
    /// Groups of every group norm.
    #[config(default = 32)]
    pub norm_num_groups: usize,
    /// Epsilon of the residual blocks' and the output's group norms.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// `DownBlock2D` or `CrossAttnDownBlock2D` per level, finest first.
    pub down_block_types: Vec<String>,
    /// `UpBlock2D` or `CrossAttnUpBlock2D` per level, coarsest first.
    pub up_block_types: Vec<String>,
    /// Whether the transformers project in and out with linear layers (SDXL: true; the only
    /// value supported).
    #[config(default = true)]
    pub use_linear_projection: bool,
    /// Whether the timestep embeddings put cosines first (SDXL: true; the only value supported).
    #[config(default = true)]
    pub flip_sin_to_cos: bool,
    /// Frequency shift of the timestep embeddings (SDXL: 0; the only value supported).
    #[config(default = 0)]
    pub freq_shift: usize,
}

impl UNetConfig {
    /// SDXL base 1.0 (`stabilityai/stable-diffusion-xl-base-1.0`, `unet/config.json`): widths
    /// 320, 640, 1280, the first level without attention, 2 and 10 transformer blocks in the
    /// others, heads of width 64 (2.6 B parameters).
    pub fn sdxl() -> Self {
        Self {
            in_channels: 4,
            out_channels: 4,
            block_out_channels: vec![320, 640, 1280],
            layers_per_block: 2,
            transformer_layers_per_block: vec![1, 2, 10],
            attention_head_dim: vec![5, 10, 20],
            cross_attention_dim: 2048,
            addition_time_embed_dim: 256,
            projection_class_embeddings_input_dim: 2816,
            norm_num_groups: 32,
            norm_eps: 1e-5,
            down_block_types: [DOWN_BLOCK, CROSS_ATTN_DOWN_BLOCK, CROSS_ATTN_DOWN_BLOCK]
                .map(String::from)
                .to_vec(),
            up_block_types: [CROSS_ATTN_UP_BLOCK, CROSS_ATTN_UP_BLOCK, UP_BLOCK]
                .map(String::from)
                .to_vec(),
            use_linear_projection: true,
            flip_sin_to_cos: true,
            freq_shift: 0,
        }
    }

    /// Resolution levels.
    pub fn levels(&self) -> usize {
        self.block_out_channels.len()
    }

    /// Width of the timestep embedding that every residual block receives (4 × the first
    /// level's width).
    pub fn time_embed_dim(&self) -> usize {
        4 * self.block_out_channels[0]
    }

    /// Whether down block `level` has attention layers.
    pub fn down_has_attention(&self, level: usize) -> bool {
        self.down_block_types[level] == CROSS_ATTN_DOWN_BLOCK
    }

    /// Whether up block `index` (coarsest first) has attention layers.
    pub fn up_has_attention(&self, index: usize) -> bool {
        self.up_block_types[index] == CROSS_ATTN_UP_BLOCK
    }

    /// The block structure that names the UNet's tensors in the original (SGM) layout and in
    /// LoRA files ([`UNetLayout`]).
    pub fn layout(&self) -> UNetLayout {
        let transformer_depth = (0..self.levels())
            .map(|level| {
                if self.down_has_attention(level) {
                    self.transformer_layers_per_block[level]
                } else {
                    0
                }
            })
            .collect();
        UNetLayout {
            block_out_channels: self.block_out_channels.clone(),
            layers_per_block: self.layers_per_block,
            transformer_depth,
            mid_depth: *self
                .transformer_layers_per_block
                .last()
                .expect("a validated configuration has levels"),
        }
    }

    /// Checks that the sizes agree with each other and that every choice is one this port
    /// implements.
    pub fn validate(&self) -> Result<(), String> {
        let levels = self.levels();
        if levels == 0 {
            return Err("block_out_channels is empty".into());
        }
        for (field, len) in [
            (
                "transformer_layers_per_block",
                self.transformer_layers_per_block.len(),
            ),
            ("attention_head_dim", self.attention_head_dim.len()),
            ("down_block_types", self.down_block_types.len()),
            ("up_block_types", self.up_block_types.len()),
        ] {
            if len != levels {
                return Err(format!(
                    "{field} has {len} entries for {levels} levels (block_out_channels {:?})",
                    self.block_out_channels
                ));
            }
        }
        for (field, types, allowed) in [
            (
                "down_block_types",
                &self.down_block_types,
                [DOWN_BLOCK, CROSS_ATTN_DOWN_BLOCK],
            ),
            (
                "up_block_types",
                &self.up_block_types,
                [UP_BLOCK, CROSS_ATTN_UP_BLOCK],
            ),
        ] {
            if let Some(other) = types.iter().find(|t| !allowed.contains(&t.as_str())) {
                return Err(format!(
                    "{field}: `{other}` is not supported (expected {} or {})",
                    allowed[0], allowed[1]
                ));
            }
        }
        if !self.use_linear_projection {
            return Err(
                "use_linear_projection false (convolution projections) is not supported".into(),
            );
        }
        if !self.flip_sin_to_cos || self.freq_shift != 0 {
            return Err(format!(
                "flip_sin_to_cos {} / freq_shift {} is not supported (expected true / 0)",
                self.flip_sin_to_cos, self.freq_shift
            ));
        }
        if self.layers_per_block == 0 {
            return Err("layers_per_block is 0".into());
        }
        check_group_norm(self.norm_num_groups, &self.block_out_channels)?;
        if !self.block_out_channels[0].is_multiple_of(2)
            || !self.addition_time_embed_dim.is_multiple_of(2)
        {
            return Err(format!(
                "the sinusoidal embeddings need even widths: block_out_channels[0] {} / \
                 addition_time_embed_dim {}",
                self.block_out_channels[0], self.addition_time_embed_dim
            ));
        }
        if self.cross_attention_dim == 0 || self.projection_class_embeddings_input_dim == 0 {
            return Err(
                "cross_attention_dim and projection_class_embeddings_input_dim must be positive"
                    .into(),
            );
        }
        // The middle block attends at the coarsest level whatever its type.
        let attended = (0..levels)
            .filter(|&l| self.down_has_attention(l) || self.up_has_attention(levels - 1 - l))
            .chain([levels - 1]);
        for level in attended {
            let (width, heads) = (
                self.block_out_channels[level],
                self.attention_head_dim[level],
            );
            if heads == 0 || !width.is_multiple_of(heads) {
                return Err(format!(
                    "level {level}: {heads} heads (attention_head_dim) do not divide the width {width}"
                ));
            }
            if self.transformer_layers_per_block[level] == 0 {
                return Err(format!(
                    "level {level} has attention but transformer_layers_per_block is 0"
                ));
            }
        }
        Ok(())
    }

    /// Reads diffusers' `unet/config.json` (`UNet2DConditionModel`), with diffusers' defaults
    /// for absent fields. Per-level fields may be one number or a list; every option SDXL does
    /// not use must be absent or at its default, else the error names the field.
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let json = Json {
            file,
            map: read_json(file)?,
        };
        json.expect(
            "_class_name",
            Value::Null,
            &[Value::Null, "UNet2DConditionModel".into()],
        )?;
        for (field, allowed) in unsupported_options() {
            let default = allowed[0].clone();
            json.expect(field, default, &allowed)?;
        }
        if !json.is_null("num_attention_heads") {
            return Err(json.error("`num_attention_heads` must be null (diffusers refuses it too)"));
        }
        json.expect("addition_embed_type", Value::Null, &["text_time".into()])?;
        let block_out_channels = json.usizes("block_out_channels", &[320, 640, 1280, 1280])?;
        let levels = block_out_channels.len();
        let config = Self {
            in_channels: json.usize("in_channels", Some(4))?,
            out_channels: json.usize("out_channels", Some(4))?,
            layers_per_block: json.uniform("layers_per_block", 2, levels)?,
            transformer_layers_per_block: json.per_level(
                "transformer_layers_per_block",
                1,
                levels,
            )?,
            attention_head_dim: json.per_level("attention_head_dim", 8, levels)?,
            cross_attention_dim: json.uniform("cross_attention_dim", 1280, levels)?,
            addition_time_embed_dim: json.usize("addition_time_embed_dim", None)?,
            projection_class_embeddings_input_dim: json
                .usize("projection_class_embeddings_input_dim", None)?,
            norm_num_groups: json.usize("norm_num_groups", Some(32))?,
            norm_eps: json.f64("norm_eps", 1e-5)?,
            down_block_types: json.strings(
                "down_block_types",
                &[
                    CROSS_ATTN_DOWN_BLOCK,
                    CROSS_ATTN_DOWN_BLOCK,
                    CROSS_ATTN_DOWN_BLOCK,
                    DOWN_BLOCK,
                ],
            )?,
            up_block_types: json.strings(
                "up_block_types",
                &[
                    UP_BLOCK,
                    CROSS_ATTN_UP_BLOCK,
                    CROSS_ATTN_UP_BLOCK,
                    CROSS_ATTN_UP_BLOCK,
                ],
            )?,
            use_linear_projection: json.bool("use_linear_projection", false)?,
            flip_sin_to_cos: json.bool("flip_sin_to_cos", true)?,
            freq_shift: json.usize("freq_shift", Some(0))?,
            block_out_channels,
        };
        config.validate().map_err(|message| json.error(&message))?;
        Ok(config)
    }
}

/// The options of `UNet2DConditionModel` that SDXL leaves at one value, with the values this
/// port accepts (the first is diffusers' default, assumed when the field is absent).
fn unsupported_options() -> Vec<(&'static str, Vec<Value>)> {
    let null = || vec![Value::Null];
    vec![
        ("act_fn", vec!["silu".into()]),
        ("mid_block_type", vec!["UNetMidBlock2DCrossAttn".into()]),
        ("center_input_sample", vec![false.into()]),
        ("only_cross_attention", vec![false.into()]),
        ("dual_cross_attention", vec![false.into()]),
        ("upcast_attention", vec![Value::Null, false.into()]),
        ("downsample_padding", vec![1.into()]),
        ("mid_block_scale_factor", vec![1.into()]),
        ("resnet_out_scale_factor", vec![1.into()]),
        ("dropout", vec![0.into()]),
        ("resnet_time_scale_shift", vec!["default".into()]),
        ("resnet_skip_time_act", vec![false.into()]),
        ("time_embedding_type", vec!["positional".into()]),
        ("conv_in_kernel", vec![3.into()]),
        ("conv_out_kernel", vec![3.into()]),
        ("attention_type", vec!["default".into()]),
        ("class_embeddings_concat", vec![false.into()]),
        (
            "mid_block_only_cross_attention",
            vec![Value::Null, false.into()],
        ),
        ("class_embed_type", null()),
        ("num_class_embeds", null()),
        ("encoder_hid_dim", null()),
        ("encoder_hid_dim_type", null()),
        ("time_embedding_dim", null()),
        ("time_embedding_act_fn", null()),
        ("timestep_post_act", null()),
        ("time_cond_proj_dim", null()),
        ("cross_attention_norm", null()),
        ("reverse_transformer_layers_per_block", null()),
    ]
}

/// A parsed `config.json` and the reading of its fields, every error naming the file and field.
struct Json<'a> {
    file: &'a Path,
    map: Map<String, Value>,
}

impl Json<'_> {
    fn error(&self, message: &str) -> LoadError {
        LoadError::Config {
            file: self.file.to_path_buf(),
            message: message.to_string(),
        }
    }

    fn field_error(&self, field: &str, value: &Value, expected: &str) -> LoadError {
        self.error(&format!("`{field}` is {value}, expected {expected}"))
    }

    /// The field's value, `None` when absent or null.
    fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn is_null(&self, field: &str) -> bool {
        self.get(field).is_none()
    }

    /// Checks that the field (`default` when absent) is one of `allowed`; numbers compare by
    /// value (`1` and `1.0` are equal).
    fn expect(&self, field: &str, default: Value, allowed: &[Value]) -> Result<(), LoadError> {
        let value = self.map.get(field).cloned().unwrap_or(default);
        let same = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => a == b,
        };
        if allowed.iter().any(|a| same(a, &value)) {
            return Ok(());
        }
        let expected: Vec<String> = allowed.iter().map(Value::to_string).collect();
        Err(self.field_error(
            field,
            &value,
            &format!("{} (the only supported)", expected.join(" or ")),
        ))
    }

    fn as_usize(&self, field: &str, value: &Value) -> Result<usize, LoadError> {
        value
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| self.field_error(field, value, "a non-negative integer"))
    }

    /// An integer field; `default` when absent or null, an error when there is none.
    fn usize(&self, field: &str, default: Option<usize>) -> Result<usize, LoadError> {
        match (self.get(field), default) {
            (Some(value), _) => self.as_usize(field, value),
            (None, Some(default)) => Ok(default),
            (None, None) => Err(self.error(&format!("`{field}` is required"))),
        }
    }

    fn f64(&self, field: &str, default: f64) -> Result<f64, LoadError> {
        match self.get(field) {
            Some(value) => value
                .as_f64()
                .ok_or_else(|| self.field_error(field, value, "a number")),
            None => Ok(default),
        }
    }

    fn bool(&self, field: &str, default: bool) -> Result<bool, LoadError> {
        match self.get(field) {
            Some(value) => value
                .as_bool()
                .ok_or_else(|| self.field_error(field, value, "a boolean")),
            None => Ok(default),
        }
    }

    fn usizes(&self, field: &str, default: &[usize]) -> Result<Vec<usize>, LoadError> {
        match self.get(field) {
            Some(Value::Array(items)) => items.iter().map(|v| self.as_usize(field, v)).collect(),
            Some(value) => Err(self.field_error(field, value, "a list of integers")),
            None => Ok(default.to_vec()),
        }
    }

    fn strings(&self, field: &str, default: &[&str]) -> Result<Vec<String>, LoadError> {
        match self.get(field) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(String::from)
                        .ok_or_else(|| self.field_error(field, v, "a string"))
                })
                .collect(),
            Some(value) => Err(self.field_error(field, value, "a list of strings")),
            None => Ok(default.iter().map(|s| s.to_string()).collect()),
        }
    }

    /// One integer per level: a number (the same for every level) or a list of `levels`.
    fn per_level(
        &self,
        field: &str,
        default: usize,
        levels: usize,
    ) -> Result<Vec<usize>, LoadError> {
        match self.get(field) {
            Some(Value::Array(items)) if items.len() == levels => {
                items.iter().map(|v| self.as_usize(field, v)).collect()
            }
            Some(value @ Value::Array(_)) => {
                Err(self.field_error(field, value, &format!("one integer per level ({levels})")))
            }
            Some(value) => Ok(vec![self.as_usize(field, value)?; levels]),
            None => Ok(vec![default; levels]),
        }
    }

    /// A number that may be written per level, where every level must have the same one.
    fn uniform(&self, field: &str, default: usize, levels: usize) -> Result<usize, LoadError> {
        let values = self.per_level(field, default, levels)?;
        match values.split_first() {
            Some((first, rest)) if rest.iter().all(|v| v == first) => Ok(*first),
            Some(_) => Err(self.field_error(
                field,
                &Value::from(values.clone()),
                "the same value for every level (the only supported)",
            )),
            None => Ok(default),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdxl_names_its_tensors_by_the_sdxl_layout() {
        assert_eq!(UNetConfig::sdxl().layout(), UNetLayout::sdxl());
    }

    /// SDXL base 1.0's `unet/config.json` as published.
    const SDXL_JSON: &str = r#"{
        "_class_name": "UNet2DConditionModel",
        "_diffusers_version": "0.19.0.dev0",
        "act_fn": "silu",
        "addition_embed_type": "text_time",
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256,
        "attention_head_dim": [5, 10, 20],
        "block_out_channels": [320, 640, 1280],
        "center_input_sample": false,
        "class_embed_type": null,
        "class_embeddings_concat": false,
        "conv_in_kernel": 3,
        "conv_out_kernel": 3,
        "cross_attention_dim": 2048,
        "cross_attention_norm": null,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "downsample_padding": 1,
        "dual_cross_attention": false,
        "encoder_hid_dim": null,
        "encoder_hid_dim_type": null,
        "flip_sin_to_cos": true,
        "freq_shift": 0,
        "in_channels": 4,
        "layers_per_block": 2,
        "mid_block_only_cross_attention": null,
        "mid_block_scale_factor": 1,
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "norm_eps": 1e-05,
        "norm_num_groups": 32,
        "num_attention_heads": null,
        "num_class_embeds": null,
        "only_cross_attention": false,
        "out_channels": 4,
        "projection_class_embeddings_input_dim": 2816,
        "resnet_out_scale_factor": 1.0,
        "resnet_skip_time_act": false,
        "resnet_time_scale_shift": "default",
        "sample_size": 128,
        "time_cond_proj_dim": null,
        "time_embedding_act_fn": null,
        "time_embedding_dim": null,
        "time_embedding_type": "positional",
        "timestep_post_act": null,
        "transformer_layers_per_block": [1, 2, 10],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "upcast_attention": null,
        "use_linear_projection": true
    }"#;

    fn read(text: &str) -> Result<UNetConfig, LoadError> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, text).unwrap();
        UNetConfig::from_json(&file)
    }

    /// SDXL's json with `field` replaced by `value` (json text).
    fn sdxl_with(field: &str, value: &str) -> String {
        let mut json: Map<String, Value> = serde_json::from_str(SDXL_JSON).unwrap();
        json.insert(field.into(), serde_json::from_str(value).unwrap());
        Value::Object(json).to_string()
    }

    #[test]
    fn the_preset_is_sdxl_base_and_valid() {
        let config = UNetConfig::sdxl();
        config.validate().unwrap();
        assert_eq!(config.time_embed_dim(), 1280);
        assert_eq!(read(SDXL_JSON).unwrap(), config);
    }

    #[test]
    fn a_number_stands_for_every_level() {
        let config = read(&sdxl_with("transformer_layers_per_block", "2")).unwrap();
        assert_eq!(config.transformer_layers_per_block, [2, 2, 2]);
        let config = read(&sdxl_with("cross_attention_dim", "[2048, 2048, 2048]")).unwrap();
        assert_eq!(config.cross_attention_dim, 2048);
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let cases = [
            (
                "mid_block_type",
                r#""UNetMidBlock2D""#,
                "`mid_block_type` is \"UNetMidBlock2D\"",
            ),
            (
                "use_linear_projection",
                "false",
                "use_linear_projection false",
            ),
            (
                "addition_embed_type",
                "null",
                "`addition_embed_type` is null",
            ),
            (
                "attention_head_dim",
                "[5, 10]",
                "`attention_head_dim` is [5,10], expected one integer per level (3)",
            ),
            (
                "cross_attention_dim",
                "[768, 1024, 1024]",
                "`cross_attention_dim` is [768,1024,1024]",
            ),
            (
                "down_block_types",
                r#"["DownBlock2D", "AttnDownBlock2D", "CrossAttnDownBlock2D"]"#,
                "`AttnDownBlock2D` is not supported",
            ),
            (
                "attention_head_dim",
                "[5, 7, 20]",
                "7 heads (attention_head_dim) do not divide the width 640",
            ),
            ("dropout", "0.1", "`dropout` is 0.1"),
            (
                "_class_name",
                r#""UNet2DModel""#,
                "`_class_name` is \"UNet2DModel\"",
            ),
        ];
        for (field, value, expected) in cases {
            let text = read(&sdxl_with(field, value)).unwrap_err().to_string();
            assert!(text.contains("config.json: "), "{text}");
            assert!(text.contains(expected), "{field}: {text}");
        }
        let mut json: Map<String, Value> = serde_json::from_str(SDXL_JSON).unwrap();
        json.remove("addition_time_embed_dim");
        let text = read(&Value::Object(json).to_string())
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("`addition_time_embed_dim` is required"),
            "{text}"
        );
    }
}
