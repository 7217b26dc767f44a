//! Wan's original tensor names (Wan-Video's checkpoints, ComfyUI's repackaged files, with or
//! without `model.diffusion_model.`; `Wan2.1_VAE.pth` and ComfyUI's `wan_2.1_vae.safetensors`
//! for the VAE) and the diffusers names the models' fields follow.

use std::path::Path;

use burn_lora::{LayoutNames, NameMap, PeftAlpha};
use burn_quant::Checkpoint;
use serde::Deserialize;

use super::WanConfig;
use crate::weights::{component_folder, read_json};

/// The prefix ComfyUI's all-in-one files put before the transformer's names.
const COMFY_PREFIX: &str = "model.diffusion_model.";

/// Original prefixes outside the blocks and their diffusers names.
const TOP: [(&str, &str); 7] = [
    (
        "time_embedding.0.",
        "condition_embedder.time_embedder.linear_1.",
    ),
    (
        "time_embedding.2.",
        "condition_embedder.time_embedder.linear_2.",
    ),
    (
        "text_embedding.0.",
        "condition_embedder.text_embedder.linear_1.",
    ),
    (
        "text_embedding.2.",
        "condition_embedder.text_embedder.linear_2.",
    ),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
];

/// Original prefixes inside a block and their diffusers names (the original's `norm3` is the
/// cross-attention's norm, diffusers' `norm2`).
const BLOCK: [(&str, &str); 4] = [
    ("norm3.", "norm2."),
    ("ffn.0.", "ffn.net.0.proj."),
    ("ffn.2.", "ffn.net.2."),
    ("modulation", "scale_shift_table"),
];

/// The two attentions of a block.
const ATTENTIONS: [(&str, &str); 2] = [("self_attn.", "attn1."), ("cross_attn.", "attn2.")];

/// An attention's projections.
const PROJECTIONS: [(&str, &str); 4] = [
    ("q.", "to_q."),
    ("k.", "to_k."),
    ("v.", "to_v."),
    ("o.", "to_out.0."),
];

/// Which way a table of (original, diffusers) prefixes is read.
#[derive(Clone, Copy)]
enum Direction {
    ToDiffusers,
    ToOriginal,
}

impl Direction {
    /// The prefix to find and the one to put in its place, of an (original, diffusers) pair.
    fn sides(
        self,
        (original, diffusers): (&'static str, &'static str),
    ) -> (&'static str, &'static str) {
        match self {
            Direction::ToDiffusers => (original, diffusers),
            Direction::ToOriginal => (diffusers, original),
        }
    }
}

/// `name` with the first prefix of `table` it starts with replaced by that prefix's name in the
/// other layout.
fn renamed(
    name: &str,
    table: &[(&'static str, &'static str)],
    direction: Direction,
) -> Option<String> {
    table.iter().find_map(|&pair| {
        let (from, to) = direction.sides(pair);
        name.strip_prefix(from).map(|rest| format!("{to}{rest}"))
    })
}

/// The diffusers name of a tensor of Wan's original layout; any other name (diffusers' own
/// among them) is kept, so that a file under diffusers' names loads too and an unknown name is
/// reported by the loader.
pub fn diffusers_name(original: &str) -> String {
    let name = original.strip_prefix(COMFY_PREFIX).unwrap_or(original);
    rename(name, Direction::ToDiffusers)
}

/// The original name of a tensor or module of diffusers' layout (the inverse of
/// [`diffusers_name`] without ComfyUI's prefix); any other name is kept.
pub fn original_name(diffusers: &str) -> String {
    rename(diffusers, Direction::ToOriginal)
}

/// `name` in the other layout, by the tables above.
fn rename(name: &str, direction: Direction) -> String {
    if let Some(name) = renamed(name, &TOP, direction) {
        return name;
    }
    let Some((index, inner)) = name
        .strip_prefix("blocks.")
        .and_then(|rest| rest.split_once('.'))
    else {
        return name.to_string();
    };
    let attention = ATTENTIONS.iter().find_map(|&pair| {
        let (from, to) = direction.sides(pair);
        inner.strip_prefix(from).map(|rest| (to, rest))
    });
    let inner = match attention {
        Some((attention, rest)) => format!(
            "{attention}{}",
            renamed(rest, &PROJECTIONS, direction).unwrap_or(rest.into())
        ),
        None => renamed(inner, &BLOCK, direction).unwrap_or(inner.into()),
    };
    format!("blocks.{index}.{inner}")
}

