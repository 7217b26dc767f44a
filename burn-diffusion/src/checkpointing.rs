//! Block-level gradient checkpointing: keep only each block's inputs in the forward pass and
//! recompute the block, with autodiff, during the backward pass.
//!
//! Burn's own checkpointing recomputes only element-wise operations; matmul inputs and attention
//! scores are always kept. Here a whole transformer block is the unit: a model routes its blocks
//! through a [`BlockRunner`], either [`Direct`] (in place) or [`BlockTape`] (recomputed).

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::ExecutionError;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive, read_sync};

/// Whether a training forward pass keeps every activation or recomputes each block in backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Checkpointing {
    /// Keep only block inputs; recompute each block during the backward pass (the default for
    /// training: activation memory of one block instead of all).
    #[default]
    Blocks,
    /// As [`Blocks`](Self::Blocks), with each block's inputs in host memory from the time the
    /// block has run until its recomputation (read in the forward pass's order, awaited by a
    /// thread of their own while the forward pass goes on): the device holds one block's inputs
    /// instead of every block's.
    BlocksOnHost,
    /// Keep every activation (faster, much more memory).
    Off,
}

/// A set of float tensors passed into or out of a block: one tensor, or a tuple of up to four.
pub trait Activations<B: Backend>: Sized {
    /// Appends the tensors' primitives to `out`, in order.
    fn into_primitives(self, out: &mut Vec<FloatTensor<B>>);
    /// Rebuilds the set from primitives taken in the same order.
    fn from_primitives(it: &mut impl Iterator<Item = FloatTensor<B>>) -> Self;
}

impl<B: Backend, const D: usize> Activations<B> for Tensor<B, D> {
    fn into_primitives(self, out: &mut Vec<FloatTensor<B>>) {
        out.push(self.into_primitive().tensor());
    }

    fn from_primitives(it: &mut impl Iterator<Item = FloatTensor<B>>) -> Self {
        let primitive = it.next().expect("one primitive per tensor");
        Tensor::from_primitive(TensorPrimitive::Float(primitive))
    }
}

macro_rules! tuple_activations {
    ($($t:ident),+) => {
        impl<B: Backend, $($t: Activations<B>),+> Activations<B> for ($($t,)+) {
            #[allow(non_snake_case)]
            fn into_primitives(self, out: &mut Vec<FloatTensor<B>>) {
                let ($($t,)+) = self;
                $($t.into_primitives(out);)+
            }

            fn from_primitives(it: &mut impl Iterator<Item = FloatTensor<B>>) -> Self {
                ($($t::from_primitives(it),)+)
            }
        }
    };
}

tuple_activations!(T0, T1);
tuple_activations!(T0, T1, T2);
tuple_activations!(T0, T1, T2, T3);

/// Runs the blocks of a model: in place, or recording them for recomputation.
pub trait BlockRunner<B: Backend> {
    /// Declares tensors that blocks will read; returns the tensors to use from here on.
    fn input<T: Activations<B>>(&mut self, tensors: T) -> T;

    /// Runs `forward(block, inputs)`.
    fn run<M, I, O, F>(&mut self, block: &M, inputs: I, forward: F) -> O
    where
        M: Module<B> + 'static,
        I: Activations<B> + 'static,
        O: Activations<B> + 'static,
        F: Fn(&M, I) -> O + 'static;
}

/// Runs every block in place: inference, or training that keeps every activation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Direct;

impl<B: Backend> BlockRunner<B> for Direct {
    fn input<T: Activations<B>>(&mut self, tensors: T) -> T {
        tensors
    }

    fn run<M, I, O, F>(&mut self, block: &M, inputs: I, forward: F) -> O
    where
        M: Module<B> + 'static,
        I: Activations<B> + 'static,
        O: Activations<B> + 'static,
        F: Fn(&M, I) -> O + 'static,
    {
        forward(block, inputs)
    }
}

/// The primitive of a tensor on `Autodiff<B, C>` (the strategy does not change its type).
type Tracked<B, C> = FloatTensor<Autodiff<B, C>>;

