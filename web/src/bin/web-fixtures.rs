//! Writes the values the browser test compares with: every case of the
//! suite computed natively (on the CPU executor unless `--device` says
//! otherwise), as JSON.
//!
//!     web-fixtures OUT.json [--device cpu|gpu|gpu:N]

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first() else {
        eprintln!("usage: web-fixtures OUT.json [--device cpu|gpu|gpu:N]");
        std::process::exit(2);
    };
    let device = match args.iter().position(|a| a == "--device").and_then(|i| args.get(i + 1)) {
        Some(d) => voltaic::Device::parse(d).unwrap_or_else(|e| {
            eprintln!("web-fixtures: {e}");
            std::process::exit(2)
        }),
        None => voltaic::Device::Cpu,
    };
    let fixtures = pollster::block_on(voltaic_web::suite::run_all(device)).unwrap_or_else(|e| {
        eprintln!("web-fixtures: {e}");
        std::process::exit(1)
    });
    let json = serde_json::to_string(&fixtures).expect("fixtures serialize");
    if let Err(e) = std::fs::write(out, json) {
        eprintln!("web-fixtures: cannot write {out}: {e}");
        std::process::exit(1);
    }
    eprintln!("web-fixtures: {} cases computed on {device:?} -> {out}", fixtures.cases.len());
}
