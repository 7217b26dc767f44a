//! How whole-model operations reach every [`Adapted`] layer through Burn's module traversal.
//!
//! `ModuleMapper` only sees parameters, so it cannot attach, merge or export adapters. Instead,
//! an operation installs a [`Task`] in a thread-local session and walks the model with a
//! [`Tracker`] (a mapper / visitor that only records the module path). `Adapted::map` and
//! `Adapted::visit` call [`on_map`] / [`on_visit`], which hand the layer and its path to the
//! task. Outside a session the hooks do nothing.

use std::cell::RefCell;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

use crate::layer::{Adapted, BaseLayer};
use crate::model::Task;

struct Session {
    path: Vec<String>,
    task: Option<Task>,
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

/// Removes the session when dropped, even if a task panics.
struct Guard;

impl Guard {
    fn install(task: Task) -> Self {
        SESSION.with(|s| {
            let mut s = s.borrow_mut();
            assert!(s.is_none(), "adapter operations do not nest");
            *s = Some(Session {
                path: Vec::new(),
                task: Some(task),
            });
        });
        Guard
    }

    fn finish(self) -> Task {
        let task = SESSION
            .with(|s| s.borrow_mut().take())
            .and_then(|s| s.task)
            .expect("the session holds its task");
        std::mem::forget(self);
        task
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        SESSION.with(|s| s.borrow_mut().take());
    }
}

/// Runs `task` over every adapted layer of `model`, allowing the task to replace them.
pub(crate) fn run_map<B: Backend, M: Module<B>>(model: M, task: Task) -> (M, Task) {
    let guard = Guard::install(task);
    let model = model.map(&mut Tracker);
    (model, guard.finish())
}

/// Runs `task` over every adapted layer of `model`, read-only.
pub(crate) fn run_visit<B: Backend, M: Module<B>>(model: &M, task: Task) -> Task {
    let guard = Guard::install(task);
    model.visit(&mut Tracker);
    guard.finish()
}

/// Takes the task and the current path out of the session, if one is running.
fn take() -> Option<(Task, String)> {
    SESSION.with(|s| {
        let mut s = s.borrow_mut();
        let session = s.as_mut()?;
        let task = session.task.take()?;
        Some((task, session.path.join(".")))
    })
}

fn put_back(task: Task) {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            session.task = Some(task);
        }
    });
}

/// Called by `Adapted::map` after its base was mapped.
pub(crate) fn on_map<B: Backend, L: BaseLayer<B>>(layer: Adapted<B, L>) -> Adapted<B, L> {
    match take() {
        Some((mut task, path)) => {
            let layer = task.map_layer(&path, layer);
            put_back(task);
            layer
        }
        None => layer,
    }
}

/// Called by `Adapted::visit` after its base was visited.
pub(crate) fn on_visit<B: Backend, L: BaseLayer<B>>(layer: &Adapted<B, L>) {
    if let Some((mut task, path)) = take() {
        task.visit_layer(&path, layer);
        put_back(task);
    }
}

fn enter(name: &str) {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            session.path.push(name.to_string());
        }
    });
}

fn exit() {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            session.path.pop();
        }
    });
}

/// Records the module path; leaves every parameter untouched (lazy ones stay lazy).
struct Tracker;

impl<B: Backend> ModuleMapper<B> for Tracker {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        param
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        param
    }
}

impl<B: Backend> ModuleVisitor<B> for Tracker {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        exit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LoraConfig;
    use crate::layer::LoraLinear;
    use crate::plan::LoraPlan;
    use burn::backend::Flex;
    use burn::module::ParamId;
    use burn::nn::{Linear, LinearConfig};

    fn active() -> bool {
        SESSION.with(|s| s.borrow().is_some())
    }

    #[test]
    fn a_panicking_task_leaves_no_session_behind() {
        let device = Default::default();
        // A base weight whose (lazy) initialisation panics: merging reads it inside the task.
        let weight = Param::uninitialized(
            ParamId::new(),
            |_: &burn::tensor::Device<Flex>, _| -> Tensor<Flex, 2> { panic!("weight read") },
            device,
            false,
            [4, 4].into(),
        );
        let layer: LoraLinear<Flex> = Linear { weight, bias: None }.into();
        let layer = layer.attach(&LoraConfig::new(2).into()).unwrap();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| crate::merge(layer)));
        assert!(result.is_err());
        assert!(!active());

        // The next operation runs normally.
        let layer: LoraLinear<Flex> = LinearConfig::new(4, 4).init(&device).into();
        let (layer, report) = LoraPlan::new(LoraConfig::new(2)).unwrap().apply(layer);
        assert_eq!(report.count(), 1);
        assert!(layer.adapter().is_some() && !active());
    }
}
