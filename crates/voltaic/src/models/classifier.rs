//! The Fashion-MNIST classifiers of `voltaic train`, with the same layers
//! (and so the same `state_dict` names) as the PyTorch `nn.Sequential` models
//! written the obvious way.

use crate::error::Result;
use crate::nn::{Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential};
use crate::ops::nn::Conv2dOpts;
use crate::Device;

/// `Flatten, Linear(784, 256), ReLU, Linear(256, 128), ReLU, Linear(128, 10)`.
pub fn mlp(device: Device) -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Flatten)
        .add(Linear::new(784, 256, true, device)?)
        .add(ReLU)
        .add(Linear::new(256, 128, true, device)?)
        .add(ReLU)
        .add(Linear::new(128, 10, true, device)?))
}

/// Two conv + pool blocks and a linear head: `Conv2d(1, 32, 3, padding=1),
/// ReLU, MaxPool2d(2), Conv2d(32, 64, 3, padding=1), ReLU, MaxPool2d(2),
/// Flatten, Linear(3136, 10)`.
pub fn cnn(device: Device) -> Result<Sequential> {
    let same = Conv2dOpts { padding: [1, 1], ..Default::default() };
    Ok(Sequential::new()
        .add(Conv2d::new(1, 32, [3, 3], same, true, device)?)
        .add(ReLU)
        .add(MaxPool2d::new(2))
        .add(Conv2d::new(32, 64, [3, 3], same, true, device)?)
        .add(ReLU)
        .add(MaxPool2d::new(2))
        .add(Flatten)
        .add(Linear::new(64 * 7 * 7, 10, true, device)?))
}
