//! Every name of every FLUX.1 weight: its path in the Burn module tree, its key in BFL files and
//! where it lives in diffusers files. All remapping between the layouts is here.
//!
//! The model's fields follow BFL's keys, except where Rust cannot spell them: a BFL MLP's
//! `0` / `2` are `lin1` / `lin2`, and `final_layer.adaLN_modulation.1` is
//! `final_layer.ada_ln_modulation`. Diffusers splits some BFL layers: the fused `qkv` of a
//! double block is `to_q`, `to_k`, `to_v` (or `add_*_proj` for text), a single block's
//! `linear1` is `to_q`, `to_k`, `to_v`, `proj_mlp`, and the final modulation stores
//! `(scale, shift)` where BFL stores `(shift, scale)`. A BFL layer is therefore described as a
//! list of row ranges of diffusers layers.

use burn_lora::{LayoutNames, NameMap, PeftAlpha, RowSlice};

use super::FluxConfig;

/// One `nn::Linear` of the model, under each naming scheme.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearKeys {
    /// Path in the Burn module tree, e.g. `double_blocks.0.img_mlp.lin1`.
    pub module: String,
    /// Name in BFL files (the `.weight` / `.bias` keys without suffix), e.g.
    /// `double_blocks.0.img_mlp.0`.
    pub bfl: String,
    /// Where the output rows live in diffusers files, in the order of this layer's rows.
    pub diffusers: Vec<RowSlice>,
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
}

/// A learned vector that is not part of a Linear (the RMS-norm scales of the attention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VectorKeys {
    /// Path in the Burn module tree, which is also the BFL key.
    pub module: String,
    /// Key in diffusers files.
    pub diffusers: String,
    /// Length.
    pub len: usize,
}

/// Every Linear of a model of this configuration, in module order.
pub fn linear_keys(config: &FluxConfig) -> Vec<LinearKeys> {
    let h = config.hidden_size;
    let mlp = config.mlp_hidden_dim();
    let mut out = Vec::new();
    let same = |name: &str| (name.to_string(), name.to_string());

    let (m, b) = same("img_in");
    out.push(whole(m, b, "x_embedder".into(), config.in_channels, h));
    let embedders = [
        ("time_in", "timestep_embedder", 256, true),
        ("vector_in", "text_embedder", config.vec_in_dim, true),
        (
            "guidance_in",
            "guidance_embedder",
            256,
            config.guidance_embed,
        ),
    ];
    for (bfl, diffusers, d_input, present) in embedders {
        if !present {
            continue;
        }
        let (m, b) = same(&format!("{bfl}.in_layer"));
        out.push(whole(
            m,
            b,
            format!("time_text_embed.{diffusers}.linear_1"),
            d_input,
            h,
        ));
        let (m, b) = same(&format!("{bfl}.out_layer"));
        out.push(whole(
            m,
            b,
            format!("time_text_embed.{diffusers}.linear_2"),
            h,
            h,
        ));
    }
    let (m, b) = same("txt_in");
    out.push(whole(
        m,
        b,
        "context_embedder".into(),
        config.context_in_dim,
        h,
    ));

    for i in 0..config.depth {
        let mlp_names = ["net.0.proj", "net.2"];
        out.extend(double_block_keys(i, h, [mlp, mlp], mlp_names, true));
    }
    for i in 0..config.depth_single_blocks {
        let p = format!("single_blocks.{i}");
        let d = format!("single_transformer_blocks.{i}");
        let parts = [
            ("attn.to_q", h),
            ("attn.to_k", h),
            ("attn.to_v", h),
            ("proj_mlp", mlp),
        ]
        .map(|(n, rows)| (format!("{d}.{n}"), rows));
        let (m, b) = same(&format!("{p}.linear1"));
        out.push(stacked(
            m,
            b,
            parts.iter().map(|(n, r)| (n.as_str(), *r)),
            h,
        ));
        let (m, b) = same(&format!("{p}.linear2"));
        out.push(whole(m, b, format!("{d}.proj_out"), h + mlp, h));
        let (m, b) = same(&format!("{p}.modulation.lin"));
        out.push(whole(m, b, format!("{d}.norm.linear"), h, 3 * h));
    }

    out.extend(final_layer_keys(h, config.out_channels));
    out
}

