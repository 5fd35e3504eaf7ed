//! One wgpu device: what the adapter can do, the pipeline cache, the buffer
//! pool, and how its failures become [`Error`](crate::Error) values.

use super::pool::Pool;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What Voltaic uses of an adapter, read once when the device is opened.
#[derive(Clone, Debug)]
pub(crate) struct Caps {
    /// `SHADER_F16`: f16 storage and arithmetic in shaders.
    pub f16: bool,
    /// The device's stores of f32 values to f16 buffers (scalar and vec4)
    /// round to nearest even with subnormals kept and overflow to infinity,
    /// as the CPU does (checked by `halfmath::probe` when the device
    /// opens): an f16 result that is only stored is rounded by the store.
    pub half_store: bool,
    /// The device's own f16 additions, subtractions and multiplications of
    /// halves held in f32 values round as the CPU does (the same probe):
    /// kernels use them instead of rounding the result on its bits.
    pub half_math: bool,
    /// `TIMESTAMP_QUERY`: per-kernel GPU times for `VOLTAIC_PROFILE`.
    pub timestamps: bool,
    /// Largest byte range one storage binding may cover.
    pub max_binding: u64,
    /// Largest buffer the device can create.
    pub max_buffer: u64,
    /// Storage buffers one shader may bind.
    pub max_storage_buffers: u32,
    /// Alignment of a binding's offset.
    pub offset_align: u64,
    /// Workgroups per dispatch dimension.
    pub max_groups: u32,
    /// Workgroup shared memory in bytes.
    pub workgroup_storage: u32,
    /// Invocations one workgroup may have.
    pub max_invocations: u32,
    /// Cooperative matrices (tensor cores) of 16x16x16 f16 with f32
    /// accumulation, on subgroups of 32.
    pub coop_f16: bool,
    /// A software adapter (lavapipe, llvmpipe): invocations run on CPU
    /// threads, where a workgroup barrier costs a coroutine switch per
    /// invocation, so kernels that can do without one prefer to.
    /// `VOLTAIC_KERNELS=hardware` gives a software adapter the kernels of a
    /// hardware one (so the tests check those here too).
    pub software: bool,
    /// Threads per subgroup, where the device has subgroup operations and
    /// every subgroup of the adapter has the same size (a power of two):
    /// reductions then combine a subgroup's values by shuffles, without
    /// workgroup memory or barriers (`Reduction::segment_fold`). `None`
    /// elsewhere, and with `VOLTAIC_SUBGROUPS=0` (to measure them).
    pub subgroup: Option<u32>,
}

/// The subgroup size folds may rely on (see [`Caps::subgroup`]).
pub(crate) fn fold_subgroup(info: &wgpu::AdapterInfo, features: wgpu::Features) -> Option<u32> {
    let on = std::env::var("VOLTAIC_SUBGROUPS").map_or(true, |v| v != "0");
    let size = info.subgroup_min_size;
    (on && features.contains(wgpu::Features::SUBGROUP) && size == info.subgroup_max_size && size.is_power_of_two() && (4..=128).contains(&size)).then_some(size)
}

/// Whether `VOLTAIC_KERNELS=hardware` asks for hardware kernels on a software adapter.
fn hardware_kernels() -> bool {
    std::env::var("VOLTAIC_KERNELS").is_ok_and(|v| v == "hardware")
}

impl Caps {
    /// The most buffers the scheduler lets one kernel read: the storage
    /// bindings a shader may have, less the output, the constants, the
    /// index-error flag and a matmul's two scratch buffers.
    pub fn max_inputs(&self) -> usize {
        (self.max_storage_buffers as usize).saturating_sub(5).max(3)
    }

    /// Bytes one binding chunk of a large buffer covers: the largest
    /// multiple of the offset alignment that fits in one binding.
    pub fn chunk_bytes(&self) -> u64 {
        (self.max_binding / self.offset_align) * self.offset_align
    }
}

/// Submissions allowed in flight before the host waits for the oldest, so a
/// loop that never reads cannot queue unbounded work (and memory).
/// `VOLTAIC_MAX_IN_FLIGHT` overrides it (for measurements).
fn max_in_flight() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("VOLTAIC_MAX_IN_FLIGHT").ok().and_then(|v| v.parse().ok()).filter(|&n| n >= 1).unwrap_or(8))
}

/// Dispatches of small realizations that share one command buffer before it
/// is submitted (`VOLTAIC_BATCH_DISPATCHES`; 1 submits every realization).
fn batch_dispatches() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("VOLTAIC_BATCH_DISPATCHES").ok().and_then(|v| v.parse().ok()).unwrap_or(64).max(1))
}

/// Whether a batch held back by a gate is finished in parts while it waits
/// (see `encode_pending`; `VOLTAIC_GATED_PARTS=0`: all of it when the gate
/// opens).
fn gated_parts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_GATED_PARTS").map_or(true, |v| v != "0"))
}

/// Dispatches an idle GPU gets from the thread that recorded them rather
/// than through the submitting thread: waking that thread delays the GPU by
/// more than submitting a few dispatches costs here (on an H200, a small
/// realization read afterwards took 66-75 us handed over, 46-57 submitted
/// here).
const INLINE_SUBMIT_DISPATCHES: usize = 8;

/// Freed bytes held back from reuse (see `Pool`) past which pending work is
/// submitted, so batching never costs much memory.
const MAX_DEFERRED_BYTES: u64 = 64 << 20;

