//! Reading and writing adapter files (kohya / LyCORIS, PEFT / diffusers and ai-toolkit
//! safetensors), atomically, and a model's names in each layout; see the crate documentation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::Path;

use burn::tensor::{DType, TensorData};
use regex::Regex;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Map, Value, json};

use crate::LoraError;
use crate::keymap::NameMap;
use crate::plan::ApplyReport;
use crate::set::{
    AdapterSet, LokrFactor, LoraMetadata, Matrix, Origin, Role, StoredAdapter, flatten_name,
};

/// The naming style of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// kohya sd-scripts / LyCORIS: `lora_unet_<path_with_underscores>.lora_down.weight`.
    Kohya,
    /// PEFT / diffusers: `transformer.<path>.lora_A.weight` and `.alpha`.
    Peft,
    /// ai-toolkit: `diffusion_model.<path>.lora_A.weight` with the checkpoint's module paths
    /// and an f32 `.alpha` per module.
    AiToolkit,
}

impl Format {
    /// The name used in configuration files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kohya => "kohya",
            Self::Peft => "peft",
            Self::AiToolkit => "ai-toolkit",
        }
    }

    /// Whether the format names modules as a checkpoint does (BFL, SGM, Wan paths) rather than
    /// as diffusers does.
    pub fn checkpoint_names(self) -> bool {
        matches!(self, Self::Kohya | Self::AiToolkit)
    }
}

/// Where a file of `lora_A` / `lora_B` names (PEFT, ai-toolkit) keeps the LoRA alpha.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PeftAlpha {
    /// As f32 `.alpha` tensors, which ComfyUI reads and diffusers' FLUX.1 loader turns into its
    /// LoRA config (`network_alphas`).
    #[default]
    Tensors,
    /// Only in the `lora_adapter_metadata` entry diffusers reads (`lora_alpha`,
    /// `alpha_pattern`), as diffusers' `save_lora_weights` writes it; ComfyUI, which does not
    /// read it, then applies the file at scale 1. PEFT files only (ai-toolkit files keep
    /// `.alpha` tensors then).
    Metadata,
    /// Multiplied into `lora_B`, so that `alpha = rank`: what loaders assume without alpha
    /// (the original alpha stays in the `ss_network_alpha` metadata).
    Baked,
}

/// How to write a file.
#[derive(Clone, Debug, PartialEq)]
pub struct SaveOptions {
    /// The naming style.
    pub format: Format,
    /// The key prefix; `None` means `lora_unet` (kohya), `transformer` (PEFT) or
    /// `diffusion_model` (ai-toolkit).
    pub prefix: Option<String>,
    /// Where a PEFT or ai-toolkit file keeps alpha.
    pub peft_alpha: PeftAlpha,
    /// Convert the weights to this dtype; `None` keeps each tensor's dtype.
    pub dtype: Option<DType>,
}

impl SaveOptions {
    /// kohya naming with the `lora_unet` prefix.
    pub fn kohya() -> Self {
        Self {
            format: Format::Kohya,
            prefix: None,
            peft_alpha: PeftAlpha::Tensors,
            dtype: None,
        }
    }

    /// PEFT / diffusers naming with the `transformer` prefix and `.alpha` tensors.
    pub fn peft() -> Self {
        Self {
            format: Format::Peft,
            ..Self::kohya()
        }
    }

    /// Default options for `format`.
    pub fn for_format(format: Format) -> Self {
        Self {
            format,
            ..Self::kohya()
        }
    }

    fn prefix(&self) -> &str {
        match (&self.prefix, self.format) {
            (Some(p), _) => p,
            (None, Format::Kohya) => KOHYA_PREFIXES[0],
            (None, Format::Peft) => "transformer",
            (None, Format::AiToolkit) => "diffusion_model",
        }
    }
}

/// Metadata key: the kohya network module (`networks.lora` or `lycoris.kohya`).
const META_NETWORK_MODULE: &str = "ss_network_module";
/// Metadata key: network arguments as JSON; `algo` is `lora`, `locon` or `lokr`.
const META_NETWORK_ARGS: &str = "ss_network_args";
/// Metadata key: the rank (the most common one).
const META_RANK: &str = "ss_network_dim";
/// Metadata key: the alpha (the most common one).
const META_ALPHA: &str = "ss_network_alpha";
/// Metadata key: the base model name.
const META_BASE_MODEL: &str = "ss_sd_model_name";
/// Metadata key: the training step.
const META_STEP: &str = "ss_steps";
/// Metadata key: JSON list of module paths, so kohya names map back to paths.
const META_MODULES: &str = "burn_lora_modules";
/// Metadata key diffusers reads LoRA config (alpha, patterns) from.
const META_PEFT_CONFIG: &str = "lora_adapter_metadata";

const DERIVED_KEYS: [&str; 8] = [
    META_NETWORK_MODULE,
    META_NETWORK_ARGS,
    META_RANK,
    META_ALPHA,
    META_BASE_MODEL,
    META_STEP,
    META_MODULES,
    META_PEFT_CONFIG,
];

const KOHYA_PREFIXES: [&str; 2] = ["lora_unet", "lora_transformer"];
const PEFT_PREFIXES: [&str; 5] = [
    "base_model.model",
    "model.diffusion_model",
    "diffusion_model",
    "transformer",
    "unet",
];

fn io_error(file: &Path) -> impl FnOnce(std::io::Error) -> LoraError + '_ {
    move |source| LoraError::Io {
        file: file.to_path_buf(),
        source,
    }
}

fn st_error(file: &Path) -> impl FnOnce(safetensors::SafeTensorError) -> LoraError + '_ {
    move |source| LoraError::Safetensors {
        file: file.to_path_buf(),
        source,
    }
}

