//! Voltaic in the browser: the WebGPU test suite ([`suite`]) and the
//! Fashion-MNIST demo ([`demo`]), exported to JavaScript through
//! wasm-bindgen when built for `wasm32-unknown-unknown` (see `web/build.sh`).
//! Natively the same code runs too: `web-fixtures` computes the values the
//! browser's results are compared with.

pub mod demo;
pub mod suite;

#[cfg(target_arch = "wasm32")]
mod bindings;
