//! Writes the values the browser test compares with: every case of the
//! suite computed natively (on the CPU executor unless `--device` says
//! otherwise), as JSON.
//!
//!     web-fixtures OUT.json [--device cpu|gpu|gpu:N] [--minilm MODEL_DIR MINILM_OUT.json]
//!
//! With `--minilm`, also the MiniLM panel's similarity matrix of the
//! built-in sentences, from the model directory's files read as bytes (the
//! page's path).

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
    if let Some(i) = args.iter().position(|a| a == "--minilm") {
        let (Some(dir), Some(out)) = (args.get(i + 1), args.get(i + 2)) else {
            eprintln!("web-fixtures: --minilm needs MODEL_DIR and an output file");
            std::process::exit(2);
        };
        let dir = std::path::Path::new(dir);
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap_or_else(|e| {
            eprintln!("web-fixtures: {}: {e}", dir.join(f).display());
            std::process::exit(1)
        });
        let text = |f: &str| String::from_utf8(read(f)).expect("utf-8 json");
        let sim = pollster::block_on(voltaic_web::demo::similarity(
            &text("config.json"),
            read("model.safetensors"),
            &read("tokenizer.json"),
            Some(&text("sentence_bert_config.json")),
            &voltaic_web::demo::SENTENCES,
            device,
        ))
        .unwrap_or_else(|e| {
            eprintln!("web-fixtures: MiniLM: {e}");
            std::process::exit(1)
        });
        std::fs::write(out, serde_json::json!({ "sentences": voltaic_web::demo::SENTENCES, "similarity": sim }).to_string()).expect("write the MiniLM fixture");
        eprintln!("web-fixtures: MiniLM similarities of {} sentences -> {out}", voltaic_web::demo::SENTENCES.len());
    }
    let json = serde_json::to_string(&fixtures).expect("fixtures serialize");
    if let Err(e) = std::fs::write(out, json) {
        eprintln!("web-fixtures: cannot write {out}: {e}");
        std::process::exit(1);
    }
    eprintln!("web-fixtures: {} cases computed on {device:?} -> {out}", fixtures.cases.len());
}
