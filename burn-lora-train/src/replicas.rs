//! Data-parallel training on several devices of one host: one replica of the run per device,
//! each in its own thread, with the same adapters and optimizer state; each step's gradients
//! and losses are combined through burn-collective (NCCL on CUDA) so that every replica
//! applies the same update.
//!
//! Before each collective operation the replicas meet ([`Group::meet`]): when one of them has
//! failed, the others return [`TrainError::ReplicaFailed`] there instead of waiting forever
//! inside the operation for a peer that will not come.

use std::sync::{Condvar, Mutex, MutexGuard};

use burn::collective::{
    CollectiveConfig, PeerId, ReduceOperation, all_reduce, finish_collective, register,
};
use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn::{module::AutodiffModule, tensor::TensorPrimitive};

use crate::error::TrainError;

/// The replicas of one run, and where they meet.
pub(crate) struct Group {
    world: usize,
    state: Mutex<Meeting>,
    arrived: Condvar,
}

/// Who has come to the current meeting.
#[derive(Default)]
struct Meeting {
    present: usize,
    /// Meetings completed so far.
    held: u64,
    failed: bool,
}

impl Group {
    /// The group of `world` replicas.
    pub(crate) fn new(world: usize) -> Self {
        Self {
            world,
            state: Mutex::default(),
            arrived: Condvar::new(),
        }
    }

    /// Waits until every replica has come, or one has failed.
    fn meet(&self) -> Result<(), TrainError> {
        let mut state = self.lock();
        if state.failed {
            return Err(TrainError::ReplicaFailed);
        }
        state.present += 1;
        if state.present == self.world {
            state.present = 0;
            state.held += 1;
            self.arrived.notify_all();
            return Ok(());
        }
        let meeting = state.held;
        let state = self
            .arrived
            .wait_while(state, |s| s.held == meeting && !s.failed)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match state.held == meeting {
            true => Err(TrainError::ReplicaFailed),
            false => Ok(()),
        }
    }

    /// Releases the replicas waiting now or later: this one stopped with an error.
    pub(crate) fn fail(&self) {
        self.lock().failed = true;
        self.arrived.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, Meeting> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One replica's place in its run: its rank among `world`, and the group it meets.
#[derive(Clone, Copy)]
pub(crate) struct Replica<'a> {
    /// 0 for the replica that logs and saves.
    pub rank: usize,
    /// Replicas in the run.
    pub world: usize,
    group: Option<&'a Group>,
}

impl<'a> Replica<'a> {
    /// The only replica of a run on one device.
    pub(crate) fn alone() -> Self {
        Self {
            rank: 0,
            world: 1,
            group: None,
        }
    }

    /// Replica `rank` of `group`.
    pub(crate) fn of(group: &'a Group, rank: usize) -> Self {
        Self {
            rank,
            world: group.world,
            group: Some(group),
        }
    }

    /// Whether this replica logs and saves.
    pub(crate) fn leads(&self) -> bool {
        self.rank == 0
    }

    /// Joins the collective on `device` (the inner backend `B` of the training backend).
    pub(crate) fn join<B: Backend>(&self, device: &B::Device) -> Result<(), TrainError> {
        let Some(group) = self.group else {
            return Ok(());
        };
        group.meet()?;
        let config = CollectiveConfig::default().with_num_devices(self.world);
        register::<B>(self.peer(), device.clone(), config).map_err(collective)
    }

    /// Leaves the collective.
    pub(crate) fn leave<B: Backend>(&self) -> Result<(), TrainError> {
        match self.group {
            Some(_) => finish_collective::<B>(self.peer()).map_err(collective),
            None => Ok(()),
        }
    }

    /// The mean over the replicas of each gradient of `module`'s parameters, taken in the
    /// module's order (parameter ids differ from one replica to the next).
    pub(crate) fn mean_gradients<AB, M>(
        &self,
        module: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams, TrainError>
    where
        AB: AutodiffBackend,
        M: AutodiffModule<AB>,
    {
        let Some(group) = self.group else {
            return Ok(grads);
        };
        group.meet()?;
        let mut visitor = MeanGradients::<AB> {
            peer: self.peer(),
            grads,
            error: None,
            backend: std::marker::PhantomData,
        };
        module.visit(&mut visitor);
        match visitor.error {
            Some(error) => Err(error),
            None => Ok(visitor.grads),
        }
    }

    /// `values` summed over the replicas (through `device`).
    pub(crate) fn sum<B: Backend, const N: usize>(
        &self,
        values: [f64; N],
        device: &B::Device,
    ) -> Result<[f64; N], TrainError> {
        let Some(group) = self.group else {
            return Ok(values);
        };
        group.meet()?;
        let tensor = Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [N]), device)
            .into_primitive()
            .tensor();
        let summed =
            all_reduce::<B>(self.peer(), tensor, ReduceOperation::Sum).map_err(collective)?;
        let summed: Vec<f64> = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(summed))
            .into_data()
            .convert::<f64>()
            .to_vec()
            .expect("an f64 vector reads as f64");
        Ok(std::array::from_fn(|i| summed[i]))
    }

    fn peer(&self) -> PeerId {
        PeerId::from(self.rank as u32)
    }
}

/// Replaces each parameter's gradient with its mean over the replicas, in the order the
/// module visits its parameters.
struct MeanGradients<AB: AutodiffBackend> {
    peer: PeerId,
    grads: GradientsParams,
    error: Option<TrainError>,
    backend: std::marker::PhantomData<AB>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for MeanGradients<AB> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if self.error.is_some() {
            return;
        }
        let Some(grad) = self.grads.remove::<AB::InnerBackend, D>(param.id) else {
            return;
        };
        let reduced = all_reduce::<AB::InnerBackend>(
            self.peer,
            grad.into_primitive().tensor(),
            ReduceOperation::Mean,
        );
        match reduced {
            Ok(mean) => self.grads.register::<AB::InnerBackend, D>(
                param.id,
                Tensor::from_primitive(TensorPrimitive::Float(mean)),
            ),
            Err(error) => self.error = Some(collective(error)),
        }
    }
}

fn collective(error: burn::collective::CollectiveError) -> TrainError {
    TrainError::Collective(format!("{error:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_meet_again_and_again() {
        let group = Group::new(3);
        std::thread::scope(|s| {
            let replicas: Vec<_> = (0..3)
                .map(|_| s.spawn(|| (0..100).all(|_| group.meet().is_ok())))
                .collect();
            assert!(replicas.into_iter().all(|r| r.join().unwrap()));
        });
        assert_eq!(group.lock().held, 100);
    }

    #[test]
    fn a_failed_replica_releases_those_waiting_and_those_to_come() {
        let group = Group::new(3);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| group.meet());
            group.fail();
            assert!(matches!(
                waiting.join().unwrap(),
                Err(TrainError::ReplicaFailed)
            ));
        });
        assert!(matches!(group.meet(), Err(TrainError::ReplicaFailed)));
    }
}
