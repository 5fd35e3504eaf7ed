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
    if json {
        let cpu = json!({
            "device": "cpu", "name": model, "backend": "native", "device_type": "Cpu",
            "threads": threads, "features": features, "matmul": "gemm",
            "dtypes": ["f32", "f64", "f16", "bf16", "i32", "u32", "bool"],
        });
        println!("{cpu}");
    } else {
        println!("{:<8} {:<10} {}", "DEVICE", "BACKEND", "DETAILS");
        println!(
            "{:<8} {:<10} {} | {} threads (rayon) | SIMD: {} | matmul: gemm | dtypes: f32 f64 f16 bf16 i32 u32 bool",
            "cpu",
            "native",
            model,
            threads,
            features.join(" ")
        );
    }
    if !json {
        println!("\nGPU adapters: none usable yet (this build has no wgpu executor; `Device::best()` is the CPU).");
    }
    Ok(())
}
