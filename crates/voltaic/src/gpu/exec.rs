//! Running a plan on a GPU: one command encoder, one submission.

use super::codegen::{check_dtype, elem_bytes, Bind, Src};
use super::context::GpuContext;
use super::pool::{alloc, GpuBuf};
use crate::error::{Error, Result};
use crate::graph::schedule::{Plan, SlotSource};
use crate::graph::Buffer;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One encoded dispatch, waiting for the pass.
struct Encoded {
    pipeline: Arc<wgpu::ComputePipeline>,
    bind_group: wgpu::BindGroup,
    grid: (u32, u32),
    kernel: usize,
}

/// Run `plan` on `ctx`; returns the buffers of the slots the plan stores.
pub(crate) fn run_plan(ctx: &Arc<GpuContext>, plan: &Plan) -> Result<Vec<Option<Buffer>>> {
    ctx.check_alive()?;
    let (res, err) = ctx.scoped(|| encode_and_submit(ctx, plan));
    if let Some(e) = err {
        return Err(e);
    }
    res
}

fn encode_and_submit(ctx: &Arc<GpuContext>, plan: &Plan) -> Result<Vec<Option<Buffer>>> {
    let mut bufs: Vec<Option<Arc<GpuBuf>>> = Vec::with_capacity(plan.slots.len());
    for s in &plan.slots {
        bufs.push(match &s.source {
            SlotSource::External(Buffer::Gpu(b)) => Some(b.clone()),
            SlotSource::External(Buffer::Cpu(_)) => {
                return Err(Error::Device {
                    op: "realize",
                    msg: format!("a CPU buffer reached gpu:{}; move tensors with to_device", ctx.index),
                })
            }
            SlotSource::Kernel => None,
        });
    }
    let keep: std::collections::HashSet<usize> = plan.store.iter().map(|(s, _)| *s).collect();
    let mut stored: Vec<Option<Buffer>> = vec![None; plan.slots.len()];
    let mut encoded: Vec<Encoded> = Vec::new();
    let mut labels: Vec<String> = Vec::new();
    for (ki, k) in plan.kernels.iter().enumerate() {
        check_dtype(&ctx.caps, k.dtype, k.kind.name())?;
        let inputs: Vec<_> = k.inputs.iter().map(|&s| (plan.slots[s].dtype, plan.slots[s].numel)).collect();
        for &(dt, _) in &inputs {
            check_dtype(&ctx.caps, dt, k.kind.name())?;
        }
        let prog = super::kernels::program(&ctx.caps, k, &inputs)?;
        let out = Arc::new(alloc(ctx, k.dtype, k.numel, k.numel as u64 * elem_bytes(k.dtype))?);
        let scratch: Vec<GpuBuf> = prog
            .scratch
            .iter()
            .map(|&(dt, n)| alloc(ctx, dt, n, n as u64 * elem_bytes(dt)))
            .collect::<Result<_>>()?;
        for d in &prog.dispatches {
            if d.binds.len() > ctx.caps.max_storage_buffers as usize {
                return Err(Error::Backend(format!(
                    "{}: the kernel binds {} buffers but gpu:{} allows {} per shader",
                    k.kind.name(),
                    d.binds.len(),
                    ctx.index,
                    ctx.caps.max_storage_buffers
                )));
            }
            let read_only: Vec<bool> = d.binds.iter().map(|b| b.read_only).collect();
            let pipeline = ctx.pipeline(&d.source, &read_only)?;
            let buffer_of = |b: &Bind| -> &wgpu::Buffer {
                match b.src {
                    Src::Input(i) => bufs[k.inputs[i]].as_ref().expect("inputs are live").raw(),
                    Src::Output => out.raw(),
                    Src::Scratch(i) => scratch[i].raw(),
                    Src::IndexError => &ctx.index_error,
                }
            };
            let entries: Vec<wgpu::BindGroupEntry> = d
                .binds
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let buf = buffer_of(b);
                    let offset = b.chunk as u64 * b.chunk_bytes;
                    let size = b.chunk_bytes.min(buf.size() - offset);
                    wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: buf,
                            offset,
                            size: std::num::NonZeroU64::new(size),
                        }),
                    }
                })
                .collect();
            let bind_group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
            encoded.push(Encoded { pipeline, bind_group, grid: grid(ctx, d.groups)?, kernel: ki });
        }
        labels.push(prog.dispatches.first().map(|d| d.label.clone()).unwrap_or_else(|| k.kind.name().into()));
        if keep.contains(&k.out) {
            stored[k.out] = Some(Buffer::Gpu(out.clone()));
        }
        bufs[k.out] = Some(out);
        // Freed buffers go back to the pool now; a later kernel of this same
        // pass may reuse them, and wgpu orders its writes after these reads.
        for &s in &plan.free_after[ki] {
            bufs[s] = None;
        }
    }
    for (s, _) in &plan.store {
        if stored[*s].is_none() {
            stored[*s] = bufs[*s].clone().map(Buffer::Gpu);
        }
    }
    if encoded.is_empty() {
        return Ok(stored);
    }
    let profile = super::transfer::profiling() && ctx.caps.timestamps;
    let mut encoder = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("voltaic") });
    let timing = if profile { Some(super::transfer::Timing::new(ctx, plan.kernels.len())) } else { None };
    match &timing {
        None => {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for e in &encoded {
                dispatch(&mut pass, e);
            }
        }
        Some(t) => {
            // A pass per kernel, each bracketed by timestamps.
            for ki in 0..plan.kernels.len() {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: Some(t.writes(ki)),
                });
                for e in encoded.iter().filter(|e| e.kernel == ki) {
                    dispatch(&mut pass, e);
                }
            }
            t.resolve(&mut encoder);
        }
    }
    ctx.dispatches.fetch_add(encoded.len() as u64, Ordering::Relaxed);
    let idx = ctx.submit(encoder.finish())?;
    if let Some(t) = timing {
        let rows: Vec<(String, usize)> = plan.kernels.iter().zip(&labels).map(|(k, l)| (l.clone(), k.numel)).collect();
        t.report(ctx, idx, &rows)?;
    }
    Ok(stored)
}

fn dispatch(pass: &mut wgpu::ComputePass<'_>, e: &Encoded) {
    pass.set_pipeline(&e.pipeline);
    pass.set_bind_group(0, &e.bind_group, &[]);
    pass.dispatch_workgroups(e.grid.0, e.grid.1, 1);
}

/// Spread `groups` workgroups over x and y within the adapter's per-dimension limit.
fn grid(ctx: &GpuContext, groups: u64) -> Result<(u32, u32)> {
    let max = ctx.caps.max_groups as u64;
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x).max(1);
    if y > max {
        return Err(Error::Backend(format!("a dispatch of {groups} workgroups exceeds gpu:{}'s grid of {max} x {max}", ctx.index)));
    }
    Ok((x as u32, y as u32))
}