/// The diffusers paths of the model's `Linear` layers (every one an adapter may wrap): the
/// timestep and text embeddings, each block's attention projections and feed-forward, the
/// output projection.
pub fn linear_modules(config: &WanConfig) -> Vec<String> {
    let embeddings = [
        "condition_embedder.time_embedder.linear_1",
        "condition_embedder.time_embedder.linear_2",
        "condition_embedder.time_proj",
        "condition_embedder.text_embedder.linear_1",
        "condition_embedder.text_embedder.linear_2",
    ];
    let block = [
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    ];
    embeddings
        .iter()
        .map(|m| m.to_string())
        .chain(
            (0..config.num_layers)
                .flat_map(|i| block.iter().map(move |m| format!("blocks.{i}.{m}"))),
        )
        .chain(["proj_out".to_string()])
        .collect()
}

/// The names the adapted layers take in each LoRA layout: Wan's original module paths
/// (`blocks.0.self_attn.q`; kohya's `lora_unet_blocks_0_self_attn_q` as musubi-tuner writes
/// it, ai-toolkit's `diffusion_model.blocks.0.self_attn.q` as ComfyUI reads it) and diffusers'
/// (`transformer.blocks.0.attn1.to_q`), with alpha in the PEFT file's metadata, as diffusers'
/// `save_lora_weights` writes it.
pub fn lora_names(config: &WanConfig) -> LayoutNames {
    let (checkpoint, diffusers) = linear_modules(config).into_iter().fold(
        (NameMap::new(), NameMap::new()),
        |(checkpoint, diffusers), module| {
            let original = original_name(&format!("{module}.weight"));
            let original = original.strip_suffix(".weight").unwrap_or(&original);
            (
                checkpoint.rename(&module, original),
                diffusers.rename(&module, &module),
            )
        },
    );
    LayoutNames {
        checkpoint,
        diffusers,
        diffusers_prefix: "transformer".into(),
        peft_alpha: PeftAlpha::Metadata,
        components: Vec::new(),
    }
}

/// The VAE's original names outside the numbered blocks and their diffusers names.
const VAE_TOP: [(&str, &str); 8] = [
    ("conv1.", "quant_conv."),
    ("conv2.", "post_quant_conv."),
    ("encoder.conv1.", "encoder.conv_in."),
    ("decoder.conv1.", "decoder.conv_in."),
    ("encoder.head.0.", "encoder.norm_out."),
    ("encoder.head.2.", "encoder.conv_out."),
    ("decoder.head.0.", "decoder.norm_out."),
    ("decoder.head.2.", "decoder.conv_out."),
];

/// The VAE's middle blocks (`middle.N`) and their diffusers names.
const VAE_MIDDLE: [(&str, &str); 3] = [
    ("0", "mid_block.resnets.0"),
    ("1", "mid_block.attentions.0"),
    ("2", "mid_block.resnets.1"),
];

/// Inside a residual block of the VAE: the original's `residual` sequence (norm, SiLU,
/// convolution, norm, SiLU, dropout, convolution) and `shortcut`.
const VAE_RESIDUAL: [(&str, &str); 5] = [
    ("residual.0.", "norm1."),
    ("residual.2.", "conv1."),
    ("residual.3.", "norm2."),
    ("residual.6.", "conv2."),
    ("shortcut.", "conv_shortcut."),
];

/// The diffusers name of a tensor of the Wan VAE's original layout, for a VAE of
/// `num_res_blocks` residual blocks per encoder level (the original numbers the decoder's
/// blocks in one sequence: each level's `num_res_blocks + 1` residual blocks, then its
/// resample). Any other name (diffusers' own among them) is kept, so that an unknown name is
/// reported by the loader.
pub fn vae_diffusers_name(original: &str, num_res_blocks: usize) -> String {
    if let Some(name) = renamed(original, &VAE_TOP, Direction::ToDiffusers) {
        return name;
    }
    let block_of = |rest: &str| -> Option<(String, String)> {
        let (sequence, rest) = rest.split_once('.')?;
        let (index, inner) = rest.split_once('.')?;
        let block = match sequence {
            "middle" => VAE_MIDDLE
                .iter()
                .find(|(from, _)| *from == index)
                .map(|(_, to)| to.to_string())?,
            "downsamples" => format!("down_blocks.{index}"),
            "upsamples" => {
                let index: usize = index.parse().ok()?;
                let per_level = num_res_blocks + 2;
                let (level, position) = (index / per_level, index % per_level);
                if position <= num_res_blocks {
                    format!("up_blocks.{level}.resnets.{position}")
                } else {
                    format!("up_blocks.{level}.upsamplers.0")
                }
            }
            _ => return None,
        };
        Some((
            block,
            renamed(inner, &VAE_RESIDUAL, Direction::ToDiffusers).unwrap_or(inner.into()),
        ))
    };
    original
        .split_once('.')
        .filter(|(side, _)| ["encoder", "decoder"].contains(side))
        .and_then(|(side, rest)| {
            block_of(rest).map(|(block, inner)| format!("{side}.{block}.{inner}"))
        })
        .unwrap_or_else(|| original.to_string())
}

