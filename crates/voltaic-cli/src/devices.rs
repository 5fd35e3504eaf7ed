//! `voltaic devices`: what Voltaic can run on.

use serde_json::json;

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn simd() -> Vec<&'static str> {
    let mut v = vec![];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            v.push("avx2");
        }
        if is_x86_feature_detected!("fma") {
            v.push("fma");
        }
        if is_x86_feature_detected!("avx512f") {
            v.push("avx512f");
        }
        if is_x86_feature_detected!("f16c") {
            v.push("f16c");
        }
    }
    #[cfg(target_arch = "aarch64")]
    v.push("neon");
    v
}

pub fn run(json: bool) -> anyhow::Result<()> {
    let threads = rayon::current_num_threads();
    let model = cpu_model();
    let features = simd();
    // GL adapters too (otherwise searched for only where nothing else is found).
    voltaic::backend::probe_gl();
    // Open each device but GL's (which share one context lock), so that the
    // report says what opening tells: how f16 arithmetic rounds there.
    for a in voltaic::backend::adapters().iter().filter(|a| a.backend != "Gl") {
        let _ = voltaic::Device::Gpu(a.index).synchronize();
    }
    let gpus = voltaic::backend::adapters();
    let best = voltaic::Device::best();
    if json {
        let cpu = json!({
            "device": "cpu", "name": model, "backend": "native", "device_type": "Cpu",
            "threads": threads, "features": features, "matmul": "gemm",
            "dtypes": ["f32", "f64", "f16", "bf16", "i32", "u32", "bool"], "best": best == voltaic::Device::Cpu,
            "precision": {"f32": "gemm", "f16": "2 bytes, computed in f32", "bf16": "2 bytes, computed in f32"},
        });
        println!("{cpu}");
        for a in &gpus {
            let limits: serde_json::Map<String, serde_json::Value> = a.limits.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
            println!(
                "{}",
                json!({
                    "device": format!("gpu:{}", a.index), "name": a.name, "backend": a.backend,
                    "device_type": a.device_type, "driver": a.driver, "features": a.features, "limits": limits,
                    "software": a.is_software(), "best": best == voltaic::Device::Gpu(a.index), "notes": a.notes,
                    "precision": a.precision.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
                })
            );
        }
        return Ok(());
    }
    let mark = |d: voltaic::Device| if d == best { "*" } else { " " };
    println!("{:<9} {:<8} {:<14} DETAILS", "DEVICE", "BACKEND", "TYPE");
    println!(
        "{}{:<8} {:<8} {:<14} {} | {} threads (rayon) | SIMD: {} | matmul: gemm",
        mark(voltaic::Device::Cpu),
        "cpu",
        "native",
        "Cpu",
        model,
        threads,
        features.join(" ")
    );
    for a in &gpus {
        let d = voltaic::Device::Gpu(a.index);
        let gl_n = gpus.iter().filter(|g| g.backend == "Gl" && g.index < a.index).count();
        let alias = if a.backend == "Gl" { format!(" (gl:{gl_n})") } else { String::new() };
        println!("{}{:<8} {:<8} {:<14} {}{alias} | driver: {}", mark(d), d.to_string(), a.backend, a.device_type, a.name, a.driver);
        println!("{:<33} features: {}", "", if a.features.is_empty() { "none".into() } else { a.features.join(" ") });
        let lim: Vec<String> = a.limits.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("{:<33} limits: {}", "", lim.join(" "));
        for (dt, how) in &a.precision {
            println!("{:<33} {dt}: {how}", "");
        }
        for n in &a.notes {
            println!("{:<33} note: {n}", "");
        }
    }
    if gpus.is_empty() {
        println!("\nNo GPU adapter found (on Linux: `apt-get install libvulkan1 mesa-vulkan-drivers`).");
    }
    println!("\ngpu:N numbering: Vulkan/Metal/DX12 adapters first, then GL (also gl:N); hardware before software within each.");
    println!("* = Device::best(){}", if gpus.iter().any(|a| a.is_software()) {
        "; software adapters are used only when asked for (--device gpu:N or VOLTAIC_DEVICE)"
    } else {
        ""
    });
    Ok(())
}