/// Block-level gradient checkpointing on `Autodiff<B, C>`: records block inputs during a
/// training forward pass and replays the blocks in [`BlockTape::backward`]. With
/// [`Checkpointing::Off`] it records nothing and blocks run in the ordinary autodiff graph.
///
/// Each block runs without a graph (its parameters detached); its outputs are handed out as
/// fresh leaves. `backward` then runs several small backward passes: through the graph after
/// the last block, through each block recomputed from its recorded inputs (in reverse), and
/// through the graph before the first block, accumulating everything into one `Gradients`
/// (the same values `loss.backward()` gives without checkpointing). The passes are sequential
/// because Burn 0.21 holds the graph's lock while a backward pass runs, so a block cannot be
/// recomputed from inside another backward pass.
///
/// Rules for a model: every tracked tensor that blocks read goes through
/// [`BlockRunner::input`] first, and the returned tensor replaces it everywhere after (blocks
/// and the rest of the forward pass); tensors flow from block to block only through
/// [`BlockRunner::run`]'s inputs and outputs; a block closure may capture constants (untracked
/// tensors, such as rotary tables) but no tracked tensor. `run` panics when a tracked tensor
/// arrives by another way.
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::GradientsParams;
/// use burn::tensor::Tensor;
/// use burn_diffusion::{BlockRunner, BlockTape, Checkpointing};
///
/// type B = Autodiff<Flex>;
/// let device = Default::default();
/// let blocks: Vec<Linear<B>> = (0..4).map(|_| LinearConfig::new(8, 8).init(&device)).collect();
/// let x = Tensor::<B, 2>::ones([2, 8], &device);
///
/// let mut tape = BlockTape::new(Checkpointing::Blocks);
/// let mut h = tape.input(x);
/// for block in &blocks {
///     h = tape.run(block, h, |block, h| block.forward(h).tanh());
/// }
/// let loss = h.sum();
/// let grads = tape.backward(&loss, &blocks);
/// // A weight and a bias per block.
/// assert_eq!(GradientsParams::from_grads(grads, &blocks).len(), 8);
/// ```
pub struct BlockTape<B: Backend, C: CheckpointStrategy> {
    checkpointing: Checkpointing,
    slots: Vec<Slot<B, C>>,
    by_node: HashMap<NodeId, usize>,
    steps: Vec<Step<B, C>>,
    /// With [`Checkpointing::BlocksOnHost`]: the copies of block outputs in host memory.
    host: Option<HostCopies>,
}

/// A tensor crossing a block boundary.
struct Slot<B: Backend, C: CheckpointStrategy> {
    /// The leaf handed to the model; its value is the recorded activation (while the value is
    /// in host memory, a one-element stand-in that keeps the leaf's identity).
    leaf: Option<Tracked<B, C>>,
    /// Whether the value is in [`BlockTape`]'s host copies.
    on_host: bool,
    /// The gradient accumulated so far.
    grad: Option<FloatTensor<B>>,
    /// For a declared input: the tracked tensor it came from.
    source: Option<Tracked<B, C>>,
}

/// One input of a recorded block.
enum Arg<B: Backend, C: CheckpointStrategy> {
    /// A declared input or an earlier block's output.
    Slot(usize),
    /// An untracked tensor, used as it is.
    Constant(Tracked<B, C>),
}

struct Step<B: Backend, C: CheckpointStrategy> {
    args: Vec<Arg<B, C>>,
    outputs: Vec<usize>,
    replay: Box<dyn Replay<B, C>>,
}

/// A recorded block, type-erased.
trait Replay<B: Backend, C: CheckpointStrategy> {
    /// Runs the block with its tracked parameters.
    fn forward(&self, inputs: Vec<Tracked<B, C>>) -> Vec<Tracked<B, C>>;
    /// Moves the gradients of the block's parameters from `from` into `into`.
    fn move_param_grads(&self, from: &mut Gradients, into: &mut Gradients);
}

struct BlockReplay<M, F, I, O> {
    block: M,
    forward: F,
    _io: PhantomData<fn(I) -> O>,
}