fn to_st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        other => unreachable!("adapter weights are float tensors, got {other:?}"),
    }
}

fn from_st_dtype(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F64 => Some(DType::F64),
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

fn scalar(value: f32) -> TensorData {
    TensorData::new(vec![value], Vec::<usize>::new())
}

/// Writes `set` to `path`, atomically (a temporary file in the same directory, synced, then
/// renamed over `path`).
///
/// Alpha is written as an f32 scalar `.alpha` tensor, except for LoRA in PEFT style with
/// [`PeftAlpha::Metadata`], where it goes into the `lora_adapter_metadata` entry diffusers
/// reads (`r`, `lora_alpha`, `rank_pattern`, `alpha_pattern`, `target_modules`), or with
/// [`PeftAlpha::Baked`], where it is multiplied into `lora_B`.
///
/// Metadata: `format = pt`, `ss_network_module` (`networks.lora` or `lycoris.kohya`),
/// `ss_network_args` (`{"algo": "lora" | "locon" | "lokr"}`), `ss_network_dim` and
/// `ss_network_alpha` (the most common rank and alpha), `ss_sd_model_name` (base model) and
/// `ss_steps` (training step) when known, and for kohya files whose module paths contain dots
/// `burn_lora_modules`, the list of paths that lets [`load`] restore them. Other entries of
/// `set.metadata.extra` are kept.
pub fn save(set: &AdapterSet, path: &Path, options: &SaveOptions) -> Result<(), LoraError> {
    save_parts(&[(set, options, "")], path)
}

/// Writes the adapters of every part in one file, each part named by its own options (its
/// format and key prefix), as [`save`] writes one; the file's metadata is the first part's,
/// its network entries (`ss_network_*`) cover every part, and the PEFT parts' alphas share one
/// `lora_adapter_metadata` entry, each under its own prefix, module names without the part's
/// leading `config_root` (see [`ComponentNames::peft_config_root`]).
fn save_parts(parts: &[(&AdapterSet, &SaveOptions, &str)], path: &Path) -> Result<(), LoraError> {
    let mut tensors = NamedTensors::new();
    let mut peft_config = Map::new();
    for (set, options, config_root) in parts {
        let (part, mut alphas) = encode(set, options)?;
        tensors.extend(part);
        for (name, _, _) in &mut alphas {
            if let Some(rest) = name.strip_prefix(config_root) {
                *name = rest.to_string();
            }
        }
        if !alphas.is_empty() {
            peft_config.extend(peft_config_json(&alphas, options.prefix()));
        }
    }
    let (first, _, _) = parts[0];
    let mut metadata: HashMap<String, String> = first
        .metadata
        .extra
        .iter()
        .filter(|(k, _)| !DERIVED_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.insert("format".into(), "pt".into());
    metadata.extend(network_metadata(
        parts
            .iter()
            .flat_map(|(set, _, _)| set.iter().map(|(_, a)| a)),
    ));
    if let Some(base) = &first.metadata.base_model {
        metadata.insert(META_BASE_MODEL.into(), base.clone());
    }
    if let Some(step) = first.metadata.step {
        metadata.insert(META_STEP.into(), step.to_string());
    }
    let kohya_names: Vec<&str> = parts
        .iter()
        .filter(|(_, options, _)| options.format == Format::Kohya)
        .flat_map(|(set, _, _)| set.iter().map(|(n, _)| n))
        .collect();
    if kohya_names.iter().any(|n| n.contains('.')) {
        metadata.insert(META_MODULES.into(), json!(kohya_names).to_string());
    }
    if !peft_config.is_empty() {
        metadata.insert(
            META_PEFT_CONFIG.into(),
            Value::Object(peft_config).to_string(),
        );
    }
    write_atomic(path, &tensors, metadata)
}

/// Tensors by their keys in a file.
type NamedTensors = Vec<(String, TensorData)>;

/// The `(name, rank, alpha)` of each module whose alpha goes into the PEFT config.
type PeftAlphas = Vec<(String, usize, f32)>;

/// The tensors of `set` under `options`' keys, and, where alphas go into the PEFT config, each
/// module's `(name, rank, alpha)`.
fn encode(
    set: &AdapterSet,
    options: &SaveOptions,
) -> Result<(NamedTensors, PeftAlphas), LoraError> {
    if options.format != Format::Kohya && set.has_flat_names() {
        let key = set
            .iter()
            .next()
            .map(|(n, _)| n.to_string())
            .unwrap_or_default();
        return Err(LoraError::UnresolvedName { key });
    }
    let prefix = options.prefix();
    let mut tensors = NamedTensors::new();
    let mut peft_alphas = PeftAlphas::new();
    for (name, adapter) in set.iter() {
        let adapter = match options.dtype {
            Some(dtype) => adapter.with_dtype(dtype),
            None => adapter.clone(),
        };
        let (module, suffix): (String, fn(Role) -> &'static str) = match options.format {
            Format::Kohya => (
                format!("{prefix}_{}", flatten_name(name)),
                Role::kohya_suffix,
            ),
            Format::Peft | Format::AiToolkit if prefix.is_empty() => {
                (name.to_string(), Role::peft_suffix)
            }
            Format::Peft | Format::AiToolkit => (format!("{prefix}.{name}"), Role::peft_suffix),
        };
        let mut push = |role: Role, data: TensorData| {
            tensors.push((format!("{module}{}", suffix(role)), data));
        };
        match (&adapter, options.format) {
            (StoredAdapter::Lora { down, up, alpha }, Format::Peft)
                if options.peft_alpha == PeftAlpha::Metadata =>
            {
                push(Role::Down, down.clone());
                push(Role::Up, up.clone());
                peft_alphas.push((name.to_string(), down.shape[0], *alpha));
            }
            (StoredAdapter::Lora { down, up, alpha }, Format::Peft | Format::AiToolkit)
                if options.peft_alpha == PeftAlpha::Baked =>
            {
                let scale = *alpha as f64 / down.shape[0] as f64;
                let baked = Matrix::from_data(up)
                    .scaled(scale)
                    .into_data(up.shape.to_vec(), up.dtype);
                push(Role::Down, down.clone());
                push(Role::Up, baked);
            }
            (adapter, _) => {
                for (role, data) in adapter.tensors() {
                    push(role, data.clone());
                }
                push(Role::Alpha, scalar(adapter.alpha()));
            }
        }
    }
    Ok((tensors, peft_alphas))
}

/// The most common value, ties broken by the smallest.
fn most_common<T: Ord + Copy>(values: impl IntoIterator<Item = T>) -> Option<T> {
    let mut counts: BTreeMap<T, usize> = BTreeMap::new();
    for v in values {
        *counts.entry(v).or_default() += 1;
    }
    let best = counts.values().copied().max()?;
    counts.into_iter().find(|(_, c)| *c == best).map(|(v, _)| v)
}

/// An f32 alpha as the shortest f64 that reads back as the same f32 (`0.1`, not
/// `0.10000000149011612`).
fn json_alpha(alpha: f32) -> Value {
    json!(
        alpha
            .to_string()
            .parse::<f64>()
            .expect("a float prints as a float")
    )
}

fn network_metadata<'a>(
    adapters: impl Iterator<Item = &'a StoredAdapter>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let adapters: Vec<&StoredAdapter> = adapters.collect();
    if adapters.is_empty() {
        return out;
    }
    let lokr = adapters
        .iter()
        .any(|a| matches!(a, StoredAdapter::Lokr { .. }));
    let conv = adapters
        .iter()
        .any(|a| a.tensors().iter().any(|(_, t)| t.shape.len() == 4));
    let algo = match (lokr, conv) {
        (true, _) => "lokr",
        (false, true) => "locon",
        (false, false) => "lora",
    };
    let module = if lokr {
        "lycoris.kohya"
    } else {
        "networks.lora"
    };
    out.push((META_NETWORK_MODULE.into(), module.into()));
    out.push((
        META_NETWORK_ARGS.into(),
        json!({ "algo": algo }).to_string(),
    ));
    if let Some(rank) = most_common(adapters.iter().filter_map(|a| a.rank())) {
        out.push((META_RANK.into(), rank.to_string()));
    }
    if let Some(bits) = most_common(adapters.iter().map(|a| a.alpha().to_bits())) {
        out.push((META_ALPHA.into(), f32::from_bits(bits).to_string()));
    }
    out
}

/// The LoraConfig fields diffusers reads back, keys prefixed by the component name.
fn peft_config_json(alphas: &[(String, usize, f32)], prefix: &str) -> Map<String, Value> {
    let r = most_common(alphas.iter().map(|(_, r, _)| *r)).expect("not empty");
    let alpha_bits = most_common(alphas.iter().map(|(_, _, a)| a.to_bits())).expect("not empty");
    let lora_alpha = f32::from_bits(alpha_bits);
    let mut rank_pattern = Map::new();
    let mut alpha_pattern = Map::new();
    for (name, rank, alpha) in alphas {
        if *rank != r {
            rank_pattern.insert(name.clone(), json!(rank));
        }
        if alpha.to_bits() != alpha_bits {
            alpha_pattern.insert(name.clone(), json_alpha(*alpha));
        }
    }
    let names: Vec<&str> = alphas.iter().map(|(n, _, _)| n.as_str()).collect();
    let key = |field: &str| {
        if prefix.is_empty() {
            field.to_string()
        } else {
            format!("{prefix}.{field}")
        }
    };
    let mut config = Map::new();
    config.insert(key("r"), json!(r));
    config.insert(key("lora_alpha"), json_alpha(lora_alpha));
    config.insert(key("rank_pattern"), Value::Object(rank_pattern));
    config.insert(key("alpha_pattern"), Value::Object(alpha_pattern));
    config.insert(key("target_modules"), json!(names));
    config
}

fn write_atomic(
    path: &Path,
    tensors: &[(String, TensorData)],
    metadata: HashMap<String, String>,
) -> Result<(), LoraError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".burn-lora-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io_error(path))?;
    let views = tensors
        .iter()
        .map(|(key, data)| {
            TensorView::new(
                to_st_dtype(data.dtype),
                data.shape.to_vec(),
                data.as_bytes(),
            )
            .map(|view| (key.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(st_error(path))?;
    safetensors::serialize_to_file(views, Some(metadata), tmp.path()).map_err(st_error(path))?;
    File::open(tmp.path())
        .and_then(|f| f.sync_all())
        .map_err(io_error(path))?;
    tmp.persist(path).map_err(|e| io_error(path)(e.error))?;
    Ok(())
}

/// How a module key of a file is named.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ModuleKey {
    kohya: bool,
    prefix: String,
    name: String,
}

/// The key prefixes a read takes: every diffusion model's ([`KOHYA_PREFIXES`],
/// [`PEFT_PREFIXES`], and PEFT keys without a prefix), or one component's.
#[derive(Clone, Copy, Debug)]
struct Prefixes<'a> {
    kohya: &'a [&'a str],
    peft: &'a [&'a str],
    /// Whether PEFT keys without a known prefix are taken as unprefixed module paths...
    bare: bool,
    /// ...unless they start with one of these prefixes (other components').
    others: &'a [&'a str],
}

