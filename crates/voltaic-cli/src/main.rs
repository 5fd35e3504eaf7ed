//! The `voltaic` command: devices, demo, train, eval, embed, similarity, generate, bench.

mod bench;
mod demo;
mod devices;
mod embed;
mod generate;
mod parallel;
mod plot;
mod train;

use clap::{Parser, Subcommand};

// Every realization records, collects and schedules a graph of thousands of
// small nodes, while the submit thread encodes the previous one and frees
// what it held; mimalloc's per-thread pages serve that faster than glibc's
// arenas (host phases per step in BENCHMARKS.md, issue 16).
#[cfg(not(target_arch = "wasm32"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Voltaic: a PyTorch-shaped tensor and deep-learning library for any GPU (wgpu) and the CPU.
#[derive(Parser)]
#[command(name = "voltaic", version, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the devices Voltaic can run on, with what it uses of each.
    Devices {
        /// Print one JSON object per device.
        #[arg(long)]
        json: bool,
    },
    /// Run a short demo computation and show how it was scheduled.
    Demo {
        /// Device to run on: cpu, gpu or gpu:N (default: the best available).
        #[arg(long)]
        device: Option<String>,
    },
    /// Train a classifier on Fashion-MNIST (the main job).
    Train(Box<train::TrainArgs>),
    /// Report the test accuracy and loss of a `voltaic train` checkpoint.
    Eval(train::EvalArgs),
    /// Print sentence embeddings (all-MiniLM-L6-v2 by default).
    Embed(embed::EmbedArgs),
    /// Print the cosine similarity of two sentences.
    Similarity(embed::SimilarityArgs),
    /// Generate text with a LLaMA-family GGUF model (SmolLM2-135M-Instruct by default).
    Generate(generate::GenerateArgs),
    /// Benchmark Voltaic against a peer library measured in the same run.
    Bench(bench::BenchArgs),
}

fn main() {
    // Without XDG_RUNTIME_DIR (a headless machine, a container), the GL/EGL
    // probe of adapter enumeration prints an error line for every attempt;
    // a temporary directory quiets it. Set before any thread starts.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    // Exit quietly when the reader of our output goes away (`voltaic embed |
    // head -1`), as Unix tools do, instead of failing on the write.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Rust's allocations go to mimalloc (above), which keeps freed memory
    // for a second before returning it; what C libraries allocate (the
    // Vulkan driver, MPI) still goes through glibc, whose large buffers
    // should likewise go back to the heap when freed and be reused, instead
    // of being unmapped and faulted in again page by page (glibc's default
    // above 32 MB, and its trimming).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 31);
    }
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Devices { json } => devices::run(json),
        Command::Demo { device } => demo::run(device.as_deref()),
        Command::Train(args) => train::run(*args),
        Command::Eval(args) => train::eval(args),
        Command::Embed(args) => embed::run(args),
        Command::Similarity(args) => embed::similarity(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Parse a `--device` value, defaulting to the best device, and check that
/// the device can be opened before anything is printed or written.
pub(crate) fn parse_device(s: Option<&str>) -> anyhow::Result<voltaic::Device> {
    let d = match s {
        Some(s) => voltaic::Device::parse(s)?,
        None => voltaic::Device::best(),
    };
    d.stats()?;
    Ok(d)
}
