//! Captured steps: a function of tensors replayed from the plans it
//! realized, without its graph; see [`Capture`].

use crate::backend::{executor, Buffer};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::{Node, State, Value};
use crate::ir::{Plan, SlotSource};
use crate::layout::Layout;
use crate::realize::{self, Realization};
use crate::tensor::Tensor;
use std::sync::Arc;

/// Counters of a [`Capture`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Calls that ran the function through the graph.
    pub eager_calls: u64,
    /// Calls replayed from a capture.
    pub replays: u64,
    /// Captures made (one per distinct kind of inputs, and again after eviction).
    pub captures: u64,
    /// Times two traced calls disagreed in their graphs, so nothing was kept.
    pub mismatches: u64,
}

/// A function of tensors run through the graph twice, then replayed from
/// the plans it realized, with new input buffers and no graph at all (in
/// the spirit of CUDA graphs and tinygrad's `TinyJit`).
///
/// The plan cache already spares a repeated step its scheduling, but each
/// call still records its graph node by node, collects it and looks it up;
/// for a decode step of a language model (hundreds of small kernels per
/// token) that host work is most of the step. A [`Capture`] runs its
/// function normally on the first two calls with the same kind of inputs,
/// logging every realization (plan, buffers read, buffers stored); if the
/// two logs agree it keeps the second and, from the third call on, runs
/// those plans straight on the executors: the function is not called.
///
/// What a replay can and cannot see is checked, not assumed:
/// - Buffers a plan reads are classified per call: an input of the step,
///   a result of an earlier realization of the same call, or something
///   else (a weight). A weight must be the same buffer in both calls, or
///   hold the same values (a table the function uploads each call): one
///   whose values differ is host data that changes per call, and the
///   capture fails with an error saying to pass it as an input.
/// - A Rust number folded into the graph (`x.add(step as f64)`) is a
///   constant of a plan: if it differs between the two calls, the capture
///   fails the same way.
/// - If the two calls realized different graphs (control flow on values
///   read back, or a first call that realized something lazily), nothing
///   is kept and the next call tries again; calls stay correct, only not
///   replayed ([`CaptureStats::eager_calls`]). The same holds when an input
///   is the same tensor on both calls: it could not be told from a tensor
///   the step holds itself, so inputs must be new tensors each call (pass
///   what stays the same by capturing it in the closure).
///
/// Replayed outputs carry no autograd history, and side effects of the
/// function (assigning to a model's fields, an optimizer's update) do not
/// happen: a step must return everything it changes. In a browser, where
/// values cannot be read back while the thread waits, a table uploaded
/// inside the step cannot be compared between the two calls, so such a
/// step is never replayed there (it runs through the graph every call).
///
/// ```
/// use voltaic::{Capture, DType, Device, Tensor};
/// let w = Tensor::from_vec(vec![1f32, -2., 3., 4.], &[2, 2], Device::Cpu)?;
/// let mut step = Capture::new(|x: &[Tensor]| Ok(vec![x[0].matmul(&w)?.relu()?]));
/// for i in 0..4 {
///     let x = Tensor::full(&[1, 2], i as f64, DType::F32, Device::Cpu)?;
///     let y = &step.call(&[&x])?[0];
///     assert_eq!(y.to_vec::<f32>()?, vec![4.0 * i as f32, 2.0 * i as f32]);
/// }
/// assert_eq!(step.stats().replays, 2);
/// # Ok::<(), voltaic::Error>(())
/// ```
pub struct Capture<F> {
    step: F,
    /// Per kind of inputs, the most recently used first.
    entries: Vec<Entry>,
    stats: CaptureStats,
}

/// Kinds of inputs a capture keeps replays for.
const KEPT: usize = 8;

/// What a replay needs to know of an input: where it lives and how it is read.
#[derive(Clone, Debug, PartialEq)]
struct ArgKind {
    device: Device,
    dtype: DType,
    /// The node's (contiguous) shape: its buffer's size.
    node_dims: Vec<usize>,
    layout: Layout,
    /// The first input with the same node, if another: plans bind it once.
    alias_of: Option<usize>,
}

