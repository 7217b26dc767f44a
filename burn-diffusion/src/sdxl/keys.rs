//! Every name of every SDXL UNet layer: its module path in the original single file (SGM's
//! `sd_xl_base_1.0.safetensors`, under [`SGM_UNET_PREFIX`]) and in diffusers, which the model's
//! fields follow. All remapping between the two layouts is this one table, and the same table
//! names LoRA modules ([`lora_names`]).
//!
//! SGM numbers its blocks flat. `input_blocks.0.0` is `conv_in`; then each level has
//! `layers_per_block` blocks of a resnet (`.0`) and, on levels with attention, a spatial
//! transformer (`.1`), and every level but the last ends in a block holding the downsampler
//! (`.0.op`). `middle_block.0`, `.1`, `.2` are a resnet, the transformer and a resnet.
//! `output_blocks` has `layers_per_block + 1` blocks per up block (coarsest level first), each
//! a resnet (`.0`) and a transformer (`.1`) where the level has attention; the last block of
//! every up block but the last also holds the upsampler (`.1.conv`, or `.2.conv` after a
//! transformer). Inside a resnet, `in_layers.0` / `.2` are `norm1` / `conv1`, `emb_layers.1` is
//! `time_emb_proj`, `out_layers.0` / `.3` are `norm2` / `conv2` and `skip_connection` is
//! `conv_shortcut`. The embeddings are `time_embed.0` / `.2` (`time_embedding.linear_1` / `_2`)
//! and `label_emb.0.0` / `.0.2` (`add_embedding.linear_1` / `_2`), the output `out.0` / `.2`
//! (`conv_norm_out` / `conv_out`). Transformers have the same names in both layouts.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/loaders/single_file_utils.py (convert_ldm_unet_checkpoint)

use burn_lora::{ComponentNames, LayoutNames, NameMap, PeftAlpha};

/// The prefix of the UNet's keys in SGM single files.
pub const SGM_UNET_PREFIX: &str = "model.diffusion_model.";

/// The block structure that decides a UNet's tensor names. The UNet's configuration gives it
/// (a level's depth is its `transformer_layers_per_block` entry for a cross-attention down
/// block, 0 for a `DownBlock2D`; the middle's is the last entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UNetLayout {
    /// Output channels of each level, finest first (`block_out_channels`).
    pub block_out_channels: Vec<usize>,
    /// Resnets per down block (`layers_per_block`); up blocks have one more.
    pub layers_per_block: usize,
    /// Transformer blocks in each attention of each level, finest first, 0 for a level without
    /// attention; the up blocks mirror the down blocks.
    pub transformer_depth: Vec<usize>,
    /// Transformer blocks of the middle block's attention.
    pub mid_depth: usize,
}

impl UNetLayout {
    /// SDXL base 1.0: levels of 320, 640 and 1280 channels, two resnets per down block, no
    /// attention at the finest level, then 2 and 10 transformer blocks; 10 in the middle.
    pub fn sdxl() -> Self {
        Self {
            block_out_channels: vec![320, 640, 1280],
            layers_per_block: 2,
            transformer_depth: vec![0, 2, 10],
            mid_depth: 10,
        }
    }

    /// The number of levels.
    pub fn levels(&self) -> usize {
        self.block_out_channels.len()
    }
}

/// What kind of layer a module is, which decides its parameters and whether an adapter wraps
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// `nn::Linear`, with or without a bias (the attentions' `to_q`, `to_k`, `to_v` have none).
    Linear {
        /// Whether the layer has a bias.
        bias: bool,
    },
    /// `nn::Conv2d` with a bias.
    Conv2d,
    /// A group or layer norm (`weight` and `bias`).
    Norm,
}

impl ModuleKind {
    /// The names of the module's tensors in both layouts (`weight`, and `bias` where it has
    /// one).
    pub fn params(self) -> &'static [&'static str] {
        match self {
            Self::Linear { bias: false } => &["weight"],
            Self::Linear { bias: true } | Self::Conv2d | Self::Norm => &["weight", "bias"],
        }
    }

    /// Whether a LoRA (linear) or LoCon (convolution) adapter can wrap the layer.
    pub fn adaptable(self) -> bool {
        matches!(self, Self::Linear { .. } | Self::Conv2d)
    }
}

/// One layer of the UNet under both names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UNetModule {
    /// The module path in SGM files, without [`SGM_UNET_PREFIX`] (e.g.
    /// `input_blocks.4.1.transformer_blocks.0.attn1.to_q`).
    pub sgm: String,
    /// The module path in diffusers (e.g.
    /// `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`).
    pub diffusers: String,
    /// The kind of layer.
    pub kind: ModuleKind,
}