impl Prefixes<'_> {
    const MODEL: Prefixes<'static> = Prefixes {
        kohya: &KOHYA_PREFIXES,
        peft: &PEFT_PREFIXES,
        bare: true,
        others: &[],
    };

    fn classify(self, module: &str) -> Option<ModuleKey> {
        let split = |prefixes: &[&str], separator: char, kohya: bool| {
            prefixes.iter().find_map(|p| {
                module
                    .strip_prefix(p)
                    .and_then(|rest| rest.strip_prefix(separator))
                    .map(|name| ModuleKey {
                        kohya,
                        prefix: p.to_string(),
                        name: name.to_string(),
                    })
            })
        };
        if !module.contains('.') {
            return split(self.kohya, '_', true);
        }
        let other = self.others.iter().any(|p| {
            module
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('.'))
        });
        split(self.peft, '.', false).or_else(|| {
            (self.bare && !other).then(|| ModuleKey {
                kohya: false,
                prefix: String::new(),
                name: module.to_string(),
            })
        })
    }
}

/// The PEFT LoRA config that gives alphas: `lora_alpha`, `alpha_pattern`, `use_rslora`.
#[derive(Debug, Default)]
struct PeftConfig {
    lora_alpha: Option<f64>,
    alpha_pattern: Vec<(String, f64)>,
    rslora: bool,
}

