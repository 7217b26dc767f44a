//! Operations on every adapted layer of a model: merge, unmerge, multiplier, listing, export to
//! an [`AdapterSet`] and loading from one.

use std::collections::BTreeMap;
use std::fmt;

use burn::module::Module;
use burn::tensor::backend::Backend;

use crate::LoraError;
use crate::adapter::{Adapter, AdapterKind, Geometry, StoredShape, check_stored};
use crate::layer::{Adapted, BaseLayer};
use crate::plan::{ApplyReport, LoraPlan};
use crate::session;
use crate::set::{AdapterSet, LoraMetadata, StoredAdapter, flatten_name};

/// What a session does to each adapted layer it meets.
pub(crate) enum Task {
    Attach {
        plan: Box<LoraPlan>,
        report: ApplyReport,
    },
    Merge,
    Unmerge,
    Multiplier(f64),
    Inspect(Vec<LayerInfo>),
    Export(BTreeMap<String, StoredAdapter>),
    Import(BTreeMap<String, StoredAdapter>),
}

impl Task {
    pub(crate) fn map_layer<B: Backend, L: BaseLayer<B>>(
        &mut self,
        path: &str,
        layer: Adapted<B, L>,
    ) -> Adapted<B, L> {
        match self {
            Task::Attach { plan, report } => plan.attach_one(path, layer, report),
            Task::Merge => layer.merge(),
            Task::Unmerge => layer.unmerge(),
            Task::Multiplier(m) => layer.with_multiplier(*m),
            Task::Import(adapters) => match adapters.remove(path) {
                Some(stored) => {
                    let layer = layer.unmerge();
                    let geometry = layer.base().geometry();
                    let device = layer.base().weight_device();
                    let previous = layer.adapter().cloned();
                    let adapter = Adapter::from_stored(&stored, &geometry, &device, previous);
                    layer.with_adapter(Some(adapter))
                }
                None => layer,
            },
            Task::Inspect(_) | Task::Export(_) => layer,
        }
    }

    pub(crate) fn visit_layer<B: Backend, L: BaseLayer<B>>(
        &mut self,
        path: &str,
        layer: &Adapted<B, L>,
    ) {
        match self {
            Task::Inspect(layers) => layers.push(LayerInfo::of(path, layer)),
            Task::Export(adapters) => {
                if let Some(adapter) = layer.adapter() {
                    adapters.insert(
                        path.to_string(),
                        adapter.to_stored(&layer.base().geometry()),
                    );
                }
            }
            _ => {}
        }
    }
}

/// One adapted layer of a model, as [`adapted_layers`] reports it.
#[derive(Clone, Debug)]
pub struct LayerInfo {
    /// The module path (`double_blocks.0.img_attn.qkv`).
    pub path: String,
    /// The base layer's shape.
    pub geometry: Geometry,
    /// The kind of the attached adapter, if any.
    pub adapter: Option<AdapterKind>,
    /// The adapter's rank, if it has one.
    pub rank: Option<usize>,
    /// Number of adapter weights.
    pub adapter_params: usize,
    pub(crate) shape: Option<StoredShape>,
    pub(crate) unsupported: Option<&'static str>,
}

impl LayerInfo {
    fn of<B: Backend, L: BaseLayer<B>>(path: &str, layer: &Adapted<B, L>) -> Self {
        let adapter = layer.adapter();
        Self {
            path: path.to_string(),
            geometry: layer.base().geometry(),
            adapter: adapter.map(Adapter::kind),
            rank: adapter.and_then(Adapter::rank),
            adapter_params: adapter.map_or(0, |a| a.num_params()),
            shape: adapter.map(StoredShape::of_adapter),
            unsupported: layer.base().unsupported(),
        }
    }
}

/// Every [`Adapted`] layer of `model`, in traversal order, with or without an adapter.
pub fn adapted_layers<B: Backend, M: Module<B>>(model: &M) -> Vec<LayerInfo> {
    match session::run_visit(model, Task::Inspect(Vec::new())) {
        Task::Inspect(layers) => layers,
        _ => unreachable!("the session returns its task"),
    }
}

/// Merges every adapter into its base weight (see [`Adapted::merge`]).
pub fn merge<B: Backend, M: Module<B>>(model: M) -> M {
    session::run_map(model, Task::Merge).0
}

/// Undoes [`merge`].
pub fn unmerge<B: Backend, M: Module<B>>(model: M) -> M {
    session::run_map(model, Task::Unmerge).0
}