/// The class name in a diffusers `config.json`.
#[derive(Deserialize)]
struct ClassName {
    #[serde(rename = "_class_name")]
    class_name: String,
}

/// Whether `path` holds a Wan transformer: a diffusers folder (or its `transformer` folder)
/// whose `config.json` names `WanTransformer3DModel`, or a single file holding Wan's timestep
/// projection under either layout's name.
pub fn holds_wan(path: &Path) -> bool {
    if path.is_dir() {
        return component_folder(path, "transformer")
            .and_then(|folder| read_json::<ClassName>(&folder.join("config.json")).ok())
            .is_some_and(|config| config.class_name == "WanTransformer3DModel");
    }
    Checkpoint::open(path).is_ok_and(|files| {
        files
            .tensors()
            .any(|t| diffusers_name(t.name) == "condition_embedder.time_proj.weight")
    })
}

#[cfg(test)]
mod tests {
    use burn_lora::Format;

    use super::*;

    #[test]
    fn every_linear_has_an_original_name_that_maps_back() {
        let config = WanConfig::wan21_1_3b();
        let modules = linear_modules(&config);
        assert_eq!(modules.len(), 5 + 10 * 30 + 1);
        for module in modules {
            let original = original_name(&format!("{module}.weight"));
            assert_ne!(
                original,
                format!("{module}.weight"),
                "{module} has no original name"
            );
            assert_eq!(diffusers_name(&original), format!("{module}.weight"));
        }
    }

    #[test]
    fn lora_names_follow_musubi_tuner_and_diffusers() {
        let names = lora_names(&WanConfig::wan21_1_3b());
        let cases = [
            ("blocks.0.attn1.to_q", "blocks.0.self_attn.q"),
            ("blocks.3.attn2.to_out.0", "blocks.3.cross_attn.o"),
            ("blocks.29.ffn.net.0.proj", "blocks.29.ffn.0"),
            ("blocks.29.ffn.net.2", "blocks.29.ffn.2"),
            ("condition_embedder.time_proj", "time_projection.1"),
            (
                "condition_embedder.text_embedder.linear_2",
                "text_embedding.2",
            ),
            ("proj_out", "head.head"),
        ];
        let (originals, diffusers) = (
            names.map(Format::Kohya).target_names(),
            names.map(Format::Peft).target_names(),
        );
        assert_eq!(originals.len(), 306);
        for (module, original) in cases {
            assert!(originals.contains(original), "{original}");
            assert!(diffusers.contains(module), "{module}");
        }
        assert_eq!(names.diffusers_prefix, "transformer");
    }

    #[test]
    fn the_vae_original_names_map_as_diffusers_converter_maps_them() {
        let cases = [
            ("conv1.weight", "quant_conv.weight"),
            ("conv2.bias", "post_quant_conv.bias"),
            ("encoder.conv1.weight", "encoder.conv_in.weight"),
            (
                "encoder.downsamples.0.residual.0.gamma",
                "encoder.down_blocks.0.norm1.gamma",
            ),
            (
                "encoder.downsamples.3.shortcut.weight",
                "encoder.down_blocks.3.conv_shortcut.weight",
            ),
            (
                "encoder.downsamples.5.time_conv.weight",
                "encoder.down_blocks.5.time_conv.weight",
            ),
            (
                "encoder.middle.1.to_qkv.weight",
                "encoder.mid_block.attentions.0.to_qkv.weight",
            ),
            (
                "decoder.middle.2.residual.6.bias",
                "decoder.mid_block.resnets.1.conv2.bias",
            ),
            (
                "decoder.upsamples.3.resample.1.weight",
                "decoder.up_blocks.0.upsamplers.0.resample.1.weight",
            ),
            (
                "decoder.upsamples.4.shortcut.weight",
                "decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "decoder.upsamples.14.residual.3.gamma",
                "decoder.up_blocks.3.resnets.2.norm2.gamma",
            ),
            ("decoder.head.0.gamma", "decoder.norm_out.gamma"),
            ("decoder.head.2.weight", "decoder.conv_out.weight"),
            ("decoder.conv_in.weight", "decoder.conv_in.weight"),
        ];
        for (original, diffusers) in cases {
            assert_eq!(vae_diffusers_name(original, 2), diffusers, "{original}");
        }
    }
}