impl<B, C, M, F, I, O> Replay<B, C> for BlockReplay<M, F, I, O>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Module<Autodiff<B, C>>,
    I: Activations<Autodiff<B, C>>,
    O: Activations<Autodiff<B, C>>,
    F: Fn(&M, I) -> O,
{
    fn forward(&self, inputs: Vec<Tracked<B, C>>) -> Vec<Tracked<B, C>> {
        let inputs = I::from_primitives(&mut inputs.into_iter());
        let mut out = Vec::new();
        (self.forward)(&self.block, inputs).into_primitives(&mut out);
        out
    }

    fn move_param_grads(&self, from: &mut Gradients, into: &mut Gradients) {
        move_param_grads(&self.block, from, into);
    }
}

/// Moves the gradient of every parameter of `module` from one container into another, adding
/// to what is already there.
fn move_param_grads<B: Backend, C: CheckpointStrategy, M: Module<Autodiff<B, C>>>(
    module: &M,
    from: &mut Gradients,
    into: &mut Gradients,
) {
    struct Mover<'a, B, C> {
        from: &'a mut Gradients,
        into: &'a mut Gradients,
        _backend: PhantomData<(B, C)>,
    }
    impl<B: Backend, C: CheckpointStrategy> ModuleVisitor<Autodiff<B, C>> for Mover<'_, B, C> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Autodiff<B, C>, D>>) {
            let tensor = param.val().into_primitive().tensor();
            if let Some(grad) = self.from.remove::<B>(&tensor) {
                self.into.register::<B>(tensor.node.id, grad);
            }
        }
    }
    module.visit(&mut Mover::<B, C> {
        from,
        into,
        _backend: PhantomData,
    });
}

impl<B: Backend, C: CheckpointStrategy> BlockTape<B, C> {
    /// An empty tape.
    pub fn new(checkpointing: Checkpointing) -> Self {
        Self {
            checkpointing,
            slots: Vec::new(),
            by_node: HashMap::new(),
            steps: Vec::new(),
            host: None,
        }
    }

    /// Bytes of block inputs in host memory now (copied or on their way).
    pub fn bytes_on_host(&self) -> u64 {
        self.host.as_ref().map_or(0, HostCopies::bytes)
    }

