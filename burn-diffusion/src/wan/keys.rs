//! Wan's original tensor names (Wan-Video's checkpoints, ComfyUI's repackaged files, with or
//! without `model.diffusion_model.`) and the diffusers names the model's fields follow.

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
    }
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
}
