//! Host time per phase of realization, for `VOLTAIC_PROFILE` and benchmarks.
//!
//! Every realization passes through the same phases: the graph is
//! *recorded* (ops build nodes, between realizations), the pending part is
//! *collected*, *scheduled* into a plan (or taken from the plan cache),
//! its kernels *compiled* (or found compiled), *encoded* into a command
//! buffer, *submitted*, and a read *waits* for the device. On the CPU the
//! kernels run on the calling thread: that time is *execute*. The counters
//! are always kept (a clock read per phase); [`host_profile`] returns their
//! totals, and with `VOLTAIC_PROFILE=1` each realization prints its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use web_time::Instant;

/// Whether `VOLTAIC_PROFILE` asks for profiles (read once).
pub(crate) fn enabled() -> bool {
    mode().is_some()
}

/// How GPU kernels are timed under `VOLTAIC_PROFILE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuTiming {
    /// `VOLTAIC_PROFILE=1`: a pass per kernel, each bracketed by timestamps.
    /// Tells kernels apart, but every kernel pays a pass's start and drain.
    PerKernel,
    /// `VOLTAIC_PROFILE=pass`: the realization's kernels in one pass, as
    /// they run unprofiled, bracketed once: what the device really spends
    /// on the realization, launches and barriers between kernels included.
    Pass,
    /// `VOLTAIC_PROFILE=dispatch`: the kernels in one pass as they run
    /// unprofiled, with a timestamp after each kernel (where the adapter
    /// has `TIMESTAMP_QUERY_INSIDE_PASSES`; a pass per kernel elsewhere). A
    /// kernel's time runs from the end of the one before it, so it holds its
    /// launch and the barrier it waits on, and the times add up to the pass's.
    Dispatch,
}

/// The timing `VOLTAIC_PROFILE` asks for, if any (read once).
pub(crate) fn mode() -> Option<GpuTiming> {
    static MODE: std::sync::OnceLock<Option<GpuTiming>> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("VOLTAIC_PROFILE").ok()?.as_str() {
        "" | "0" => None,
        "pass" => Some(GpuTiming::Pass),
        "dispatch" => Some(GpuTiming::Dispatch),
        _ => Some(GpuTiming::PerKernel),
    })
}

/// A phase of the host's work on a realization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Record,
    Collect,
    Schedule,
    Compile,
    Encode,
    Submit,
    Wait,
    Execute,
}

const PHASES: [(Phase, &str); 8] = [
    (Phase::Record, "record"),
    (Phase::Collect, "collect"),
    (Phase::Schedule, "schedule"),
    (Phase::Compile, "compile"),
    (Phase::Encode, "encode"),
    (Phase::Submit, "submit"),
    (Phase::Wait, "wait"),
    (Phase::Execute, "execute"),
];

static TOTAL_NS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
static REALIZATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The time phases took on this thread so far, ns: what a gap between
    /// two realizations of this thread spent on other phases (a read's
    /// wait and the submission of its copy), not recording. Per thread, as
    /// background threads (compiling ahead, submitting) time phases too.
    static TIMED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Add `d` to `phase`.
pub(crate) fn add(phase: Phase, d: Duration) {
    let ns = d.as_nanos() as u64;
    TOTAL_NS[phase as usize].fetch_add(ns, Ordering::Relaxed);
    TIMED_HERE.with(|t| t.set(t.get() + ns));
}

/// Time `f` as `phase`.
pub(crate) fn time<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    add(phase, t.elapsed());
    out
}

/// Time `f` as `phase`, less the time it spent in other phases.
pub(crate) fn exclusive<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let before: u64 = totals().iter().sum();
    let t = Instant::now();
    let out = f();
    let inner = totals().iter().sum::<u64>() - before;
    add(phase, t.elapsed().saturating_sub(Duration::from_nanos(inner)));
    out
}

fn totals() -> [u64; 8] {
    std::array::from_fn(|i| TOTAL_NS[i].load(Ordering::Relaxed))
}

/// What the last realization left behind: when it ended, and the totals
/// then, and the thread that ran it with the time its phases had taken.
struct Mark {
    end: Option<Instant>,
    totals: [u64; 8],
    thread: Option<std::thread::ThreadId>,
    timed_here: u64,
}

static MARK: Mutex<Mark> = Mutex::new(Mark { end: None, totals: [0; 8], thread: None, timed_here: 0 });

/// Graph nodes recorded so far.
static NODES: AtomicU64 = AtomicU64::new(0);

/// The graph recorded a node (counted for [`HostProfile::nodes`]).
pub(crate) fn node_recorded() {
    NODES.fetch_add(1, Ordering::Relaxed);
}