/// Small realizations encoded but not yet submitted: one command buffer and
/// one compute pass that later realizations append to. Submitting costs the
/// host more than a small kernel costs the GPU, so a loop of small
/// realizations submits once per batch; any read, wait or other submission
/// submits this first.
struct Pending {
    encoder: wgpu::CommandEncoder,
    pass: Option<wgpu::ComputePass<'static>>,
    dispatches: usize,
    /// Command buffers finished while a gate held the batch back, in order
    /// before `encoder`'s (see `encode_pending`).
    finished: Vec<wgpu::CommandBuffer>,
    /// `dispatches` when the last of them was finished.
    finished_dispatches: usize,
    /// Upload staging buffers the recorded copies read: mapped again for
    /// the next upload once this work is submitted (see `record_upload`).
    uploads: Vec<wgpu::Buffer>,
    /// Copies recorded from staging that another thread still writes
    /// (see `record_upload_later`): nothing is submitted before they open.
    gates: Vec<Arc<Gate>>,
    /// The batch's number (see `Pool::defer`).
    batch: u64,
}

impl Pending {
    fn new(encoder: wgpu::CommandEncoder, batch: u64) -> Pending {
        Pending { encoder, pass: None, dispatches: 0, finished: Vec::new(), finished_dispatches: 0, uploads: Vec::new(), gates: Vec::new(), batch }
    }

    /// Whether a copy in this batch still waits for its values.
    fn gated(&self) -> bool {
        self.gates.iter().any(|g| !g.is_open())
    }
}

/// Opened once by the thread that writes an upload's staging memory (and
/// unmaps it); a submission that carries the upload's copy waits for it.
#[derive(Default)]
pub(crate) struct Gate {
    open: Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gate {
    pub(crate) fn open(&self) {
        *self.open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.opened.notify_all();
    }

    fn is_open(&self) -> bool {
        *self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A thread that submits the batches `encode_pending` fills, so the thread
/// that records them goes on recording: wgpu does most of its work on a
/// command buffer (validating each dispatch, tracking its buffers, placing
/// barriers) when the buffer is finished, about 1.5-2 us a dispatch on the
/// H100's hosts, as much as Voltaic's own encoding. Batches reach the queue
/// in the order they were handed over, and every other submission waits
/// for those handed over before it (`GpuContext::drain`), so the queue
/// sees the same order as when one thread submitted everything.
/// `VOLTAIC_SUBMIT_THREAD=0` submits on the recording thread.
struct Submitter {
    /// At most one batch waits while another is submitted: a thread that
    /// records faster than batches are submitted waits here, not later.
    jobs: std::sync::mpsc::SyncSender<Pending>,
    handed: Arc<(Mutex<Handed>, std::sync::Condvar)>,
}

/// Batches handed to the [`Submitter`] and submitted, and its first error.
#[derive(Default)]
struct Handed {
    sent: u64,
    done: u64,
    error: Option<Error>,
    /// The newest batches the submitter finished with, oldest first: their
    /// submission's index, or `None` where it failed (for reads of them;
    /// see [`Ticket`]).
    submitted: std::collections::VecDeque<(u64, Option<wgpu::SubmissionIndex>)>,
}

/// Batches whose submissions [`Handed::submitted`] remembers.
const REMEMBERED_SUBMISSIONS: usize = 64;

/// Where work handed over for submission is: submitted, or in a batch the
/// submitting thread has yet to submit ([`GpuContext::submission_of`]).
pub(crate) enum Ticket {
    Submitted(wgpu::SubmissionIndex),
    Handed(u64),
}

/// Freed bytes a batch that waits on a gate may hold back (see
/// `MAX_DEFERRED_BYTES`): an optimizer step recorded behind a gradient
/// that has not arrived frees the old parameters and moments, and a
/// submission forced by them would stall the thread that records it.
const MAX_GATED_DEFERRED_BYTES: u64 = 1 << 30;

/// Upload staging kept mapped for reuse, at most this many bytes.
const KEPT_UPLOAD_BYTES: u64 = 256 << 20;

impl Pending {
    /// The batch's command buffers, in order.
    fn finish(mut self) -> Vec<wgpu::CommandBuffer> {
        drop(self.pass.take());
        self.finished.push(self.encoder.finish());
        self.finished
    }

    /// Finish the commands so far into a command buffer of their own and go
    /// on in a new encoder from `device`.
    fn finish_part(&mut self, device: &wgpu::Device) {
        drop(self.pass.take());
        let encoder = std::mem::replace(&mut self.encoder, device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("voltaic") }));
        self.finished.push(encoder.finish());
        self.finished_dispatches = self.dispatches;
    }
}

/// How long a wait checks the device without blocking before it sleeps
/// (`VOLTAIC_SPIN_WAIT_US` overrides it; 0 sleeps at once).
fn spin_wait() -> std::time::Duration {
    static D: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        let us = std::env::var("VOLTAIC_SPIN_WAIT_US").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
        std::time::Duration::from_micros(us)
    })
}

/// Whether pipelines are compiled through the driver pipeline cache that
/// Voltaic keeps on disk (`VOLTAIC_PIPELINE_CACHE=0` turns it off).
fn pipeline_cache_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_PIPELINE_CACHE").map_or(true, |v| v != "0"))
}

/// Whether `VOLTAIC_COMPILE_LOG` asks for a line per compiled pipeline
/// (`source`: with its WGSL).
fn compile_log() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_COMPILE_LOG").is_ok_and(|v| !v.is_empty() && v != "0"))
}

fn compile_log_source() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_COMPILE_LOG").is_ok_and(|v| v == "source"))
}