impl PeftConfig {
    fn parse(value: &Value, prefix: &str, file: &Path, key: &str) -> Result<Self, LoraError> {
        let err = |reason: String| LoraError::Metadata {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let object = value
            .as_object()
            .ok_or_else(|| err("expected a JSON object".into()))?;
        let field = |name: &str| {
            let prefixed = format!("{prefix}.{name}");
            object.get(&prefixed).or_else(|| object.get(name))
        };
        let lora_alpha = match field("lora_alpha") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| err(format!("lora_alpha {v} is not a number")))?,
            ),
        };
        let mut alpha_pattern = Vec::new();
        if let Some(Value::Object(patterns)) = field("alpha_pattern") {
            for (pattern, v) in patterns {
                let alpha = v
                    .as_f64()
                    .ok_or_else(|| err(format!("alpha_pattern `{pattern}` is not a number")))?;
                alpha_pattern.push((pattern.clone(), alpha));
            }
        }
        let rslora = field("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Self {
            lora_alpha,
            alpha_pattern,
            rslora,
        })
    }

    /// The plain alpha (`scale · rank`) of module `name` with rank `rank`, PEFT's rules:
    /// an exact pattern, else the first pattern matching the end of the path, else
    /// `lora_alpha`, else `rank`.
    fn alpha(&self, name: &str, rank: usize) -> f64 {
        let pattern = self
            .alpha_pattern
            .iter()
            .find(|(p, _)| p == name)
            .or_else(|| {
                self.alpha_pattern.iter().find(|(p, _)| {
                    Regex::new(&format!(r"^(.*\.)?(?:{p})$"))
                        .map(|r| r.is_match(name))
                        .unwrap_or(false)
                })
            })
            .map(|(_, a)| *a);
        let alpha = pattern.or(self.lora_alpha).unwrap_or(rank as f64);
        if self.rslora {
            alpha * (rank as f64).sqrt()
        } else {
            alpha
        }
    }
}

fn read_scalar(view: &TensorView<'_>, file: &Path, key: &str) -> Result<f32, LoraError> {
    let err = |reason: String| LoraError::Metadata {
        file: file.to_path_buf(),
        key: key.to_string(),
        reason,
    };
    if view.shape().iter().product::<usize>() != 1 {
        return Err(err(format!(
            "alpha must be a scalar, found shape {:?}",
            view.shape()
        )));
    }
    let dtype = from_st_dtype(view.dtype())
        .ok_or_else(|| err(format!("alpha has dtype {:?}", view.dtype())))?;
    let value = TensorData::from_bytes_vec(view.data().to_vec(), [1], dtype)
        .convert_dtype(DType::F32)
        .into_vec::<f32>()
        .expect("converted to f32")[0];
    Ok(value)
}

/// Reads an adapter file of either style (detected from its keys).
///
/// PEFT alphas come from `.alpha` tensors, else the `lora_adapter_metadata` entry, else an
/// `adapter_config.json` next to the file (what PEFT's `save_pretrained` writes), else `rank`.
/// Keys that are not adapter tensors of the diffusion model are listed in
/// [`AdapterSet::unrecognized_keys`].
pub fn load(path: &Path) -> Result<AdapterSet, LoraError> {
    load_prefixed(path, Prefixes::MODEL)
}

