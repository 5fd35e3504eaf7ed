//! The public op methods of [`Tensor`](crate::Tensor), grouped by kind. Each
//! records graph nodes after checking shapes and dtypes; nothing runs here.

pub mod autocast;
pub mod elementwise;
pub mod index;
pub mod join;
pub mod linalg;
pub mod nn;
mod overload;
pub mod reduce;
pub mod view;

pub use elementwise::IntoOperand;