/// The Linears of double block `i` of width `h`: per stream, the modulation (FLUX.1's blocks
/// own theirs, `with_modulation`), the fused `qkv`, the attention output and the MLP, whose
/// expansion has `mlp[0]` outputs and contraction `mlp[1]` inputs; `mlp_names` are the
/// diffusers names of the two MLP layers inside `ff` / `ff_context`.
pub(crate) fn double_block_keys(
    i: usize,
    h: usize,
    mlp: [usize; 2],
    mlp_names: [&str; 2],
    with_modulation: bool,
) -> Vec<LinearKeys> {
    let p = format!("double_blocks.{i}");
    let d = format!("transformer_blocks.{i}");
    let mut out = Vec::new();
    for (stream, norm, attn_out, ff, qkv) in [
        (
            "img",
            "norm1",
            "attn.to_out.0",
            "ff",
            ["to_q", "to_k", "to_v"],
        ),
        (
            "txt",
            "norm1_context",
            "attn.to_add_out",
            "ff_context",
            ["add_q_proj", "add_k_proj", "add_v_proj"],
        ),
    ] {
        let bfl = |name: &str| format!("{p}.{stream}_{name}");
        if with_modulation {
            out.push(whole(
                bfl("mod.lin"),
                bfl("mod.lin"),
                format!("{d}.{norm}.linear"),
                h,
                6 * h,
            ));
        }
        let qkv = qkv.map(|n| format!("{d}.attn.{n}"));
        out.push(stacked(
            bfl("attn.qkv"),
            bfl("attn.qkv"),
            qkv.iter().map(|n| (n.as_str(), h)),
            h,
        ));
        out.push(whole(
            bfl("attn.proj"),
            bfl("attn.proj"),
            format!("{d}.{attn_out}"),
            h,
            h,
        ));
        out.push(whole(
            bfl("mlp.lin1"),
            bfl("mlp.0"),
            format!("{d}.{ff}.{}", mlp_names[0]),
            h,
            mlp[0],
        ));
        out.push(whole(
            bfl("mlp.lin2"),
            bfl("mlp.2"),
            format!("{d}.{ff}.{}", mlp_names[1]),
            mlp[1],
            h,
        ));
    }
    out
}

/// The output layer's two Linears; BFL stores the modulation as `(shift, scale)`, diffusers'
/// `norm_out` as `(scale, shift)`.
pub(crate) fn final_layer_keys(h: usize, out_channels: usize) -> [LinearKeys; 2] {
    let linear = "final_layer.linear".to_string();
    [
        whole(linear.clone(), linear, "proj_out".into(), h, out_channels),
        LinearKeys {
            module: "final_layer.ada_ln_modulation".into(),
            bfl: "final_layer.adaLN_modulation.1".into(),
            diffusers: vec![
                RowSlice {
                    target: "norm_out.linear".into(),
                    len: 2 * h,
                    rows: h..2 * h,
                    to: 0,
                },
                RowSlice {
                    target: "norm_out.linear".into(),
                    len: 2 * h,
                    rows: 0..h,
                    to: h,
                },
            ],
            d_input: h,
            d_output: 2 * h,
        },
    ]
}

/// The names of every adapted layer of a model of this configuration in each LoRA file
/// layout: BFL module paths for kohya and ai-toolkit files, diffusers paths (under
/// `transformer.`) for PEFT files, where BFL's fused `qkv` and `linear1` split into diffusers'
/// projections and the final modulation's halves swap. Built from [`linear_keys`], the table
/// that loads checkpoints.
pub fn lora_names(config: &FluxConfig) -> LayoutNames {
    layout_names(linear_keys(config), PeftAlpha::Tensors)
}