    /// Whether blocks are recomputed in backward.
    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing
    }

    /// Gradients of `loss` with respect to the parameters, as `loss.backward()` gives them
    /// without checkpointing: those of the graph after the last block, of every recorded block,
    /// and of `model` (typically the whole model, whose parameters produced the tensors
    /// declared with [`BlockRunner::input`]). Tracked tensors that are not parameters get a
    /// gradient only if the graph after the last block reads them.
    pub fn backward<M: Module<Autodiff<B, C>>>(
        mut self,
        loss: &Tensor<Autodiff<B, C>, 1>,
        model: &M,
    ) -> Gradients {
        let mut grads = loss.backward();
        if self.checkpointing == Checkpointing::Off {
            return grads;
        }
        for slot in &mut self.slots {
            if let Some(leaf) = &slot.leaf {
                slot.grad = grads.remove::<B>(leaf);
            }
        }
        while let Some(step) = self.steps.pop() {
            self.replay(step, &mut grads);
        }
        let terms = self
            .slots
            .iter_mut()
            .filter_map(|slot| Some((slot.source.take()?, slot.grad.take()?)));
        if let Some(total) = dot::<B, C>(terms) {
            let mut inner = total.backward();
            move_param_grads(model, &mut inner, &mut grads);
        }
        grads
    }

    /// Recomputes one block from its recorded inputs and pushes its output gradients through it.
    fn replay(&mut self, step: Step<B, C>, grads: &mut Gradients) {
        let out_grads: Vec<_> = step
            .outputs
            .iter()
            .map(|&s| {
                let slot = &mut self.slots[s];
                slot.leaf = None;
                slot.grad.take()
            })
            .collect();
        if out_grads.iter().all(Option::is_none) {
            return;
        }
        for arg in &step.args {
            if let Arg::Slot(s) = arg {
                self.bring_back(*s);
            }
        }
        let inputs: Vec<Tracked<B, C>> = step
            .args
            .iter()
            .map(|arg| match arg {
                Arg::Slot(s) => {
                    let leaf = self.slots[*s]
                        .leaf
                        .as_ref()
                        .expect("inputs outlive their readers");
                    leaf_of::<B, C>(leaf.primitive.clone())
                }
                Arg::Constant(t) => t.clone(),
            })
            .collect();
        let terms = out_grads
            .into_iter()
            .zip(step.replay.forward(inputs.clone()))
            .filter_map(|(grad, out)| Some((out, grad?)));
        let Some(total) = dot::<B, C>(terms) else {
            return;
        };
        let mut inner = total.backward();
        for (arg, input) in step.args.iter().zip(&inputs) {
            if let Arg::Slot(s) = arg
                && let Some(grad) = inner.remove::<B>(input)
            {
                let slot = &mut self.slots[*s];
                slot.grad = Some(match slot.grad.take() {
                    Some(acc) => B::float_add(acc, grad),
                    None => grad,
                });
            }
        }
        step.replay.move_param_grads(&mut inner, grads);
    }

    /// Registers a leaf (and the tracked tensor it stands for, if any); returns its slot.
    fn new_slot(&mut self, leaf: Tracked<B, C>, source: Option<Tracked<B, C>>) -> usize {
        let index = self.slots.len();
        self.by_node.insert(leaf.node.id, index);
        self.slots.push(Slot {
            leaf: Some(leaf),
            on_host: false,
            grad: None,
            source,
        });
        index
    }

    /// With [`Checkpointing::BlocksOnHost`], starts copying the value of `slot` (an earlier
    /// block's output, which a block has just read) to host memory, leaving a stand-in.
    fn move_to_host(&mut self, slot: usize) {
        if self.checkpointing != Checkpointing::BlocksOnHost {
            return;
        }
        let Slot {
            leaf: Some(leaf),
            on_host: false,
            source: None,
            ..
        } = &mut self.slots[slot]
        else {
            return;
        };
        let device = B::float_device(&leaf.primitive);
        let stand_in = B::float_zeros(Shape::new([1]), &device, leaf.primitive.dtype().into());
        let value = std::mem::replace(&mut leaf.primitive, stand_in);
        self.slots[slot].on_host = true;
        self.host
            .get_or_insert_with(HostCopies::new)
            .put::<B>(slot, value);
    }

    /// Puts the value of `slot` back on the device where it is in host memory.
    fn bring_back(&mut self, slot: usize) {
        if !std::mem::take(&mut self.slots[slot].on_host) {
            return;
        }
        let host = self
            .host
            .as_ref()
            .expect("a value on the host has its copies");
        let leaf = self.slots[slot]
            .leaf
            .as_mut()
            .expect("inputs outlive their readers");
        let device = B::float_device(&leaf.primitive);
        let data = host.take(slot).unwrap_or_else(|error| {
            panic!("copying a checkpointed block's input to host memory failed: {error:?}")
        });
        leaf.primitive = B::float_from_data(data, &device);
    }
}

impl<B: Backend, C: CheckpointStrategy> BlockRunner<Autodiff<B, C>> for BlockTape<B, C> {
    fn input<T: Activations<Autodiff<B, C>>>(&mut self, tensors: T) -> T {
        if self.checkpointing == Checkpointing::Off {
            return tensors;
        }
        let mut primitives = Vec::new();
        tensors.into_primitives(&mut primitives);
        let leaves: Vec<_> = primitives
            .into_iter()
            .map(|t| {
                if t.node.requirement.is_none() {
                    return t;
                }
                let leaf = leaf_of::<B, C>(t.primitive.clone());
                self.new_slot(leaf.clone(), Some(t));
                leaf
            })
            .collect();
        T::from_primitives(&mut leaves.into_iter())
    }