impl UNetModule {
    /// Each tensor of the layer as `(sgm key, diffusers key)`, the SGM key without
    /// [`SGM_UNET_PREFIX`].
    pub fn param_keys(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.kind.params().iter().map(|param| {
            (
                format!("{}.{param}", self.sgm),
                format!("{}.{param}", self.diffusers),
            )
        })
    }
}

/// Every layer of a UNet of this layout (SDXL's `use_linear_projection`: the transformers'
/// `proj_in` / `proj_out` are Linears), under its SGM and diffusers names.
///
/// A down block's first resnet has a shortcut convolution where the level's channels differ
/// from the previous level's; every resnet of an up block has one, since its input also holds
/// the skip connection's channels.
///
/// # Panics
/// If `transformer_depth` does not have one entry per level.
pub fn unet_modules(layout: &UNetLayout) -> Vec<UNetModule> {
    let levels = layout.levels();
    assert_eq!(
        layout.transformer_depth.len(),
        levels,
        "one transformer depth per level"
    );
    let channels = &layout.block_out_channels;
    let depth = &layout.transformer_depth;
    let per_block = layout.layers_per_block;
    let step = per_block + 1;
    let mut table = Table::default();
    let linear = ModuleKind::Linear { bias: true };

    table.push("time_embed.0", "time_embedding.linear_1", linear);
    table.push("time_embed.2", "time_embedding.linear_2", linear);
    table.push("label_emb.0.0", "add_embedding.linear_1", linear);
    table.push("label_emb.0.2", "add_embedding.linear_2", linear);
    table.push("input_blocks.0.0", "conv_in", ModuleKind::Conv2d);

    for level in 0..levels {
        for j in 0..per_block {
            let sgm = format!("input_blocks.{}", 1 + step * level + j);
            let previous = if j == 0 && level > 0 {
                level - 1
            } else {
                level
            };
            let shortcut = channels[previous] != channels[level];
            table.resnet(
                &format!("{sgm}.0"),
                &format!("down_blocks.{level}.resnets.{j}"),
                shortcut,
            );
            table.transformer(
                &format!("{sgm}.1"),
                &format!("down_blocks.{level}.attentions.{j}"),
                depth[level],
            );
        }
        if level + 1 < levels {
            table.push(
                format!("input_blocks.{}.0.op", step * (level + 1)),
                format!("down_blocks.{level}.downsamplers.0.conv"),
                ModuleKind::Conv2d,
            );
        }
    }

    table.resnet("middle_block.0", "mid_block.resnets.0", false);
    table.transformer("middle_block.1", "mid_block.attentions.0", layout.mid_depth);
    table.resnet("middle_block.2", "mid_block.resnets.1", false);

    for block in 0..levels {
        let level = levels - 1 - block;
        for j in 0..step {
            let sgm = format!("output_blocks.{}", step * block + j);
            table.resnet(
                &format!("{sgm}.0"),
                &format!("up_blocks.{block}.resnets.{j}"),
                true,
            );
            table.transformer(
                &format!("{sgm}.1"),
                &format!("up_blocks.{block}.attentions.{j}"),
                depth[level],
            );
        }
        if block + 1 < levels {
            let slot = if depth[level] > 0 { 2 } else { 1 };
            table.push(
                format!("output_blocks.{}.{slot}.conv", step * block + per_block),
                format!("up_blocks.{block}.upsamplers.0.conv"),
                ModuleKind::Conv2d,
            );
        }
    }

    table.push("out.0", "conv_norm_out", ModuleKind::Norm);
    table.push("out.2", "conv_out", ModuleKind::Conv2d);
    table.0
}

/// The table as it is built.
#[derive(Default)]
struct Table(Vec<UNetModule>);

impl Table {
    fn push(&mut self, sgm: impl Into<String>, diffusers: impl Into<String>, kind: ModuleKind) {
        self.0.push(UNetModule {
            sgm: sgm.into(),
            diffusers: diffusers.into(),
            kind,
        });
    }

    /// A resnet (`ResnetBlock2D`), with its shortcut convolution or without.
    fn resnet(&mut self, sgm: &str, diffusers: &str, shortcut: bool) {
        let layers = [
            ("in_layers.0", "norm1", ModuleKind::Norm),
            ("in_layers.2", "conv1", ModuleKind::Conv2d),
            (
                "emb_layers.1",
                "time_emb_proj",
                ModuleKind::Linear { bias: true },
            ),
            ("out_layers.0", "norm2", ModuleKind::Norm),
            ("out_layers.3", "conv2", ModuleKind::Conv2d),
        ];
        let shortcut = shortcut.then_some(("skip_connection", "conv_shortcut", ModuleKind::Conv2d));
        for (s, d, kind) in layers.into_iter().chain(shortcut) {
            self.push(format!("{sgm}.{s}"), format!("{diffusers}.{d}"), kind);
        }
    }