/// An open wgpu device with everything Voltaic keeps per device.
pub(crate) struct GpuContext {
    pub index: usize,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub caps: Caps,
    pub pool: Arc<Mutex<Pool>>,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    pipeline_cache: Option<wgpu::PipelineCache>,
    /// Set by the device-lost callback.
    lost: Arc<Mutex<Option<String>>>,
    /// Errors that escaped every error scope (kept, never panicked on).
    uncaptured: Arc<Mutex<Vec<String>>>,
    in_flight: Mutex<VecDeque<wgpu::SubmissionIndex>>,
    /// Submissions the device has finished (counted by callbacks that run
    /// when the device is polled).
    finished: Arc<AtomicU64>,
    pending: Mutex<Option<Pending>>,
    /// Batches begun so far (the last one's number).
    batches: AtomicU64,
    /// Where full batches go to be submitted (native targets).
    submitter: std::sync::OnceLock<Submitter>,
    /// A small buffer that index kernels flag out-of-range indices in; read
    /// with every transfer to the host.
    pub index_error: wgpu::Buffer,
    /// Atomic counters that kernels leave at zero (`Shader::counters`);
    /// zero when made, as every wgpu buffer is.
    pub counters: wgpu::Buffer,
    /// Mappable buffers kept for reading results back.
    pub staging: Mutex<Vec<wgpu::Buffer>>,
    /// Upload staging buffers, mapped and ready to be written (see
    /// `record_upload`).
    pub upload_staging: Arc<Mutex<Vec<wgpu::Buffer>>>,
    /// Compiled kernels by signature (see `exec::compile`).
    pub compiled_kernels: Mutex<super::exec::KernelCache>,
    /// Signatures (hashes) of kernels being compiled now, so that a second
    /// thread that needs one waits for it instead of compiling it again.
    pub compiling: (Mutex<std::collections::HashSet<u64>>, std::sync::Condvar),
    /// Matmul plans chosen by measurement.
    pub tuner: super::autotune::Tuner,
    /// Where the driver's pipeline cache is kept between runs.
    pipeline_cache_file: Option<std::path::PathBuf>,
    last_cache_save: Mutex<Option<web_time::Instant>>,
    /// What `halfmath::probe` found (`Caps::half_store`, `Caps::half_math`),
    /// with why each is refused.
    pub half_probe: super::halfmath::HalfProbe,
    /// Pipelines compiled, submissions and dispatches so far (for tests and profiles).
    pub compiled: AtomicU64,
    pub submissions: AtomicU64,
    pub dispatches: AtomicU64,
    pub bind_groups: AtomicU64,
}

/// Say why a device keeps rounding half results in software, once, where
/// the compile log is on (the probe's refusal is a property of the driver,
/// not an error).
fn log_half_probe(index: usize, info: &wgpu::AdapterInfo, what: &str, why: &str) {
    if compile_log() {
        eprintln!("voltaic: gpu:{index} ({}): f16 {what} rounded in software: {why}", info.name);
    }
}

/// Whether Voltaic runs f16 products on the adapter's tensor cores: through
/// cooperative matrices, where it offers 16x16x16 f16 with f32
/// accumulation on subgroups of 32 (the layout the kernel assumes).
/// VOLTAIC_COOP=0 turns them off.
pub(crate) fn tensor_cores(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    adapter.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && std::env::var("VOLTAIC_COOP").map(|v| v != "0").unwrap_or(true)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == wgpu::CooperativeScalarType::F16 && p.cr_type == wgpu::CooperativeScalarType::F32
        })
}