    fn run<M, I, O, F>(&mut self, block: &M, inputs: I, forward: F) -> O
    where
        M: Module<Autodiff<B, C>> + 'static,
        I: Activations<Autodiff<B, C>> + 'static,
        O: Activations<Autodiff<B, C>> + 'static,
        F: Fn(&M, I) -> O + 'static,
    {
        if self.checkpointing == Checkpointing::Off {
            return forward(block, inputs);
        }
        let mut primitives = Vec::new();
        inputs.into_primitives(&mut primitives);
        let mut args = Vec::with_capacity(primitives.len());
        let mut untracked = Vec::with_capacity(primitives.len());
        for t in primitives {
            if let Some(&slot) = self.by_node.get(&t.node.id) {
                args.push(Arg::Slot(slot));
                untracked.push(Autodiff::<B, C>::from_inner(t.primitive));
            } else {
                assert!(
                    t.node.requirement.is_none(),
                    "a tracked tensor reached a checkpointed block without passing through \
                     BlockRunner::input or an earlier block"
                );
                args.push(Arg::Constant(t.clone()));
                untracked.push(t);
            }
        }
        // A clone of a lazily initialized parameter would initialize on its own, to other values.
        initialize(block);
        let frozen = block.clone().no_grad();
        let mut outputs = Vec::new();
        forward(&frozen, I::from_primitives(&mut untracked.into_iter()))
            .into_primitives(&mut outputs);
        for arg in &args {
            if let Arg::Slot(s) = arg {
                self.move_to_host(*s);
            }
        }
        let mut slots = Vec::with_capacity(outputs.len());
        let leaves: Vec<_> = outputs
            .into_iter()
            .map(|t| {
                assert!(
                    t.node.requirement.is_none(),
                    "a checkpointed block's output is tracked: its closure captured a tracked \
                     tensor, which must be passed as an input instead"
                );
                let leaf = leaf_of::<B, C>(t.primitive);
                slots.push(self.new_slot(leaf.clone(), None));
                leaf
            })
            .collect();
        self.steps.push(Step {
            args,
            outputs: slots,
            replay: Box::new(BlockReplay {
                block: block.clone(),
                forward,
                _io: PhantomData,
            }),
        });
        O::from_primitives(&mut leaves.into_iter())
    }
}

/// Copies of block inputs in host memory, keyed by slot, each asked of the backend in the
/// forward pass's order and awaited by [`copier`]'s thread.
struct HostCopies {
    shared: Arc<(Mutex<Copies>, Condvar)>,
}

/// Copies that wait on the device for the copying thread: beyond them, [`HostCopies::put`]
/// waits, so that the device never holds more than a few of the values it hands over.
const COPIES_IN_FLIGHT: usize = 2;

/// The copies made, and how many are on their way.
#[derive(Default)]
struct Copies {
    done: HashMap<usize, Result<TensorData, ExecutionError>>,
    in_flight: usize,
    bytes: u64,
}

/// A copy for the copying thread to make.
type CopyJob = Box<dyn FnOnce() + Send>;

/// The thread that makes every tape's copies, one for the process: a CubeCL backend gives each
/// thread a stream and memory pools of its own, which one thread reuses from step to step.
fn copier() -> &'static Mutex<Sender<CopyJob>> {
    static COPIER: OnceLock<Mutex<Sender<CopyJob>>> = OnceLock::new();
    COPIER.get_or_init(|| {
        let (jobs, received) = channel::<CopyJob>();
        std::thread::Builder::new()
            .name("block-inputs-to-host".into())
            .spawn(move || received.into_iter().for_each(|job| job()))
            .expect("starting the thread that copies block inputs to host memory");
        Mutex::new(jobs)
    })
}

impl HostCopies {
    fn new() -> Self {
        Self {
            shared: Arc::new((Mutex::new(Copies::default()), Condvar::new())),
        }
    }

    /// Hands `value` to the copying thread, once fewer than [`COPIES_IN_FLIGHT`] wait for it.
    fn put<B: Backend>(&self, slot: usize, value: FloatTensor<B>) {
        let (mutex, settled) = &*self.shared;
        let bytes = (value.shape().num_elements() * value.dtype().size()) as u64;
        let mut copies = settled
            .wait_while(lock(mutex), |c| c.in_flight >= COPIES_IN_FLIGHT)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        copies.in_flight += 1;
        copies.bytes += bytes;
        drop(copies);
        // Asked for here, in this thread's order: a backend may start the copy now.
        let read = B::float_into_data(value);
        let shared = self.shared.clone();
        let job = Box::new(move || {
            let data = read_sync(read);
            let mut copies = lock(&shared.0);
            copies.done.insert(slot, data);
            copies.in_flight -= 1;
            shared.1.notify_all();
        });
        copier()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .send(job)
            .expect("the copying thread runs as long as the process");
    }