/// Sets the inference multiplier of every adapted layer.
pub fn set_multiplier<B: Backend, M: Module<B>>(model: M, multiplier: f64) -> M {
    session::run_map(model, Task::Multiplier(multiplier)).0
}

pub(crate) fn attach<B: Backend, M: Module<B>>(model: M, plan: &LoraPlan) -> (M, ApplyReport) {
    let task = Task::Attach {
        plan: Box::new(plan.clone()),
        report: ApplyReport::default(),
    };
    match session::run_map(model, task) {
        (model, Task::Attach { report, .. }) => (model, report),
        _ => unreachable!("the session returns its task"),
    }
}

/// Copies every attached adapter to the host, keyed by module path, in file layout.
pub fn export<B: Backend, M: Module<B>>(model: &M, metadata: LoraMetadata) -> AdapterSet {
    let adapters = match session::run_visit(model, Task::Export(BTreeMap::new())) {
        Task::Export(adapters) => adapters,
        _ => unreachable!("the session returns its task"),
    };
    let mut set = AdapterSet::new(metadata);
    set.replace_adapters(adapters);
    set
}

/// What [`load_adapters`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Module paths that received an adapter from the set.
    pub loaded: Vec<String>,
    /// Names in the set that match no adapted layer of the model.
    pub unmatched: Vec<String>,
    /// Layers that already had an adapter the set does not provide.
    pub missing: Vec<String>,
    /// File keys that were not adapter tensors.
    pub unrecognized: Vec<String>,
}

impl LoadReport {
    /// Whether every adapter of the set found its layer and every key was understood.
    pub fn is_complete(&self) -> bool {
        self.unmatched.is_empty() && self.unrecognized.is_empty()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loaded {} adapters", self.loaded.len())?;
        if !self.unmatched.is_empty() {
            write!(f, "; no layer for: {}", self.unmatched.join(", "))?;
        }
        if !self.missing.is_empty() {
            write!(f, "; not in the file: {}", self.missing.join(", "))?;
        }
        if !self.unrecognized.is_empty() {
            write!(f, "; unrecognised keys: {}", self.unrecognized.join(", "))?;
        }
        Ok(())
    }
}

/// Loads the adapters of `set` into the matching layers of `model`.
///
/// A layer without an adapter gets one of the file's kind and rank; a layer that has one must
/// have the same kind and shapes (its parameter ids are kept, so optimizer state survives a
/// resume). Every shape is checked before the model is touched: a mismatch is an error naming
/// the file key. Names without a layer are reported, not fatal. kohya names (dots replaced by
/// underscores) are matched against the flattened module paths.
pub fn load_adapters<B: Backend, M: Module<B>>(
    model: M,
    mut set: AdapterSet,
) -> Result<(M, LoadReport), LoraError> {
    let layers = adapted_layers(&model);
    let flat = set.has_flat_names();
    let mut by_name: BTreeMap<String, &LayerInfo> = BTreeMap::new();
    let mut ambiguous: BTreeMap<String, (String, String)> = BTreeMap::new();
    for layer in &layers {
        let name = if flat {
            flatten_name(&layer.path)
        } else {
            layer.path.clone()
        };
        if let Some(first) = by_name.insert(name.clone(), layer) {
            ambiguous.insert(name, (first.path.clone(), layer.path.clone()));
        }
    }

    let mut report = LoadReport {
        unrecognized: set.unrecognized_keys().to_vec(),
        ..LoadReport::default()
    };
    let mut to_import = BTreeMap::new();
    for (name, stored) in set.take_adapters() {
        if let Some((first, second)) = ambiguous.remove(&name) {
            return Err(LoraError::AmbiguousName {
                key: name,
                first,
                second,
            });
        }
        let Some(layer) = by_name.get(&name) else {
            report.unmatched.push(name);
            continue;
        };
        if let Some(reason) = layer.unsupported {
            return Err(LoraError::Mapping {
                key: layer.path.clone(),
                reason: reason.to_string(),
            });
        }
        check_stored(&stored, &layer.geometry, layer.shape.as_ref(), |role| {
            set.file_key(&name, role)
        })?;
        report.loaded.push(layer.path.clone());
        to_import.insert(layer.path.clone(), stored);
    }
    report.missing = layers
        .iter()
        .filter(|l| l.adapter.is_some() && !to_import.contains_key(&l.path))
        .map(|l| l.path.clone())
        .collect();
    let (model, _) = session::run_map(model, Task::Import(to_import));
    Ok((model, report))
}