impl GpuContext {
    /// Open a device on `adapter`, asking for every limit it offers and the
    /// features Voltaic can use.
    pub(crate) async fn open(index: usize, adapter: &wgpu::Adapter) -> Result<GpuContext> {
        let info = adapter.get_info();
        let have = adapter.features();
        let coop = tensor_cores(adapter);
        let wanted = wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
            | wgpu::Features::PIPELINE_CACHE;
        let mut features = have & wanted;
        if coop {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("voltaic"),
            required_features: features,
            required_limits: limits.clone(),
            // SAFETY: the experimental feature is only the cooperative matrix
            // extension, used by one kernel that the tests check on such adapters.
            experimental_features: if coop { unsafe { wgpu::ExperimentalFeatures::enabled() } } else { wgpu::ExperimentalFeatures::disabled() },
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) = adapter
            .request_device(&desc)
            .await
            .map_err(|e| Error::Backend(format!("gpu:{index} ({}): cannot open the device: {e}", info.name)))?;
        let lost = Arc::new(Mutex::new(None));
        let l2 = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            *l2.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{reason:?}: {msg}"));
        });
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let u2 = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            u2.lock().unwrap_or_else(|p| p.into_inner()).push(e.to_string());
        }));
        let f16 = features.contains(wgpu::Features::SHADER_F16);
        // A browser answers only through promises, which this opener does
        // not wait for: there the software rounding stays.
        #[cfg(not(target_arch = "wasm32"))]
        let half_probe = if f16 { super::halfmath::probe(&device, &queue) } else { super::halfmath::HalfProbe::refused("no SHADER_F16") };
        #[cfg(target_arch = "wasm32")]
        let half_probe = super::halfmath::HalfProbe::refused("not probed in a browser");
        for (what, r) in [("stores", &half_probe.stores), ("arithmetic", &half_probe.math)] {
            if let Err(why) = r {
                log_half_probe(index, &info, what, why);
            }
        }
        let caps = Caps {
            f16,
            half_store: half_probe.stores.is_ok(),
            half_math: half_probe.math.is_ok(),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            max_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
            max_buffer: limits.max_buffer_size,
            max_storage_buffers: limits.max_storage_buffers_per_shader_stage,
            offset_align: limits.min_storage_buffer_offset_alignment.max(4) as u64,
            max_groups: limits.max_compute_workgroups_per_dimension,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            coop_f16: coop && features.contains(wgpu::Features::SHADER_F16),
            software: info.device_type == wgpu::DeviceType::Cpu && !hardware_kernels(),
            subgroup: fold_subgroup(&info, features),
        };
        let pipeline_cache_file = wgpu::util::pipeline_cache_key(&info)
            .and_then(|k| Some(crate::files::cache_dir()?.join(format!("{k}-{}.bin", super::autotune::device_tag(&info)))));
        let pipeline_cache = features.contains(wgpu::Features::PIPELINE_CACHE).then(|| {
            let data = pipeline_cache_file.as_ref().and_then(|f| std::fs::read(f).ok());
            // SAFETY: the data, if any, is what `get_data` returned for this
            // adapter and driver in an earlier run (the file name holds both);
            // with `fallback` the driver drops data it does not accept.
            unsafe {
                device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                    label: Some("voltaic"),
                    data: data.as_deref(),
                    fallback: true,
                })
            }
        });
        let index_error = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("voltaic index errors"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let counters = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("voltaic counters"),
            size: 4 * super::codegen::COUNTERS as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Ok(GpuContext {
            compiled_kernels: Mutex::new(HashMap::new()),
            compiling: Default::default(),
            staging: Mutex::new(Vec::new()),
            upload_staging: Arc::new(Mutex::new(Vec::new())),
            tuner: super::autotune::Tuner::new(&info),
            pipeline_cache_file,
            last_cache_save: Mutex::new(None),
            index,
            half_probe,
            pool: Arc::new(Mutex::new(Pool::new(caps.max_buffer))),
            device,
            queue,
            info,
            caps,
            pipelines: Mutex::new(HashMap::new()),
            pipeline_cache,
            lost,
            uncaptured,
            in_flight: Mutex::new(VecDeque::new()),
            finished: Arc::new(AtomicU64::new(0)),
            pending: Mutex::new(None),
            batches: AtomicU64::new(0),
            submitter: std::sync::OnceLock::new(),
            index_error,
            counters,
            compiled: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            bind_groups: AtomicU64::new(0),
        })
    }

    /// `Err` once the device is lost: nothing more can run on it.
    pub(crate) fn check_alive(&self) -> Result<()> {
        if let Some(why) = self.lost.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Err(Error::Backend(format!("gpu:{} ({}) was lost: {why}", self.index, self.info.name)));
        }
        Ok(())
    }

    /// The compute pipeline for a WGSL source, compiled once per device.
    /// `read_only` gives each binding's access; the layout is explicit so
    /// that a binding the shader happens not to use is still accepted.
    /// `label` names the kernel in the compile log.
    pub(crate) fn pipeline(&self, source: &str, read_only: &[bool], label: &str) -> Result<Arc<wgpu::ComputePipeline>> {
        if let Some(p) = self.pipelines.lock().unwrap_or_else(|e| e.into_inner()).get(source) {
            return Ok(p.clone());
        }
        let started = web_time::Instant::now();
        let (p, err) = self.scoped(|| {
            // SAFETY: every index a generated kernel computes is in bounds by
            // construction (index tensors are checked in the kernel), and its
            // loops are bounded; naga's per-access clamping and loop counters
            // would only cost time. Storage buffers keep the driver's robust
            // access where the adapter has it.
            let module = unsafe {
                self.device.create_shader_module_trusted(
                    wgpu::ShaderModuleDescriptor { label: None, source: wgpu::ShaderSource::Wgsl(source.into()) },
                    wgpu::ShaderRuntimeChecks::unchecked(),
                )
            };
            let entries: Vec<wgpu::BindGroupLayoutEntry> = read_only
                .iter()
                .enumerate()
                .map(|(i, &ro)| wgpu::BindGroupLayoutEntry {
                    binding: i as u32,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: ro },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                })
                .collect();
            let bgl = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries });
            let layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: None,
                bind_group_layouts: &[Some(&bgl)],
                immediate_size: 0,
            });
            let p = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: None,
                layout: Some(&layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: if pipeline_cache_on() { self.pipeline_cache.as_ref() } else { None },
            });
            // A driver that fails to compile the shader (seen on the H100:
            // "NVVM compilation failed") leaves an invalid pipeline without an
            // error here; touching it raises one inside this scope, so the
            // failure is this kernel's, not the next operation's.
            let _ = p.get_bind_group_layout(0);
            p
        });
        if let Some(e) = err {
            return Err(Error::Backend(format!("the driver of gpu:{} refused the kernel: {}", self.index, short_error(&e.to_string(), source))));
        }
        self.compiled.fetch_add(1, Ordering::Relaxed);
        if compile_log() {
            eprintln!("voltaic compile: {:.1} ms, {} bytes of WGSL: {}", started.elapsed().as_secs_f64() * 1e3, source.len(), label);
            if compile_log_source() {
                eprintln!("{source}\nvoltaic compile: end of {label}");
            }
        }
        self.save_pipeline_cache(false);
        let p = Arc::new(p);
        self.pipelines.lock().unwrap_or_else(|e| e.into_inner()).insert(source.to_string(), p.clone());
        Ok(p)
    }

    /// Write the driver's pipeline cache to disk (at most every few seconds
    /// unless `now`), so the next run skips compiling.
    pub(crate) fn save_pipeline_cache(&self, now: bool) {
        let (Some(cache), Some(file)) = (&self.pipeline_cache, &self.pipeline_cache_file) else { return };
        let mut last = self.last_cache_save.lock().unwrap_or_else(|e| e.into_inner());
        if !now && last.is_some_and(|t| t.elapsed().as_secs_f64() < 5.0) {
            return;
        }
        *last = Some(web_time::Instant::now());
        if let Some(data) = cache.get_data() {
            // A cache that cannot be written only costs compile time later.
            let _ = crate::files::write_atomic(file, &data);
        }
    }

    /// Run `f` inside error scopes for out-of-memory, validation and internal
    /// errors, returning its value and the first error raised.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn scoped<T>(&self, f: impl FnOnce() -> T) -> (T, Option<Error>) {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let int = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let out = f();
        let e_int = pollster::block_on(int.pop());
        let e_val = pollster::block_on(val.pop());
        let e_oom = pollster::block_on(oom.pop());
        let err = match (e_oom, e_val, e_int) {
            (Some(e), _, _) => Some(Error::OutOfMemory(format!("gpu:{}: {e}", self.index))),
            (_, Some(e), _) | (_, _, Some(e)) => Some(Error::Backend(format!("gpu:{}: {e}", self.index))),
            _ => None,
        };
        (out, err.or_else(|| self.take_uncaptured()))
    }

    /// Run `f`, returning its value and any error reported so far. A browser
    /// answers error scopes through promises, which this synchronous caller
    /// cannot wait for: there, errors arrive through the uncaptured-error
    /// handler, a little later (by the next read at the latest).
    #[cfg(target_arch = "wasm32")]
    pub(crate) fn scoped<T>(&self, f: impl FnOnce() -> T) -> (T, Option<Error>) {
        let out = f();
        (out, self.take_uncaptured())
    }

    /// An error that escaped every error scope since the last call, if any.
    pub(crate) fn take_uncaptured(&self) -> Option<Error> {
        let mut u = self.uncaptured.lock().unwrap_or_else(|e| e.into_inner());
        if u.is_empty() {
            return None;
        }
        let msg = u.join("; ");
        u.clear();
        Some(Error::Backend(format!("gpu:{}: {msg}", self.index)))
    }

    /// Append dispatches to the pending command buffer (`encode` records
    /// them into its compute pass); submits it when `now` (large work, which
    /// should start at once), when the GPU has nothing else to do (as of the
    /// last poll), when the batch is full, or when too much memory waits on it.
    pub(crate) fn encode_pending(&self, dispatches: usize, now: bool, encode: impl FnOnce(&mut wgpu::ComputePass<'static>)) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let p = self.pending_or_new(&mut pending);
        if p.pass.is_none() {
            // Recorded copies ended the last pass.
            p.pass = Some(p.encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None }).forget_lifetime());
        }
        encode(p.pass.as_mut().expect("an open pass"));
        p.dispatches += dispatches;
        let deferred = self.pool.lock().unwrap_or_else(|e| e.into_inner()).deferred_bytes();
        if p.gated() {
            // Work behind an upload still being written waits in the batch
            // (its writer submits it; see `record_upload_later`) unless it
            // holds back too much memory. wgpu does most of its work on a
            // command buffer when it is finished (1.5-2 us a dispatch on
            // the H100's hosts): that is done here, in parts, rather than
            // when the gate opens, where a data-parallel step's next
            // forward and backward passes would wait for it.
            if p.dispatches - p.finished_dispatches >= batch_dispatches() && gated_parts() {
                p.finish_part(&self.device);
            }
            if deferred > MAX_GATED_DEFERRED_BYTES {
                drop(pending);
                self.flush()?;
            }
            return Ok(());
        }
        // A step submitted as one waits for its read, however long.
        let one = crate::backend::is_one_submission();
        let full = (p.dispatches >= batch_dispatches() && !one) || deferred > MAX_DEFERRED_BYTES;
        // An idle GPU gets the work at once, unless a read follows: its
        // submission carries this work too.
        let idle = self.submissions.load(Ordering::Relaxed) + self.handed_not_submitted() <= self.finished.load(Ordering::Acquire)
            && !crate::backend::is_read_following()
            && !one;
        if idle && !now && !full && p.dispatches <= INLINE_SUBMIT_DISPATCHES {
            self.submit_locked(&mut pending, None)?;
        } else if now || full || idle {
            self.hand_off(pending)?;
        }
        Ok(())
    }

    /// Start the thread that submits full batches (see [`Submitter`]); on
    /// a browser, on wgpu's GL backend, or with `VOLTAIC_SUBMIT_THREAD=0`,
    /// batches are submitted by the thread that fills them. GL puts every
    /// call through one context lock per adapter and panics when a thread
    /// waits for it over a second ("Could not lock adapter context"): a
    /// submitting thread could only contend with the recording one (a
    /// pipeline compiling while a batch ran on llvmpipe failed a CI run).
    pub(crate) fn start_submitter(self: &Arc<Self>) {
        if cfg!(target_arch = "wasm32") || self.info.backend == wgpu::Backend::Gl || std::env::var("VOLTAIC_SUBMIT_THREAD").is_ok_and(|v| v == "0") {
            return;
        }
        let (jobs, queue) = std::sync::mpsc::sync_channel::<Pending>(1);
        let handed: Arc<(Mutex<Handed>, std::sync::Condvar)> = Arc::default();
        let (ctx, counts) = (Arc::downgrade(self), handed.clone());
        let spawned = std::thread::Builder::new().name(format!("voltaic-submit-gpu{}", self.index)).spawn(move || {
            // Ends when the context, which holds the sender, is dropped.
            while let Ok(p) = queue.recv() {
                let batch = p.batch;
                let res = match ctx.upgrade() {
                    Some(ctx) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.submit_batch(Some(p), None, false)))
                        .unwrap_or_else(|_| Err(Error::Backend("internal: submitting a batch of GPU work panicked".into())))
                        .map(Some),
                    None => Ok(None),
                };
                let mut h = counts.0.lock().unwrap_or_else(|e| e.into_inner());
                h.done += 1;
                if h.submitted.len() == REMEMBERED_SUBMISSIONS {
                    h.submitted.pop_front();
                }
                match res {
                    Ok(idx) => h.submitted.push_back((batch, idx)),
                    Err(e) => {
                        h.submitted.push_back((batch, None));
                        h.error.get_or_insert(e);
                    }
                }
                counts.1.notify_all();
            }
        });
        if spawned.is_ok() {
            let _ = self.submitter.set(Submitter { jobs, handed });
        }
    }

    /// Batches handed to the submitter and not yet submitted.
    fn handed_not_submitted(&self) -> u64 {
        self.submitter.get().map_or(0, |s| {
            let h = s.handed.0.lock().unwrap_or_else(|e| e.into_inner());
            h.sent - h.done
        })
    }

    /// Submit the pending batch through the submitter, or here when there is none.
    fn hand_off(&self, mut pending: std::sync::MutexGuard<'_, Option<Pending>>) -> Result<Ticket> {
        let Some(sub) = self.submitter.get() else {
            return self.submit_locked(&mut pending, None).map(Ticket::Submitted);
        };
        {
            let mut h = sub.handed.0.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = h.error.take() {
                // The batch stays pending.
                return Err(e);
            }
            h.sent += 1;
        }
        let p = pending.take().expect("encode_pending hands over the batch it filled");
        let batch = p.batch;
        // Sent under the lock on the batch, so batches reach the submitter in
        // the order they were recorded in, whichever thread hands them over
        // (the next may reuse buffers this one reads). The submitter never
        // takes that lock.
        if let Err(std::sync::mpsc::SendError(p)) = sub.jobs.send(p) {
            // The thread is gone (it never exits while the context lives): submit here.
            sub.handed.0.lock().unwrap_or_else(|e| e.into_inner()).done += 1;
            return self.submit_batch(Some(p), None, true).map(Ticket::Submitted);
        }
        drop(pending);
        Ok(Ticket::Handed(batch))
    }

    /// Whether batches go to the device through a thread of their own.
    pub(crate) fn has_submitter(&self) -> bool {
        self.submitter.get().is_some()
    }

    /// Record commands with `record` at the end of the pending batch (after
    /// its compute pass) and hand the batch to the submitting thread: as
    /// [`GpuContext::submit_recording`], without waiting on this thread for
    /// wgpu to finish and submit the command buffer.
    pub(crate) fn hand_off_recording(&self, record: impl FnOnce(&mut wgpu::CommandEncoder)) -> Result<Ticket> {
        self.hand_off(self.pending_recording(record))
    }

    /// The submission holding a ticket's work, once it is made: waits for
    /// the submitting thread when `block`, else `Ok(None)` until then. A
    /// batch submitted so long ago that its index is forgotten gets a later
    /// submission's, whose end implies its own.
    pub(crate) fn submission_of(&self, ticket: &Ticket, block: bool) -> Result<Option<wgpu::SubmissionIndex>> {
        let batch = match ticket {
            Ticket::Submitted(idx) => return Ok(Some(idx.clone())),
            Ticket::Handed(batch) => *batch,
        };
        let failed = || Error::Backend(format!("gpu:{}: submitting the work a read waits for failed", self.index));
        let Some(sub) = self.submitter.get() else { return Err(failed()) };
        let (lock, changed) = &*sub.handed;
        let mut h = lock.lock().unwrap_or_else(|e| e.into_inner());
        let t = web_time::Instant::now();
        // Batches are submitted in order: the newest finished tells whether this one is.
        while h.submitted.back().is_none_or(|&(b, _)| b < batch) && h.done < h.sent {
            if !block {
                return Ok(None);
            }
            h = changed.wait(h).unwrap_or_else(|e| e.into_inner());
        }
        crate::profile::add(crate::profile::Phase::Wait, t.elapsed());
        let idx = match h.submitted.iter().find(|(b, _)| *b == batch) {
            Some((_, idx)) => idx.clone(),
            None => h.submitted.iter().find_map(|(_, idx)| idx.clone()),
        };
        match idx {
            Some(idx) => Ok(Some(idx)),
            None => Err(h.error.take().unwrap_or_else(failed)),
        }
    }

    /// Wait until every batch handed to the submitter is submitted; its
    /// first error, if it had one.
    fn drain(&self) -> Result<()> {
        let Some(sub) = self.submitter.get() else { return Ok(()) };
        let (lock, changed) = &*sub.handed;
        let mut h = lock.lock().unwrap_or_else(|e| e.into_inner());
        if h.done < h.sent {
            let t = web_time::Instant::now();
            while h.done < h.sent {
                h = changed.wait(h).unwrap_or_else(|e| e.into_inner());
            }
            crate::profile::add(crate::profile::Phase::Wait, t.elapsed());
        }
        match h.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The pending command buffer, begun if there is none.
    fn pending_or_new<'a>(&self, pending: &'a mut Option<Pending>) -> &'a mut Pending {
        pending.get_or_insert_with(|| {
            let batch = self.batches.fetch_add(1, Ordering::Relaxed) + 1;
            // Before anything this work uses can be freed.
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).defer(batch);
            Pending::new(self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("voltaic") }), batch)
        })
    }

    /// Record a copy of `size` bytes from the upload staging buffer
    /// `staging` (written and unmapped) into `dst`, in order with the
    /// pending work, without submitting. Once submitted, `staging` is mapped
    /// again and kept for the next upload: a large upload through
    /// `queue.write_buffer` allocates and maps fresh staging memory every
    /// time, which took most of the time of a data-parallel step's
    /// gradient uploads.
    pub(crate) fn record_upload(&self, staging: wgpu::Buffer, dst: &wgpu::Buffer, size: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let p = self.pending_or_new(&mut pending);
        // Copies go outside compute passes.
        drop(p.pass.take());
        p.encoder.copy_buffer_to_buffer(&staging, 0, dst, 0, size);
        p.uploads.push(staging);
    }

    /// For an upload from `staging` that is still mapped: another thread
    /// writes it, unmaps it, submits its copy ([`submit_copy`](Self::submit_copy),
    /// of as many bytes as it wrote) and opens the returned gate, and until
    /// then nothing on this device is submitted (work recorded meanwhile
    /// waits in the batch; a submission that must happen, a read, waits for
    /// the gate). Whoever opens it then calls
    /// [`flush_opened`](Self::flush_opened) so the batch starts at once.
    /// `staging` is mapped again for reuse once the batch is submitted.
    pub(crate) fn record_upload_later(&self, staging: wgpu::Buffer) -> Arc<Gate> {
        let gate = Arc::new(Gate::default());
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let p = self.pending_or_new(&mut pending);
        p.uploads.push(staging);
        p.gates.push(gate.clone());
        gate
    }

    /// Submit a copy of the first `size` bytes of `staging` into `dst` at
    /// once, ahead of the pending batch (which a gate of the caller's
    /// holds back) and after everything handed over before it.
    pub(crate) fn submit_copy(&self, staging: &wgpu::Buffer, dst: &wgpu::Buffer, size: u64) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("voltaic upload") });
        encoder.copy_buffer_to_buffer(staging, 0, dst, 0, size);
        self.drain()?;
        self.submit_batch(None, Some(encoder.finish()), false).map(|_| ())
    }

    /// Submit the pending batch if every gate it waits on is open (called
    /// by the thread that just opened one; a batch still gated is left for
    /// the last writer).
    pub(crate) fn flush_opened(&self) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        match &*pending {
            Some(p) if !p.gated() => self.submit_locked(&mut pending, None).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// Map submitted upload staging buffers again; each rejoins the kept
    /// ones when its mapping completes (the copy that read it has finished).
    pub(crate) fn recycle_uploads(&self, uploads: Vec<wgpu::Buffer>) {
        for b in uploads {
            let (kept, again) = (self.upload_staging.clone(), b.clone());
            b.map_async(wgpu::MapMode::Write, .., move |r| {
                if r.is_err() {
                    return;
                }
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                if kept.iter().map(|k| k.size()).sum::<u64>() + again.size() <= KEPT_UPLOAD_BYTES {
                    kept.push(again);
                }
            });
        }
    }

    /// Submit the pending command buffer, if any.
    pub(crate) fn flush(&self) -> Result<Option<wgpu::SubmissionIndex>> {
        let mut pending = self.lock_ungated();
        if pending.is_none() {
            // Batches handed to the submitter are submitted before this returns.
            self.drain()?;
            return Ok(None);
        }
        self.submit_locked(&mut pending, None).map(Some)
    }

    /// Record commands with `record` at the end of the pending command
    /// buffer (after its compute pass; a new one if none is pending) and
    /// submit it: a read right after a realization costs one command buffer
    /// and one submission.
    pub(crate) fn submit_recording(&self, record: impl FnOnce(&mut wgpu::CommandEncoder)) -> Result<wgpu::SubmissionIndex> {
        let mut pending = self.pending_recording(record);
        self.submit_locked(&mut pending, None)
    }

    /// The pending batch (locked, begun if there is none) with `record`'s
    /// commands at its end.
    fn pending_recording(&self, record: impl FnOnce(&mut wgpu::CommandEncoder)) -> std::sync::MutexGuard<'_, Option<Pending>> {
        let mut pending = self.lock_ungated();
        let p = self.pending_or_new(&mut pending);
        // Copies go after the compute pass, which must end first.
        drop(p.pass.take());
        record(&mut p.encoder);
        pending
    }

    /// Submit a command buffer, after the pending one (in the same
    /// submission); waits for the oldest submission when too many are in
    /// flight.
    pub(crate) fn submit(&self, cmd: wgpu::CommandBuffer) -> Result<wgpu::SubmissionIndex> {
        let mut pending = self.lock_ungated();
        self.submit_locked(&mut pending, Some(cmd))
    }

    /// The pending batch, locked once no gate holds it back. Gates are
    /// waited for unlocked: the thread that opens one may have to record
    /// work first (on one thread, or another thread's, before it starts the
    /// writer), and gates are only added under the lock, so none closes
    /// between this and a submission made under the same lock.
    fn lock_ungated(&self) -> std::sync::MutexGuard<'_, Option<Pending>> {
        loop {
            let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let closed: Vec<Arc<Gate>> = pending.as_ref().map(|p| p.gates.iter().filter(|g| !g.is_open()).cloned().collect()).unwrap_or_default();
            if closed.is_empty() {
                return pending;
            }
            drop(pending);
            for g in closed {
                g.wait();
            }
        }
    }

    /// Submit the pending batch (which no closed gate may hold: callers
    /// lock through `lock_ungated` or check `Pending::gated`) and `cmd`.
    fn submit_locked(&self, pending: &mut Option<Pending>, cmd: Option<wgpu::CommandBuffer>) -> Result<wgpu::SubmissionIndex> {
        debug_assert!(!pending.as_ref().is_some_and(Pending::gated), "a submission of a batch still held back");
        // Batches handed to the submitter reach the queue first.
        self.drain()?;
        self.submit_batch(pending.take(), cmd, true)
    }

    /// Submit `pending` (finished here) and then `cmd`; `timed` on the
    /// thread whose host profile this is (not the submitter's).
    fn submit_batch(&self, mut pending: Option<Pending>, cmd: Option<wgpu::CommandBuffer>, timed: bool) -> Result<wgpu::SubmissionIndex> {
        let uploads = pending.as_mut().map(|p| std::mem::take(&mut p.uploads)).unwrap_or_default();
        let batch = pending.as_ref().map(|p| p.batch);
        let first = pending.map(Pending::finish).unwrap_or_default();
        let submit = || self.queue.submit(first.into_iter().chain(cmd));
        let idx = if timed { crate::profile::time(crate::profile::Phase::Submit, submit) } else { submit() };
        if let Some(batch) = batch {
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).release_deferred(batch);
        }
        self.recycle_uploads(uploads);
        let finished = self.finished.clone();
        self.queue.on_submitted_work_done(move || {
            finished.fetch_add(1, Ordering::Release);
        });
        let submitted = self.submissions.fetch_add(1, Ordering::Relaxed) + 1;
        let mut q = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        // The browser polls for itself: nothing there waits on this queue.
        if !cfg!(target_arch = "wasm32") {
            q.push_back(idx.clone());
        }
        let limit = max_in_flight() as u64;
        if q.len() as u64 > limit {
            let oldest = q.pop_front().expect("non-empty");
            drop(q);
            // Poll until enough have finished before sleeping in the driver:
            // waking from that sleep can take longer than the queued work
            // lasts, and the GPU would idle (see `spin_until`).
            let done = |_| submitted.saturating_sub(self.finished.load(Ordering::Acquire)) <= limit;
            let throttle = || -> Result<()> {
                if !self.spin_until_untimed(&done)? {
                    self.wait_untimed(Some(oldest))?;
                }
                Ok(())
            };
            if timed {
                crate::profile::exclusive(crate::profile::Phase::Wait, throttle)?;
            } else {
                throttle()?;
            }
        } else {
            drop(q);
            // Now and then, let wgpu retire finished work so its bookkeeping
            // does not grow (polling every time costs more than it saves).
            if self.submissions.load(Ordering::Relaxed).is_multiple_of(16) {
                let _ = self.device.poll(wgpu::PollType::Poll);
            }
        }
        Ok(idx)
    }

    /// Block until a submission (or all work) has finished.
    pub(crate) fn wait(&self, idx: Option<wgpu::SubmissionIndex>) -> Result<()> {
        crate::profile::exclusive(crate::profile::Phase::Wait, || self.wait_untimed(idx))
    }

    fn wait_untimed(&self, idx: Option<wgpu::SubmissionIndex>) -> Result<()> {
        if idx.is_none() {
            self.flush()?;
        }
        // A full wait first polls without blocking for a short while: see `spin_until`.
        if idx.is_none() && self.spin_until_untimed(&|status| matches!(status, wgpu::PollStatus::QueueEmpty))? {
            return self.check_alive();
        }
        self.device
            .poll(wgpu::PollType::Wait { submission_index: idx, timeout: None })
            .map_err(|e| Error::Backend(format!("gpu:{}: waiting for the device failed: {e}", self.index)))?;
        self.check_alive()
    }

    /// Poll the device without blocking until `done` (given each poll's
    /// status) holds or `spin_wait()` has passed; whether it held. A blocking
    /// wait sleeps in the driver, and on some machines waking up from it
    /// costs 0.1 to 1 ms, far more than the small kernels a read usually
    /// waits for; PyTorch's CUDA synchronisation spins the same way. Only
    /// plain polls are used: wgpu 30 can panic when threads race waits with
    /// a zero timeout on one device.
    pub(crate) fn spin_until(&self, done: &dyn Fn(wgpu::PollStatus) -> bool) -> Result<bool> {
        crate::profile::time(crate::profile::Phase::Wait, || self.spin_until_untimed(done))
    }

    fn spin_until_untimed(&self, done: &dyn Fn(wgpu::PollStatus) -> bool) -> Result<bool> {
        let start = web_time::Instant::now();
        let limit = spin_wait();
        while start.elapsed() < limit {
            let status = self
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| Error::Backend(format!("gpu:{}: polling the device failed: {e}", self.index)))?;
            if done(status) {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        Ok(false)
    }

    /// Forget submissions known to be finished (after a full wait).
    pub(crate) fn clear_in_flight(&self) {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// The first lines of a compile error (naga quotes the WGSL around the
/// fault at length); with `VOLTAIC_DEBUG=1`, the whole error and the
/// kernel's source.
pub(crate) fn short_error(e: &str, source: &str) -> String {
    if std::env::var("VOLTAIC_DEBUG").is_ok_and(|v| !v.is_empty() && v != "0") {
        return format!("{e}\n--- WGSL ---\n{source}");
    }
    // Skip wgpu's framing and naga's quotes of the source (`1 │ ...`, `┌─ wgsl:1:2`).
    let framing = |l: &str| l.is_empty() || l == "Validation Error" || l == "Caused by:" || l.starts_with("In Device::");
    let quote = |l: &str| l.starts_with(['│', '┌', '·', '=']) || l.split_once('│').is_some_and(|(n, _)| n.trim().parse::<u32>().is_ok());
    let lines: Vec<&str> = e.lines().map(str::trim).filter(|l| !framing(l) && !quote(l)).take(2).collect();
    format!("{} (set VOLTAIC_DEBUG=1 to see the generated WGSL)", lines.join(" "))
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Tensor};
    use std::sync::atomic::Ordering;

    /// A step submitted as one: realizations of more dispatches than a
    /// batch holds and the read of their result go to the device in one
    /// submission (the submitting thread's), and the read, waited for after
    /// later work was queued, gives the step's values.
    #[test]
    fn a_step_submitted_as_one_is_one_submission_and_reads_its_values() {
        assert!(!crate::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
        let dev = Device::Gpu(0);
        let ctx = super::super::context(0).unwrap();
        assert!(ctx.has_submitter(), "the test is of batches submitted by their own thread");
        let x = Tensor::randn(&[1000], DType::F32, dev).unwrap();
        let want: Vec<f64> = x.to_f64_vec().unwrap().iter().map(|v| (0..3 * super::batch_dispatches()).fold(*v, |y, i| (y * 0.5 + i as f64) as f32 as f64)).collect();
        // Tests running in parallel may submit to the same device meanwhile
        // (seen on an H200 with four test threads): the step must be one
        // submission in one of three tries. A step that took more would take
        // more every time.
        let mut counts = vec![];
        let read = loop {
            let before = ctx.submissions.load(Ordering::Relaxed);
            let read = crate::backend::one_submission(|| {
                let mut y = x.clone();
                for i in 0..3 * super::batch_dispatches() {
                    y = y.mul(0.5).unwrap().add(i as f64).unwrap();
                    y.realize().unwrap();
                }
                y.read_start().unwrap()
            });
            ctx.drain().unwrap();
            counts.push(ctx.submissions.load(Ordering::Relaxed) - before);
            if counts.last() == Some(&1) || counts.len() == 3 {
                break read;
            }
        };
        assert_eq!(counts.last(), Some(&1), "the step and its read took more than one submission in each try: {counts:?}");
        // Work queued after the step, before its read is waited for.
        let later = x.mul(3.0).unwrap();
        later.realize().unwrap();
        let got: Vec<f32> = read.wait().unwrap().into_vec().unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "element {i}: {g}, expected {w}");
        }
        assert_eq!(later.to_vec::<f32>().unwrap()[7], x.to_vec::<f32>().unwrap()[7] * 3.0);
    }

    #[test]
    fn a_compile_error_is_one_line_without_the_source() {
        let e = "Validation Error\n\nCaused by:\n  In Device::create_shader_module\n    \nShader '' parsing error: redefinition of `in0_0`\n  ┌─ wgsl:1:42\n  │\n1 │ @group(0) var in0_0\n";
        let s = super::short_error(e, "fn main() {}");
        assert!(!s.contains('\n') && !s.contains("fn main") && s.contains("redefinition"), "{s}");
    }
}
