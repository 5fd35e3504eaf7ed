//! What one tiny kernel and a read of its result cost: through raw wgpu
//! calls (the floor any wgpu library stands on), and through Voltaic, as one
//! read (`add(..).to_vec()`) and as a realization then a read.
//!
//! `cargo run --release -p voltaic --example read_latency -- gpu:0`
//!
//! The raw loop reuses one pipeline, one bind group and one staging buffer,
//! and records a dispatch of 1,024 additions and the copy into one command
//! buffer per step, then waits either by polling without blocking or by a
//! blocking `poll(Wait)`. Medians over 1,800 steps, in microseconds.
use std::time::Instant;
use voltaic::{DType, Device, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

const ADD: &str = "@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x < 1024u { c[g.x] = a[g.x] + b[g.x]; }
}";

/// The raw wgpu loop on the first high-performance Vulkan adapter.
fn raw(spin: bool) -> Result<(), Box<dyn std::error::Error>> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN;
    desc.flags = wgpu::InstanceFlags::empty();
    let instance = wgpu::Instance::new(desc);
    let options = wgpu::RequestAdapterOptions { power_preference: wgpu::PowerPreference::HighPerformance, ..Default::default() };
    let adapter = pollster::block_on(instance.request_adapter(&options))?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default()))?;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor { label: None, source: wgpu::ShaderSource::Wgsl(ADD.into()) });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: None,
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let buffer = |usage| device.create_buffer(&wgpu::BufferDescriptor { label: None, size: 4096, usage, mapped_at_creation: false });
    let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let (a, b, c) = (buffer(storage), buffer(storage), buffer(storage));
    let staging = buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST);
    let entries = [a.as_entire_binding(), b.as_entire_binding(), c.as_entire_binding()];
    let entries: Vec<wgpu::BindGroupEntry> = entries.into_iter().enumerate().map(|(i, resource)| wgpu::BindGroupEntry { binding: i as u32, resource }).collect();
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &pipeline.get_bind_group_layout(0), entries: &entries });
    let (mut total, mut encode, mut submit, mut wait, mut read) = (vec![], vec![], vec![], vec![], vec![]);
    for step in 0..2000 {
        let t0 = Instant::now();
        let mut enc = device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(4, 1, 1);
        }
        enc.copy_buffer_to_buffer(&c, 0, &staging, 0, 4096);
        let commands = enc.finish();
        let t1 = Instant::now();
        let idx = queue.submit([commands]);
        staging.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        let t2 = Instant::now();
        if spin {
            while !matches!(device.poll(wgpu::PollType::Poll)?, wgpu::PollStatus::QueueEmpty) {
                std::hint::spin_loop();
            }
        } else {
            device.poll(wgpu::PollType::Wait { submission_index: Some(idx), timeout: None })?;
        }
        let t3 = Instant::now();
        let first = staging.slice(..).get_mapped_range()?[..4].to_vec();
        staging.unmap();
        let t4 = Instant::now();
        std::hint::black_box(first);
        if step >= 200 {
            total.push(us(t4 - t0));
            encode.push(us(t1 - t0));
            submit.push(us(t2 - t1));
            wait.push(us(t3 - t2));
            read.push(us(t4 - t3));
        }
    }
    let how = if spin { "polling" } else { "blocking wait" };
    println!(
        "raw wgpu ({}, {how}): {:.1} us; encode {:.1}, submit and map {:.1}, wait {:.1}, read and unmap {:.1}",
        adapter.get_info().name,
        median(total),
        median(encode),
        median(submit),
        median(wait),
        median(read)
    );
    Ok(())
}

/// Voltaic's paths for the same work.
fn voltaic_paths(dev: Device) -> voltaic::Result<()> {
    let a = Tensor::randn(&[1024], DType::F32, dev)?;
    let b = Tensor::randn(&[1024], DType::F32, dev)?;
    let (va, vb) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    for _ in 0..200 {
        let got = a.add(&b)?.to_vec::<f32>()?;
        assert!(got.iter().zip(va.iter().zip(&vb)).all(|(g, (x, y))| *g == x + y), "wrong sums");
    }
    let mut one = vec![];
    let before = voltaic::host_profile();
    for _ in 0..1800 {
        let t = Instant::now();
        std::hint::black_box(a.add(&b)?.to_vec::<f32>()?);
        one.push(us(t.elapsed()));
    }
    let host = voltaic::host_profile().since(&before);
    let phases: Vec<String> = host.phases().iter().filter(|(_, t)| *t > 0.0).map(|(p, t)| format!("{p} {:.1}", t / 1800.0)).collect();
    println!("voltaic ({dev}), add then to_vec: {:.1} us; host us: {}", median(one), phases.join(", "));
    let (mut total, mut realize, mut read) = (vec![], vec![], vec![]);
    for _ in 0..1800 {
        let t0 = Instant::now();
        let c = a.add(&b)?;
        c.realize()?;
        let t1 = Instant::now();
        std::hint::black_box(c.to_vec::<f32>()?);
        let t2 = Instant::now();
        total.push(us(t2 - t0));
        realize.push(us(t1 - t0));
        read.push(us(t2 - t1));
    }
    println!("voltaic ({dev}), add, realize, then to_vec: {:.1} us; realize {:.1}, to_vec {:.1}", median(total), median(realize), median(read));
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::parse(&std::env::args().nth(1).unwrap_or_else(|| "gpu:0".into()))?;
    raw(true)?;
    raw(false)?;
    voltaic_paths(dev)?;
    Ok(())
}