/// The LoRA names of the layers `keys` describes: BFL module paths as the checkpoint names,
/// diffusers paths (renamed, or split by rows) under `transformer.`; PEFT and ai-toolkit files
/// keep alpha as `peft_alpha` says.
pub(crate) fn layout_names(keys: Vec<LinearKeys>, peft_alpha: PeftAlpha) -> LayoutNames {
    let (checkpoint, diffusers) = keys.into_iter().fold(
        (NameMap::new(), NameMap::new()),
        |(checkpoint, diffusers), keys| {
            let diffusers = match keys.diffusers.as_slice() {
                [whole] if whole.rows.len() == whole.len => {
                    diffusers.rename(&keys.module, &whole.target)
                }
                _ => diffusers.split(&keys.module, keys.diffusers),
            };
            (checkpoint.rename(&keys.module, keys.bfl), diffusers)
        },
    );
    LayoutNames {
        checkpoint,
        diffusers,
        diffusers_prefix: "transformer".into(),
        peft_alpha,
        components: Vec::new(),
    }
}

/// A layer that is one diffusers layer, whole.
pub(crate) fn whole(
    module: String,
    bfl: String,
    diffusers: String,
    d_input: usize,
    d_output: usize,
) -> LinearKeys {
    LinearKeys {
        module,
        bfl,
        diffusers: vec![RowSlice {
            target: diffusers,
            len: d_output,
            rows: 0..d_output,
            to: 0,
        }],
        d_input,
        d_output,
    }
}

/// A layer made of whole diffusers layers stacked along the output rows.
pub(crate) fn stacked<'a>(
    module: String,
    bfl: String,
    parts: impl Iterator<Item = (&'a str, usize)>,
    d_input: usize,
) -> LinearKeys {
    let mut to = 0;
    let diffusers: Vec<RowSlice> = parts
        .map(|(name, len)| {
            let range = RowSlice {
                target: name.to_string(),
                len,
                rows: 0..len,
                to,
            };
            to += len;
            range
        })
        .collect();
    LinearKeys {
        module,
        bfl,
        diffusers,
        d_input,
        d_output: to,
    }
}

/// Every RMS-norm scale of a model of this configuration.
pub(crate) fn vector_keys(config: &FluxConfig) -> Vec<VectorKeys> {
    norm_keys(config.depth, config.depth_single_blocks, config.head_dim())
}

