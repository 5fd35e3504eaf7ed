//! Reverse-mode automatic differentiation over the lazy graph.
//!
//! A tensor that takes part in differentiation carries a [`GradNode`]: a
//! leaf holds its accumulated gradient; an op's result holds the inputs and a
//! backward function, recorded by the op itself (`Tensor::track`) right where
//! the op is defined. Backward functions are written with tensor ops, so
//! gradients are lazy graphs like everything else: they fuse, and they run
//! on the device the values live on, with no host round trip.

use crate::error::{bail, Result};
use crate::tensor::Tensor;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The gradient of an op's output to the gradients of its inputs. `needs[i]`
/// tells whether input `i` wants one; the result has one entry per input.
pub(crate) type BackwardFn = Box<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// What backpropagation needs of an op's input: its place in the graph of
/// differentiation, its dtype and its shape. Not its value: holding that
/// would keep every intermediate of a forward pass alive, and a value that
/// is kept is stored, so it could not fuse into the kernel that reads it.
/// Backward functions hold the values they read themselves.
struct GradInput {
    grad: Option<Arc<GradNode>>,
    dtype: crate::DType,
    dims: Vec<usize>,
}

impl GradInput {
    fn of(t: &Tensor) -> GradInput {
        GradInput { grad: t.grad.clone(), dtype: t.dtype(), dims: t.dims().to_vec() }
    }
}

/// A tensor's place in the graph of differentiation.
pub(crate) struct GradNode {
    id: u64,
    /// The op's inputs (empty for a leaf).
    inputs: Vec<GradInput>,
    /// How the gradient reaches the inputs.
    backward: Backward,
    /// A leaf's accumulated gradient.
    grad: Mutex<Option<Tensor>>,
}

impl std::fmt::Debug for GradNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradNode({}, {} inputs)", self.id, self.inputs.len())
    }
}

impl Drop for GradNode {
    /// Unlink long chains iteratively: the default recursive drop of a deep
    /// chain of nodes would overflow the stack.
    fn drop(&mut self) {
        let mut stack: Vec<GradInput> = std::mem::take(&mut self.inputs);
        while let Some(mut t) = stack.pop() {
            if let Some(g) = t.grad.take() {
                if let Ok(mut node) = Arc::try_unwrap(g) {
                    stack.append(&mut node.inputs);
                }
            }
        }
    }
}

/// How a node's gradient reaches its inputs.
enum Backward {
    /// None: the node accumulates it (`GradNode::grad`).
    Leaf,
    /// Through the op's backward function.
    Op(BackwardFn),
    /// `narrow` of dim `dim` at `start`: the gradient is a slice of the one
    /// input's, kept apart until that gradient is complete so that the
    /// slices of one tensor become one `cat` (see [`Pending`]).
    Slice { dim: usize, start: usize },
}

static NEXT: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops record gradients on this thread (see [`no_grad`]).
pub fn is_grad_enabled() -> bool {
    ENABLED.with(|e| e.get())
}

/// Run `f` without recording gradients (PyTorch's `torch.no_grad()`).
///
/// ```
/// use voltaic::{Tensor, Device, DType};
/// let w = Tensor::ones(&[3], DType::F32, Device::Cpu)?.requires_grad()?;
/// let y = voltaic::no_grad(|| w.mul(2.0))?;
/// assert!(!y.is_tracked());
/// # Ok::<(), voltaic::Error>(())
/// ```
pub fn no_grad<T>(f: impl FnOnce() -> T) -> T {
    let _g = NoGradGuard::new();
    f()
}

/// Turns gradient recording off on this thread until dropped.
pub struct NoGradGuard {
    was: bool,
}

impl NoGradGuard {
    /// Stop recording gradients on this thread.
    pub fn new() -> NoGradGuard {
        NoGradGuard { was: ENABLED.with(|e| e.replace(false)) }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        NoGradGuard::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        ENABLED.with(|e| e.set(self.was));
    }
}