/// [`load`] of the modules whose keys carry one of `prefixes`.
fn load_prefixed(path: &Path, prefixes: Prefixes<'_>) -> Result<AdapterSet, LoraError> {
    let file = File::open(path).map_err(io_error(path))?;
    // SAFETY: the mapping is read-only and dropped before returning; the file must not be
    // truncated meanwhile, as with any memory-mapped read.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error(path))?;
    let (_, header) = SafeTensors::read_metadata(&mmap).map_err(st_error(path))?;
    let file_metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(&mmap).map_err(st_error(path))?;

    let mut groups: BTreeMap<ModuleKey, BTreeMap<Role, (String, TensorView<'_>)>> = BTreeMap::new();
    let mut unrecognized = Vec::new();
    for (key, view) in tensors.iter() {
        match Role::split_key(key).and_then(|(m, role)| prefixes.classify(m).map(|k| (k, role))) {
            Some((module, role)) => {
                groups
                    .entry(module)
                    .or_default()
                    .insert(role, (key.to_string(), view));
            }
            None => unrecognized.push(key.to_string()),
        }
    }
    let kohya = groups.keys().filter(|k| k.kohya).count() * 2 >= groups.len() && !groups.is_empty();
    let prefix = most_common(
        groups
            .keys()
            .filter(|k| k.kohya == kohya)
            .map(|k| k.prefix.as_str()),
    )
    .unwrap_or_default()
    .to_string();

    let peft_config = if kohya {
        PeftConfig::default()
    } else {
        peft_config(path, &file_metadata, &prefix)?
    };

    let mut adapters = BTreeMap::new();
    for (module, mut roles) in groups {
        if module.kohya != kohya || module.prefix != prefix {
            unrecognized.extend(roles.into_values().map(|(key, _)| key));
            continue;
        }
        let alpha = roles
            .remove(&Role::Alpha)
            .map(|(key, view)| read_scalar(&view, path, &key).map(|a| (key, a)))
            .transpose()?;
        let Some(first_key) = roles.values().next().map(|(k, _)| k.clone()) else {
            unrecognized.extend(alpha.map(|(key, _)| key));
            continue;
        };
        let alpha = alpha.map(|(_, a)| a);
        let mut data = read_tensors(roles, path)?;
        let mut take = |role: Role| data.remove(&role);
        let missing = |role: Role| LoraError::Incomplete {
            file: path.to_path_buf(),
            key: first_key.clone(),
            missing: if module.kohya {
                role.kohya_suffix()
            } else {
                role.peft_suffix()
            }
            .to_string(),
        };
        let adapter = match (take(Role::Down), take(Role::Up), take(Role::W1)) {
            (Some(down), Some(up), None) => {
                let rank = down.shape[0];
                let alpha = alpha.map(f64::from).unwrap_or_else(|| {
                    if module.kohya {
                        rank as f64
                    } else {
                        peft_config.alpha(&module.name, rank)
                    }
                });
                StoredAdapter::Lora {
                    down,
                    up,
                    alpha: alpha as f32,
                }
            }
            (Some(_), None, None) => return Err(missing(Role::Up)),
            (None, Some(_), None) => return Err(missing(Role::Down)),
            (None, None, Some(w1)) => {
                let w2 = match (take(Role::W2), take(Role::W2A), take(Role::W2B)) {
                    (Some(w2), None, None) => LokrFactor::Full(w2),
                    (None, Some(a), Some(b)) => LokrFactor::LowRank { a, b },
                    (None, Some(_), None) => return Err(missing(Role::W2B)),
                    (None, None, Some(_)) => return Err(missing(Role::W2A)),
                    _ => return Err(missing(Role::W2)),
                };
                let default = match &w2 {
                    LokrFactor::LowRank { b, .. } => b.shape[0] as f32,
                    LokrFactor::Full(_) => 1.0,
                };
                StoredAdapter::Lokr {
                    w1,
                    w2,
                    alpha: alpha.unwrap_or(default),
                }
            }
            (None, None, None) => return Err(missing(Role::W1)),
            _ => {
                return Err(LoraError::Metadata {
                    file: path.to_path_buf(),
                    key: first_key,
                    reason: "mixes LoRA and LoKr tensors".into(),
                });
            }
        };
        adapters.insert(module.name, adapter);
    }

    let mut metadata = LoraMetadata {
        extra: file_metadata.into_iter().collect(),
        ..LoraMetadata::default()
    };
    metadata.base_model = metadata.extra.get(META_BASE_MODEL).cloned();
    metadata.step = metadata.extra.get(META_STEP).and_then(|s| s.parse().ok());
    let mut set = AdapterSet::new(metadata).with_flat_names(kohya);
    set.origin = Some(Origin {
        file: path.to_path_buf(),
        kohya,
        prefix,
    });
    set.unrecognized = unrecognized;
    set.replace_adapters(adapters);
    if kohya && let Some(names) = set.metadata.extra.get(META_MODULES).cloned() {
        let names: Vec<String> =
            serde_json::from_str(&names).map_err(json_error(path, META_MODULES))?;
        set.resolve_names(names.iter().map(String::as_str))?;
    }
    Ok(set)
}

/// The weight tensors of a module, converted to `TensorData`.
fn read_tensors(
    roles: BTreeMap<Role, (String, TensorView<'_>)>,
    file: &Path,
) -> Result<BTreeMap<Role, TensorData>, LoraError> {
    roles
        .into_iter()
        .map(|(role, (key, view))| {
            let dtype = from_st_dtype(view.dtype()).ok_or_else(|| LoraError::Dtype {
                file: file.to_path_buf(),
                key,
                dtype: format!("{:?}", view.dtype()),
            })?;
            let data =
                TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype);
            Ok((role, data))
        })
        .collect()
}

fn json_error(file: &Path, key: &str) -> impl FnOnce(serde_json::Error) -> LoraError {
    let (file, key) = (file.to_path_buf(), key.to_string());
    move |e| LoraError::Metadata {
        file,
        key,
        reason: e.to_string(),
    }
}

fn peft_config(
    path: &Path,
    metadata: &HashMap<String, String>,
    prefix: &str,
) -> Result<PeftConfig, LoraError> {
    if let Some(raw) = metadata.get(META_PEFT_CONFIG) {
        let value: Value = serde_json::from_str(raw).map_err(json_error(path, META_PEFT_CONFIG))?;
        return PeftConfig::parse(&value, prefix, path, META_PEFT_CONFIG);
    }
    let sidecar = path.with_file_name("adapter_config.json");
    if sidecar.is_file() {
        let raw = std::fs::read_to_string(&sidecar).map_err(io_error(&sidecar))?;
        let value: Value =
            serde_json::from_str(&raw).map_err(json_error(&sidecar, "adapter_config.json"))?;
        return PeftConfig::parse(&value, prefix, &sidecar, "adapter_config.json");
    }
    Ok(PeftConfig::default())
}

/// What [`convert`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertReport {
    /// Number of adapters written.
    pub adapters: usize,
    /// Number of adapter weights written.
    pub params: usize,
    /// Input keys that were not converted (not adapter tensors of the diffusion model).
    pub dropped: Vec<String>,
}