    /// A spatial transformer (`Transformer2DModel`) of `depth` blocks; nothing for depth 0.
    fn transformer(&mut self, sgm: &str, diffusers: &str, depth: usize) {
        if depth == 0 {
            return;
        }
        let linear = ModuleKind::Linear { bias: true };
        let mut same = |name: &str, kind| {
            self.push(format!("{sgm}.{name}"), format!("{diffusers}.{name}"), kind);
        };
        same("norm", ModuleKind::Norm);
        same("proj_in", linear);
        for i in 0..depth {
            let block = format!("transformer_blocks.{i}");
            for norm in ["norm1", "norm2", "norm3"] {
                same(&format!("{block}.{norm}"), ModuleKind::Norm);
            }
            for attn in ["attn1", "attn2"] {
                for projection in ["to_q", "to_k", "to_v"] {
                    same(
                        &format!("{block}.{attn}.{projection}"),
                        ModuleKind::Linear { bias: false },
                    );
                }
                same(&format!("{block}.{attn}.to_out.0"), linear);
            }
            same(&format!("{block}.ff.net.0.proj"), linear);
            same(&format!("{block}.ff.net.2"), linear);
        }
        same("proj_out", linear);
    }
}

/// The names of every layer an adapter can wrap (Linears, and convolutions for LoCon) in each
/// LoRA file layout, for a model whose module paths are diffusers' names:
///
/// - kohya files carry SGM paths, `lora_unet_` + the path with `_` for `.`, as kohya's
///   sd-scripts writes them (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`,
///   `lora_unet_output_blocks_2_2_conv`, `lora_unet_input_blocks_1_0_in_layers_2`), which
///   diffusers' SDXL loader reads whole (burn-lora-train's `tool_fixtures_sdxl.rs`, from
///   fixtures its own code made). ComfyUI names SDXL's layers the same way
///   (`comfy/lora.py`, `model_lora_keys_unet`); its own loader has not been run on these
///   files. ai-toolkit writes its SDXL LoRAs in this layout.
/// - ai-toolkit-style files (`diffusion_model.` + SGM path), ComfyUI's other layout (not run
///   through ComfyUI's loader).
/// - PEFT files carry diffusers paths under `unet.`, as `StableDiffusionXLPipeline.
///   load_lora_weights` expects, with alpha in the `lora_adapter_metadata` entry: diffusers'
///   SDXL loader reads `.alpha` tensors from kohya files only.
///
/// Text-encoder adapters (`lora_te1_`, `lora_te2_`) are [`text_encoder_names`]'.
pub fn lora_names(layout: &UNetLayout) -> LayoutNames {
    let (checkpoint, diffusers) = unet_modules(layout)
        .into_iter()
        .filter(|m| m.kind.adaptable())
        .fold(
            (NameMap::new(), NameMap::new()),
            |(checkpoint, diffusers), m| {
                (
                    checkpoint.rename(&m.diffusers, m.sgm),
                    diffusers.rename(&m.diffusers, &m.diffusers),
                )
            },
        );
    LayoutNames {
        checkpoint,
        diffusers,
        diffusers_prefix: "unet".into(),
        peft_alpha: PeftAlpha::Metadata,
        components: Vec::new(),
    }
}

/// The model paths under which [`text_encoder_names`] expects SDXL's text encoders, CLIP-L's and
/// bigG's: diffusers' pipeline components.
pub const TEXT_ENCODERS: [&str; 2] = ["text_encoder", "text_encoder_2"];