/// The queries' and keys' RMS-norm scales of `double` double and `single` single blocks with
/// heads of `len`: the same names in FLUX.1 and FLUX.2.
pub(crate) fn norm_keys(double: usize, single: usize, len: usize) -> Vec<VectorKeys> {
    let mut out = Vec::new();
    let mut push = |module: String, diffusers: String| {
        out.push(VectorKeys {
            module,
            diffusers,
            len,
        })
    };
    for i in 0..double {
        let (p, d) = (
            format!("double_blocks.{i}"),
            format!("transformer_blocks.{i}.attn"),
        );
        for (stream, added) in [("img", ""), ("txt", "added_")] {
            push(
                format!("{p}.{stream}_attn.norm.query_norm.scale"),
                format!("{d}.norm_{added}q.weight"),
            );
            push(
                format!("{p}.{stream}_attn.norm.key_norm.scale"),
                format!("{d}.norm_{added}k.weight"),
            );
        }
    }
    for i in 0..single {
        let (p, d) = (
            format!("single_blocks.{i}"),
            format!("single_transformer_blocks.{i}.attn"),
        );
        push(
            format!("{p}.norm.query_norm.scale"),
            format!("{d}.norm_q.weight"),
        );
        push(
            format!("{p}.norm.key_norm.scale"),
            format!("{d}.norm_k.weight"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> FluxConfig {
        FluxConfig::new(16, 12, 20, 24, 64, 2, 1, 1, vec![4, 14, 14], true)
    }

    #[test]
    fn fused_layers_stack_their_diffusers_parts() {
        let keys = linear_keys(&tiny());
        let find = |m: &str| keys.iter().find(|k| k.module == m).unwrap();
        let linear1 = find("single_blocks.0.linear1");
        assert_eq!(linear1.d_output, 3 * 64 + 256);
        let parts: Vec<_> = linear1
            .diffusers
            .iter()
            .map(|r| (r.target.as_str(), r.to, r.rows.len()))
            .collect();
        assert_eq!(
            parts,
            [
                ("single_transformer_blocks.0.attn.to_q", 0, 64),
                ("single_transformer_blocks.0.attn.to_k", 64, 64),
                ("single_transformer_blocks.0.attn.to_v", 128, 64),
                ("single_transformer_blocks.0.proj_mlp", 192, 256),
            ]
        );
        let txt_qkv = find("double_blocks.0.txt_attn.qkv");
        assert_eq!(
            txt_qkv.diffusers[2].target,
            "transformer_blocks.0.attn.add_v_proj"
        );
        let mlp = find("double_blocks.0.txt_mlp.lin2");
        assert_eq!(mlp.bfl, "double_blocks.0.txt_mlp.2");
        assert_eq!(
            mlp.diffusers[0].target,
            "transformer_blocks.0.ff_context.net.2"
        );
        assert_eq!((mlp.d_input, mlp.d_output), (256, 64));
    }

    #[test]
    fn final_modulation_swaps_its_halves() {
        let keys = linear_keys(&tiny());
        let last = keys.last().unwrap();
        assert_eq!(last.bfl, "final_layer.adaLN_modulation.1");
        let halves: Vec<_> = last
            .diffusers
            .iter()
            .map(|r| (r.rows.clone(), r.to))
            .collect();
        assert_eq!(halves, [(64..128, 0), (0..64, 64)]);
    }

    #[test]
    fn every_diffusers_row_is_used_once() {
        let keys = linear_keys(&tiny());
        let mut rows = std::collections::HashMap::<&str, Vec<usize>>::new();
        for k in &keys {
            let covered: usize = k.diffusers.iter().map(|r| r.rows.len()).sum();
            assert_eq!(covered, k.d_output, "{}", k.module);
            for r in &k.diffusers {
                rows.entry(&r.target).or_default().extend(r.rows.clone());
                assert!(r.rows.end <= r.len);
            }
        }
        for (module, mut used) in rows {
            used.sort_unstable();
            let len = keys
                .iter()
                .flat_map(|k| &k.diffusers)
                .find(|r| r.target == module)
                .unwrap()
                .len;
            assert_eq!(used, (0..len).collect::<Vec<_>>(), "{module}");
        }
    }

    fn model_params(config: &FluxConfig) -> Vec<(String, Vec<usize>)> {
        crate::weights::param_shapes(&config.init::<burn::backend::Flex>(&Default::default()))
    }

    #[test]
    fn keys_cover_exactly_the_model_parameters() {
        for config in [
            tiny(),
            FluxConfig {
                guidance_embed: false,
                depth: 2,
                ..tiny()
            },
        ] {
            let mut expected: Vec<(String, Vec<usize>)> = linear_keys(&config)
                .into_iter()
                .flat_map(|k| {
                    [
                        (format!("{}.weight", k.module), vec![k.d_input, k.d_output]),
                        (format!("{}.bias", k.module), vec![k.d_output]),
                    ]
                })
                .chain(
                    vector_keys(&config)
                        .into_iter()
                        .map(|k| (k.module, vec![k.len])),
                )
                .collect();
            let mut actual = model_params(&config);
            expected.sort();
            actual.sort();
            assert_eq!(actual, expected);
        }
    }

    #[test]
    fn guidance_layers_only_with_guidance() {
        let with = linear_keys(&tiny());
        let without = linear_keys(&FluxConfig {
            guidance_embed: false,
            ..tiny()
        });
        assert_eq!(with.len(), without.len() + 2);
        assert!(without.iter().all(|k| !k.bfl.starts_with("guidance_in")));
    }
}