struct Entry {
    kinds: Vec<ArgKind>,
    state: Stage,
}

enum Stage {
    /// One call traced; the next is compared with it.
    Traced(Trace),
    Ready(Replay),
}

/// One traced call: its realizations, the step's inputs and outputs.
struct Trace {
    log: Vec<Realization>,
    args: Vec<Buffer>,
    outputs: Vec<Tensor>,
}

/// Where a plan's input buffer comes from in a call.
#[derive(Clone, Debug)]
enum Source {
    /// Input `i` of the step.
    Arg(usize),
    /// Output `j` of realization `r` of the same call.
    Produced(usize, usize),
    /// The same buffer every call (a weight, a table).
    Fixed(Buffer),
}

/// One plan to run, with where its inputs come from.
struct Run {
    device: Device,
    plan: Arc<Plan>,
    inputs: Vec<Source>,
    /// Results of earlier runs that no later run or output reads.
    release: Vec<(usize, usize)>,
}

/// One output of the step.
enum Output {
    /// A view of a buffer the call produced or was given.
    Buffer { source: Source, dtype: DType, node_dims: Vec<usize>, layout: Layout, device: Device },
    /// A tensor that is the same every call (neither an input nor computed).
    Same(Tensor),
}

struct Replay {
    runs: Vec<Run>,
    outputs: Vec<Output>,
}

impl<F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>> Capture<F> {
    /// A capture of `step`, which maps the inputs given to [`Capture::call`]
    /// to its outputs.
    pub fn new(step: F) -> Capture<F> {
        Capture { step, entries: Vec::new(), stats: CaptureStats::default() }
    }

    /// Run the step on `inputs`: through the graph on the first two calls
    /// with inputs of this kind (device, dtype, shape, layout), replayed
    /// after that. Inputs are realized first; outputs come back realized.
    pub fn call(&mut self, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Tensor::realize_all(inputs)?;
        let args: Vec<Buffer> = inputs.iter().map(|t| t.value.node.buffer().expect("inputs are realized")).collect();
        let kinds: Vec<ArgKind> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| ArgKind {
                device: t.device(),
                dtype: t.dtype(),
                node_dims: t.value.node.dims.clone(),
                layout: t.value.layout.clone(),
                // By buffer, not node: two nodes can hold one buffer (a replay's outputs).
                alias_of: args[..i].iter().position(|o| o.same(&args[i])),
            })
            .collect();
        // The entry of this kind, if any, moves to the front (most recently used).
        let found = self.entries.iter().position(|e| e.kinds == kinds);
        if let Some(i) = found {
            let e = self.entries.remove(i);
            self.entries.insert(0, e);
            if let Stage::Ready(r) = &self.entries[0].state {
                self.stats.replays += 1;
                return r.run(inputs, &args);
            }
        }
        // Through the graph, traced.
        let trace = self.trace(inputs, args)?;
        let outputs = trace.outputs.clone();
        self.stats.eager_calls += 1;
        match found {
            None => {
                self.entries.insert(0, Entry { kinds, state: Stage::Traced(trace) });
                self.entries.truncate(KEPT);
            }
            Some(_) => {
                let Stage::Traced(first) = std::mem::replace(&mut self.entries[0].state, Stage::Traced(trace)) else {
                    unreachable!("a ready entry replays above")
                };
                let Stage::Traced(second) = &self.entries[0].state else { unreachable!("just stored") };
                match Replay::from_traces(&first, second)? {
                    Some(r) => {
                        self.entries[0].state = Stage::Ready(r);
                        self.stats.captures += 1;
                    }
                    None => self.stats.mismatches += 1,
                }
            }
        }
        Ok(outputs)
    }

    /// What the capture has done so far.
    pub fn stats(&self) -> CaptureStats {
        self.stats
    }

    /// Forget every capture: the next calls run through the graph again.
    pub fn reset(&mut self) {
        self.entries.clear();
    }

    /// Run the step through the graph, logging its realizations.
    fn trace(&mut self, inputs: &[&Tensor], args: Vec<Buffer>) -> Result<Trace> {
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        let log = realize::Log::start()?;
        let outs = (self.step)(&owned)?;
        Tensor::realize_all(&outs.iter().collect::<Vec<_>>())?;
        Ok(Trace { log: log.end(), args, outputs: outs })
    }
}