/// Converts an adapter file to another naming style, keeping its module names (a model's
/// [`LayoutNames::convert`] also renames them to the target layout's).
///
/// Adapters, alphas and metadata are kept; PEFT output keeps the input's PEFT prefix. A kohya
/// file from another tool has lost the dots of its module paths: converting it to PEFT fails
/// with [`LoraError::UnresolvedName`] (read it with [`load`], call
/// [`AdapterSet::resolve_names`] with the model's module paths, then [`save`]).
pub fn convert(input: &Path, output: &Path, to: Format) -> Result<ConvertReport, LoraError> {
    let set = load(input)?;
    let mut options = SaveOptions::for_format(to);
    if let Some(origin) = &set.origin
        && to == Format::Peft
        && !origin.kohya
    {
        options.prefix = Some(origin.prefix.clone());
    }
    save(&set, output, &options)?;
    Ok(ConvertReport {
        adapters: set.len(),
        params: set.num_params(),
        dropped: set.unrecognized_keys().to_vec(),
    })
}

/// The names a model's adapted layers take in every file layout, and the file I/O that uses
/// them, so that every file carries names its target tools load.
///
/// A model crate builds it from the table that names its checkpoint tensors:
/// [`checkpoint`](Self::checkpoint) gives the checkpoint's module paths (BFL, SGM, Wan),
/// written by kohya files (`lora_unet_` + path with `_`) and ai-toolkit files
/// (`diffusion_model.` + path); [`diffusers`](Self::diffusers) gives diffusers' module paths,
/// written by PEFT files under [`diffusers_prefix`](Self::diffusers_prefix). The layers of
/// further trained [`components`](Self::components) (SDXL's text encoders) go to the same file
/// under their own prefixes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayoutNames {
    /// Model paths → the checkpoint's module paths.
    pub checkpoint: NameMap,
    /// Model paths → diffusers' module paths.
    pub diffusers: NameMap,
    /// The PEFT key prefix of the diffusers component (`transformer`, `unet`).
    pub diffusers_prefix: String,
    /// Where this model's PEFT and ai-toolkit files keep alpha so that its tools apply them
    /// whole: [`PeftAlpha::Tensors`] where they read `.alpha`, [`PeftAlpha::Baked`] where a
    /// loader refuses keys other than `lora_A` / `lora_B` (diffusers' FLUX.2 loaders).
    pub peft_alpha: PeftAlpha,
    /// The model's other trained components, whose model paths start with their own
    /// [`ComponentNames::module_prefix`].
    pub components: Vec<ComponentNames>,
}

/// The names of a further trained part of a model (SDXL's text encoders), which kohya and PEFT
/// files keep under their own key prefixes (`lora_te1_`, `text_encoder.`); ai-toolkit files
/// have none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ComponentNames {
    /// The start of the model paths of the component's layers (`text_encoder.`).
    pub module_prefix: String,
    /// The component's kohya key prefix (`lora_te1`).
    pub kohya_prefix: String,
    /// The component's PEFT key prefix and `lora_adapter_metadata` prefix (`text_encoder`).
    pub peft_prefix: String,
    /// Paths within the component (after `module_prefix`) → the module paths both layouts
    /// write (`text_model.encoder.layers.0.self_attn.q_proj`).
    pub names: NameMap,
    /// A leading part of those module paths (`text_model.`) that the PEFT config's module
    /// names (`target_modules`, `alpha_pattern`) leave out: PEFT matches a module by the end
    /// of its name, and the shorter name matches models with and without that level
    /// (transformers' CLIP has it up to version 4 only).
    pub peft_config_root: String,
}

impl ComponentNames {
    /// The key prefix of the component in `format`; `None` where the format has none.
    fn prefix(&self, format: Format) -> Option<&str> {
        match format {
            Format::Kohya => Some(&self.kohya_prefix),
            Format::Peft => Some(&self.peft_prefix),
            Format::AiToolkit => None,
        }
    }
}

impl LayoutNames {
    /// The map a format names the main component's modules with.
    pub fn map(&self, format: Format) -> &NameMap {
        if format.checkpoint_names() {
            &self.checkpoint
        } else {
            &self.diffusers
        }
    }

