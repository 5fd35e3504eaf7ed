//! The wgpu executor: the scheduler's kernels as generated WGSL, run on any
//! GPU that wgpu reaches (Vulkan, Metal, DX12, GL).
//!
//! A realization encodes every kernel of its plan into one command encoder
//! and submits once; buffers come from a size-bucketed pool and return to it
//! after their last consumer; pipelines are compiled once per distinct
//! kernel source. Failures (validation, out of memory, device loss) come
//! back as [`Error`](crate::Error) values.

pub(crate) mod autotune;
pub(crate) mod codegen;
pub(crate) mod context;
pub(crate) mod exec;
mod halfmath;
pub(crate) mod kernels;
pub(crate) mod matmul;
pub(crate) mod pool;
mod quant;
pub(crate) mod transfer;
#[cfg(test)]
mod validate;

use super::{Buffer, Capabilities, Completion, DeviceStats, Executor, HostView, PendingRead};
use crate::error::{Error, Result};
use crate::ir::Plan;
use crate::layout::Layout;
use crate::storage::CpuStorage;
use context::GpuContext;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

/// An adapter wgpu found, with what Voltaic uses of it.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    /// Index for `Device::Gpu(index)`.
    pub index: usize,
    /// Adapter name (e.g. `NVIDIA H100 80GB HBM3`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// Backend (`Vulkan`, `Metal`, `Dx12`, `Gl`).
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu` (a software adapter) or `Other`.
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// Features Voltaic uses that the adapter has.
    pub features: Vec<&'static str>,
    /// Limits Voltaic uses, by name.
    pub limits: Vec<(&'static str, u64)>,
    /// What the executor does differently on this adapter, where it lacks
    /// something a kernel or a part of the executor would use.
    pub notes: Vec<String>,
    /// How each float type is held and computed here, by name (`f32`,
    /// `f16`, `bf16`), and whether products run on tensor cores.
    pub precision: Vec<(&'static str, String)>,
}

impl AdapterReport {
    /// A software rasteriser such as lavapipe: used only when asked for.
    pub fn is_software(&self) -> bool {
        self.device_type == "Cpu"
    }
}

struct Registry {
    adapters: Vec<wgpu::Adapter>,
    /// GL adapters found on request ([`probe_gl`]) where the search above
    /// had none; numbered after `adapters`.
    gl: OnceLock<Vec<wgpu::Adapter>>,
    contexts: Mutex<HashMap<usize, Arc<GpuContext>>>,
    /// The adapter index of each extra device opened on an adapter
    /// ([`open_replica`]); replica `k` is `gpu:{REPLICA_BASE + k}`. The
    /// web opens none.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code, reason = "a browser opens one device per adapter"))]
    replicas: Mutex<Vec<usize>>,
}

/// The first `gpu:N` of the extra devices opened on an adapter (more than
/// any machine has adapters, so the two never meet).
pub(crate) const REPLICA_BASE: usize = 1000;

/// The backends asked for by `VOLTAIC_BACKEND` or, as in every wgpu
/// program, `WGPU_BACKEND` (e.g. `gl`, `vulkan`, `vulkan,gl`).
fn backends_from_env() -> Option<wgpu::Backends> {
    ["VOLTAIC_BACKEND", "WGPU_BACKEND"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
        .map(|s| wgpu::Backends::from_comma_list(&s))
}

/// Every adapter of `backends`, best first: gpu:N is stable across set-ups
/// (the native APIs (Vulkan, Metal, DX12) before GL, then real GPUs before
/// software ones, then the driver's order; `voltaic devices` prints this rule).
async fn enumerate(backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    desc.flags = wgpu::InstanceFlags::empty().with_env();
    let mut adapters = wgpu::Instance::new(desc).enumerate_adapters(backends).await;
    let rank = |a: &wgpu::Adapter| {
        let i = a.get_info();
        let t = match i.device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        (matches!(i.backend, wgpu::Backend::Gl) as u8, t)
    };
    adapters.sort_by_key(rank);
    adapters
}

/// Every adapter of the backends asked for, best first. Without a choice,
/// the native APIs (and the browser's WebGPU); GL only where they find
/// nothing (probing EGL is slow and noisy on headless machines).
async fn find_adapters() -> Vec<wgpu::Adapter> {
    if let Some(b) = backends_from_env() {
        return enumerate(b).await;
    }
    let primary = enumerate(wgpu::Backends::PRIMARY).await;
    if primary.is_empty() && !cfg!(target_arch = "wasm32") { enumerate(wgpu::Backends::GL).await } else { primary }
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

impl Registry {
    fn new(adapters: Vec<wgpu::Adapter>) -> Registry {
        Registry { adapters, gl: OnceLock::new(), contexts: Mutex::new(HashMap::new()), replicas: Mutex::new(Vec::new()) }
    }

    /// Every adapter known so far, in `gpu:N` order.
    fn all(&self) -> impl Iterator<Item = &wgpu::Adapter> {
        self.adapters.iter().chain(self.gl.get().into_iter().flatten())
    }
}

/// Also look for GL adapters (EGL; slow and noisy on some headless
/// machines, so only when asked: `voltaic devices`, `gl:N`), numbered
/// after the others. A no-op where the search already found GL ones.
pub fn probe_gl() {
    let reg = registry();
    reg.gl.get_or_init(|| {
        // The web has no GL backend here (WebGPU only).
        #[cfg(not(target_arch = "wasm32"))]
        if !reg.adapters.iter().any(|a| a.get_info().backend == wgpu::Backend::Gl) {
            return pollster::block_on(enumerate(wgpu::Backends::GL));
        }
        Vec::new()
    });
}

/// The index `gpu:N` of the `n`-th GL adapter (`gl:n`), probing for GL.
pub(crate) fn gl_index(n: usize) -> Result<usize> {
    probe_gl();
    let gl: Vec<usize> = registry().all().enumerate().filter(|(_, a)| a.get_info().backend == wgpu::Backend::Gl).map(|(i, _)| i).collect();
    gl.get(n).copied().ok_or_else(|| Error::Device {
        op: "device",
        msg: if gl.is_empty() {
            format!("gl:{n} is not available: wgpu found no GL adapter (on Linux install EGL and Mesa: `apt-get install libegl1 libgl1-mesa-dri`)")
        } else {
            format!("gl:{n} is not available: wgpu found {} GL adapter(s)", gl.len())
        },
    })
}

/// The adapters, found on first use. On the web only [`registry_async`]
/// can find them; until it has, there are none.
fn registry() -> &'static Registry {
    #[cfg(not(target_arch = "wasm32"))]
    return REGISTRY.get_or_init(|| Registry::new(pollster::block_on(find_adapters())));
    #[cfg(target_arch = "wasm32")]
    {
        static NOT_YET: OnceLock<Registry> = OnceLock::new();
        REGISTRY.get().unwrap_or_else(|| NOT_YET.get_or_init(|| Registry::new(Vec::new())))
    }
}

/// The adapters, found without blocking the thread.
async fn registry_async() -> &'static Registry {
    if let Some(r) = REGISTRY.get() {
        return r;
    }
    let adapters = find_adapters().await;
    // Two finders racing keep the first one's list.
    let _ = REGISTRY.set(Registry::new(adapters));
    REGISTRY.get().expect("just set")
}

/// Every adapter wgpu finds, best first (`gpu:0` is the first). On the web
/// the browser's adapter appears once [`adapters_async`] or
/// `Device::gpu_async` has asked for it.
pub fn adapters() -> Vec<AdapterReport> {
    reports(registry())
}

/// Every adapter wgpu finds, best first, found without blocking the thread.
pub async fn adapters_async() -> Vec<AdapterReport> {
    reports(registry_async().await)
}

fn reports(reg: &Registry) -> Vec<AdapterReport> {
    reg.all()
        .enumerate()
        .map(|(index, a)| {
            let i = a.get_info();
            let f = a.features();
            let l = a.limits();
            let named = [
                (wgpu::Features::SHADER_F16, "shader-f16"),
                (wgpu::Features::SUBGROUP, "subgroup"),
                (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
                (wgpu::Features::PIPELINE_CACHE, "pipeline-cache"),
                (wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX, "cooperative-matrix"),
                (wgpu::Features::SHADER_F64, "shader-f64"),
            ];
            let mut notes = Vec::new();
            let f16 = f.contains(wgpu::Features::SHADER_F16);
            let tc = context::tensor_cores(a);
            if !f16 {
                notes.push("no SHADER_F16: f16 tensors are packed two to a 32-bit word and computed in f32, rounded to f16 on every store".to_string());
            }
            let products = |dt: &str| match (tc, dt) {
                (true, "f16") => "products on tensor cores (cooperative matrices, f32 accumulation)",
                (true, _) => "products on tensor cores, rows and columns scaled into f16's range (cooperative matrices, f32 accumulation)",
                _ => "products on the shader cores, f32 accumulation",
            };
            // How f16 results round is known once the device is open (its probe).
            let half_rounding = reg.contexts.lock().unwrap_or_else(|e| e.into_inner()).get(&index).map(|c| {
                let say = |what: &str, r: &std::result::Result<(), String>| match r {
                    Ok(()) => format!("; {what} by the device (its probe rounds as the CPU does)"),
                    Err(why) => format!("; {what} rounded in software ({why})"),
                };
                format!("{}{}", say("stores", &c.half_probe.stores), say("add, sub and mul", &c.half_probe.math))
            });
            let precision = vec![
                ("f32", "4 bytes; products on the shader cores".to_string()),
                ("f16", format!("2 bytes, {}{}; {}", if f16 { "native (SHADER_F16)" } else { "packed in 32-bit words" }, half_rounding.unwrap_or_default(), products("f16"))),
                ("bf16", format!("2 bytes, packed in 32-bit words, computed in f32; {}", products("bf16"))),
            ];
            if f.contains(wgpu::Features::SUBGROUP) {
                notes.push(match context::fold_subgroup(&i, f) {
                    Some(n) => format!("subgroups of {n} lanes: reductions combine within them by shuffles"),
                    None => format!("subgroups of {}-{} lanes: reductions combine through workgroup memory", i.subgroup_min_size, i.subgroup_max_size),
                });
            }
            if i.backend == wgpu::Backend::Gl {
                notes.push("autotune off: GL serialises the device on one context lock".to_string());
            } else if i.backend == wgpu::Backend::BrowserWebGpu {
                notes.push("no blocking reads or autotuning: use the async API (to_vec_async, ...)".to_string());
            } else if i.device_type == wgpu::DeviceType::Cpu {
                notes.push("autotune off unless VOLTAIC_AUTOTUNE asks (software adapter)".to_string());
            }
            if !f.contains(wgpu::Features::TIMESTAMP_QUERY) {
                notes.push("no GPU timestamps: VOLTAIC_PROFILE has no per-kernel times, the tuner times on the host".to_string());
            }
            AdapterReport {
                notes,
                precision,
                index,
                name: i.name.clone(),
                backend: format!("{:?}", i.backend),
                device_type: format!("{:?}", i.device_type),
                driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
                features: named.iter().filter(|(x, _)| f.contains(*x)).map(|(_, n)| *n).collect(),
                limits: vec![
                    ("max_buffer_size", l.max_buffer_size),
                    ("max_storage_buffer_binding_size", l.max_storage_buffer_binding_size),
                    ("max_storage_buffers_per_shader_stage", l.max_storage_buffers_per_shader_stage as u64),
                    ("max_compute_workgroups_per_dimension", l.max_compute_workgroups_per_dimension as u64),
                    ("max_compute_invocations_per_workgroup", l.max_compute_invocations_per_workgroup as u64),
                    ("max_compute_workgroup_storage_size", l.max_compute_workgroup_storage_size as u64),
                ],
            }
        })
        .collect()
}

/// The open device `gpu:index`, opened on first use (natively; on the web
/// it must have been opened by [`context_async`]).
pub(crate) fn context(index: usize) -> Result<Arc<GpuContext>> {
    if let Some(c) = registry().contexts.lock().unwrap_or_else(|e| e.into_inner()).get(&index) {
        c.check_alive()?;
        return Ok(c.clone());
    }
    #[cfg(target_arch = "wasm32")]
    return Err(Error::Device {
        op: "device",
        msg: format!("gpu:{index} is not open: in a browser, open it first with `Device::gpu_async({index}).await` (opening blocks otherwise)"),
    });
    #[cfg(not(target_arch = "wasm32"))]
    pollster::block_on(context_async(index))
}

/// Open another wgpu device on the adapter of `gpu:index` (its own queue,
/// memory and pipelines), as `gpu:N` for a new N from [`REPLICA_BASE`] up.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn open_replica(index: usize) -> Result<usize> {
    let reg = registry();
    let adapter_index = if index >= REPLICA_BASE {
        let r = reg.replicas.lock().unwrap_or_else(|e| e.into_inner());
        *r.get(index - REPLICA_BASE).ok_or_else(|| Error::Device { op: "device", msg: format!("gpu:{index} is not open") })?
    } else {
        context(index)?;
        index
    };
    let adapter = reg.all().nth(adapter_index).expect("an opened adapter is listed");
    if adapter.get_info().backend == wgpu::Backend::Gl {
        // wgpu's GL backend runs every device of an adapter under one context
        // lock: a second device would gain nothing and, busy, trips wgpu's
        // deadlock detector.
        return Err(Error::Device {
            op: "DeviceGroup::new",
            msg: format!("gpu:{index} is a GL adapter, which cannot run a second device beside the first (one GL context per adapter); use a Vulkan, Metal or DX12 adapter, or several adapters"),
        });
    }
    let mut replicas = reg.replicas.lock().unwrap_or_else(|e| e.into_inner());
    let new = REPLICA_BASE + replicas.len();
    let ctx = Arc::new(pollster::block_on(GpuContext::open(new, adapter))?);
    ctx.start_submitter();
    replicas.push(adapter_index);
    reg.contexts.lock().unwrap_or_else(|e| e.into_inner()).insert(new, ctx);
    Ok(new)
}

/// The web opens one device per adapter.
#[cfg(target_arch = "wasm32")]
pub(crate) fn open_replica(index: usize) -> Result<usize> {
    Err(Error::Device { op: "device", msg: format!("a second device on the adapter of gpu:{index} cannot be opened in a browser") })
}

/// The open device `gpu:index`, opened without blocking the thread.
pub(crate) async fn context_async(index: usize) -> Result<Arc<GpuContext>> {
    let reg = registry_async().await;
    if let Some(c) = reg.contexts.lock().unwrap_or_else(|e| e.into_inner()).get(&index) {
        c.check_alive()?;
        return Ok(c.clone());
    }
    if index >= REPLICA_BASE {
        return Err(Error::Device {
            op: "device",
            msg: format!("gpu:{index} is not available: numbers from gpu:{REPLICA_BASE} up are extra devices opened on an adapter (DeviceGroup), and this one was not"),
        });
    }
    if index >= reg.adapters.len() {
        // Numbered after the others: the GL adapters `voltaic devices` lists.
        #[cfg(not(target_arch = "wasm32"))]
        probe_gl();
    }
    let Some(adapter) = reg.all().nth(index) else {
        let n = reg.all().count();
        return Err(Error::Device {
            op: "device",
            msg: if n == 0 && cfg!(target_arch = "wasm32") {
                format!("gpu:{index} is not available: the browser offers no WebGPU adapter (`navigator.gpu` is missing or refused)")
            } else if n == 0 {
                format!(
                    "gpu:{index} is not available: wgpu found no GPU adapter (on Linux install a Vulkan driver, e.g. \
                     `apt-get install libvulkan1 mesa-vulkan-drivers`, which includes the lavapipe software adapter)"
                )
            } else {
                format!("gpu:{index} is not available: wgpu found {n} adapter(s), gpu:0 to gpu:{}", n - 1)
            },
        });
    };
    let ctx = Arc::new(GpuContext::open(index, adapter).await?);
    // Two openers racing keep the first device (the other's submitter ends with it).
    ctx.start_submitter();
    Ok(reg.contexts.lock().unwrap_or_else(|e| e.into_inner()).entry(index).or_insert(ctx).clone())
}

/// Write each open device's pipeline cache to disk now (it is also written
/// every few seconds while kernels compile).
pub(crate) fn save_caches() {
    let reg = registry();
    for c in reg.contexts.lock().unwrap_or_else(|e| e.into_inner()).values() {
        Executor::save_caches(&**c);
    }
}

/// Block until every open device's background tuner is idle.
pub(crate) fn finish_tuning() {
    let ctxs: Vec<Arc<GpuContext>> = registry().contexts.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
    for c in ctxs {
        c.tuner.finish();
    }
}

/// Rows up to which quantized GEMVs take prologues: on hardware adapters
/// by default; not on a software one, where a GEMV's thread per weight row
/// makes recomputing the operand cost more than the kernel it saves
/// (lavapipe: SmolLM2 decode 1.6-1.7 tokens/s without, 1.1-1.26 with).
/// `VOLTAIC_PROLOGUES=0` turns them off everywhere, `=1` on everywhere
/// (to measure what they change, and to test them on a software adapter).
fn prologue_rows(software: bool) -> usize {
    static SET: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let on = SET.get_or_init(|| std::env::var("VOLTAIC_PROLOGUES").ok().map(|v| v != "0")).unwrap_or(!software);
    if on {
        quant::GEMV_ROWS
    } else {
        0
    }
}

/// Whether kernels of several outputs are used (`VOLTAIC_MULTI_OUTPUT=0`
/// turns them off, to measure what they change).
fn multi_output() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_MULTI_OUTPUT").map_or(true, |v| v != "0"))
}

impl GpuContext {
    /// Start reading a contiguous view back (see [`Executor::read_start_in_place`]).
    fn read(&self, buf: &Buffer, layout: &Layout, in_place: bool) -> Result<PendingRead> {
        let Buffer::Wgpu(b) = buf else {
            return Err(Error::Device { op: "to_vec", msg: format!("a buffer of another device reached gpu:{}", self.index) });
        };
        if !layout.is_contiguous() {
            return Err(Error::Backend(format!("gpu:{}: internal: a strided view was read without making it contiguous", self.index)));
        }
        let (completion, collect) = transfer::download_start(&context(self.index)?, b, layout.offset(), layout.numel(), in_place)?;
        let layout = Layout::contiguous(layout.dims());
        Ok(PendingRead::new(completion, Box::new(move || Ok(HostView { data: collect()?, layout }))))
    }
}

impl Executor for GpuContext {
    fn capabilities(&self) -> Capabilities {
        Capabilities { row_kernels: true, strided_reads: false, dense_wide_qmatmul: true, multi_output: multi_output(), max_inputs: self.caps.max_inputs(), prologue_rows: prologue_rows(self.caps.software), index_epilogues: false }
    }

    fn run(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
        exec::run_plan(self, plan, inputs)
    }

    fn dry_run(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
        exec::dry_run(self, plan, inputs)
    }

    fn upload(&self, data: CpuStorage) -> Result<Buffer> {
        Ok(Buffer::Wgpu(Arc::new(transfer::upload(self, &data)?)))
    }

    fn read_start(&self, buf: &Buffer, layout: &Layout) -> Result<PendingRead> {
        self.read(buf, layout, false)
    }

    fn read_start_in_place(&self, buf: &Buffer, layout: &Layout) -> Result<PendingRead> {
        self.read(buf, layout, true)
    }

    fn upload_f32_with(&self, len: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<Buffer> {
        match transfer::upload_f32_with(self, len, fill)? {
            Some(b) => Ok(Buffer::Wgpu(Arc::new(b))),
            None => super::upload_f32_through_host(self, len, fill),
        }
    }

    fn upload_f32_later(&self, len: usize) -> Result<Option<(Buffer, Box<dyn super::LaterFill>)>> {
        Ok(transfer::upload_f32_later(self, len)?.map(|(b, f)| (Buffer::Wgpu(Arc::new(b)), f)))
    }

    fn completion(&self) -> Result<Option<Box<dyn Completion>>> {
        self.check_alive()?;
        let idx = self.flush()?;
        let signal = std::sync::Arc::new(transfer::Signal::default());
        let s2 = signal.clone();
        self.queue.on_submitted_work_done(move || s2.set(None));
        Ok(Some(Box::new(transfer::GpuCompletion::new(context(self.index)?, idx, signal))))
    }

    fn stats(&self) -> DeviceStats {
        DeviceStats {
            submissions: self.submissions.load(Ordering::Relaxed),
            dispatches: self.dispatches.load(Ordering::Relaxed),
            pipelines: self.compiled.load(Ordering::Relaxed),
            bind_groups: self.bind_groups.load(Ordering::Relaxed),
            memory: self.pool.lock().unwrap_or_else(|e| e.into_inner()).stats(),
        }
    }

    fn empty_cache(&self) -> Result<()> {
        // Queued work may still read cached buffers: finish it first.
        self.wait(None)?;
        self.clear_in_flight();
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).destroy_cached();
        Ok(())
    }

    fn save_caches(&self) {
        self.save_pipeline_cache(true);
    }
}