impl Trace {
    /// Where the buffer `b`, read by realization `r` (or by the step's
    /// outputs when `r` is the number of realizations), comes from.
    fn source(&self, r: usize, b: &Buffer) -> Source {
        if let Some(i) = self.args.iter().position(|a| a.same(b)) {
            return Source::Arg(i);
        }
        for (q, real) in self.log[..r].iter().enumerate().rev() {
            if let Some(j) = real.outputs.iter().position(|o| o.same(b)) {
                return Source::Produced(q, j);
            }
        }
        Source::Fixed(b.clone())
    }
}

impl Replay {
    /// The replay of `second` if it ran the graph that `first` ran; `None`
    /// when the graphs differ; an error when they agree but read host data
    /// or constants that changed between the calls.
    fn from_traces(first: &Trace, second: &Trace) -> Result<Option<Replay>> {
        if first.log.len() != second.log.len() || first.outputs.len() != second.outputs.len() {
            return Ok(None);
        }
        // An input given as the same buffer on both calls cannot be told
        // from a weight the step holds itself: a replay with another input
        // could read it where the step read the weight. Not captured.
        if first.args.iter().zip(&second.args).any(|(a, b)| a.same(b)) {
            return Ok(None);
        }
        let mut runs = Vec::with_capacity(second.log.len());
        for (r, (a, b)) in first.log.iter().zip(&second.log).enumerate() {
            // Plans of one structure share their prepared state (the plan cache's entry).
            if a.device != b.device || !Arc::ptr_eq(&a.plan.prepared, &b.plan.prepared) || a.inputs.len() != b.inputs.len() {
                return Ok(None);
            }
            check_constants(&a.plan, &b.plan)?;
            let mut inputs = Vec::with_capacity(b.inputs.len());
            for (k, (x, y)) in a.inputs.iter().zip(&b.inputs).enumerate() {
                let source = match (first.source(r, x), second.source(r, y)) {
                    (Source::Arg(i), Source::Arg(j)) if i == j => Source::Arg(i),
                    (Source::Produced(p, i), Source::Produced(q, j)) if (p, i) == (q, j) => Source::Produced(p, i),
                    (Source::Fixed(x), Source::Fixed(y)) => {
                        if !x.same(&y) && !same_values(b.device, &b.plan, k, &x, &y)? {
                            return Ok(None);
                        }
                        Source::Fixed(y)
                    }
                    _ => return Ok(None),
                };
                inputs.push(source);
            }
            runs.push(Run { device: b.device, plan: b.plan.clone(), inputs, release: vec![] });
        }
        let end = second.log.len();
        let mut outputs = Vec::with_capacity(second.outputs.len());
        for (x, y) in first.outputs.iter().zip(&second.outputs) {
            let (bx, by) = (x.value.node.buffer().expect("outputs are realized"), y.value.node.buffer().expect("outputs are realized"));
            let out = |source| Output::Buffer { source, dtype: y.dtype(), node_dims: y.value.node.dims.clone(), layout: y.value.layout.clone(), device: y.device() };
            let same_view = x.value.layout == y.value.layout && x.value.node.dims == y.value.node.dims;
            outputs.push(match (first.source(end, &bx), second.source(end, &by)) {
                (Source::Arg(i), Source::Arg(j)) if i == j && same_view => out(Source::Arg(i)),
                (Source::Produced(p, i), Source::Produced(q, j)) if (p, i) == (q, j) && same_view => out(Source::Produced(p, i)),
                (Source::Fixed(_), Source::Fixed(_)) if Arc::ptr_eq(&x.value.node, &y.value.node) && same_view => Output::Same(y.clone()),
                (Source::Fixed(_), Source::Fixed(_)) => {
                    bail!(Value, "capture", "output {} is a tensor the step neither computes nor takes as an input, and it differs between calls: pass it as an input", outputs.len())
                }
                _ => return Ok(None),
            });
        }
        // Each result is released after the last run that reads it, unless an output is a view of it.
        let mut last: std::collections::HashMap<(usize, usize), usize> = Default::default();
        for (r, run) in runs.iter().enumerate() {
            for s in &run.inputs {
                if let Source::Produced(p, j) = s {
                    last.insert((*p, *j), r);
                }
            }
        }
        for o in &outputs {
            if let Output::Buffer { source: Source::Produced(p, j), .. } = o {
                last.remove(&(*p, *j));
            }
        }
        for (key, r) in last {
            runs[r].release.push(key);
        }
        Ok(Some(Replay { runs, outputs }))
    }