impl Tensor {
    /// A leaf that records the gradients flowing into it (PyTorch
    /// `requires_grad_()`); only float tensors can.
    pub fn requires_grad(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            bail!(DType, "requires_grad", "only float tensors can require gradients, got {}", self.dtype());
        }
        let mut t = self.clone();
        t.grad = Some(Arc::new(GradNode { id: NEXT.fetch_add(1, Ordering::Relaxed), inputs: vec![], backward: Backward::Leaf, grad: Mutex::new(None) }));
        Ok(t)
    }

    /// Whether gradients flow through this tensor (a leaf that requires them,
    /// or the result of ops on one).
    pub fn is_tracked(&self) -> bool {
        self.grad.is_some()
    }

    /// Whether this is a leaf that accumulates a gradient.
    pub fn is_leaf(&self) -> bool {
        self.grad.as_ref().is_some_and(|g| matches!(g.backward, Backward::Leaf))
    }

    /// The same values, cut off from differentiation.
    pub fn detach(&self) -> Tensor {
        let mut t = self.clone();
        t.grad = None;
        t
    }

    /// A leaf's accumulated gradient (`None` before any backward pass, or for
    /// tensors that are not leaves).
    pub fn grad(&self) -> Option<Tensor> {
        let g = self.grad.as_ref()?;
        g.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forget a leaf's accumulated gradient.
    pub fn zero_grad(&self) {
        if let Some(g) = &self.grad {
            *g.grad.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Replace a leaf's accumulated gradient (used by gradient clipping).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        let Some(g) = &self.grad else {
            bail!(Value, "set_grad", "the tensor does not require gradients");
        };
        if let Some(t) = &grad {
            if t.dims() != self.dims() {
                bail!(Shape, "set_grad", "gradient of shape {:?} for a tensor of shape {:?}", t.dims(), self.dims());
            }
        }
        *g.grad.lock().unwrap_or_else(|e| e.into_inner()) = grad.map(|t| t.detach());
        Ok(())
    }

    /// Record that `self` was computed from `inputs` by an op whose gradient
    /// `backward` gives; does nothing when no input is tracked or recording
    /// is off. Each differentiable op calls this where it is defined.
    pub(crate) fn track(self, inputs: &[&Tensor], backward: impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static) -> Tensor {
        self.track_node(inputs, Backward::Op(Box::new(backward)))
    }

    /// [`Tensor::track`] for `narrow` of `input` at `start` of `dim`: its
    /// gradient is that slice of the input's.
    pub(crate) fn track_slice(self, input: &Tensor, dim: usize, start: usize) -> Tensor {
        self.track_node(&[input], Backward::Slice { dim, start })
    }

    fn track_node(mut self, inputs: &[&Tensor], backward: Backward) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.grad.is_some()) {
            return self;
        }
        self.grad = Some(Arc::new(GradNode {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            inputs: inputs.iter().map(|t| GradInput::of(t)).collect(),
            backward,
            grad: Mutex::new(None),
        }));
        self
    }

    /// Backpropagate from a scalar (one-element) tensor, as `loss.backward()`.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            bail!(Shape, "backward", "backward() needs a one-element tensor, got shape {:?}; use backward_with", self.dims());
        }
        let seed = Tensor::ones(self.dims(), self.dtype(), self.device())?;
        self.backward_with(&seed)
    }

    /// Backpropagate `grad` (the gradient of some scalar with respect to
    /// `self`). Gradients add up in the leaves across calls, as in PyTorch.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        let Some(root) = &self.grad else {
            bail!(Value, "backward", "the tensor does not require gradients (no input of its computation requires them)");
        };
        if grad.dims() != self.dims() {
            bail!(Shape, "backward", "gradient of shape {:?} for a tensor of shape {:?}", grad.dims(), self.dims());
        }
        let _g = NoGradGuard::new();
        // Each gradient runs in the types of its forward pass (ops/autocast.rs).
        let _a = crate::ops::autocast::AutocastGuard::new(None);
        let order = topo_order(root);
        let mut grads: HashMap<u64, Pending> = HashMap::new();
        grads.insert(root.id, Pending::dense(grad.to_dtype(self.dtype())?.detach(), self.dims()));
        for node in order.iter().rev() {
            let Some(g) = grads.remove(&node.id) else { continue };
            let g = g.sum()?;
            match &node.backward {
                Backward::Leaf => {
                    let mut acc = node.grad.lock().unwrap_or_else(|e| e.into_inner());
                    *acc = Some(match acc.take() {
                        Some(prev) => prev.add(&g)?,
                        None => g,
                    });
                }
                Backward::Slice { dim, start } => {
                    // One input, tracked (or the node would not exist).
                    let [GradInput { grad: Some(n), dtype, dims }] = &node.inputs[..] else {
                        bail!(Value, "backward", "internal: a slice's node has {} inputs", node.inputs.len());
                    };
                    let g = if g.dtype() != *dtype { g.to_dtype(*dtype)? } else { g };
                    grads.entry(n.id).or_insert_with(|| Pending::empty(dims)).add_slice(*dim, *start, g)?;
                }
                Backward::Op(f) => {
                    let needs: Vec<bool> = node.inputs.iter().map(|t| t.grad.is_some()).collect();
                    let in_grads = f(&g, &needs)?;
                    for ((input, ig), need) in node.inputs.iter().zip(in_grads).zip(needs) {
                        let (Some(n), Some(ig), true) = (&input.grad, ig, need) else { continue };
                        let ig = if ig.dtype() != input.dtype { ig.to_dtype(input.dtype)? } else { ig };
                        if ig.dims() != input.dims {
                            bail!(Shape, "backward", "internal: a gradient of shape {:?} for an input of shape {:?}", ig.dims(), input.dims);
                        }
                        grads.entry(n.id).or_insert_with(|| Pending::empty(&input.dims)).add(ig)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sum a broadcast gradient back down to `dims` (the inverse of
    /// broadcasting `dims` to `self`'s shape).
    pub(crate) fn sum_to(&self, dims: &[usize]) -> Result<Tensor> {
        if self.dims() == dims {
            return Ok(self.clone());
        }
        let lead = self.rank() - dims.len();
        let mut axes: Vec<isize> = (0..lead as isize).collect();
        for (i, &d) in dims.iter().enumerate() {
            if d == 1 && self.dims()[lead + i] != 1 {
                axes.push((lead + i) as isize);
            }
        }
        self.sum(&axes, true)?.reshape_dims(dims)
    }
}

/// A gradient being summed over the ops that read a tensor: the sum of the
/// whole contributions, and apart from it the slices that `narrow`s of the
/// tensor gave. Slices that do not overlap become one `cat` (with zeros in
/// the gaps) when the gradient is complete. Summed one by one, each slice
/// would be a zero-padded copy of the whole tensor and an add: queries, keys
/// and values narrowed from one stacked product cost three full-size
/// copies and two full-size adds a layer instead of one copy.
struct Pending {
    dims: Vec<usize>,
    whole: Option<Tensor>,
    /// The slices' dim, and each slice's start along it.
    slices: Option<(usize, Vec<(usize, Tensor)>)>,
}

impl Pending {
    fn empty(dims: &[usize]) -> Pending {
        Pending { dims: dims.to_vec(), whole: None, slices: None }
    }

    fn dense(t: Tensor, dims: &[usize]) -> Pending {
        Pending { dims: dims.to_vec(), whole: Some(t), slices: None }
    }

    fn add(&mut self, t: Tensor) -> Result<()> {
        self.whole = Some(match self.whole.take() {
            Some(prev) => prev.add(&t)?,
            None => t,
        });
        Ok(())
    }

    /// Add the gradient of the slice of `dim` at `start`; slices along
    /// another dim than the first one's are added whole.
    fn add_slice(&mut self, dim: usize, start: usize, g: Tensor) -> Result<()> {
        match &mut self.slices {
            None => self.slices = Some((dim, vec![(start, g)])),
            Some((d, parts)) if *d == dim => parts.push((start, g)),
            Some(_) => {
                let whole = g.embed(dim, start, 1, self.dims[dim])?;
                self.add(whole)?;
            }
        }
        Ok(())
    }

    /// The complete gradient.
    fn sum(self) -> Result<Tensor> {
        let Pending { dims, whole, slices } = self;
        let Some((dim, mut parts)) = slices else {
            return whole.map_or_else(|| bail!(Value, "backward", "internal: an empty gradient"), Ok);
        };
        parts.sort_by_key(|(start, _)| *start);
        let like = parts[0].1.clone();
        let zeros = |n: usize| {
            let mut d = dims.clone();
            d[dim] = n;
            Tensor::zeros(&d, like.dtype(), like.device())
        };
        // Slices in order, each starting at or after the end of the last one
        // kept; one that overlaps it is added whole.
        let (mut row, mut overlapping, mut end) = (vec![], vec![], 0);
        for (start, g) in parts {
            let len = g.dims()[dim];
            if len == 0 {
                continue;
            }
            if start < end {
                overlapping.push((start, g));
                continue;
            }
            if start > end {
                row.push(zeros(start - end)?);
            }
            row.push(g);
            end = start + len;
        }
        if end < dims[dim] || row.is_empty() {
            row.push(zeros(dims[dim] - end)?);
        }
        let mut total = if row.len() == 1 { row.pop().expect("one part") } else { Tensor::cat(&row.iter().collect::<Vec<_>>(), dim as isize)? };
        for (start, g) in overlapping {
            total = total.add(&g.embed(dim, start, 1, dims[dim])?)?;
        }
        match whole {
            Some(w) => w.add(&total),
            None => Ok(total),
        }
    }
}

/// Every node reachable from `root`, inputs before the nodes that use them.
fn topo_order(root: &Arc<GradNode>) -> Vec<Arc<GradNode>> {
    let mut order = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut stack: Vec<(Arc<GradNode>, bool)> = vec![(root.clone(), false)];
    while let Some((n, expanded)) = stack.pop() {
        if expanded {
            order.push(n);
            continue;
        }
        if !seen.insert(n.id) {
            continue;
        }
        stack.push((n.clone(), true));
        for t in &n.inputs {
            if let Some(c) = &t.grad {
                if !seen.contains(&c.id) {
                    stack.push((c.clone(), false));
                }
            }
        }
    }
    order
}