/// A realization starts: the host time since the last one ended, less what
/// other phases took in between (a read's wait and its copy's submission),
/// was spent recording the graph. After a realization of another thread,
/// only the waits are known to be this one's.
pub(crate) fn realization_starts() {
    let now = Instant::now();
    let mark = MARK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(end) = mark.end {
        let gap = now.duration_since(end).as_nanos() as u64;
        let timed = if mark.thread == Some(std::thread::current().id()) {
            TIMED_HERE.with(|t| t.get()) - mark.timed_here
        } else {
            totals()[Phase::Wait as usize] - mark.totals[Phase::Wait as usize]
        };
        TOTAL_NS[Phase::Record as usize].fetch_add(gap.saturating_sub(timed), Ordering::Relaxed);
    }
}

/// A realization ended; with `VOLTAIC_PROFILE`, print the host time per
/// phase since the previous line (so a read's wait appears on the next one).
/// `plan` says where the plan came from (`new plan`, `cached plan`,
/// `replayed plan`).
pub(crate) fn realization_ends(device: crate::Device, plan: &str) {
    REALIZATIONS.fetch_add(1, Ordering::Relaxed);
    let now = totals();
    let mut mark = MARK.lock().unwrap_or_else(|e| e.into_inner());
    if enabled() {
        let parts: Vec<String> = PHASES
            .iter()
            .filter(|(p, _)| *p != Phase::Execute || now[*p as usize] != mark.totals[*p as usize])
            .map(|(p, name)| format!("{name} {:.1}", (now[*p as usize] - mark.totals[*p as usize]) as f64 / 1e3))
            .collect();
        eprintln!("voltaic host ({device}, {plan}), us: {}", parts.join(", "));
    }
    mark.totals = now;
    mark.thread = Some(std::thread::current().id());
    mark.timed_here = TIMED_HERE.with(|t| t.get());
    mark.end = Some(Instant::now());
}

/// Host time per phase summed over every realization so far (see the
/// module docs of `profile`): microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostProfile {
    /// Realizations so far.
    pub realizations: u64,
    /// Graph nodes recorded so far (each op on a tensor records one; views
    /// record none).
    pub nodes: u64,
    /// Host time between realizations, less reads' waits: building the graph.
    pub record_us: f64,
    /// Collecting the pending graph and computing its structure key.
    pub collect_us: f64,
    /// Scheduling, or taking the plan from the plan cache.
    pub schedule_us: f64,
    /// Generating and compiling kernels, choosing matmul variants.
    pub compile_us: f64,
    /// Allocating buffers, binding and recording dispatches.
    pub encode_us: f64,
    /// Handing command buffers to the queue.
    pub submit_us: f64,
    /// Waiting for the device (reads, back-pressure).
    pub wait_us: f64,
    /// Running kernels on the host (the CPU executor).
    pub execute_us: f64,
}

impl HostProfile {
    /// The time from `earlier` to `self`, per phase.
    pub fn since(&self, earlier: &HostProfile) -> HostProfile {
        HostProfile {
            realizations: self.realizations - earlier.realizations,
            nodes: self.nodes - earlier.nodes,
            record_us: self.record_us - earlier.record_us,
            collect_us: self.collect_us - earlier.collect_us,
            schedule_us: self.schedule_us - earlier.schedule_us,
            compile_us: self.compile_us - earlier.compile_us,
            encode_us: self.encode_us - earlier.encode_us,
            submit_us: self.submit_us - earlier.submit_us,
            wait_us: self.wait_us - earlier.wait_us,
            execute_us: self.execute_us - earlier.execute_us,
        }
    }

    /// The phases as (name, microseconds), in order.
    pub fn phases(&self) -> [(&'static str, f64); 8] {
        [
            ("record", self.record_us),
            ("collect", self.collect_us),
            ("schedule", self.schedule_us),
            ("compile", self.compile_us),
            ("encode", self.encode_us),
            ("submit", self.submit_us),
            ("wait", self.wait_us),
            ("execute", self.execute_us),
        ]
    }
}

/// Host time per phase summed over every realization of the process so far.
pub fn host_profile() -> HostProfile {
    let t = totals();
    let us = |p: Phase| t[p as usize] as f64 / 1e3;
    HostProfile {
        realizations: REALIZATIONS.load(Ordering::Relaxed),
        nodes: NODES.load(Ordering::Relaxed),
        record_us: us(Phase::Record),
        collect_us: us(Phase::Collect),
        schedule_us: us(Phase::Schedule),
        compile_us: us(Phase::Compile),
        encode_us: us(Phase::Encode),
        submit_us: us(Phase::Submit),
        wait_us: us(Phase::Wait),
        execute_us: us(Phase::Execute),
    }
}