    /// Run the captured plans with `args` as the step's input buffers.
    fn run(&self, inputs: &[&Tensor], args: &[Buffer]) -> Result<Vec<Tensor>> {
        let mut produced: Vec<Vec<Option<Buffer>>> = Vec::with_capacity(self.runs.len());
        let fetch = |produced: &Vec<Vec<Option<Buffer>>>, s: &Source| -> Buffer {
            match s {
                Source::Arg(i) => args[*i].clone(),
                Source::Produced(r, j) => produced[*r][*j].clone().expect("a result is kept until its last reader"),
                Source::Fixed(b) => b.clone(),
            }
        };
        for run in &self.runs {
            let bufs: Vec<Buffer> = run.inputs.iter().map(|s| fetch(&produced, s)).collect();
            let outs = realize::replay(run.device, &run.plan, &bufs)?;
            produced.push(outs.into_iter().map(Some).collect());
            for &(r, j) in &run.release {
                produced[r][j] = None;
            }
        }
        Ok(self
            .outputs
            .iter()
            .map(|o| match o {
                Output::Same(t) => t.clone(),
                Output::Buffer { source: Source::Arg(i), layout, .. } => inputs[*i].with_layout(layout.clone()),
                Output::Buffer { source, dtype, node_dims, layout, device } => {
                    let node = Node::new(State::Realized(fetch(&produced, source)), *dtype, *device, node_dims.clone(), 0);
                    Tensor { value: Value { node, layout: layout.clone() }, grad: None }
                }
            })
            .collect())
    }
}

/// Error unless the constants of two plans of one structure are equal.
fn check_constants(a: &Plan, b: &Plan) -> Result<()> {
    for (ka, kb) in a.kernels.iter().zip(&b.kernels) {
        let (ca, cb) = (ka.kind.consts(), kb.kind.consts());
        if let Some((x, y)) = ca.iter().zip(&cb).find(|(x, y)| x.0.to_bits() != y.0.to_bits()) {
            bail!(
                Value,
                "capture",
                "a constant of the step's {} kernel was {} on one call and {} on the next: a number that changes per call must reach the step as a tensor input",
                kb.ops.join(" "),
                x.0,
                y.0
            );
        }
    }
    Ok(())
}

/// Whether input `k` of `plan` holds the same values in buffers `x` and
/// `y`: an error when it does not, `false` where it cannot be known (no
/// blocking reads in a browser).
fn same_values(device: Device, plan: &Plan, k: usize, x: &Buffer, y: &Buffer) -> Result<bool> {
    if cfg!(target_arch = "wasm32") && device.is_gpu() {
        return Ok(false);
    }
    let Some(slot) = plan.slots.iter().find(|s| s.source == SlotSource::Input(k)) else {
        return Ok(true);
    };
    let exec = executor(device)?;
    let layout = Layout::contiguous(&[slot.numel]);
    let read = |b: &Buffer| -> Result<Vec<u64>> {
        let v = crate::backend::read_follows(|| exec.read_start(b, &layout))?.wait()?;
        let s = v.storage();
        Ok((0..slot.numel).map(|i| s.get_f64(i).to_bits()).collect())
    };
    if read(x)? != read(y)? {
        bail!(
            Value,
            "capture",
            "the step reads a tensor of {} {} values that it neither takes as an input nor computes, and its values changed between calls (host data uploaded inside the step, or state the step updates): pass it as an input",
            slot.numel,
            slot.dtype
        );
    }
    Ok(true)
}