    /// The component a model path belongs to, and the path within it; `None` for the main
    /// component's.
    fn component_of<'a>(&self, path: &'a str) -> Option<(&ComponentNames, &'a str)> {
        self.components
            .iter()
            .find_map(|c| path.strip_prefix(&c.module_prefix).map(|rest| (c, rest)))
    }

    /// Checks, before any training, that every layer `report` adapted can be written in
    /// `format`: each has a name, a layer split across target layers carries LoRA (a LoKr
    /// update cannot be split exactly), and a component's layer needs a format that has the
    /// component's prefix.
    pub fn check(&self, format: Format, report: &ApplyReport) -> Result<(), LoraError> {
        report
            .wrapped
            .iter()
            .try_for_each(|layer| match self.component_of(&layer.path) {
                None => self.map(format).check_layer(&layer.path, layer.kind),
                Some((component, _)) if component.prefix(format).is_none() => {
                    Err(LoraError::Unnamed {
                        module: layer.path.clone(),
                    })
                }
                Some((component, path)) => component.names.check_layer(path, layer.kind),
            })
    }

    /// Writes `set` (keyed by the model's module paths) in `options.format` with the layout's
    /// names (see [`save`]) and, in PEFT and ai-toolkit files, its
    /// [`peft_alpha`](Self::peft_alpha); each component's adapters go under its prefix. A
    /// module without a name in the layout is an error naming it, and nothing is written.
    pub fn save(
        &self,
        set: &AdapterSet,
        path: &Path,
        options: &SaveOptions,
    ) -> Result<(), LoraError> {
        let mut options = options.clone();
        if options.format == Format::Peft && options.prefix.is_none() {
            options.prefix = Some(self.diffusers_prefix.clone());
        }
        if options.format != Format::Kohya {
            options.peft_alpha = self.peft_alpha;
        }
        let mut parts = Vec::new();
        for component in &self.components {
            let mut part = AdapterSet::new(LoraMetadata::default());
            for (name, adapter) in set.iter() {
                if let Some(inner) = name.strip_prefix(&component.module_prefix) {
                    part.insert(inner, adapter.clone());
                }
            }
            let Some((first, _)) = part.iter().next() else {
                continue;
            };
            let Some(prefix) = component.prefix(options.format) else {
                return Err(LoraError::Unnamed {
                    module: format!("{}{first}", component.module_prefix),
                });
            };
            let part_options = SaveOptions {
                prefix: Some(prefix.to_string()),
                ..options.clone()
            };
            parts.push((
                component.names.to_target(&part)?,
                part_options,
                component.peft_config_root.as_str(),
            ));
        }
        let map = self.map(options.format);
        let main = if parts.is_empty() {
            map.to_target(set)?
        } else {
            let mut main = set.clone();
            let mut adapters = main.take_adapters();
            adapters.retain(|name, _| self.component_of(name).is_none());
            main.replace_adapters(adapters);
            map.to_target(&main)?
        };
        let mut all = vec![(&main, &options, "")];
        all.extend(
            parts
                .iter()
                .map(|(set, options, root)| (set, options, *root)),
        );
        save_parts(&all, path)
    }

    /// Reads a file of any layout this model's names describe (kohya, PEFT / diffusers,
    /// ai-toolkit, OneTrainer's `lora_transformer_`) into a set keyed by the model's module
    /// paths, its components' adapters included. Split adapters join into the model's fused
    /// layers exactly; adapters of layers the model does not have are an error listing them.
    pub fn load(&self, path: &Path) -> Result<AdapterSet, LoraError> {
        let others: Vec<&str> = self
            .components
            .iter()
            .map(|c| c.peft_prefix.as_str())
            .collect();
        let mut set = load_prefixed(
            path,
            Prefixes {
                others: &others,
                ..Prefixes::MODEL
            },
        )?;
        // Each map's names as this file spells them (kohya files flatten dots to `_`).
        let spelled = |map: &NameMap| -> BTreeSet<String> {
            let names = map.target_names().into_iter();
            if set.has_flat_names() {
                names.map(flatten_name).collect()
            } else {
                names.map(str::to_string).collect()
            }
        };
        let known =
            |names: &BTreeSet<String>| set.iter().filter(|(n, _)| names.contains(*n)).count();
        let (checkpoint, diffusers) = (spelled(&self.checkpoint), spelled(&self.diffusers));
        let (map, names) = if known(&diffusers) > known(&checkpoint) {
            (&self.diffusers, diffusers)
        } else {
            (&self.checkpoint, checkpoint)
        };
        let unknown: Vec<String> = set
            .iter()
            .filter(|(n, _)| !names.contains(*n))
            .map(|(n, _)| n.to_string())
            .collect();
        if !unknown.is_empty() {
            return Err(LoraError::UnknownModules { modules: unknown });
        }
        set.resolve_names(map.target_names())?;
        let mut set = map.from_target(&set)?;
        for component in &self.components {
            let prefixes = Prefixes {
                kohya: &[&component.kohya_prefix],
                peft: &[&component.peft_prefix],
                bare: false,
                others: &[],
            };
            let mut part = load_prefixed(path, prefixes)?;
            if part.is_empty() {
                continue;
            }
            part.resolve_names(component.names.target_names())?;
            let part = component.names.from_target(&part)?;
            set.unrecognized.retain(|key| {
                prefixes
                    .classify(Role::split_key(key).map_or("", |(m, _)| m))
                    .is_none()
            });
            for (name, adapter) in part.iter() {
                set.insert(
                    format!("{}{name}", component.module_prefix),
                    adapter.clone(),
                );
            }
        }
        Ok(set)
    }

    /// Rewrites a file of any layout [`load`](Self::load) reads in format `to`, keeping every
    /// adapter's update, its scale and the metadata.
    pub fn convert(
        &self,
        input: &Path,
        output: &Path,
        to: Format,
    ) -> Result<ConvertReport, LoraError> {
        let set = self.load(input)?;
        self.save(&set, output, &SaveOptions::for_format(to))?;
        Ok(ConvertReport {
            adapters: set.len(),
            params: set.num_params(),
            dropped: set.unrecognized_keys().to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_module_keys() {
        assert_eq!(
            Prefixes::MODEL.classify("lora_unet_double_blocks_0_img_attn_qkv"),
            Some(ModuleKey {
                kohya: true,
                prefix: "lora_unet".into(),
                name: "double_blocks_0_img_attn_qkv".into()
            })
        );
        assert_eq!(
            Prefixes::MODEL.classify("lora_te1_text_model_encoder_layers_0_mlp_fc1"),
            None
        );
        assert_eq!(
            Prefixes::MODEL
                .classify("base_model.model.blocks.0.proj")
                .map(|k| (k.prefix, k.name)),
            Some(("base_model.model".into(), "blocks.0.proj".into()))
        );
        assert_eq!(
            Prefixes::MODEL
                .classify("blocks.0.proj")
                .map(|k| (k.prefix, k.name)),
            Some((String::new(), "blocks.0.proj".into()))
        );
    }

    #[test]
    fn peft_alpha_rules() {
        let value = json!({
            "transformer.lora_alpha": 8,
            "transformer.alpha_pattern": {"blocks.1.proj": 2, "out": 3.5},
        });
        let cfg = PeftConfig::parse(&value, "transformer", Path::new("f"), "k").unwrap();
        assert_eq!(cfg.alpha("blocks.1.proj", 4), 2.0);
        assert_eq!(cfg.alpha("blocks.11.proj", 4), 8.0);
        assert_eq!(cfg.alpha("head.out", 4), 3.5);
        assert_eq!(cfg.alpha("head.output", 4), 8.0);
        let rs = json!({"lora_alpha": 8, "use_rslora": true});
        let cfg = PeftConfig::parse(&rs, "", Path::new("f"), "k").unwrap();
        // scale alpha / sqrt(r) = 2 at r = 16, i.e. plain alpha 32.
        assert_eq!(cfg.alpha("x", 16), 32.0);
        assert_eq!(PeftConfig::default().alpha("x", 16), 16.0);
    }

    #[test]
    fn most_common_breaks_ties_low() {
        assert_eq!(most_common([4, 8, 8, 4, 2]), Some(4));
        assert_eq!(most_common([16, 16, 4]), Some(16));
        assert_eq!(most_common(Vec::<usize>::new()), None);
    }

    /// A model of one layer `unet_layer` beside a component `te.` with one layer `fc`, as the
    /// files name them: `lora_unet_` / `unet.` and `lora_te1_` / `text_encoder.`.
    fn with_component() -> LayoutNames {
        let main = NameMap::new().rename("unet_layer", "down.0.proj");
        LayoutNames {
            checkpoint: main.clone(),
            diffusers: main,
            diffusers_prefix: "unet".into(),
            peft_alpha: PeftAlpha::Metadata,
            components: vec![ComponentNames {
                module_prefix: "te.".into(),
                kohya_prefix: "lora_te1".into(),
                peft_prefix: "text_encoder".into(),
                names: NameMap::new().rename("fc", "text_model.fc"),
                peft_config_root: "text_model.".into(),
            }],
        }
    }

    fn lora(rank: usize, alpha: f32, seed: f32) -> StoredAdapter {
        let values = |n: usize| (0..n).map(|i| seed + i as f32).collect::<Vec<f32>>();
        StoredAdapter::Lora {
            down: TensorData::new(values(rank * 3), [rank, 3]),
            up: TensorData::new(values(2 * rank), [2, rank]),
            alpha,
        }
    }

    fn keys_and_config(path: &Path) -> (Vec<String>, Option<Value>) {
        let bytes = std::fs::read(path).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut keys: Vec<String> = header.tensors().keys().cloned().collect();
        keys.sort();
        let config = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_PEFT_CONFIG))
            .map(|raw| serde_json::from_str(raw).unwrap());
        (keys, config)
    }

    #[test]
    fn a_component_goes_under_its_own_prefix_and_comes_back() {
        let names = with_component();
        let mut set = AdapterSet::new(LoraMetadata::default());
        set.insert("unet_layer", lora(2, 4.0, 1.0));
        set.insert("te.fc", lora(2, 1.0, 7.0));
        let dir = tempfile::tempdir().unwrap();

        let kohya = dir.path().join("kohya.safetensors");
        names.save(&set, &kohya, &SaveOptions::kohya()).unwrap();
        let (keys, _) = keys_and_config(&kohya);
        assert_eq!(
            keys,
            [
                "lora_te1_text_model_fc.alpha",
                "lora_te1_text_model_fc.lora_down.weight",
                "lora_te1_text_model_fc.lora_up.weight",
                "lora_unet_down_0_proj.alpha",
                "lora_unet_down_0_proj.lora_down.weight",
                "lora_unet_down_0_proj.lora_up.weight",
            ]
        );

        let peft = dir.path().join("peft.safetensors");
        names.save(&set, &peft, &SaveOptions::peft()).unwrap();
        let (keys, config) = keys_and_config(&peft);
        assert_eq!(
            keys,
            [
                "text_encoder.text_model.fc.lora_A.weight",
                "text_encoder.text_model.fc.lora_B.weight",
                "unet.down.0.proj.lora_A.weight",
                "unet.down.0.proj.lora_B.weight",
            ]
        );
        let config = config.unwrap();
        assert_eq!(config["unet.lora_alpha"], json!(4.0));
        assert_eq!(config["text_encoder.lora_alpha"], json!(1.0));
        assert_eq!(config["text_encoder.target_modules"], json!(["fc"]));

        for file in [&kohya, &peft] {
            let back = names.load(file).unwrap();
            assert_eq!(
                back.iter().collect::<Vec<_>>(),
                set.iter().collect::<Vec<_>>()
            );
            assert!(back.unrecognized_keys().is_empty(), "{file:?}");
        }

        let error = names
            .save(
                &set,
                &dir.path().join("a.safetensors"),
                &SaveOptions::for_format(Format::AiToolkit),
            )
            .unwrap_err();
        assert!(matches!(error, LoraError::Unnamed { module } if module == "te.fc"));
    }

    #[test]
    fn a_file_of_the_component_alone_loads() {
        let names = with_component();
        let mut set = AdapterSet::new(LoraMetadata::default());
        set.insert("te.fc", lora(1, 1.0, 2.0));
        let dir = tempfile::tempdir().unwrap();
        for options in [SaveOptions::kohya(), SaveOptions::peft()] {
            let file = dir.path().join("te.safetensors");
            names.save(&set, &file, &options).unwrap();
            let back = names.load(&file).unwrap();
            assert_eq!(
                back.iter().collect::<Vec<_>>(),
                set.iter().collect::<Vec<_>>()
            );
        }
    }
}
