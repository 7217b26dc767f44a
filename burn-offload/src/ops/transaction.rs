//! `TransactionOps`: streamed weights are read from host memory, the rest in one transaction of
//! the inner backend.

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{TransactionOps, TransactionPrimitive, TransactionPrimitiveData};

use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;

impl<B: StreamTarget, P: PrefetchPolicy> TransactionOps<Self> for Offload<B, P> {
    async fn tr_execute(
        transaction: TransactionPrimitive<Self>,
    ) -> Result<TransactionPrimitiveData, ExecutionError> {
        let mut streamed = Vec::new();
        let mut on_device = Vec::new();
        for (index, tensor) in transaction.read_floats.into_iter().enumerate() {
            match tensor.as_streamed() {
                Some(s) => streamed.push((index, s.weight.decode())),
                None => on_device.push(tensor.into_inner()),
            }
        }
        let mut data = B::tr_execute(TransactionPrimitive::new(
            on_device,
            transaction.read_qfloats,
            transaction.read_ints,
            transaction.read_bools,
        ))
        .await?;
        for (index, values) in streamed {
            data.read_floats.insert(index, values);
        }
        Ok(data)
    }
}