    /// The copy of `slot`'s value, once made; it leaves host memory.
    fn take(&self, slot: usize) -> Result<TensorData, ExecutionError> {
        let (mutex, settled) = &*self.shared;
        let mut copies = settled
            .wait_while(lock(mutex), |c| !c.done.contains_key(&slot))
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let data = copies.done.remove(&slot).expect("waited for");
        if let Ok(data) = &data {
            copies.bytes -= data.as_bytes().len() as u64;
        }
        data
    }

    fn bytes(&self) -> u64 {
        lock(&self.shared.0).bytes
    }
}

fn lock(mutex: &Mutex<Copies>) -> MutexGuard<'_, Copies> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Creates every lazily initialized parameter of `module` now, so that its clones share them.
fn initialize<B: Backend, M: Module<B>>(module: &M) {
    struct Initialize;
    impl<B: Backend> ModuleVisitor<B> for Initialize {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            param.val();
        }
    }
    module.visit(&mut Initialize);
}

/// A fresh leaf that requires a gradient, holding `value`.
fn leaf_of<B: Backend, C: CheckpointStrategy>(value: FloatTensor<B>) -> Tracked<B, C> {
    Autodiff::<B, C>::float_set_require_grad(Autodiff::<B, C>::from_inner(value), true)
}

/// `Σ sum(tensor · grad)` as a tracked scalar, or `None` when there is no term; its gradient
/// with respect to each tensor is that tensor's `grad`.
fn dot<B: Backend, C: CheckpointStrategy>(
    terms: impl Iterator<Item = (Tracked<B, C>, FloatTensor<B>)>,
) -> Option<Tensor<Autodiff<B, C>, 1>> {
    terms
        .map(|(tensor, grad)| {
            let product = Autodiff::<B, C>::float_mul(tensor, Autodiff::<B, C>::from_inner(grad));
            Tensor::from_primitive(TensorPrimitive::Float(Autodiff::<B, C>::float_sum(product)))
        })
        .reduce(|a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::tensor::Distribution;

    type Ad = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct ToyBlock<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    impl<B: Backend> ToyBlock<B> {
        /// Two streams and a shared context; `bias` is a constant.
        fn forward(
            &self,
            x: Tensor<B, 2>,
            y: Tensor<B, 2>,
            ctx: Tensor<B, 2>,
            bias: &Tensor<B, 2>,
        ) -> (Tensor<B, 2>, Tensor<B, 2>) {
            let x = x.clone() + (self.a.forward(x) * ctx.clone()).tanh() + bias.clone();
            let y = y * burn::tensor::activation::sigmoid(self.b.forward(x.clone()) + ctx);
            (x, y)
        }
    }

    #[derive(Module, Debug)]
    struct Toy<B: Backend> {
        pre: Linear<B>,
        blocks: Vec<ToyBlock<B>>,
        post: Linear<B>,
    }

    impl<B: Backend> Toy<B> {
        fn new(device: &B::Device) -> Self {
            let linear = || LinearConfig::new(6, 6).init(device);
            Self {
                pre: linear(),
                blocks: (0..3)
                    .map(|_| ToyBlock {
                        a: linear(),
                        b: linear(),
                    })
                    .collect(),
                post: linear(),
            }
        }

        fn loss<R: BlockRunner<B>>(&self, input: Tensor<B, 2>, runner: &mut R) -> Tensor<B, 1> {
            let h = self.pre.forward(input);
            let ctx = h.clone().sin();
            let bias = Tensor::<B, 2>::ones([1, 6], &h.device()) * 0.1;
            let (mut x, mut y, ctx) = runner.input((h.clone(), h * 2.0, ctx));
            let mut first = None;
            for block in &self.blocks {
                let bias = bias.clone();
                (x, y) = runner.run(block, (x, y, ctx.clone()), move |b, (x, y, ctx)| {
                    b.forward(x, y, ctx, &bias)
                });
                first.get_or_insert_with(|| x.clone());
            }
            // The first block's output is read by the next block and by the loss.
            let first = first.expect("blocks").sum() * 0.5;
            (self.post.forward(x) * ctx).sum() + y.powi_scalar(2).sum() + first
        }
    }

    /// Every parameter's gradient, in visiting order.
    fn all_grads(model: &Toy<Ad>, grads: &GradientsParams) -> Vec<Vec<f32>> {
        struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
        impl ModuleVisitor<Ad> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
                let grad = self
                    .0
                    .get::<Flex, D>(param.id)
                    .expect("every parameter has a gradient");
                self.1.push(grad.into_data().to_vec().unwrap());
            }
        }
        let mut collect = Collect(grads, Vec::new());
        model.visit(&mut collect);
        collect.1
    }

    #[test]
    fn recomputed_blocks_give_the_same_gradients() {
        let device = Default::default();
        // Fresh (lazily initialized) parameters: the tape runs first.
        let model = Toy::<Ad>::new(&device);
        let input = Tensor::<Ad, 2>::random([4, 6], Distribution::Normal(0.0, 1.0), &device);

        let mut tape = BlockTape::new(Checkpointing::Blocks);
        let loss = model.loss(input.clone(), &mut tape);
        let grads = GradientsParams::from_grads(tape.backward(&loss, &model), &model);

        let direct = model.loss(input, &mut Direct);
        loss.to_data()
            .assert_approx_eq::<f32>(&direct.to_data(), burn::tensor::Tolerance::relative(1e-6));
        let expected = GradientsParams::from_grads(direct.backward(), &model);

        let (expected, actual) = (all_grads(&model, &expected), all_grads(&model, &grads));
        assert_eq!(expected.len(), 16);
        for (e, a) in expected.iter().zip(&actual) {
            assert!(e.iter().any(|v| *v != 0.0));
            for (x, y) in e.iter().zip(a) {
                assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{x} vs {y}");
            }
        }
    }

    #[test]
    fn inputs_kept_on_the_host_give_the_same_gradients() {
        let device = Default::default();
        let model = Toy::<Ad>::new(&device);
        let input = Tensor::<Ad, 2>::random([4, 6], Distribution::Normal(0.0, 1.0), &device);
        let grads = |checkpointing| {
            let mut tape = BlockTape::new(checkpointing);
            let loss = model.loss(input.clone(), &mut tape);
            let on_host = tape.bytes_on_host();
            let grads = GradientsParams::from_grads(tape.backward(&loss, &model), &model);
            (all_grads(&model, &grads), on_host)
        };
        let (expected, none) = grads(Checkpointing::Blocks);
        let (actual, on_host) = grads(Checkpointing::BlocksOnHost);
        assert_eq!(none, 0);
        // The two outputs of the first two blocks, each [4, 6] f32; the last block's outputs
        // are read only after the blocks and stay.
        assert_eq!(on_host, 4 * 4 * 6 * 4);
        assert_eq!(expected, actual);
    }

    #[test]
    fn switched_off_the_tape_is_plain_backward() {
        let device = Default::default();
        let model = Toy::<Ad>::new(&device);
        let input = Tensor::<Ad, 2>::random([2, 6], Distribution::Normal(0.0, 1.0), &device);
        let expected = all_grads(
            &model,
            &GradientsParams::from_grads(model.loss(input.clone(), &mut Direct).backward(), &model),
        );
        let mut tape = BlockTape::new(Checkpointing::Off);
        let loss = model.loss(input, &mut tape);
        let actual = all_grads(
            &model,
            &GradientsParams::from_grads(tape.backward(&loss, &model), &model),
        );
        assert_eq!(expected, actual);
    }

    #[test]
    #[should_panic(expected = "without passing through BlockRunner::input")]
    fn undeclared_tracked_inputs_are_refused() {
        let device = Default::default();
        let model = Toy::<Ad>::new(&device);
        let x = model.pre.forward(Tensor::<Ad, 2>::ones([1, 6], &device));
        let bias = Tensor::<Ad, 2>::zeros([1, 6], &device);
        let mut tape = BlockTape::new(Checkpointing::Blocks);
        let _ = tape.run(
            &model.blocks[0],
            (x.clone(), x.clone(), x),
            move |b, (x, y, c)| b.forward(x, y, c, &bias),
        );
    }
}