/// The names of the layers of SDXL's text encoders an adapter can wrap (each layer's attention
/// projections and MLP Linears, the targets of kohya's sd-scripts), as components of a model
/// that keeps CLIP-L and bigG at the paths [`TEXT_ENCODERS`], with `layers` (CLIP-L's count,
/// bigG's):
///
/// - kohya files: `lora_te1_` / `lora_te2_` + `text_model_encoder_layers_0_self_attn_q_proj`, as
///   kohya's sd-scripts write them;
/// - PEFT files: `text_encoder.` / `text_encoder_2.` + `text_model.encoder.layers.0.self_attn.
///   q_proj`, as diffusers' `save_lora_weights` writes them, alphas in `lora_adapter_metadata`
///   under the same prefixes (its module names without `text_model.`, which transformers' CLIP
///   lost in version 5 and PEFT matches either way).
///
/// ComfyUI's and diffusers' loaders read both (burn-lora-train's `tool_fixtures_sdxl.rs`).
pub fn text_encoder_names(layers: (usize, usize)) -> Vec<ComponentNames> {
    let component = |path: &str, kohya: &str, layers: usize| {
        let names = (0..layers)
            .flat_map(|i| {
                [
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.out_proj",
                    "mlp.fc1",
                    "mlp.fc2",
                ]
                .map(|layer| format!("encoder.layers.{i}.{layer}"))
            })
            .fold(NameMap::new(), |map, module| {
                let target = format!("text_model.{module}");
                map.rename(module, target)
            });
        ComponentNames {
            module_prefix: format!("{path}."),
            kohya_prefix: kohya.into(),
            peft_prefix: path.into(),
            names,
            peft_config_root: "text_model.".into(),
        }
    };
    vec![
        component(TEXT_ENCODERS[0], "lora_te1", layers.0),
        component(TEXT_ENCODERS[1], "lora_te2", layers.1),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(modules: &'a [UNetModule], sgm: &str) -> &'a UNetModule {
        modules
            .iter()
            .find(|m| m.sgm == sgm)
            .unwrap_or_else(|| panic!("no `{sgm}`"))
    }

    #[test]
    fn sdxl_names_of_each_kind_of_layer() {
        let modules = unet_modules(&UNetLayout::sdxl());
        let cases = [
            (
                "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
                "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            ),
            ("input_blocks.3.0.op", "down_blocks.0.downsamplers.0.conv"),
            ("input_blocks.6.0.op", "down_blocks.1.downsamplers.0.conv"),
            (
                "input_blocks.4.0.skip_connection",
                "down_blocks.1.resnets.0.conv_shortcut",
            ),
            (
                "input_blocks.1.0.in_layers.2",
                "down_blocks.0.resnets.0.conv1",
            ),
            (
                "input_blocks.8.1.transformer_blocks.9.ff.net.0.proj",
                "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.0.proj",
            ),
            ("middle_block.1.proj_in", "mid_block.attentions.0.proj_in"),
            (
                "middle_block.2.emb_layers.1",
                "mid_block.resnets.1.time_emb_proj",
            ),
            ("output_blocks.2.2.conv", "up_blocks.0.upsamplers.0.conv"),
            ("output_blocks.5.2.conv", "up_blocks.1.upsamplers.0.conv"),
            (
                "output_blocks.0.0.skip_connection",
                "up_blocks.0.resnets.0.conv_shortcut",
            ),
            (
                "output_blocks.8.0.out_layers.3",
                "up_blocks.2.resnets.2.conv2",
            ),
            ("label_emb.0.2", "add_embedding.linear_2"),
            ("out.2", "conv_out"),
        ];
        for (sgm, diffusers) in cases {
            assert_eq!(find(&modules, sgm).diffusers, diffusers, "{sgm}");
        }
        let (conv_in, diffusers) = find(&modules, "input_blocks.0.0")
            .param_keys()
            .next()
            .unwrap();
        assert_eq!(
            (format!("{SGM_UNET_PREFIX}{conv_in}"), diffusers.as_str()),
            (
                "model.diffusion_model.input_blocks.0.0.weight".to_string(),
                "conv_in.weight"
            )
        );
        let missing = [
            "input_blocks.1.1.norm",
            "input_blocks.9.0.op",
            "output_blocks.8.1.conv",
            "output_blocks.6.1.norm",
            "input_blocks.1.0.skip_connection",
            "input_blocks.5.0.skip_connection",
            "middle_block.0.skip_connection",
        ];
        for sgm in missing {
            assert!(modules.iter().all(|m| m.sgm != sgm), "{sgm}");
        }
    }

    #[test]
    fn up_blocks_without_attention_hold_the_upsampler_second() {
        let layout = UNetLayout {
            block_out_channels: vec![8, 16],
            layers_per_block: 1,
            transformer_depth: vec![1, 0],
            mid_depth: 1,
        };
        let modules = unet_modules(&layout);
        assert_eq!(
            find(&modules, "output_blocks.1.1.conv").diffusers,
            "up_blocks.0.upsamplers.0.conv"
        );
        assert_eq!(
            find(&modules, "output_blocks.3.1.proj_out").diffusers,
            "up_blocks.1.attentions.1.proj_out"
        );
        assert_eq!(
            find(&modules, "input_blocks.2.0.op").diffusers,
            "down_blocks.0.downsamplers.0.conv"
        );
    }

    #[test]
    fn attention_projections_have_no_bias() {
        let modules = unet_modules(&UNetLayout::sdxl());
        let to_k = find(&modules, "middle_block.1.transformer_blocks.3.attn2.to_k");
        let keys: Vec<_> = to_k.param_keys().collect();
        assert_eq!(
            keys,
            [(
                "middle_block.1.transformer_blocks.3.attn2.to_k.weight".to_string(),
                "mid_block.attentions.0.transformer_blocks.3.attn2.to_k.weight".to_string()
            )]
        );
        let out = find(
            &modules,
            "middle_block.1.transformer_blocks.3.attn2.to_out.0",
        );
        assert_eq!(out.param_keys().count(), 2);
    }

    #[test]
    fn lora_names_cover_linears_and_convolutions_only() {
        let names = lora_names(&UNetLayout::sdxl());
        let kohya = names.checkpoint.target_names();
        let flat: Vec<String> = [
            "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
            "middle_block.1.proj_in",
            "output_blocks.2.2.conv",
            "input_blocks.1.0.in_layers.2",
        ]
        .iter()
        .map(|n| {
            assert!(kohya.contains(n), "{n}");
            format!("lora_unet_{}", n.replace('.', "_"))
        })
        .collect();
        assert_eq!(
            flat,
            [
                "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                "lora_unet_middle_block_1_proj_in",
                "lora_unet_output_blocks_2_2_conv",
                "lora_unet_input_blocks_1_0_in_layers_2",
            ]
        );
        assert!(!kohya.contains("input_blocks.1.0.in_layers.0"));
        let peft = names.diffusers.target_names();
        assert!(peft.contains("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"));
        assert!(!peft.contains("conv_norm_out"));
        assert_eq!(names.diffusers_prefix, "unet");
        let adaptable = unet_modules(&UNetLayout::sdxl())
            .iter()
            .filter(|m| m.kind.adaptable())
            .count();
        assert_eq!((kohya.len(), peft.len()), (adaptable, adaptable));
    }

    #[test]
    fn flattened_kohya_names_stay_distinct() {
        let names = lora_names(&UNetLayout::sdxl());
        let sgm = names.checkpoint.target_names();
        let flat: std::collections::BTreeSet<String> =
            sgm.iter().map(|n| burn_lora::flatten_name(n)).collect();
        assert_eq!(flat.len(), sgm.len());
    }

    #[test]
    fn lora_files_carry_each_layout_names_and_read_back() {
        use burn::tensor::TensorData;
        use burn_lora::{AdapterSet, Format, LoraMetadata, SaveOptions, StoredAdapter};

        let names = lora_names(&UNetLayout::sdxl());
        let lora = |shape_down: Vec<usize>, shape_up: Vec<usize>| StoredAdapter::Lora {
            down: TensorData::new(vec![0.5f32; shape_down.iter().product()], shape_down),
            up: TensorData::new(vec![0.25f32; shape_up.iter().product()], shape_up),
            alpha: 2.0,
        };
        let mut set = AdapterSet::new(LoraMetadata::default());
        let to_q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q";
        let upsampler = "up_blocks.0.upsamplers.0.conv";
        set.insert(to_q, lora(vec![4, 640], vec![640, 4]));
        set.insert(upsampler, lora(vec![4, 1280, 3, 3], vec![1280, 4, 1, 1]));
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (
                Format::Kohya,
                [
                    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight",
                    "lora_unet_output_blocks_2_2_conv.lora_up.weight",
                ],
            ),
            (
                Format::Peft,
                [
                    "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
                    "unet.up_blocks.0.upsamplers.0.conv.lora_B.weight",
                ],
            ),
            (
                Format::AiToolkit,
                [
                    "diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.lora_A.weight",
                    "diffusion_model.output_blocks.2.2.conv.lora_B.weight",
                ],
            ),
        ];
        for (format, expected) in cases {
            let file = dir.path().join(format!("{}.safetensors", format.name()));
            names
                .save(&set, &file, &SaveOptions::for_format(format))
                .unwrap();
            let bytes = std::fs::read(&file).unwrap();
            let written = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let keys = written.names();
            for key in expected {
                assert!(keys.contains(&key), "{format:?}: no `{key}` in {keys:?}");
            }
            let read = names.load(&file).unwrap();
            assert_eq!(read.get(to_q), set.get(to_q), "{format:?}");
            assert_eq!(read.get(upsampler), set.get(upsampler), "{format:?}");
        }
    }
}
